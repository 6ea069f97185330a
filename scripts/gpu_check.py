#!/usr/bin/env python3
"""The GPU path in one command: speed, memory, the no-host-sync claim and bf16 accuracy.

    scripts/gpu_check.sh [--smoke] [--out DIR] [--only SECTION ...] [--steps N]

One GPU is enough (and one GPU cannot test NCCL between ranks: see scripts/README.md's multi-GPU
checklist). Each training run is a fresh single-rank trainer process (`python -m
titanlite.train`, FSDP at dp=1), so every figure is what a user's run reports. Sections:
  speed   llama_1b shapes at Llama 3's vocabulary (128,256) on random tokens (data.mode =
          synthetic), bf16 params, fp32 reduction, local batch 4 x seq 2048: tokens/s, TFLOP/s,
          MFU, peak memory and the memory estimate, for activation checkpointing none /
          selective / full x compile off / on (median of the log windows after the first)
  batch   the largest local batch at seq 2048 that runs, per AC kind, compile off (doubling,
          then bisection; debug.skip_memory_check lets the estimate be tested, not obeyed),
          beside the largest the memory estimate admits
  sync    steps under torch.cuda.set_sync_debug_mode("error") outside log steps
          (debug.sync_debug), compile off and on: a host sync anywhere in a step fails the run
  determinism  the same steps twice with training.deterministic (cuBLAS's fixed workspace,
          torch.use_deterministic_algorithms): every logged loss and grad norm bitwise equal
  accum   llama_1b on the built-in data: accumulation 1 vs 4 over the same global batch; the
          relative loss difference at every step, which compare_runs' default tolerance (bf16:
          growing with the step) must cover, and its margin
  probe   the diagnostics probe's device work per measured step (exact: the partial Gram;
          sketch: the CountSketch) on llama_1b's FSDP units at simulated world sizes 8 and 16,
          against the step time (diagnostics are off at one rank, so no run shows it)
  hf      a LlamaForCausalLM with llama_1b's layer shapes (2 layers) against titanlite's Llama
          read from its saved folder: logits in fp32 and in bf16 (needs transformers)
  packing llama_1b on the built-in SFT set at seq 2048: one record per sequence vs records packed
          with per-document attention (data.packing: FlexAttention's block mask, compiled), the
          packed run under sync_debug: tokens/s and target tokens per step (mean over the
          logged steps) of each
  rehearse the cluster rehearsal (./run_train.sh --rehearse W) on this GPU: llama_8b at
          torchtitan's 8 x H100 shapes (local batch 2, seq 8192, selective AC) as one rank of 8
          and of 64 (its peak memory against the estimate, compute-only tokens/s per GPU, bytes
          sent), and the speed section's llama_1b job as one rank of 8 with the diagnostics
          measuring under debug.sync_debug: the no-host-sync claim with diagnostics, on CUDA
  moe     Qwen3-MoE (train_configs/debug_moe.toml) on random tokens at Qwen3's vocabulary, the
          debug model and the 1B-active `2B-A1B` (64 experts, 8 active), each as a trainer run
          (tokens/s, MFU over the active parameters, peak memory against the estimate, selective
          AC), then one MoE layer's experts both ways on the same routed rows, forward and
          backward: grouped_mm against the per-expert loop (time, and their difference in bf16)
  tp      the tensor-parallel plan (titanlite.models.common.tensor_parallel) on this GPU at
          degree 1 (parallelism.axes = ["tp=1"]: every exchange a one-rank collective): the speed
          section's job with the plan's DTensors and vocab-parallel loss, under debug.sync_debug,
          against the same job without the axis: the loss curves within compare_runs' default
          tolerance, tokens/s and peak memory of each. One GPU cannot split a model between
          ranks; scripts/README.md's multi-GPU checklist runs tp=2 and tp=8
--smoke: every section on the CPU with the debug model's shapes and few steps (CI runs it, so
the script cannot rot; its figures are not GPU figures). Results: DIR/gpu_check.json and
DIR/gpu_check.md (the table in scripts/README.md). Exit 1 if a check fails (sync, determinism, hf, accum, a
crashed run).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv(
    dev=True
)  # any python3 will do: without titanlite's dependencies it re-executes in .venv

from titanlite.errors import UserError  # noqa: E402
from titanlite.tools.cli import Script  # noqa: E402
from titanlite.tools.records import metrics_rows  # noqa: E402

GiB = 2**30
SECTIONS = (
    "speed", "batch", "sync", "determinism", "accum", "probe", "hf", "packing", "rehearse", "moe",
    "tp",
)  # fmt: skip
MOE_CONFIG = "train_configs/debug_moe.toml"


@dataclasses.dataclass
class Shapes:
    """What the full check and the smoke run differ in."""

    config: str  # the trainer config the runs start from
    vocab: int
    seq: int
    batch: int  # the speed section's local batch
    steps: int
    log_every: int
    max_batch: int  # the batch search stops here
    batch_kinds: tuple[str, ...]  # the AC kinds whose largest batch is searched
    compile_kinds: tuple[str, ...]  # AC kinds also timed with compile on
    accum_steps: int
    hf: dict  # LlamaConfig shapes
    hf_tokens: int
    sft_seq: int  # the packing section's seq_len (the built-in records are 150-620 tokens)
    rehearsed: list[str]  # the rehearse section's job
    rehearsed_worlds: tuple[int, ...]  # ... as one rank of each
    rehearsed_steps: int  # rehearsal.steps of each rehearsal
    moe_flavors: tuple[str, ...]  # the moe section's Qwen3-MoE flavors
    moe_vocab: int  # ... and their vocabulary
    moe_reps: int  # timed repetitions of each way to run the experts


FULL = Shapes(
    config="train_configs/llama_1b.toml",
    vocab=128256,
    seq=2048,
    batch=4,
    steps=30,
    log_every=10,
    max_batch=64,
    batch_kinds=("none", "selective", "full"),
    compile_kinds=("none", "selective", "full"),
    accum_steps=30,
    hf=dict(
        hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8
    ),
    hf_tokens=512,
    sft_seq=2048,
    # torchtitan's published 8 x H100 run of Llama 3.1 8B: local batch 2, seq 8192, selective AC
    rehearsed=["--config", "train_configs/llama_8b.toml", "--training.local_batch_size", "2"]
    + ["--training.seq_len", "8192", "--training.activation_checkpoint", "selective"],
    rehearsed_worlds=(8, 64),
    rehearsed_steps=7,
    moe_flavors=("debugmodel", "2B-A1B"),
    moe_vocab=151936,  # Qwen3's
    moe_reps=5,
)
SMOKE = Shapes(
    config="train_configs/debug_model.toml",
    vocab=2048,
    seq=128,
    batch=2,
    steps=6,
    log_every=2,
    max_batch=1,  # the search's first probe: its code runs, and each run costs seconds here
    batch_kinds=("full",),  # one kind runs the search's code; the speed rows run all three
    compile_kinds=(),  # compile on a CPU costs ~20 s a run; the exactness suite compiles
    accum_steps=6,
    hf=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    hf_tokens=32,
    sft_seq=512,
    rehearsed=["--config", "train_configs/debug_model.toml", "--training.seq_len", "128"],
    rehearsed_worlds=(),  # the sync rehearsal runs the path; tests/test_rehearsal.py rehearses 2 to 1,024
    rehearsed_steps=5,
    moe_flavors=("debugmodel",),
    moe_vocab=2048,
    moe_reps=2,
)
# The hf check. fp32: the largest logit difference over the largest logit, the two models' op
# order apart. bf16: each model's error against transformers' fp32 logits; titanlite's may be at
# most this multiple of transformers' own (on an H100 at llama_1b's width and 512 tokens the two
# bf16 models differed from each other by 9% of the largest logit, each being a few per cent off
# fp32: a fixed bound on their difference is a guess, their accuracy is the claim).
HF_FP32_TOL = 1e-4
HF_BF16_MARGIN = 1.5


# ---- training runs --------------------------------------------------------------------------
def rehearse(out: Path, name: str, world: int, *overrides: str, timeout: float = 1800) -> dict:
    """One rehearsal (run_train.sh --rehearse W, through the launcher's checks); its report."""
    flags = {"--rehearsal.world": world, "--job.dump_folder": out / "runs", "--job.run_name": name}
    flags["--debug.skip_memory_check"] = "true"  # the estimate is what it checks, not obeys
    launch = [sys.executable, "-m", "titanlite.launch", "--from-env"]
    argv = [*launch, *overrides, *(str(x) for pair in flags.items() for x in pair)]
    env = {**os.environ, "NPROC": "1"} if not has_gpu() else {**os.environ, "NGPU": "1"}
    rc, err = run_process(argv, timeout, env)
    report = out / "runs" / name / "rehearsal.json"
    row = {"name": name, "world": world, "rc": rc}
    if rc == 0 and report.exists():
        r = json.loads(report.read_text())
        d = r["diagnostics"] or {}
        row.update(
            peak_gib=r["peak_bytes"] / GiB,
            est_gib=r["estimate_bytes"] / GiB,
            tokens_per_s=r["tokens_per_s"],
            sent_gib=sum(r["traffic_bytes"].values()) / GiB,
            comm_s=r["comm_s"],
            compute_s=r["compute_s"],
            host_reads=r["host_reads"],
            sync_debug=r["sync_debug"],
            diag_host_s=d.get("host_s"),
        )
    else:
        row["error"] = err
    return row


def check_rehearse(shapes: Shapes, out: Path) -> dict:
    steps = ["--rehearsal.steps", str(shapes.rehearsed_steps)]
    random_tokens = ["--data.mode", "synthetic", "--model.vocab_size", str(shapes.vocab), *steps]
    rows = [
        rehearse(out, f"rehearse-{world}", world, *shapes.rehearsed, *random_tokens)
        for world in shapes.rehearsed_worlds
    ]
    sync = synthetic(
        shapes,
        shapes.batch,
        7,
        "--debug.sync_debug",
        "true",
        "--diagnostics.method",
        "exact",
        *steps,
    )
    rows.append(rehearse(out, "rehearse-sync", 8, "--config", shapes.config, *sync))
    for row in rows:
        say(
            f"rehearse {row['name']}: "
            + (f"FAILED ({row['error']})" if row["rc"] else _rehearsed(row))
        )
    # the estimate the trainer starts on must stay above the peak it rehearses
    ok = all(r["rc"] == 0 and r["host_reads"] == 0 and r["peak_gib"] <= r["est_gib"] for r in rows)
    return {"rows": rows, "ok": ok}


def _rehearsed(r: dict) -> str:
    return (
        f"one rank of {r['world']}: peak {r['peak_gib']:.2f} GiB (estimate {r['est_gib']:.2f}), "
        f"{r['tokens_per_s']:,.0f} tokens/s compute-only, {r['sent_gib']:.2f} GiB sent a step "
        f"({r['comm_s']:.3f} s at the link, compute {r['compute_s']:.3f} s), host reads {r['host_reads']}"
        + (", sync_debug passed" if r["sync_debug"] else "")
    )


def train(
    shapes: Shapes,
    out: Path,
    name: str,
    *overrides: str,
    timeout: float = 900,
    config: str | None = None,
) -> dict:
    """One single-rank trainer run (of `config`, default the shapes'); returns its exit code, log
    records and the tail of stderr."""
    argv = [
        sys.executable,
        "-m",
        "titanlite.train",
        "--config",
        config or shapes.config,
        "--job.dump_folder",
        str(out / "runs"),
        "--job.run_name",
        name,
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.every",
        "0",
        *overrides,
    ]
    began = time.perf_counter()
    rc, err = run_process(argv, timeout)
    metrics = out / "runs" / name / "metrics.jsonl"
    records = metrics_rows(metrics, logged=True)  # the log steps' rows carry throughput and memory
    return {"rc": rc, "records": records, "error": err, "wall_s": time.perf_counter() - began}


def run_process(argv: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """A run's exit code (124: timed out) and the last three lines of its stderr."""
    try:
        proc = subprocess.run(
            argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
        rc, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = (
            124,
            e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""),
        )
    return rc, " | ".join([line for line in err.strip().splitlines() if line.strip()][-3:])


def synthetic(shapes: Shapes, batch: int, steps: int, *overrides: str) -> list[str]:
    return [
        "--data.mode",
        "synthetic",
        "--model.vocab_size",
        str(shapes.vocab),
        "--training.seq_len",
        str(shapes.seq),
        "--training.local_batch_size",
        str(batch),
        "--training.global_batch_size",
        str(batch),
        "--training.steps",
        str(steps),
        "--metrics.log_every",
        str(shapes.log_every),
        *overrides,
    ]


def estimate_gib(shapes: Shapes, overrides: list[str], config: str | None = None) -> float:
    """The trainer's memory estimate for this run, on the meta device (no GPU touched)."""
    import torch

    from titanlite.config import parse_args
    from titanlite.models.registry import build_meta_model
    from titanlite.tools.memory import job_estimate
    from titanlite.validation import validate

    cfg, _ = parse_args(["--config", config or shapes.config, *overrides])
    layout = validate(cfg, 1)
    meta = build_meta_model(cfg, 0)
    cuda = cfg.training.device == "cuda" or (cfg.training.device == "auto" and has_gpu())
    dtype = (
        torch.bfloat16
        if cuda and cfg.training.mixed_precision_param != "float32"
        else torch.float32
    )
    return job_estimate(meta, cfg, layout, dtype, device_bytes()).total_bytes / GiB


def has_gpu() -> bool:
    """Without initializing CUDA in this process (the trainer runs need the whole GPU)."""
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def device_bytes() -> float:
    """What one rank may use: the GPU's total memory, else the host's available share."""
    if has_gpu():
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
        ).stdout
        return float(out.split()[0]) * 2**20
    import torch

    from titanlite.tools.memory import available_bytes

    return available_bytes(torch.device("cpu"))[0]


def window_figures(records: list[dict], log_every: int) -> dict:
    """Medians over the log windows after the first (which holds start-up and compilation)."""
    later = [r for r in records if r["step"] > log_every] or records[-1:]
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in later)}
    for key in ("tflops", "mfu_pct"):
        if all(key in r for r in later):
            out[key] = statistics.median(r[key] for r in later)
    out["peak_gib"] = records[-1]["memory_gib"]
    return out


