"""Small utilities: caches, logging, memory estimates, host reads, formatting, run comparison,
host-sync and collective accounting."""
