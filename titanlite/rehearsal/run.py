"""The rehearsal's driver: the run built as configured on the fake world, its steps run and
measured, the report written. Step 1 builds AdamW's state (and compiles); step 2 (a measured step
of the diagnostics) and 3 (not) are watched; steps 4 on are timed. After each measured step, rank
0's host work on its record is timed; its alerts are dropped (fake gathers make ranks look alike)."""

from __future__ import annotations

import json
import signal
import time

import torch

from titanlite.components.run.plan import REHEARSAL_FILE
from titanlite.config import JobConfig
from titanlite.distributed.parallel_dims import resolve_device
from titanlite.errors import Stopped
from titanlite.rehearsal.meter import StepCost, StepMeter, group_labels
from titanlite.rehearsal.plan import make_plan
from titanlite.rehearsal.report import plan_table, summarize, table
from titanlite.tools.process import heartbeat, init_logging
from titanlite.train import Trainer

logger = init_logging()
WATCHED = (2, 3)  # the steps whose memory, bytes and host reads are counted


def rehearse(cfg: JobConfig, config_path: str | None = None) -> dict:
    """Rehearse `cfg` (rehearsal.world > 0); returns the report, also in <run>/rehearsal.json.
    Every phase says it is still going (titanlite.tools.process.heartbeat): a large model's steps
    may take minutes where the rehearsal runs."""
    plan = make_plan(cfg)  # the figures that need no step, at once
    logger.info("\n" + plan_table(plan, cfg, resolve_device(cfg.training.device).type))
    building = "rehearsal: still building the model and its optimizer"
    with heartbeat(lambda s: logger.info(f"{building} ({s:.0f}s)")):
        trainer = Trainer(cfg, config_path)
    trainer.hooks.add(EveryUpdate())
    try:
        labels = group_labels(trainer.dims, trainer.diagnostics)
        meter = StepMeter(trainer.device, trainer.model, trainer.optimizer, labels)
        costs = []
        trainer.begin(None)  # a signal now ends the rehearsal between steps, not inside one
        for step in range(1, cfg.training.steps + 1):
            began = time.perf_counter()
            say = f"rehearsal: step {step}/{cfg.training.steps}"
            with heartbeat(lambda s, say=say: logger.info(f"{say} still running ({s:.0f}s)")):
                costs.append(_step(trainer, meter, step))
            logger.info(f"{say} done in {time.perf_counter() - began:.1f}s")
            if signum := trainer.stops.received:
                # the report comes whole at the end: the launcher removes the run folder
                why = f"stopped by {signal.Signals(signum).name} after rehearsal step {step} of {cfg.training.steps}"
                kept = "nothing was kept (a rehearsal's report comes whole at its end; rerun it)"
                raise Stopped(signum, f"{why}; {kept}")
        report = summarize(trainer, costs, plan)
        (trainer.run_dir / REHEARSAL_FILE).write_text(json.dumps(report, indent=1) + "\n")
        logger.info("\n" + table(report) + f"\nreport: {trainer.run_dir / REHEARSAL_FILE}")
        return report
    finally:
        trainer.close()
        _stop_loader(trainer)


def _stop_loader(trainer: Trainer) -> None:
    """The loader's worker processes exit now: the launcher runs the rehearsal in its own
    process and waits for every child it has before its last line."""
    shutdown = getattr(
        trainer._batches, "_shutdown_workers", None
    )  # torch's, on a loader with workers
    if shutdown is not None:
        shutdown()


class EveryUpdate:
    """A hook: no update is skipped (fake collectives make the values meaningless; its cost counts)."""

    def before_update(self, s) -> None:
        s.skip = torch.zeros_like(s.skip)


def _step(trainer: Trainer, meter: StepMeter, step: int) -> StepCost:
    diagnostics = trainer.diagnostics
    measured = diagnostics.enabled and diagnostics.cfg.measures(step)
    # debug.sync_debug on CUDA: a host sync inside the step raises, from the second step (the
    # first compiles), as in training; the diagnostics' read after it is the log step's, allowed
    checked = trainer.cfg.debug.sync_debug and trainer.device.type == "cuda" and step > 1

    def run() -> None:
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            trainer.train_step(step)
        finally:
            if checked:
                torch.cuda.set_sync_debug_mode("default")

    cost = meter.run(step, measured, run, watch=step in WATCHED)
    if measured:
        start = time.perf_counter()
        records, _alerts = diagnostics.collect()  # the alerts are muted
        cost.collect_s = time.perf_counter() - start
        cost.record_bytes = len(json.dumps(records[-1])) + 1 if records else 0
    trainer.window.read(trainer.dims.dp_group)  # what a log step reads, so nothing piles up
    return cost
