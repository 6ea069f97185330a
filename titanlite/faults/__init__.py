"""Fault injection, a plugin: loaded only when a config or a flag names its [faults] section
(`--faults.same_data true`), so a run without it has no fault switch in `--help`, in its
config.toml or in any component: the injector (titanlite.faults.inject) reaches the trainer's
parts through their seams.

The switches (titanlite.faults.switches, each with its help) are of two kinds: faults the
diagnostics must detect (DIAGNOSED; the seed ones from arXiv 2602.14462, "Silent Inconsistency
in Data-Parallel Full Fine-Tuning"), and faults the loop and the checkpointer must survive (no
valid tokens, a NaN loss, a rank killed, hung or frozen, a Ctrl-C, a full or read-only disk).
corrupt_labels, grad_noise and slow_rank act from fault_from_step, so that rules comparing a rank
with its own history see it healthy first.
"""
