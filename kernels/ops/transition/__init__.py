"""HybridCache."""
