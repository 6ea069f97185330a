"""Run under torchrun at dp=4: real runs that must and must not raise alerts, one process group.

healthy (must stay silent), same_data with on_alert = "stop" (identical_data stops the run) and
grad noise on rank 1 (faulty_worker names rank 1); debug model, built-in SFT, 30 steps each.
Writes {scenario: {"alerts": [...], "stopped": message or null}} (rank 0) to argv[1].
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from titanlite.config import parse_args
from titanlite.train import Trainer, TrainingError

SCENARIOS = {
    "healthy": [],
    "same_data": ["--debug.same_data", "true", "--diagnostics.on_alert", "stop"],
    "grad_noise": ["--debug.grad_noise_rank", "1", "--debug.grad_noise_scale", "10"],
}


def main() -> None:
    out, dump = sys.argv[1], sys.argv[2]
    results = {}
    for name, extra in SCENARIOS.items():
        cfg, _ = parse_args(
            [
                "--config",
                "train_configs/debug_sft.toml",
                "--training.steps",
                "30",
                "--metrics.log_freq",
                "5",
                "--metrics.enable_tensorboard",
                "false",
                "--job.dump_folder",
                dump,
                "--job.run_name",
                name,
                *extra,
            ]
        )
        trainer = Trainer(cfg)
        stopped = None
        try:
            trainer.train()
        except TrainingError as e:
            stopped = str(e)
        trainer.close()
        events = trainer.run_dir / "events.jsonl"
        alerts = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
        results[name] = {"alerts": alerts, "stopped": stopped}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
