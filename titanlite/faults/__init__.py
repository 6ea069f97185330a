"""Fault injection, a plugin: loaded only when a config or a flag names its [faults] section
(`--faults.same_data true`), so a run without it has no fault switch in `--help`, in its
config.toml or in any component. The fault catalogue (tests/faults/), scripts/diagnose_scenarios.py
and the tests use it. The trainer registers the injector as a hook (titanlite.tools.hooks) and
lets it `attach` to its parts through their seams: the sampler's rank, the checkpoint writer,
the run folder's writes, the gradient probe's noise, the RNG streams a checkpoint carries.

The switches (titanlite.faults.switches, each with its help) are of two kinds: faults the
diagnostics must detect (DIAGNOSED; the seed ones from arXiv 2602.14462, "Silent Inconsistency
in Data-Parallel Full Fine-Tuning"), and faults the loop and the checkpointer must survive (no
valid tokens, a NaN loss, a rank killed, hung or frozen, a Ctrl-C, a full or read-only disk).
corrupt_labels, grad_noise and slow_rank act from fault_from_step, so that rules comparing a rank
with its own history see it healthy first.
"""
