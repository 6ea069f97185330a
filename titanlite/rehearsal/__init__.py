"""The cluster rehearsal: `./run_train.sh --rehearse W` builds the run as configured as rank 0 of W
ranks, in one process, on torch's fake process group, runs a few real steps and reports what each
rank would need and do: memory, compute, traffic per group, host reads, the diagnostics' cost
(run.py drives it, meter.py measures a step, report.py writes rehearsal.json and the table; the
config it runs under: titanlite.config.layout)."""