def measured(
    shapes: Shapes, out: Path, name: str, overrides: list[str], config: str | None = None
) -> dict:
    """A trainer run's row: its exit code and memory estimate, and its window figures or error."""
    run = train(shapes, out, name, *overrides, config=config)
    row = {"rc": run["rc"], "est_gib": estimate_gib(shapes, overrides, config)}
    if run["rc"] == 0 and run["records"]:
        row.update(window_figures(run["records"], shapes.log_every))
    else:
        row["error"] = run["error"]
    return row


def check_speed(shapes: Shapes, out: Path, steps: int) -> dict:
    rows = []
    for compiled in (False, True):
        for ac in ("none", "selective", "full"):
            if compiled and ac not in shapes.compile_kinds:
                continue
            extra = [
                "--training.activation_checkpoint",
                ac,
                "--training.compile",
                str(compiled).lower(),
            ]
            overrides = synthetic(shapes, shapes.batch, steps, *extra)
            name = f"speed-{ac}-{'compile' if compiled else 'eager'}"
            row = {"ac": ac, "compile": compiled, **measured(shapes, out, name, overrides)}
            rows.append(row)
            say(f"speed {ac:9s} compile {'on ' if compiled else 'off'}: {brief(row)}")
    return {"rows": rows, "ok": all(r["rc"] == 0 for r in rows)}


