"""Run comparison, outside the trainer: load finished runs, compare their curves (the invariance
verdict and its tolerance), tell their configs apart, plot them; and what decides whether two CPU
runs can agree bit for bit (numerics: the kernels' hashes the golden curves' check reads).
scripts/compare_runs.py, scripts/invariance.py and gpu_check's accumulation check use it; nothing
in training imports it."""
