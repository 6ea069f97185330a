"""Fault injection, a plugin: loaded only when a config or a flag names its [faults] section
(`--faults.same_data true`), so a run without it has no fault switch in `--help`, in its
config.toml or in any component. The fault catalogue (tests/faults/), scripts/diagnose_scenarios.py
and the tests use it. The trainer registers the injector as a hook (titanlite.tools.hooks) and
lets it `attach` to its parts through their seams: the sampler's rank, the checkpoint writer,
the run folder's writes, the gradient probe's noise, the RNG streams a checkpoint carries.

Faults that the diagnostics must detect (arXiv 2602.14462, "Silent Inconsistency in
Data-Parallel Full Fine-Tuning", studies the seed ones):
- same_data: every rank reads rank 0's share (the "rank not passed to the loader" bug);
- corrupt_labels_rank: that rank's labels are shuffled within each sequence (a bad batch);
- grad_noise_rank: Gaussian noise is added to that rank's local gradient before the reduction
  (a stand-in for a device with silent data corruption), by the diagnostics' gradient probe,
  so it needs diagnostics on;
- seed_mode: the settings of that study, S1-1 "shared" (titanlite's rule), S1-2 "rank0_differs",
  S1-3 "per_rank", applied through the seed rule (titanlite.tools.seeds); dropout
  (model.dropout) makes seeds matter;
- flip_bit_step: one bit of one parameter flips on one rank (silent data corruption in a
  replica's weights, which only the replica check sees);
- stuck_loader_step: from that step on, one rank's loader hands out that step's batch again and
  again (a reader stuck on a stale buffer), while its sampler moves on;
- slow_rank: that rank's data loading takes extra host time, slow_factor - 1 times its own step
  time (a straggler: a slow loader or a busy host), which every other rank then waits for;
- spike_step: rank 0's loss is scaled up at one step (the spike guard).
corrupt_labels, grad_noise and slow_rank act from fault_from_step: a fault that starts in a run
that was healthy, so rules that compare a rank with its own history have one.
Faults that the loop and the checkpointer must survive: a step without valid tokens, a NaN
loss, a rank killed at a step or inside a save, a rank that hangs before a step, a rank frozen
(SIGSTOP) inside a phase of a step, a Ctrl-C at a known moment, a save failing as on a full
disk, the run folder's writes failing as on a full or read-only disk.
"""
