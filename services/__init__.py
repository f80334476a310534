"""HybridCache services: runtime (models, engine, cache), router, workers, cache tier, API, CLI."""