def check_batch(shapes: Shapes, out: Path) -> dict:
    """Largest local batch that runs two steps, per AC kind: doubling, then bisection."""
    avail = device_bytes()
    rows = []
    for ac in shapes.batch_kinds:
        tried: dict[int, bool] = {}

        def fits(b: int, ac: str = ac, tried: dict = tried) -> bool:
            extra = ["--training.activation_checkpoint", ac, "--debug.skip_memory_check", "true"]
            run = train(shapes, out, f"batch-{ac}-{b}", *synthetic(shapes, b, 2, *extra))
            tried[b] = run["rc"] == 0
            return tried[b]

        lo, hi = 0, None
        b = 1
        while b <= shapes.max_batch and fits(b):
            lo, b = b, 2 * b
        hi = b if b <= shapes.max_batch else None
        while hi is not None and hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        admitted = 0
        while admitted < shapes.max_batch:
            overrides = synthetic(shapes, admitted + 1, 2, "--training.activation_checkpoint", ac)
            if estimate_gib(shapes, overrides) * GiB > avail:
                break
            admitted += 1
        row = {
            "ac": ac,
            "largest": lo,
            "capped": hi is None,
            "estimate_admits": admitted,
            "tried": tried,
        }
        rows.append(row)
        cap = f" (the search stops at {shapes.max_batch})" if hi is None else ""
        say(
            f"batch {ac:9s}: largest local batch that runs {lo}{cap}; the estimate admits {admitted}"
        )
    return {
        "rows": rows,
        "seq": shapes.seq,
        "device_gib": avail / GiB,
        "ok": all(r["largest"] for r in rows),
    }


