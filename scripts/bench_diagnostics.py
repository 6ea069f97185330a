#!/usr/bin/env python
"""Step-time overhead of the diagnostics, side by side in one run.

    .venv/bin/python scripts/bench_diagnostics.py [--dp 4 8] [--reps 5] [--steps 4] [--out FILE]

For each dp degree, one torchrun builds one trainer per configuration in the same process group
(debug model, built-in SFT data, CPU/gloo here):
    off             diagnostics.enable = false
    sketch/step     sketch, every step measured
    exact/step      exact, every step measured
    default         sketch, default interval (500) past its warmup: the probe is installed
                    but the step is not measured
and alternates them, `steps` timed steps each, `reps` rounds, so machine noise hits all alike.
It prints the median step time of each, its ratio to `off`, and the amortized overhead at the
default schedule after warmup (one measured step in 500). Results also go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {
    "off": ["--diagnostics.enable", "false"],
    "sketch/step": ["--diagnostics.method", "sketch", "--diagnostics.warmup_steps", "1000000"],
    "exact/step": ["--diagnostics.method", "exact", "--diagnostics.warmup_steps", "1000000"],
    "default": ["--diagnostics.method", "sketch", "--diagnostics.warmup_steps", "0"],
}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from titanlite.config import parse_args
    from titanlite.train import Trainer

    dump = tempfile.mkdtemp(prefix="bench-diag-")
    trainers = {}
    for name, extra in CONFIGS.items():
        cfg, _ = parse_args(
            [
                "--config",
                str(REPO / "train_configs/debug_sft.toml"),
                "--training.global_batch_size",
                str(args.world),
                "--training.local_batch_size",
                "1",
                "--training.steps",
                "100000",
                "--metrics.enable_tensorboard",
                "false",
                "--job.dump_folder",
                dump,
                "--job.run_name",
                name.replace("/", "-"),
                *extra,
            ]
        )
        trainers[name] = Trainer(cfg)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    step = {name: 0 for name in CONFIGS}
    for rep in range(args.reps + 1):  # round 0 warms up every trainer, untimed
        for name, trainer in trainers.items():
            for _ in range(args.steps):
                step[name] += 1
                dist.barrier()
                start = time.perf_counter()
                trainer.train_step(step[name])
                elapsed = time.perf_counter() - start
                if rep > 0:
                    times[name].append(elapsed)
            trainer.diagnostics.collect()  # drain outside the timed region, as a log step would
            trainer._window.clear()
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps(times))
    for trainer in trainers.values():
        trainer.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--dp", type=int, nargs="+", default=[4, 8])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default="bench_diagnostics.json")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker_out:
        return worker(args)
    report = {}
    for dp in args.dp:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={dp}",
                __file__,
                "--worker-out",
                tmp.name,
                "--world",
                str(dp),
                "--reps",
                str(args.reps),
                "--steps",
                str(args.steps),
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"dp={dp} failed:\n{proc.stderr[-4000:]}")
            times = json.loads(Path(tmp.name).read_text())
        base = statistics.median(times["off"])
        rows = {}
        for name, ts in times.items():
            med = statistics.median(ts)
            rows[name] = {"median_s": med, "ratio": med / base, "spread_s": [min(ts), max(ts)], "n": len(ts)}
        every = rows["sketch/step"]["ratio"] - 1
        rows["default, amortized"] = {"ratio": rows["default"]["ratio"] + every / 500}
        report[f"dp={dp}"] = rows
        print(
            f"\ndp={dp} (debug model, SFT, 1 sequence x 256 tokens per rank, gloo on {os.cpu_count()} CPU cores)"
        )
        print(f"{'config':<20}{'median step':>14}{'vs off':>10}")
        for name, r in rows.items():
            med = f"{r['median_s'] * 1000:.0f} ms" if "median_s" in r else ""
            print(f"{name:<20}{med:>14}{r['ratio']:>10.3f}")
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
