"""Pure-torch reference operators (naive and chunked), the oracles the fast kernels are tested against."""
