#!/usr/bin/env python
"""Step-time overhead of the diagnostics, side by side in one run.

    .venv/bin/python scripts/bench_diagnostics.py [--dp 4 8] [--reps 60] [--out FILE]

For each dp degree, one torchrun builds one trainer per configuration in the same process group
(debug model, built-in SFT data, CPU/gloo here):
    off             diagnostics.enable = false
    sketch/step     sketch, every step measured
    exact/step      exact, every step measured
    default         the default method (auto: exact under FSDP) past its warmup, at the default
                    interval: the probe is installed, this step is not measured
Each round runs one step of every configuration, in an order that rotates from round to round,
so machine noise (which drifts over seconds here) hits neighbours alike. A configuration's
ratio is the median over rounds of its step time over `off`'s in the same round, with a 95%
confidence interval of that median (order statistics), so a reader sees what the run resolves.
"default, amortized" adds a measured step's extra cost spread over the interval (1 in 500).
Two clocks: wall time on rank 0, and CPU time summed over the ranks (the work a step costs:
with 4-8 ranks sharing 2 cores, wall time mostly measures the scheduler). Last, the probe
hook's own cost on an unmeasured step (all that the default schedule adds on 499 steps of 500),
timed directly, since no step-time ratio resolves a few microseconds. Results also go to --out
as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
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
    "default": ["--diagnostics.warmup_steps", "0", "--diagnostics.interval", "500"],
}


def _row(ts: list[float], off: list[float]) -> dict:
    """Median step time, and the median of per-round ratios to `off` with its 95% interval."""
    ratios = sorted(t / o for t, o in zip(ts, off, strict=True))
    n = len(ratios)
    half = 0.98 * math.sqrt(n)  # 1.96 sigma of Binomial(n, 1/2) around the median rank
    lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return {
        "median_s": statistics.median(ts),
        "ratio": statistics.median(ratios),
        "ci95": [ratios[lo], ratios[hi]],
        "n": n,
    }


def _probe_call_cost(model, probe, calls: int = 20000) -> tuple[float, int]:
    """What an unmeasured step adds: the probe's reduce-scatter hook, one Python call per FSDP
    unit in front of the same collective. Timing the collective itself only measures the
    scheduler here (ranks share 2 cores), so the hook is timed around a no-op collective, against
    calling that no-op directly; in microseconds per call."""
    from types import SimpleNamespace

    import torch
    from torch.distributed.fsdp import FSDPModule

    import titanlite.diagnostics.probe as probe_mod

    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    hook = probe_mod.ProbingReduceScatter(probe, 0)  # what install() gives every unit
    out, inp = torch.empty(4), torch.empty(4 * probe.world)
    noop = SimpleNamespace(reduce_scatter_tensor=lambda *a, **k: None)
    real, probe_mod.dist = probe_mod.dist, noop
    try:
        timed = {}
        for name, call in (("hook", hook), ("direct", noop.reduce_scatter_tensor)) * 2:
            start = time.perf_counter()
            for _ in range(calls):
                call(out, inp, None, "sum")
            timed[name] = (time.perf_counter() - start) / calls  # the second round counts
    finally:
        probe_mod.dist = real
    return 1e6 * (timed["hook"] - timed["direct"]), units


def worker(args: argparse.Namespace) -> None:
    import torch
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
    names = list(CONFIGS)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps + 2):  # rounds 0 and 1 warm every trainer up, untimed
        for i in range(len(names)):
            name = names[(rep + i) % len(names)]
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            trainers[name].train_step(rep + 1)
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if rep > 1:
                wall[name].append(elapsed)
                cpu[name].append(elapsed_cpu)
        for trainer in trainers.values():  # drain outside the timed region, as a log step would
            trainer.diagnostics.collect()
            trainer._window.clear()
    # CPU time summed over ranks: the work a step costs, which core sharing does not blur.
    summed = torch.tensor([cpu[name] for name in names], dtype=torch.float64)
    dist.all_reduce(summed)
    probe_us, units = _probe_call_cost(trainers["default"].model, trainers["default"].diagnostics.probe)
    if dist.get_rank() == 0:
        cpu = {name: row for name, row in zip(names, summed.tolist(), strict=True)}
        result = {"wall": wall, "cpu": cpu, "probe_call_us": probe_us, "units": units}
        Path(args.worker_out).write_text(json.dumps(result))
    for trainer in trainers.values():
        trainer.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--dp", type=int, nargs="+", default=[4, 8])
    p.add_argument("--reps", type=int, default=60, help="timed rounds (one step of each config)")
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
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"dp={dp} failed:\n{proc.stderr[-4000:]}")
            times = json.loads(Path(tmp.name).read_text())
        report[f"dp={dp}"] = {}
        print(
            f"\ndp={dp} (debug model, SFT, 1 sequence x 256 tokens per rank, gloo on {os.cpu_count()} CPU cores)"
        )
        print(
            f"{'config':<20}{'wall step':>11}{'vs off':>8}{'95% CI':>17}{'CPU step':>11}{'vs off':>8}{'95% CI':>17}"
        )
        for clock in ("wall", "cpu"):
            rows = {name: _row(ts, times[clock]["off"]) for name, ts in times[clock].items()}
            every = rows["exact/step"]["ratio"] - 1  # the default method under FSDP
            rows["default, amortized"] = {"ratio": rows["default"]["ratio"] + every / 500}
            report[f"dp={dp}"][clock] = rows
        wall, cpu = report[f"dp={dp}"]["wall"], report[f"dp={dp}"]["cpu"]
        for name in wall:
            cells = []
            for r in (wall[name], cpu[name]):
                med = f"{r['median_s'] * 1000:.0f} ms" if "median_s" in r else ""
                ci = f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" if "ci95" in r else ""
                cells.append(f"{med:>11}{r['ratio']:>8.3f}{ci:>17}")
            print(f"{name:<20}{''.join(cells)}")
        us, units = times["probe_call_us"], times["units"]
        share = us * units / (wall["off"]["median_s"] * 1e6)
        report[f"dp={dp}"]["probe_hook"] = {"us_per_call": us, "units": units, "share_of_step": share}
        print(
            f"unmeasured step, the probe hook's own cost: {us:.2f} us per call x {units} "
            f"FSDP units = {100 * share:.5f}% of a step"
        )
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
