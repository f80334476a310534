"""Router: tokenization, segmentation, directory probes, LPT dispatch of cold segments, combine choice."""
