"""Reference and fast implementations of the linear-attention op families."""
