"""The cluster rehearsal (`./run_train.sh --rehearse W`): the run as rank 0 of W ranks on torch's
fake process group, a few real steps, and what each rank would need: memory, compute, traffic per
group, host reads, the diagnostics' cost (run.py drives, meter.py measures, report.py reports)."""
