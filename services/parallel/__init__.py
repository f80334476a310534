"""Segment parallelism: cold segments prefilled on several workers, entries streamed to the combine rank."""
