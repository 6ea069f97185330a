#!/usr/bin/env python3
"""Training-step speed, titanlite's configurations side by side with a plain baseline.

    ./scripts/bench.py [--quick] [--dp 4 8] [--reps 40] [--only GROUP ...]
                                      [--config FILE] [--out bench.json] [--section.key value ...]

For each dp degree, one torchrun builds one trainer per configuration in the same process group
(default: debug model, built-in SFT data, 1 sequence x 256 tokens x 2 microbatches per rank):
    baseline        what a user would otherwise write: per microbatch the mean cross entropy / M,
                    FSDP's default gradient averaging, torch's clip_grad_norm_, plain fused AdamW;
                    same model, data, optimizer settings and schedule
    titanlite       the exact loss path (summed loss / global valid tokens, SUM reductions, the
                    token-count all-reduce, on-device update skipping), FSDP, diagnostics off
    diag-default    diagnostics at the default schedule past warmup (probe installed, step not
                    measured); diag-sketch-every / diag-exact-every: every step measured
    skip-sync       FSDP without gradient reduction on non-final microbatches
    ddp, hsdp       the other data-parallel modes (hsdp: 2 replicas x dp/2 shards)
    native-rs       gloo only: titanlite with gloo's own reduce-scatter, not the all-to-all
                    titanlite uses there (titanlite.distributed.parallelize.reduce_scatter)
    reshard         FSDP freeing each block's gathered params after forward, gathering them again
                    in backward (parallelism.reshard_after_forward = always)
    one-unit        candidate: the whole model one FSDP unit (one all-gather, one reduce-scatter)
    unpacked,       at a fine-tuning length (seq_len 1024; the built-in records are 150-620 tokens,
    packed          10th-90th percentile): one SFT record per sequence, and records packed into
                    each sequence with per-document attention (data.packing); packing's gain is
                    in what a step holds: padding and target tokens
    tp2             the same global batch at dp/2 x tp=2: each pair of ranks splits the model's
                    tensors (parallelism.axes = ["tp=2"]) instead of reading its own sequences
    dropout-stream, dropout 0.1 with masks from torch's RNG (the default) and keyed by sample
    dropout-sample  (model.dropout_masks = sample: dp-invariant dropout, titanlite.ops.dropout)
    moe-local,      tests/fork_moe.py, a mixture of experts: its load-balancing loss by each
    moe-step        microbatch's formula, and over the whole step (the step-statistics pass)
and compares them in groups: loss (titanlite vs baseline), diagnostics (vs titanlite, i.e.
off; with accumulation, `sketch` sums its sketch per microbatch and reduces as titanlite
does), measuring (diag-exact-every vs skip-sync: an exact measured step reduces once, on its
last microbatch), sync (skip-sync vs titanlite, which syncs every microbatch), modes (ddp, hsdp vs
fsdp), reduce-scatter (titanlite vs native-rs), fsdp-units (reshard and one-unit vs titanlite),
packing (packed vs unpacked), dropout (dropout-sample vs dropout-stream) and statistics
(moe-step, tests/fork_moe.py's load-balancing loss over the whole step from the step-statistics
pass, vs moe-local, its formula per microbatch: what the pass costs) and tensor (tp2 vs
titanlite: a tensor split's exchanges in every block against plain data parallelism).
Each round runs one step of every configuration, in an order that rotates from round to round,
so machine noise (which drifts over seconds on a shared machine) hits neighbours alike. A ratio
is the median over rounds of the configuration's step time over its reference's in the same
round, with a 95% confidence interval of that median (order statistics). Two clocks: wall time
on rank 0, and CPU time summed over ranks (with more ranks than cores, wall time mostly
measures the scheduler). Per configuration also: tokens/s per rank, the share of padding in the
sequences of the first 64 (or more) steps and target (valid-label) tokens/s per rank, and one extra step counted
with titanlite.tools.instrument: collectives by group and host syncs, so regressions show.
After them, 5 steps each of baseline and titanlite under torch.profiler give the step-time
breakdown: forward and backward compute, FSDP's all-gathers and gradient reduction, clipping,
optimizer, data and the rest (host time; the trainer names its parts with record_function).
On CUDA: TFLOP/s, MFU and peak memory too. --quick: dp=4, 20 rounds (under 5 min on 2 cores).
Also the probe hook's own cost, timed directly: all the default diagnostics schedule adds to
499 steps of 500, which no step-time ratio resolves. Results go to --out as JSON; the tables of
scripts/README.md and titanlite/datasets/README.md render such reports kept in scripts/figures/
(markdown, profile_markdown, packing_markdown).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv()  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.analysis import harness  # noqa: E402
from titanlite.components.run.torchrun import MAX_RANKS  # noqa: E402
from titanlite.config import parse_args  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402

OFF = ["--diagnostics.enable", "false"]
EVERY = ["--diagnostics.measure_first", "1000000"]
CONFIGS = {
    "baseline": ["--loss.normalization", "local_mean", *OFF],  # its own step: see PlainStep
    "titanlite": OFF,
    "diag-default": ["--diagnostics.measure_first", "0", "--diagnostics.every", "500"],
    "diag-sketch-every": ["--diagnostics.method", "sketch", *EVERY],
    "diag-exact-every": ["--diagnostics.method", "exact", *EVERY],
    "skip-sync": ["--parallelism.skip_grad_sync", "on", *OFF],
    "ddp": ["--parallelism.dp_replicate", "{dp}", *OFF],
    "hsdp": ["--parallelism.dp_replicate", "2", *OFF],
    "native-rs": OFF,  # built with FSDP's own reduce-scatter: see build()
    # FSDP layouts: blocks resharded after forward (gathered again in backward: what auto does
    # for a model over 5% of a rank's memory), and a candidate, one FSDP unit for the whole model
    # (one all-gather and one reduce-scatter a pass; the debug model's blocks are 3.4 MB each).
    "reshard": ["--parallelism.reshard_after_forward", "always", *OFF],
    "one-unit": OFF,  # built with the blocks in the root's unit: see build()
    "unpacked": ["--training.seq_len", "1024", *OFF],
    "packed": ["--training.seq_len", "1024", "--data.packing", "true", *OFF],
    "dropout-stream": ["--model.dropout", "0.1", *OFF],
    "dropout-sample": ["--model.dropout", "0.1", "--model.dropout_masks", "sample", *OFF],
    # tests/fork_moe.py (a mixture of experts with a load-balancing loss and a z-loss): the loss
    # over the whole step, from the step-statistics pass (one forward without gradient per
    # microbatch), against transformers' formula per microbatch (no pass; not invariant)
    "moe-local": [
        "--model.import_module",
        "fork_moe",
        "--model.name",
        "fork_moe_local",
        "--model.flavor",
        "tiny",
        *OFF,
    ],
    # the same global batch with half the data-parallel ranks, each pair splitting the model's
    # tensors (titanlite.models.common.tensor_parallel): what tp's exchanges cost where dp would do
    "tp2": ["--parallelism.axes", '["tp=2"]', *OFF],
    "moe-step": [
        "--model.import_module",
        "fork_moe",
        "--model.name",
        "fork_moe",
        "--model.flavor",
        "tiny",
        *OFF,
    ],
}
# group: (reference, the configurations measured against it)
GROUPS = {
    "loss": ("baseline", ["titanlite"]),
    "diagnostics": ("titanlite", ["diag-default", "diag-sketch-every", "diag-exact-every"]),
    # An exact measured step reduces once, on its last microbatch (its probe needs whole-step
    # gradients), so its cost shows against the step that also skips the earlier syncs. The
    # sketch reduces every microbatch like titanlite: its cost is in "diagnostics".
    "measuring": ("skip-sync", ["diag-exact-every"]),
    "sync": ("titanlite", ["skip-sync"]),
    "modes": ("titanlite", ["ddp", "hsdp"]),
    "reduce-scatter": ("native-rs", ["titanlite"]),
    "fsdp-units": ("titanlite", ["reshard", "one-unit"]),
    "packing": ("unpacked", ["packed"]),
    "dropout": ("dropout-stream", ["dropout-sample"]),
    "statistics": ("moe-local", ["moe-step"]),
    "tensor": ("titanlite", ["tp2"]),
}
INTERVAL = 500  # diag-default's interval, for the amortized figure
DATA_STEPS = 64  # global batches whose padding and target tokens are counted, at least
BREAKDOWN_STEPS = 5  # profiled steps of baseline and titanlite, after the timed rounds


def ratio_stats(ts: list[float], ref: list[float]) -> dict:
    """Median of per-round ratios to the reference, with a 95% interval of that median."""
    ratios = sorted(t / r for t, r in zip(ts, ref, strict=True))
    n = len(ratios)
    half = 0.98 * math.sqrt(n)  # 1.96 sigma of Binomial(n, 1/2) around the median rank
    lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return {"ratio": statistics.median(ratios), "ci95": [ratios[lo], ratios[hi]], "n": n}


class PlainStep:
    """The baseline's step on a trainer whose FSDP kept its default gradient averaging. It uses
    the trainer's optimizer (fused AdamW) as a plain one: no update-skip flag is ever set."""

    def __init__(self, trainer) -> None:
        self.t = trainer

    def train_step(self, step: int) -> None:
        import torch
        import torch.nn.functional as F
        from torch.profiler import record_function

        from titanlite.components.loss import sequence_losses
        from titanlite.distributed.parallelize import grad_sync
        from titanlite.ops.cross_entropy import IGNORE_INDEX
        from titanlite.tools.hooks import Step

        t = self.t
        with record_function("titanlite.data"):
            micro = t.next_microbatches(Step(step, t.layout.skip_grad_sync, sequence_losses))
        for m, batch in enumerate(micro):  # the baseline runs unpacked data, without dropout
            inputs, labels = batch.inputs, batch.labels
            with grad_sync(t.model, m == len(micro) - 1 or not t.layout.skip_grad_sync):
                with t.dims.autocast(), record_function("titanlite.forward"):
                    logits = t.model(inputs)
                    loss = F.cross_entropy(
                        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX
                    )
                with record_function("titanlite.backward"):
                    (loss / len(micro)).backward()
        with record_function("titanlite.clip"):
            torch.nn.utils.clip_grad_norm_(t.model.parameters(), t.cfg.training.max_norm)
        with record_function("titanlite.optimizer"):
            t.optimizer.step()
            t.scheduler.step()
            t.optimizer.zero_grad(set_to_none=True)


