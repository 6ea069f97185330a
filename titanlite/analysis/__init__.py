"""Run comparison, outside the trainer: load finished runs, compare their curves and their
gradients at step 1 (the invariance verdict and its tolerances), name the module where two
layouts part (localize), tell their configs apart, plot them; a model's exactness against one
process (model_check); and what decides whether two CPU runs can agree bit for bit (numerics:
the kernels' hashes the golden curves' check reads). scripts/compare_runs.py,
scripts/invariance.py, scripts/check_model.py and gpu_check's accumulation check use it; nothing
in training imports it."""
