"""Scatter workers: cold segments -> entries, streamed to the combine worker and the cache tier."""
