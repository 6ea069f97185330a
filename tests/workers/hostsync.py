"""Run under torchrun: train with every host-sync entry point instrumented, diagnostics measuring
every step (their default warmup), sketch under FSDP and exact under DDP.

Counts calls of Tensor.item/.tolist/.cpu/.numpy/__bool__/__int__/__float__ and
torch.cuda.synchronize, separately for log steps (where reading metrics is allowed) and every
other moment of the training loop. Writes {"non_log": {...}, "log": {...}} per case (rank 0).
"""

from __future__ import annotations

import collections
import json
import sys

import torch
import torch.distributed as dist

from titanlite.config import parse_args
from titanlite.train import Trainer

COUNTS = {"non_log": collections.Counter(), "log": collections.Counter()}
PHASE = ["off"]
NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


def instrument() -> None:
    for name in NAMES:
        orig = getattr(torch.Tensor, name)

        def wrapper(self, *a, _orig=orig, _name=name, **k):
            if PHASE[0] != "off":
                COUNTS[PHASE[0]][_name] += 1
            return _orig(self, *a, **k)

        setattr(torch.Tensor, name, wrapper)
    orig_sync = torch.cuda.synchronize

    def sync(*a, **k):
        if PHASE[0] != "off":
            COUNTS[PHASE[0]]["cuda.synchronize"] += 1
        return orig_sync(*a, **k)

    torch.cuda.synchronize = sync


def run(overrides: list[str], out_dir: str, name: str) -> dict:
    for c in COUNTS.values():
        c.clear()
    cfg, _ = parse_args(
        [
            "--config",
            "train_configs/debug_model.toml",
            "--training.steps",
            "7",
            "--metrics.log_freq",
            "3",
            "--training.seq_len",
            "64",
            "--training.global_batch_size",
            "8",
            "--training.local_batch_size",
            "2",
            "--job.dump_folder",
            out_dir,
            "--job.run_name",
            name,
            "--metrics.enable_tensorboard",
            "false",
            *overrides,
        ]
    )
    trainer = Trainer(cfg)
    orig_log = trainer._log

    def log(*a, **k):
        PHASE[0] = "log"
        try:
            return orig_log(*a, **k)
        finally:
            PHASE[0] = "non_log"

    trainer._log = log
    PHASE[0] = "non_log"
    trainer.train()
    PHASE[0] = "off"
    trainer.close()
    return {k: dict(v) for k, v in COUNTS.items()}


def main() -> None:
    instrument()
    out_dir = sys.argv[2]
    results = {
        "fsdp_accum2_sft": run(
            ["--data.mode", "sft", "--training.seq_len", "256", "--diagnostics.method", "sketch"],
            out_dir,
            "fsdp",
        ),
        "ddp_accum2_skip": run(
            ["--parallelism.dp_replicate", "2", "--debug.ignore_all_labels_steps", "2,5"], out_dir, "ddp"
        ),
    }
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
