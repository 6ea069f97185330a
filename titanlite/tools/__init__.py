"""Small utilities: the step's hook protocol, caches, logging, memory estimates, host reads,
formatting, host-sync and collective accounting, the scripts' front door."""
