"""Run comparison, outside the trainer: finished runs' curves and gradients (the invariance
verdict, its tolerances, where two layouts part), a model's exactness against one process, and
the kernels' hashes that decide whether CPU runs can agree bitwise. Nothing in training imports it."""
