"""One module per model architecture."""
