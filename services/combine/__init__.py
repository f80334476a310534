"""Combine worker: entries in (own cache, cache tier, scatter streams), live tokens, decode, tokens out."""