def build(name: str, args, dump: str):
    """A trainer (or the baseline's step) for one configuration."""
    from unittest import mock

    import titanlite.distributed.parallelize as parallelize
    from titanlite.config import parse_args
    from titanlite.train import Trainer

    extra = [a.format(dp=args.world) for a in CONFIGS[name]]
    if name.startswith(
        "moe-"
    ):  # the worked example of titanlite/models/step.py lives with the tests
        sys.path.insert(0, str(REPO / "tests"))
    cfg, _ = parse_args(
        [
            "--config",
            str(args.config),
            "--training.global_batch_size",
            str(2 * args.world),
            "--training.local_batch_size",
            "1",
            "--training.steps",
            "100000",
            "--metrics.enable_tensorboard",
            "false",
            *args.overrides,
            "--job.dump_folder",
            dump,
            "--job.run_name",
            name,
            *extra,
        ]
    )
    if name == "native-rs":
        with mock.patch.object(parallelize, "use_fast_reduce_scatter", lambda model: None):
            return Trainer(cfg)
    if name == "one-unit":
        shard = parallelize.fully_shard

        def root_only(module, **kwargs):
            return shard(module, **kwargs) if hasattr(module, "layers") else module

        with mock.patch.object(parallelize, "fully_shard", root_only):
            return Trainer(cfg)
    if name != "baseline":
        return Trainer(cfg)
    # FSDP dividing by the world size in the reduction, as a user's script would have it.
    with mock.patch.object(parallelize, "disable_fsdp_grad_division", lambda model: None):
        return PlainStep(Trainer(cfg))