def check_sync(shapes: Shapes, out: Path, steps: int) -> dict:
    if not has_gpu():
        say(
            "sync: skipped, set_sync_debug_mode is CUDA's (the CPU suite counts host syncs instead)"
        )
        return {"skipped": "no GPU", "ok": True}
    errors = {}
    for compiled in (
        "false",
        "true",
    ):  # the host-sync counter of the CPU suite cannot see compiled code
        extra = ["--debug.sync_debug", "true", "--training.compile", compiled]
        run = train(
            shapes, out, f"sync-compile-{compiled}", *synthetic(shapes, shapes.batch, steps, *extra)
        )
        errors[compiled] = None if run["rc"] == 0 else run["error"]
        verdict = "pass" if run["rc"] == 0 else "FAIL " + run["error"]
        say(f"sync: {steps} steps under sync_debug_mode('error'), compile {compiled}: {verdict}")
    ok = not any(errors.values())
    return {"steps": steps, "ok": ok, "error": None if ok else errors}


def check_determinism(shapes: Shapes, out: Path, steps: int) -> dict:
    """Two runs of the same steps with training.deterministic: bitwise equal losses and grad norms."""
    overrides = synthetic(shapes, shapes.batch, steps, "--training.deterministic", "true")
    overrides += ["--metrics.log_every", "1"]
    curves = []
    for i in (1, 2):
        run = train(shapes, out, f"determinism-{i}", *overrides)
        if run["rc"] != 0 or not run["records"]:
            say(f"determinism: run {i} failed: {run['error']}")
            return {"ok": False, "error": run["error"]}
        curves.append([(r["step"], r["loss"], r["grad_norm"]) for r in run["records"]])
    differ = [a[0] for a, b in zip(*curves, strict=False) if a != b]
    ok = not differ and len(curves[0]) == len(curves[1]) == steps
    say(
        f"determinism: {steps} steps twice: "
        + ("bitwise equal" if ok else f"FAIL, steps {differ[:5]} differ")
    )
    return {"steps": steps, "ok": ok, "differ": differ}


def check_accum(shapes: Shapes, out: Path) -> dict:
    """Accumulation 1 vs 4 over the same global batch of 4 sequences, built-in data."""
    from titanlite.analysis.compare import compare
    from titanlite.analysis.runs import load_run
    from titanlite.analysis.tolerance import default_tolerance

    common = ["--training.global_batch_size", "4", "--training.steps", str(shapes.accum_steps)]
    common += ["--metrics.log_every", "1", "--training.seq_len", str(shapes.seq)]
    runs = {}
    for accum, local in ((1, 4), (4, 1)):
        run = train(
            shapes, out, f"accum-{accum}", *common, "--training.local_batch_size", str(local)
        )
        if run["rc"] != 0:
            say(f"accum: the run with accumulation {accum} failed: {run['error']}")
            return {"ok": False, "error": run["error"]}
        runs[accum] = load_run(out / "runs" / f"accum-{accum}")
    cmp = compare(runs[1], runs[4], default_tolerance(list(runs.values())))
    rels = [r.rel for r in cmp.rows if r.rel is not None]
    worst = max(rels) if rels else math.nan
    # The tightest margin: the step whose difference comes closest to that step's tolerance.
    margin = min(
        ((cmp.rtol_at(r) / r.rel, r.step) for r in cmp.rows if r.rel), default=(math.inf, None)
    )
    ok = cmp.passed
    say(f"accum: accumulation 1 vs 4, {len(rels)} steps: largest relative loss difference {worst:.3g}, "
        f"{margin[0]:.3g}x under compare_runs' default tolerance at its closest (step {margin[1]}; "
        f"{cmp.rtol}): {'pass' if ok else 'FAIL'}")  # fmt: skip
    return {"steps": len(rels), "max_rel": worst, "mean_rel": statistics.fmean(rels), "rtol": str(cmp.rtol),
            "rtol_last": cmp.rtol_at(cmp.rows[-1]), "margin": margin[0], "param_dtype": runs[1].param_dtype,
            "ok": ok}  # fmt: skip


