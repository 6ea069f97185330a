"""Run under torchrun (2 ranks): a real 2-rank run's watched step, then the same job rehearsed.

real: both ranks train the debug model (FSDP, params kept gathered, diagnostics off) for 2 steps;
    rank 0's second step is watched by the rehearsal's own meter (titanlite.rehearsal.meter:
    MemTracker, collective bytes, host reads), as a rehearsal watches its steps.
rehearsed: then rank 0 alone, on torch's fake process group, rehearses that job at world 2, 8, 64
    and 1,024 (one process group each, destroyed before the next), and with the diagnostics
    measuring at 64 (`exact`, `sketch`) and at 1,024 (`auto`); tests/fork_cp.py at 8 ranks
    as dp=8, 4 x cp=2 and 2 x cp=4; Qwen3-MoE's debug model at 2; the debug model at 4 as
    dp=2 x tp=2 (checkpointing none and selective); and the debug model at 8
    measured on its first 2 blocks, the rest derived (kept gathered and resharded).

Writes {"real": StepCost of rank 0, "rehearsed": {case: rehearsal.json}, "padded": {world:
elements of the model with FSDP's padding at that shard degree}, "params": n, "drawn": {case:
initial values rank 0 drew}, "logged": {partial case: the log's messages}} (rank 0).
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from titanlite.config import parse_args
from titanlite.distributed.param_init import ParamInit
from titanlite.models.registry import build_meta_model
from titanlite.rehearsal.meter import StepMeter, group_labels
from titanlite.rehearsal.run import rehearse
from titanlite.tools.memory import shard_numel
from titanlite.train import Trainer

WORLDS = (2, 8, 64, 1024)
DIAGNOSED = {"exact-64": (64, "exact"), "sketch-64": (64, "sketch"), "auto-1024": (1024, "auto")}
ACCUMULATED = (
    "accum-2"  # world 2, microbatches of 2: accumulation 2, the tracker across microbatches
)
# world 8 as dp=8, 4 x cp=2 and 2 x cp=4: tests/fork_cp.py's context parallelism, its axis in the
# mesh, diagnosed; one sequence a microbatch, so a rank's activations are one piece of one
SPLIT = {
    f"cp{cp}-8": ["--model.name", "fork_cp", "--model.import_module", "fork_cp", "--model.flavor", "tiny4",
                  "--training.local_batch_size", "1", "--diagnostics.method", "exact",
                  *(["--parallelism.axes", f'["cp={cp}"]'] if cp > 1 else [])]
    for cp in (1, 2, 4)
}  # fmt: skip
# world 2, Qwen3-MoE: its routing is not traced, so the estimate takes the model's own
# activation_bytes, which the tracker's activations at the peak (the forward's end) must confirm
MOE = {"moe-2": ["--model.name", "qwen3_moe", "--training.seq_len", "128", "--training.local_batch_size", "4",
                 "--training.global_batch_size", "8", "--rehearsal.steps", "3", "--diagnostics.enable", "false"]}  # fmt: skip

# world 4 as dp=2 x tp=2: the debug model split by titanlite's tensor-parallel plans, without and
# with selective checkpointing (which runs the blocks' exchanges again in the backward)
TENSOR = {
    f"tp2-{ac}-4": ["--parallelism.axes", '["tp=2"]', "--diagnostics.enable", "false",
                    "--training.activation_checkpoint", ac, "--rehearsal.steps", "3"]
    for ac in ("none", "selective")
}  # fmt: skip
# world 8, the debug model's 6 blocks: its first 2 measured and the rest derived, against the whole
# ("8", params kept gathered) and against a whole resharded after forward, also measured both ways;
# (those resharded with the diagnostics measuring); the log's lines are kept in order (the
# plan's figures come before the first step)
PARTIAL = {
    "partial-8": ["--rehearsal.blocks", "2"],
    "always-8": ["--rehearsal.blocks", "0", "--parallelism.reshard_after_forward", "always", "--diagnostics.enable", "true", "--diagnostics.method", "exact"],
    "partial-always-8": ["--rehearsal.blocks", "2", "--parallelism.reshard_after_forward", "always", "--diagnostics.enable", "true", "--diagnostics.method", "exact"],
}  # fmt: skip
# 4 steps each: the two watched and one timed
PARTIAL = {name: [*more, "--rehearsal.steps", "4"] for name, more in PARTIAL.items()}
LOGGED: dict[str, list[str]] = {}  # case -> the titanlite log's messages, in order


class Lines(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


DRAWN: dict[str, int] = {}  # case -> initial values rank 0 drew (ParamInit's buffers)


def count_draws(case: str) -> None:
    """Count the elements of every buffer ParamInit draws into from now on, under `case`."""
    DRAWN[case] = 0

    def empty(self, p, inner=ParamInit._empty_full):
        out = inner(self, p)
        DRAWN[case] += out.numel()
        return out

    ParamInit._empty_full = empty


def argv(runs: Path, *more: str) -> list[str]:
    keep = (
        []
        if "--parallelism.reshard_after_forward" in more
        else ["--parallelism.reshard_after_forward", "never"]
    )
    return [
        "--config",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(runs),
        *keep,
        "--training.steps",
        "2",
        *more,
    ]


def real_step(runs: Path) -> dict:
    cfg, _ = parse_args(argv(runs, "--job.run_name", "real", "--diagnostics.enable", "false"))
    trainer = Trainer(cfg)
    try:
        meter = StepMeter(
            trainer.device, trainer.model, trainer.optimizer, group_labels(trainer.dims, None)
        )
        meter.run(1, False, lambda: trainer.train_step(1), watch=False)
        cost = meter.run(2, False, lambda: trainer.train_step(2), watch=True)
        return asdict(cost)
    finally:
        trainer.close()


def main(out: str, runs: str) -> None:
    runs_dir = Path(runs)
    inner = ParamInit._empty_full
    count_draws("real")
    real = real_step(runs_dir)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        return
    cases = (
        {str(w): (w, None) for w in WORLDS}
        | DIAGNOSED
        | {ACCUMULATED: (2, None)}
        | {k: (8, "exact") for k in SPLIT}
        | {k: (2, None) for k in MOE}
        | {k: (4, None) for k in TENSOR}
        | {k: (8, None) for k in PARTIAL}
    )
    rehearsed, padded = {}, {}
    for name, (world, method) in cases.items():
        diag = ["--diagnostics.method", method] if method else ["--diagnostics.enable", "false"]
        if name == ACCUMULATED:
            diag += ["--training.local_batch_size", "2"]
        if name in SPLIT:
            diag = SPLIT[name]
        if name in MOE:
            diag = MOE[name]
        if name in TENSOR:
            diag = TENSOR[name]
        if name in PARTIAL:
            diag += PARTIAL[name]
        cfg, _ = parse_args(
            argv(runs_dir, "--rehearsal.world", str(world), "--job.run_name", name, *diag)
        )
        ParamInit._empty_full = inner
        count_draws(name)
        handler = Lines(LOGGED.setdefault(name, []))
        logging.getLogger("titanlite").addHandler(handler)
        try:
            rehearsed[name] = rehearse(cfg)
        finally:
            logging.getLogger("titanlite").removeHandler(handler)
        dist.destroy_process_group()
    model = build_meta_model(parse_args(argv(runs_dir))[0], 2048).model
    for world in WORLDS:
        padded[str(world)] = world * sum(shard_numel(p.shape, world) for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    result = {"real": real, "rehearsed": rehearsed, "padded": padded, "params": params}
    result["drawn"] = DRAWN
    result["logged"] = {name: LOGGED[name] for name in PARTIAL}
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