def _probe_call_cost(model, probe, calls: int = 20000) -> tuple[float, int]:
    """What an unmeasured step adds: the probe's reduce-scatter hook in place of the plain one,
    one Python call per FSDP unit in front of the same collective. Timing the collective itself
    only measures the scheduler here, so both are timed around a no-op collective; the
    difference, in microseconds per call."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    import titanlite.diagnostics.probe as probe_mod
    import titanlite.distributed.parallelize as parallelize

    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    hooks = {
        "probe": probe_mod.ProbingReduceScatter(probe, 0),
        "plain": parallelize.ReduceScatterComm(),
    }
    out, inp = torch.empty(4), torch.empty(4 * probe.world)
    real = probe_mod.reduce_scatter, parallelize.reduce_scatter

    def noop(*args, **kwargs):
        return None

    probe_mod.reduce_scatter = parallelize.reduce_scatter = noop
    try:
        timed = {name: math.inf for name in hooks}
        for name, call in list(hooks.items()) * 5:  # alternating; the fastest round of each
            start = time.perf_counter()
            for _ in range(calls):
                call(out, inp, None, "sum")
            timed[name] = min(timed[name], (time.perf_counter() - start) / calls)
    finally:
        probe_mod.reduce_scatter, parallelize.reduce_scatter = real
    return 1e6 * (timed["probe"] - timed["plain"]), units


def _trainer(obj):
    return obj.t if isinstance(obj, PlainStep) else obj


def count_step(obj, step: int, host) -> dict:
    """One step under the counters: collectives by group, host syncs."""
    from titanlite.tools.instrument import CollectiveCounter

    t = _trainer(obj)
    labels = {t.diagnostics.group.group_name: "diagnostics"} if t.diagnostics.enabled else {}
    host.counts.clear()
    with CollectiveCounter(labels, other="main") as coll, host.phase("step"):
        obj.train_step(step)
    return {
        "collectives": {g: sum(ops.values()) for g, ops in coll.by_group().items()},
        "collective_ops": coll.by_group(),
        "host_syncs": sum(host.counts["step"].values()),
    }


# The step's parts, from torch.profiler ranges: the trainer's own (titanlite/train.py names
# them; PlainStep does too) and FSDP's communication ranges inside forward and backward.
PARTS = ("data", "forward", "backward", "clip", "optimizer")
BREAKDOWN = ("forward", "backward", "all_gather", "reduce", "clip", "optimizer", "data", "other")


def breakdown(obj, first_step: int, steps: int) -> dict:
    """Host time per step (ms) of each part of `steps` steps, under torch.profiler: data,
    forward and backward compute (their FSDP all-gathers and gradient reductions taken out),
    all-gather, reduce (FSDP's post-backward reduction: copy-in, reduce-scatter, copy-out),
    clip, optimizer, and the rest of the step. On CUDA these are launch times, not kernel
    times (read a GPU trace there)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            with record_function("titanlite.step"):
                obj.train_step(first_step + i)
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in prof.events():
        name = e.name
        if name.startswith("FSDP::all_gather") and "copy" not in name:
            key = "all_gather"
        elif name.startswith("FSDP::post_backward_reduce"):
            key = "reduce"
        elif name.startswith("titanlite."):
            key = name.removeprefix("titanlite.")
        else:
            continue
        spans.setdefault(key, []).append((e.time_range.start, e.time_range.end))

    def total(key: str, within: str | None = None) -> float:
        inside = spans.get(within, [])
        return sum(
            b - a
            for a, b in spans.get(key, [])
            if within is None or any(s <= a and b <= e for s, e in inside)
        )

    ms = {p: total(p) for p in PARTS}
    gather_fwd, gather_bwd = total("all_gather", "forward"), total("all_gather", "backward")
    reduce = total("reduce", "backward")
    out = {
        "data": ms["data"],
        "forward": ms["forward"] - gather_fwd,
        "backward": ms["backward"] - gather_bwd - reduce,
        "all_gather": gather_fwd + gather_bwd,
        "reduce": reduce,
        "clip": ms["clip"],
        "optimizer": ms["optimizer"],
    }
    out["other"] = total("step") - sum(out.values())
    return {k: v / 1000 / steps for k, v in out.items()}  # us -> ms per step


def data_stats(obj, steps: range) -> dict:
    """What the global batches of `steps` hold (host reads of the data, no step run): the share of
    sequence slots that are padding, and target tokens (labels not ignored) per step, over all
    ranks."""
    import numpy as np

    from titanlite.ops.cross_entropy import IGNORE_INDEX

    t = _trainer(obj)
    dataset, sampler = t.dataloader.dataset, t.dataloader.batch_sampler
    seqs = np.concatenate([sampler.global_batch(step - 1) for step in steps]).tolist()
    slots = len(seqs) * t.cfg.training.seq_len
    content = (
        sum(dataset.content_slots(i) for i in seqs) if hasattr(dataset, "content_slots") else slots
    )
    targets = sum(int((np.asarray(dataset[i][1]) != IGNORE_INDEX).sum()) for i in seqs)
    tokens = t.layout.tokens_per_rank_step
    return {
        "padding": 1 - content / slots,
        "targets_per_step": targets / len(steps),
        "tokens_per_rank_step": tokens,
    }


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from titanlite.components.step_window import StepWindow
    from titanlite.distributed.utils import peak_flops
    from titanlite.tools.instrument import HostSyncCounter

    dump = tempfile.mkdtemp(prefix="bench-")
    objs = {}
    for name in args.names:  # native-rs comes last: the process group exists by then
        if name == "hsdp" and (args.world % 2 or args.world < 4):
            continue
        if name == "native-rs" and dist.get_backend() != "gloo":
            continue
        objs[name] = build(name, args, dump)
    names = list(objs)
    cuda = _trainer(objs[names[0]]).device.type == "cuda"
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    peak_mem = dict.fromkeys(names, 0.0)
    for rnd in range(args.reps + 2):  # rounds 0 and 1 warm every configuration up, untimed
        for i in range(len(names)):
            name = names[(rnd + i) % len(names)]
            dist.barrier()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start, start_cpu = time.perf_counter(), time.process_time()
            objs[name].train_step(rnd + 1)
            if cuda:
                torch.cuda.synchronize()  # the benchmark's clock, not the trainer's hot path
                peak_mem[name] = max(peak_mem[name], torch.cuda.max_memory_allocated() / 2**30)
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if rnd > 1:
                wall[name].append(elapsed)
                cpu[name].append(elapsed_cpu)
        for obj in objs.values():  # what a log step does, outside the timed region
            t = _trainer(obj)
            t.diagnostics.collect()
            t.window = StepWindow()
    steps = range(1, max(args.reps + 3, DATA_STEPS + 1))  # the timed steps and more, for the mean
    data = {n: data_stats(objs[n], steps) for n in names} if dist.get_rank() == 0 else {}
    summed = torch.tensor([cpu[n] for n in names], dtype=torch.float64)
    dist.all_reduce(summed)  # CPU time summed over ranks: the work a step costs
    host = HostSyncCounter()
    host.install()  # after the timed rounds: the patched reads cost a Python call each
    counts = {n: count_step(objs[n], args.reps + 3, host) for n in names}
    extra = {"breakdown": {}}
    for n in ("baseline", "titanlite"):
        if n in objs:
            extra["breakdown"][n] = breakdown(objs[n], args.reps + 4, BREAKDOWN_STEPS)
    if "diag-default" in objs:
        t = objs["diag-default"]
        extra["probe_call_us"], extra["units"] = _probe_call_cost(t.model, t.diagnostics.probe)
    if dist.get_rank() == 0:
        t0 = _trainer(objs[names[0]])
        peak = peak_flops(t0.device, t0.dims.param_dtype)
        result = {
            "names": names,
            "wall": wall,
            "cpu": dict(zip(names, summed.tolist(), strict=True)),
            "counts": counts,
            "data": data,
            "world": dist.get_world_size(),
            "flops_per_token": t0.meta.flops_per_token,
            "peak_flops": peak,
            "peak_mem_gib": peak_mem if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else f"{os.cpu_count()} CPU cores, gloo",
            **extra,
        }
        Path(args.worker_out).write_text(json.dumps(result))
    for obj in objs.values():
        _trainer(obj).close()
    harness.finish()


def summarize(raw: dict) -> dict:
    """Per configuration: step time, tokens/s, counts; per group: ratios to the reference."""
    names = raw["names"]
    configs = {}
    for n in names:
        step = statistics.median(raw["wall"][n])
        tokens = raw["data"][n]["tokens_per_rank_step"]
        row = {
            "step_ms": 1000 * step,
            "cpu_step_ms": 1000 * statistics.median(raw["cpu"][n]),
            "tokens_per_s_per_rank": tokens / step,
            "padding_pct": 100 * raw["data"][n]["padding"],
            "targets_per_step": raw["data"][n]["targets_per_step"],
            "targets_per_s_per_rank": raw["data"][n]["targets_per_step"] / raw["world"] / step,
            **raw["counts"][n],
        }
        if raw["flops_per_token"] and raw["peak_mem_gib"] is not None:
            row["tflops"] = raw["flops_per_token"] * tokens / step / 1e12
            row["peak_mem_gib"] = raw["peak_mem_gib"][n]
            if raw["peak_flops"]:
                row["mfu_pct"] = 100 * row["tflops"] * 1e12 / raw["peak_flops"]
        configs[n] = row
    groups = {}
    for g, (ref, others) in GROUPS.items():
        if ref not in names:
            continue
        rows = {}
        for n in others:
            if n in names:
                rows[n] = {
                    clock: ratio_stats(raw[clock][n], raw[clock][ref]) for clock in ("wall", "cpu")
                }
        if g == "diagnostics" and "diag-default" in rows and "diag-exact-every" in rows:
            # A measured step every INTERVAL: its extra cost spread over the interval.
            extra = rows["diag-exact-every"]["wall"]["ratio"] - 1
            rows["diag-default"]["amortized_wall_ratio"] = (
                rows["diag-default"]["wall"]["ratio"] + extra / INTERVAL
            )
        if rows:
            groups[g] = {"reference": ref, "ratios": rows}
    out = {
        "device": raw["device"],
        "configs": configs,
        "groups": groups,
        "breakdown": raw["breakdown"],
    }
    if "probe_call_us" in raw:
        share = raw["probe_call_us"] * raw["units"] / (configs["titanlite"]["step_ms"] * 1000)
        out["probe_hook"] = {
            "us_per_call": raw["probe_call_us"],
            "units": raw["units"],
            "share_of_step": share,
        }
    return out


def table(dp: int, s: dict) -> str:
    lines = [f"\ndp={dp} ({s['device']})"]
    gpu = any("tflops" in r for r in s["configs"].values())
    head = f"{'config':<19}{'step ms':>9}{'CPU ms':>9}{'tok/s/rank':>12}{'pad %':>7}{'targets/s/rank':>16}"
    head += f"{'collectives/step':>26}{'host syncs':>12}"
    lines.append(head + (f"{'TFLOP/s':>9}{'MFU %':>7}{'peak GiB':>10}" if gpu else ""))
    for n, r in s["configs"].items():
        coll = " ".join(f"{g} {c}" for g, c in sorted(r["collectives"].items()))
        line = f"{n:<19}{r['step_ms']:>9.1f}{r['cpu_step_ms']:>9.1f}{r['tokens_per_s_per_rank']:>12.0f}"
        line += f"{r['padding_pct']:>7.1f}{r['targets_per_s_per_rank']:>16.0f}{coll:>26}{r['host_syncs']:>12}"
        if gpu:
            line += f"{r.get('tflops', 0):>9.1f}{r.get('mfu_pct', 0):>7.1f}{r.get('peak_mem_gib', 0):>10.2f}"
        lines.append(line)
    lines.append(
        f"\n{'ratio (step time / reference)':<42}{'wall':>8}{'95% CI':>17}{'CPU':>8}{'95% CI':>17}"
    )
    for g, grp in s["groups"].items():
        for n, r in grp["ratios"].items():
            w, c = r["wall"], r["cpu"]
            label = f"{g}: {n} / {grp['reference']}"
            lines.append(
                f"{label:<42}{w['ratio']:>8.3f}{_ci(w):>17}{c['ratio']:>8.3f}{_ci(c):>17}"
                + (
                    f"   amortized {r['amortized_wall_ratio']:.4f}"
                    if "amortized_wall_ratio" in r
                    else ""
                )
            )
    if s["breakdown"]:
        lines.append(
            f"\n{'step-time breakdown, host ms per step':<42}"
            + "".join(f"{p:>11}" for p in BREAKDOWN)
        )
        for n, parts in s["breakdown"].items():
            total = sum(parts.values())
            lines.append(
                f"{n:<32}{total:>10.1f}" + "".join(f"{parts[p]:>11.1f}" for p in BREAKDOWN)
            )
            lines.append(
                f"{'':<32}{'share':>10}"
                + "".join(f"{100 * parts[p] / total:>10.1f}%" for p in BREAKDOWN)
            )
    if "probe_hook" in s:
        p = s["probe_hook"]
        lines.append(
            f"unmeasured step, the probe hook's own cost: {p['us_per_call']:.2f} us per call x "
            f"{p['units']} FSDP units = {100 * p['share_of_step']:.5f}% of a step"
        )
    return "\n".join(lines)


def _ci(r: dict) -> str:
    return f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"


# scripts/README.md's table of ratios: (group, configuration) -> its row.
README_ROWS = {
    ("loss", "titanlite"): "exact loss balancing (titanlite) / plain baseline",
    ("diagnostics", "diag-default"): "diagnostics, default schedule past warmup / off",
    (
        "diagnostics",
        "diag-sketch-every",
    ): "diagnostics `sketch` (per microbatch), every step measured / off",
    ("diagnostics", "diag-exact-every"): "diagnostics `exact`, every step measured / off",
    ("measuring", "diag-exact-every"): "`exact` measured / the same step unmeasured (skip-sync)",
    ("sync", "skip-sync"): "sync skipping on non-final microbatches / syncing each",
    ("modes", "ddp"): "DDP / FSDP",
    ("modes", "hsdp"): "HSDP 2 x dp/2 / FSDP",
    ("reduce-scatter", "titanlite"): "all-to-all reduce-scatter on gloo / gloo's own",
    ("tensor", "tp2"): "dp/2 x tp=2 / dp (the same global batch)",
}


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = [head, ["---"] * len(head), *rows]
    return "".join("| " + " | ".join(cells) + " |\n" for cells in lines) + "\n"


def markdown(report: dict) -> str:
    """scripts/README.md's table of a report (what --out writes; scripts/figures/bench-*.json):
    README_ROWS' ratios with their 95% intervals, wall and CPU time per dp degree. A row no dp
    degree measured is left out; a cell one did not measure is '-'."""
    dps = sorted(report["dp"], key=int)
    head = ["ratio (step time / reference)"] + [
        f"dp={dp} {c}" for dp in dps for c in ("wall", "CPU")
    ]
    rows = []
    for (group, name), label in README_ROWS.items():
        cells = []
        for dp in dps:
            r = report["dp"][dp]["groups"].get(group, {}).get("ratios", {}).get(name)
            cells += [f"{r[c]['ratio']:.3f} {_ci(r[c])}" if r else "-" for c in ("wall", "cpu")]
        if any(c != "-" for c in cells):
            rows.append([label, *cells])
    return _table(head, rows)


def _ms(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def profile_markdown(report: dict) -> str:
    """scripts/README.md's table of where titanlite's step goes, from a report's breakdown
    (scripts/figures/bench_profile-*.json): host ms per step of each part, and its share."""
    out = []
    for dp in sorted(report["dp"], key=int):
        parts = report["dp"][dp]["breakdown"].get("titanlite")
        if not parts:
            continue
        total = sum(parts.values())
        at = f" at dp={dp}" if len(report["dp"]) > 1 else ""
        head = [
            f"titanlite's step{at}, {total:.0f} ms profiled",
            *(p.replace("_", "-") for p in BREAKDOWN),
        ]
        rows = [
            ["ms", *(_ms(parts[p]) for p in BREAKDOWN)],
            ["share", *(f"{100 * parts[p] / total:.1f}%" for p in BREAKDOWN)],
        ]
        out.append(_table(head, rows))
    return "".join(out)


def packing_markdown(report: dict) -> str:
    """titanlite/datasets/README.md's table of a packing report (--only packing;
    scripts/figures/bench_packing-*.json): padding, tokens/s and target tokens/s per rank."""
    out = []
    for dp in sorted(report["dp"], key=int):
        plain, packed = (report["dp"][dp]["configs"][n] for n in ("unpacked", "packed"))
        gain = packed["targets_per_s_per_rank"] / plain["targets_per_s_per_rank"]
        run = f"`scripts/bench.py --dp {dp} --reps {report['reps']} --only packing`"
        head = f"built-in SFT set, debug model, seq 1,024, dp={dp}, 1 sequence x 2 microbatches per rank ({run})"
        rows = [
            [
                label,
                f"{r['padding_pct']:.1f}%",
                f"{r['tokens_per_s_per_rank']:,.0f}",
                f"{r['targets_per_s_per_rank']:,.0f}",
            ]
            for label, r in (
                ("one record per sequence", plain),
                ("packed (`data.packing = true`)", packed),
            )
        ]
        rows[1][3] += f" ({gain:.2f}x)"
        out.append(_table([head, "padding", "tokens/s per rank", "target tokens/s per rank"], rows))
    return "".join(out)


SCRIPT = Script("bench", __doc__, overrides="every configuration's trainer")
SCRIPT.arg("--quick", kind="switch", help="dp=4, 20 rounds: under 5 minutes on 2 cores")
SCRIPT.arg(
    "--dp",
    kind="int",
    nargs="+",
    at_least=1,
    at_most=MAX_RANKS,
    help="dp degrees, one torchrun each (default 4 8)",
)
SCRIPT.arg(
    "--reps", kind="int", at_least=1, at_most=10**6, help="timed rounds (default 30; --quick 20)"
)
SCRIPT.arg(
    "--only", kind="choice", nargs="+", choices=tuple(GROUPS), help="measure only these groups"
)
SCRIPT.arg(
    "--config",
    kind="file",
    default="train_configs/debug_sft.toml",
    help="the config of every configuration",
)
SCRIPT.arg("--out", kind="out_file", default="bench.json", help="the report")
SCRIPT.arg("--worker-out", kind="out_file", internal=True, help="one rank's measurements")
SCRIPT.arg(
    "--world",
    kind="int",
    at_least=1,
    at_most=MAX_RANKS,
    internal=True,
    help="the worker's world size",
)
SCRIPT.arg(
    "--names", kind="text", nargs="+", internal=True, help="the configurations the worker builds"
)


def run(args) -> int:
    overrides = args.overrides
    args.config = Path(args.config).absolute()  # the workers run in the repository
    if args.worker_out:
        return worker(args)
    dps = args.dp or ([4] if args.quick else [4, 8])
    reps = args.reps or (20 if args.quick else 30)
    groups = args.only or list(GROUPS)
    names = [n for n in CONFIGS if any(n == GROUPS[g][0] or n in GROUPS[g][1] for g in groups)]
    parse_args(
        ["--config", str(args.config), *overrides]
    )  # the config file and overrides, in one line
    report = {"reps": reps, "config": str(args.config), "overrides": overrides, "dp": {}}
    for dp in dps:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            flags = ["--worker-out", tmp.name, "--world", str(dp), "--reps", str(reps)]
            flags += ["--config", str(args.config), "--names", *names, *overrides]
            harness.check(harness.launch(dp, [__file__, *flags]), f"dp={dp}")
            summary = summarize(json.loads(Path(tmp.name).read_text()))
        report["dp"][str(dp)] = summary
        print(table(dp, summary), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nwritten to {args.out}")


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
