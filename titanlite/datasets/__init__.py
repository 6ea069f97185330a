"""Data: the built-in stdlib corpus, user files, packing, SFT rendering, dp-invariant sampling."""
