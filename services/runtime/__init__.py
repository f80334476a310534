"""Model runtime and engine."""
