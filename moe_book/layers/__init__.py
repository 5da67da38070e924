"""Token mixers, feed-forward and residual types; each module is exported from one chapter."""