def check_packing(shapes: Shapes, out: Path, steps: int) -> dict:
    """Unpacked vs packed SFT on the built-in set; the packed run under sync_debug (on CUDA)."""
    common = [
        "--data.mode",
        "sft",
        "--training.seq_len",
        str(shapes.sft_seq),
        "--training.steps",
        str(steps),
    ]
    common += [
        "--training.local_batch_size",
        str(shapes.batch),
        "--training.global_batch_size",
        str(shapes.batch),
    ]
    common += ["--metrics.log_every", str(shapes.log_every)]
    rows = []
    for packed in (False, True):
        extra = ["--data.packing", "true", "--debug.sync_debug", "true"] if packed else []
        run = train(shapes, out, f"packing-{'on' if packed else 'off'}", *common, *extra)
        row = {"packed": packed, "rc": run["rc"]}
        if run["rc"] == 0 and run["records"]:
            row.update(window_figures(run["records"], shapes.log_every))
            row["targets_per_step"] = statistics.fmean(r["valid_tokens"] for r in run["records"])
            row["targets_per_s"] = (
                row["tokens_per_s"] * row["targets_per_step"] / (shapes.batch * shapes.sft_seq)
            )
        else:
            row["error"] = run["error"]
        rows.append(row)
        what = f"{row['targets_per_s']:,.0f} target tokens/s" if "targets_per_s" in row else ""
        say(f"packing {'on ' if packed else 'off'}: {what} ({row['tokens_per_s']:,.0f} tokens/s)" if what else
            f"packing {'on ' if packed else 'off'}: FAILED ({row.get('error', '')})")  # fmt: skip
    return {"rows": rows, "seq": shapes.sft_seq, "ok": all(r["rc"] == 0 for r in rows)}


