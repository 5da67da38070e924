"""Triton kernels (exported from chapter 02), installed as moe_book.kernels."""
