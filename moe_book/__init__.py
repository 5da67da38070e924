"""moe_book: a sparse Mixture-of-Experts language model, built chapter by chapter (see chapters/)."""