# ---- in this process, after the runs (they need the whole GPU) -------------------------------
def check_probe(shapes: Shapes, step_s: float | None) -> dict:
    """The probe's work per measured step over llama_1b's FSDP units (each block, then the root:
    embedding, head, final norm), each padded to a multiple of the world size as FSDP does."""
    import torch

    from titanlite.config import parse_args
    from titanlite.diagnostics.probe import GradProbe
    from titanlite.models.registry import build_meta_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg, _ = parse_args(["--config", shapes.config, "--model.vocab_size", str(shapes.vocab)])
    model = build_meta_model(cfg, 0).model
    units = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    units.append(sum(p.numel() for p in model.parameters()) - sum(units))
    reps = 5 if device.type == "cuda" else 2
    rows = []
    for world in (8, 16):
        padded = [-(-n // world) * world for n in units]
        grad = torch.randn(max(padded), device=device)  # fp32: the reduction dtype
        for method in ("exact", "sketch"):
            probe = GradProbe(method, world, 1024, 0, device)
            times = []
            for r in range(reps + 1):  # the first warms up (sketch tables, kernels)
                sync(device)
                began = time.perf_counter()
                probe.start(True)
                for i, n in enumerate(padded):
                    probe.observe(grad[:n], i << 40)
                    if method == "exact":
                        probe.sum_with_gram(grad[:n])
                sync(device)
                if r:
                    times.append(time.perf_counter() - began)
            ms = 1000 * statistics.median(times)
            row = {"world": world, "method": method, "ms": ms}
            if step_s:
                row["of_step_pct"] = 100 * ms / 1000 / step_s
            rows.append(row)
            share = f" = {row['of_step_pct']:.2f}% of a step" if step_s else ""
            say(f"probe world {world:2d} {method:6s}: {ms:.2f} ms per measured step{share}")
        del grad
    return {"rows": rows, "units": len(units), "params": sum(units), "step_s": step_s, "ok": True}


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_hf(shapes: Shapes, out: Path) -> dict:
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        say("hf: skipped, transformers is not installed (pip install transformers)")
        return {"skipped": "no transformers", "ok": True}
    import torch

    transformers.utils.logging.disable_progress_bar()
    from titanlite.components.checkpoint.hf_load import load_hf_weights
    from titanlite.models.llama3 import Llama3
    from titanlite.models.llama3.hf import LLAMA3_HF

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = LlamaConfig(
        vocab_size=shapes.vocab,
        num_hidden_layers=2,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        **shapes.hf,
    )
    folder = out / "hf_model"
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    hf = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).to(device)
    args = LLAMA3_HF.args_from_config(json.loads((folder / "config.json").read_text()))
    ours = Llama3(dataclasses.replace(args, max_seq_len=shapes.hf_tokens))
    load_hf_weights(ours, folder, LLAMA3_HF, ours.args)
    ours = ours.to(device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shapes.vocab, (2, shapes.hf_tokens), generator=g).to(device)
    # fp32: the two models must agree. bf16: both are set against transformers' fp32 logits, and
    # titanlite's error must be no larger than HF_BF16_MARGIN x transformers' own: two bf16 models
    # differ from each other by their rounding, which grows with width and length (not a bug).
    with torch.no_grad():
        ref = hf(tokens).logits.float()
        scale = ref.abs().max()
        rel32 = ((ours(tokens).float() - ref).abs().max() / scale).item()
        hf.to(torch.bfloat16)
        ours.to(torch.bfloat16)
        hf16 = ((hf(tokens).logits.float() - ref).abs().max() / scale).item()
        ours16 = ((ours(tokens).float() - ref).abs().max() / scale).item()
    rows = [
        {"dtype": "float32", "max_rel": rel32, "tol": HF_FP32_TOL, "ok": rel32 <= HF_FP32_TOL},
        {"dtype": "bfloat16", "max_rel": ours16, "hf_max_rel": hf16, "tol": HF_BF16_MARGIN * hf16,
         "ok": ours16 <= HF_BF16_MARGIN * hf16},
    ]  # fmt: skip
    say(f"hf float32: largest logit difference / largest logit {rel32:.3g} (tolerance {HF_FP32_TOL:g}: "
        f"{'pass' if rows[0]['ok'] else 'FAIL'})")  # fmt: skip
    say(f"hf bfloat16 against fp32: titanlite {ours16:.3g}, transformers {hf16:.3g} (titanlite's may be at most "
        f"{HF_BF16_MARGIN:g}x: {'pass' if rows[1]['ok'] else 'FAIL'})")  # fmt: skip
    return {"rows": rows, "layers": 2, "vocab": shapes.vocab, "ok": all(r["ok"] for r in rows)}


def check_moe(shapes: Shapes, out: Path, steps: int) -> dict:
    rows, ways = [], []
    for flavor in shapes.moe_flavors:
        overrides = [
            *("--model.flavor", flavor, "--data.mode", "synthetic"),
            *("--model.vocab_size", str(shapes.moe_vocab), "--training.seq_len", str(shapes.seq)),
            *("--training.local_batch_size", str(shapes.batch)),
            *("--training.global_batch_size", str(shapes.batch)),
            *("--training.steps", str(steps), "--metrics.log_every", str(shapes.log_every)),
            *("--training.activation_checkpoint", "selective"),
        ]
        row = {"flavor": flavor, **measured(shapes, out, f"moe-{flavor}", overrides, MOE_CONFIG)}
        rows.append(row)
        say(f"moe {flavor}: {brief(row)}")
        ways.append(experts_both_ways(shapes, flavor))
        w = ways[-1]
        say(
            f"moe {flavor} experts, {w['rows']:,} routed rows: grouped {w['grouped_ms']:.2f} ms, "
            f"loop {w['loop_ms']:.2f} ms ({w['loop_ms'] / w['grouped_ms']:.2f}x), "
            f"difference {w['max_rel']:.2g} (tolerance {w['tol']:.2g})"
        )
    # the estimate must stay above the peak the GPU allocates (on a host the peak is the
    # process's resident set, which holds the libraries too)
    ok = all(r["rc"] == 0 and (r["peak_gib"] <= r["est_gib"] or not has_gpu()) for r in rows)
    ok = ok and all(w["max_rel"] <= w["tol"] for w in ways)
    return {"rows": rows, "experts": ways, "ok": ok}


def check_tp(shapes: Shapes, out: Path, steps: int) -> dict:
    """The tensor-parallel plan at degree 1 against the plain model on the same steps."""
    from titanlite.analysis.compare import compare
    from titanlite.analysis.runs import load_run
    from titanlite.analysis.tolerance import default_tolerance

    common = synthetic(shapes, shapes.batch, steps, "--metrics.log_every", "1")
    common += ["--diagnostics.enable", "false"]  # one rank: nothing to compare across
    sync_debug = ["--debug.sync_debug", "true"] if has_gpu() else []
    rows, runs = [], {}
    for name, extra in (("tp-none", []), ("tp-1", ["--parallelism.axes", '["tp=1"]', *sync_debug])):
        row = {"name": name, **measured(shapes, out, name, [*common, *extra])}
        rows.append(row)
        say(f"tp {name}: {brief(row)}")
        if row["rc"] != 0:
            return {"rows": rows, "ok": False, "error": row.get("error")}
        runs[name] = load_run(out / "runs" / name)
    cmp = compare(runs["tp-none"], runs["tp-1"], default_tolerance(list(runs.values())))
    rels = [r.rel for r in cmp.rows if r.rel is not None]
    worst = max(rels) if rels else math.nan
    say(f"tp: the plan at degree 1 vs none, {len(rels)} steps: largest relative loss difference "
        f"{worst:.3g} ({cmp.rtol}): {'pass' if cmp.passed else 'FAIL'}")  # fmt: skip
    return {"rows": rows, "max_rel": worst, "rtol": str(cmp.rtol), "ok": cmp.passed}


def experts_both_ways(shapes: Shapes, flavor: str) -> dict:
    """One MoE layer's experts of `flavor` in bf16 (FSDP's GPU compute dtype) on the device, run
    forward and backward on the same routed rows (a batch of the speed section's tokens, routed
    by a random router) as grouped_mm and as the per-expert loop: the median time of each, and
    the largest relative difference of the outputs and gradients (bf16's: 8 units of rounding)."""
    import torch

    from titanlite.models.qwen3_moe import qwen3_moe_flavors
    from titanlite.models.qwen3_moe.moe import Experts

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = qwen3_moe_flavors[flavor]
    tokens = shapes.batch * shapes.seq
    g = torch.Generator(device=device).manual_seed(0)
    probs = torch.randn(tokens, args.experts, device=device, generator=g).softmax(-1)
    weights, chosen = probs.topk(args.top_k, dim=-1)
    x = torch.randn(tokens, args.dim, device=device, generator=g).bfloat16()
    ways = {
        impl: Experts(dataclasses.replace(args, experts_impl=impl)).to(device, torch.bfloat16)
        for impl in ("grouped", "loop")
    }
    with torch.no_grad():
        for p in ways["grouped"].parameters():
            p.normal_(0, 0.02, generator=g)
    ways["loop"].load_state_dict(ways["grouped"].state_dict())
    times: dict[str, list[float]] = {impl: [] for impl in ways}
    results = {}
    for r in range(shapes.moe_reps + 1):  # the first warms up
        for impl, experts in ways.items():
            h = x.clone().requires_grad_()
            experts.zero_grad(set_to_none=True)
            sync(device)
            began = time.perf_counter()
            out = experts(h, chosen, weights)
            out.float().square().sum().backward()
            sync(device)
            if r:
                times[impl].append(time.perf_counter() - began)
            results[impl] = [out, h.grad, *(p.grad for p in experts.parameters())]

    def rel(a, b) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    diff = max(rel(a, b) for a, b in zip(results["grouped"], results["loop"], strict=True))
    return {
        "flavor": flavor,
        "rows": tokens * args.top_k,
        "grouped_ms": 1000 * statistics.median(times["grouped"]),
        "loop_ms": 1000 * statistics.median(times["loop"]),
        "max_rel": diff,
        "tol": 8 * 2.0**-8,
    }


# ---- report ------------------------------------------------------------------------------------
def say(line: str) -> None:
    print(f"gpu_check: {line}", flush=True)


def brief(row: dict) -> str:
    if row["rc"] != 0:
        return f"FAILED ({row.get('error', '')})"
    parts = [f"{row['tokens_per_s']:,.0f} tokens/s"]
    if "tflops" in row:
        parts.append(f"{row['tflops']:.1f} TFLOP/s")
    if "mfu_pct" in row:
        parts.append(f"MFU {row['mfu_pct']:.1f}%")
    parts.append(f"peak {row['peak_gib']:.2f} GiB (estimate {row['est_gib']:.2f})")
    return ", ".join(parts)


def _trained_cells(r: dict) -> str:
    """A trainer run's five table cells: tokens/s, TFLOP/s, MFU, peak memory, estimate."""
    if r["rc"]:
        return f"failed: {r.get('error', '')} | | | |"
    tf = f"{r['tflops']:.1f}" if "tflops" in r else "-"
    mfu = f"{r['mfu_pct']:.1f}%" if "mfu_pct" in r else "-"
    return f"{r['tokens_per_s']:,.0f} | {tf} | {mfu} | {r['peak_gib']:.2f} GiB | {r['est_gib']:.2f} GiB"


def markdown(result: dict) -> str:
    made = f" (torch {result['torch']}, {result['date']})" if "torch" in result else ""
    lines = [f"Device: {result['device']}{made}; {result['shapes']}.", ""]
    if "speed" in result:
        lines += [
            "| AC | compile | tokens/s | TFLOP/s | MFU | peak memory | estimate |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result["speed"]["rows"]:
            lines.append(f"| {r['ac']} | {'on' if r['compile'] else 'off'} | {_trained_cells(r)} |")
        lines.append("")
    if "batch" in result:
        b = result["batch"]
        cells = ", ".join(
            f"{r['ac']} {r['largest']}{'+' if r['capped'] else ''} (estimate admits {r['estimate_admits']})"
            for r in b["rows"]
        )
        lines += [f"Largest local batch at seq {b['seq']}: {cells}.", ""]
    if "packing" in result:
        cells = ", ".join(
            f"{'packed' if r['packed'] else 'one record per sequence'} "
            + (
                f"{r['tokens_per_s']:,.0f} tokens/s, {r['targets_per_step']:,.0f} target tokens per step "
                f"({r['targets_per_s']:,.0f}/s)"
                if r["rc"] == 0
                else f"failed: {r.get('error', '')}"
            )
            for r in result["packing"]["rows"]
        )
        lines += [f"SFT on the built-in set at seq {result['packing']['seq']}: {cells}.", ""]
    if "probe" in result:
        cells = ", ".join(
            f"{r['method']} at world {r['world']}: {r['ms']:.2f} ms"
            + (f" ({r['of_step_pct']:.2f}% of a step)" if "of_step_pct" in r else "")
            for r in result["probe"]["rows"]
        )
        lines += [f"Probe work per measured step: {cells}.", ""]
    for r in result.get("rehearse", {}).get("rows", []):
        lines.append(
            f"Rehearsal {r['name']}: "
            + (f"failed: {r.get('error', '')}" if r["rc"] else _rehearsed(r))
            + "."
        )
    if "moe" in result:
        lines += [
            "| Qwen3-MoE | tokens/s | TFLOP/s (active) | MFU | peak memory | estimate | experts: grouped | loop |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r, w in zip(result["moe"]["rows"], result["moe"]["experts"], strict=True):
            ways = f"{w['grouped_ms']:.2f} ms | {w['loop_ms']:.2f} ms ({w['loop_ms'] / w['grouped_ms']:.2f}x)"
            lines.append(f"| {r['flavor']} | {_trained_cells(r)} | {ways} |")
        lines.append("")
    if "tp" in result and "max_rel" in result["tp"]:
        r = result["tp"]
        cells = ", ".join(f"{x['name']} {brief(x)}" for x in r["rows"])
        lines += [f"Tensor-parallel plan at tp=1 vs none: largest relative loss difference "
                  f"{r['max_rel']:.3g} (rtol {r['rtol']}); {cells}.", ""]  # fmt: skip
    for key, what in (
        ("sync", "No host sync between log steps"),
        ("determinism", "Deterministic mode, the same steps twice"),
        ("accum", "Accumulation 1 vs 4"),
        ("hf", "HF logits"),
    ):
        if key in result:
            r = result[key]
            if "skipped" in r:
                lines.append(f"{what}: skipped ({r['skipped']}).")
            elif key in ("sync", "determinism") and "steps" in r:
                lines.append(f"{what}: {r['steps']} steps, {'pass' if r['ok'] else 'FAIL'}.")
            elif key == "accum" and "max_rel" in r:
                lines.append(
                    f"{what} ({r['param_dtype']}, {r['steps']} steps): largest relative loss difference "
                    f"{r['max_rel']:.3g}, mean {r['mean_rel']:.3g}; default rtol {r['rtol']}, "
                    f"{r['margin']:.3g}x the difference at its closest."
                )
            elif key == "hf":
                lines.append(
                    f"{what}: "
                    + ", ".join(
                        f"{x['dtype']} {x['max_rel']:.3g}"
                        + (
                            f" (transformers' own {x['hf_max_rel']:.3g})"
                            if "hf_max_rel" in x
                            else ""
                        )
                        + f" (tol {x['tol']:.3g})"
                        for x in r["rows"]
                    )
                    + "."
                )
    return "\n".join(lines) + "\n"


SCRIPT = Script("gpu_check", __doc__)
SCRIPT.arg("--smoke", kind="switch", help="the CPU version with tiny shapes (CI)")
SCRIPT.arg("--out", kind="new_folder", help="results folder (default: outputs/gpu_check-<time>)")
SCRIPT.arg("--only", kind="choice", nargs="+", choices=SECTIONS, help="these sections only")
SCRIPT.arg(
    "--steps",
    kind="int",
    at_least=1,
    at_most=10**6,
    help="steps of the speed and sync runs (default 30; smoke 6)",
)


def run(args) -> int:
    shapes = SMOKE if args.smoke else FULL
    if not args.smoke and not has_gpu():
        raise UserError(
            "no GPU here (nvidia-smi lists none); run it on a GPU machine, or --smoke on a CPU"
        )
    out = Path(args.out or REPO / "outputs" / time.strftime("gpu_check-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sections = args.only or SECTIONS
    steps = shapes.steps if args.steps is None else args.steps
    import torch

    result: dict = {
        "device": device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    result["smoke"] = args.smoke
    result["shapes"] = (
        f"{Path(shapes.config).stem} shapes, vocab {shapes.vocab:,}, seq {shapes.seq}"
    )
    began = time.perf_counter()
    checks = {
        "speed": lambda: check_speed(shapes, out, steps),
        "batch": lambda: check_batch(shapes, out),
        "sync": lambda: check_sync(shapes, out, steps),
        "determinism": lambda: check_determinism(shapes, out, min(steps, 10)),
        "accum": lambda: check_accum(shapes, out),
        "probe": lambda: check_probe(shapes, probe_base(result, shapes)),
        "hf": lambda: check_hf(shapes, out),
        "packing": lambda: check_packing(shapes, out, steps),
        "rehearse": lambda: check_rehearse(shapes, out),
        "moe": lambda: check_moe(shapes, out, steps),
        "tp": lambda: check_tp(shapes, out, steps),
    }
    for name in SECTIONS:
        if name in sections:
            result[name] = checks[name]()
            result["wall_s"] = time.perf_counter() - began
            # Written after every section, so a run cut short keeps what it measured.
            (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
            (out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    failed = [s for s in sections if not result[s]["ok"]]
    say(
        f"{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'} in {result['wall_s']:.0f} s; {out}"
    )
    return 1 if failed else 0


def probe_base(result: dict, shapes: Shapes) -> float | None:
    """The step time the probe's cost is set against: the first speed run that trained."""
    base = next((r for r in result.get("speed", {}).get("rows", []) if r.get("tokens_per_s")), None)
    return shapes.batch * shapes.seq / base["tokens_per_s"] if base else None


def device_name() -> str:
    if has_gpu():
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        return out.stdout.strip().splitlines()[0]
    return f"CPU ({os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> int:
    return SCRIPT.run(run, argv)


if __name__ == "__main__":
    sys.exit(main())
