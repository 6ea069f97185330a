"""Small utilities: caches, logging, memory estimates, host-sync accounting."""
