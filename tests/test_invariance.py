"""Loss-curve invariance, checked with the tool a user runs (scripts/invariance.py, which launches
one run per layout and gives scripts/compare_runs.py's verdict).

Debug Llama, built-in SFT data (valid tokens differ between ranks), CPU fp32, global batch 16:
dp=8 (local batch 1 x accumulation 2) vs dp=16 (1 x 1), 30 steps, with dropout masks keyed by
sample; FSDP, DDP and HSDP 2x4 at dp=8. The dp=8 run's checkpoint of step 20, copied into a new run folder, continues at dp=16 on the same
curve. And the naive local_mean control, dp=8 (one microbatch of 2) vs dp=16, which must fail the
verdict and name the step. (Accumulation against a single process: tests/test_distributed.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, check, read_metrics, train

CONFIG = "train_configs/debug_sft.toml"
TOOL = [sys.executable, "scripts/invariance.py", "--config", CONFIG]
QUIET = ["--metrics.enable_tensorboard", "false"]
# Dropout with masks keyed by sample (titanlite.ops.dropout): a dropout run is dp-invariant too.
DROPOUT = ("--model.dropout", "0.1", "--model.dropout_masks", "sample")


def batch(local: int) -> list[str]:
    return ["--training.global_batch_size", "16", "--training.local_batch_size", str(local)]


def invariance(tmp_path, *args: str, timeout: int = 1500) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "inv"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [*TOOL, *args, *QUIET, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    path = out / "compare" / "compare.json"
    return proc, json.loads(path.read_text()) if path.exists() else {}


def _max_rel(summary: dict) -> dict[str, float]:
    return {c["other"].rsplit("/", 1)[-1]: c["max_rel"] for c in summary["comparisons"]}


@pytest.mark.slow
def test_dp8_vs_dp16_same_curve_and_dp8_checkpoint_continues_at_dp16(tmp_path, prepared_sft):
    """On data prepared by scripts/prepare_data.py (the built-in SFT set), read memory-mapped."""
    ckpt = ("--checkpoint.every", "20", "--checkpoint.at_end", "true", "--data.path", prepared_sft)
    proc, summary = invariance(tmp_path, "--dp", "8", "16", "--steps", "30", *batch(1), *ckpt, *DROPOUT)
    assert proc.returncode == 0, proc.stderr
    (cmp,) = summary["comparisons"]
    assert cmp["steps"] == 30 and cmp["max_rel"] <= 1e-5, cmp["max_rel"]
    losses = [r["loss"][0] for r in cmp["rows"]]
    assert losses[-1] < losses[1]  # it trains (step 1 has few valid tokens)
    assert "PASS" in proc.stdout and (tmp_path / "inv/compare/compare.png").exists()
    assert "local batch 1 x accum 2" in proc.stdout and "local batch 1 x accum 1" in proc.stdout

    # Reshard: the dp=8 run's step-20 checkpoint (FSDP over 8), copied into a new run folder,
    # continues as FSDP over 16.
    dp8 = tmp_path / "inv" / "fsdp-1x8-lb1"
    step20 = "checkpoints/step-00000020"
    shutil.copytree(dp8 / step20, tmp_path / "dp16-from-dp8" / step20)
    source = ("--checkpoint.load_step", "20")
    where = ("--job.dump_folder", str(tmp_path), "--job.run_name", "dp16-from-dp8")
    check(
        train(
            16,
            "--config",
            CONFIG,
            "--training.steps",
            "30",
            "--metrics.log_every",
            "1",
            *batch(1),
            *QUIET,
            *source,
            *where,
            *DROPOUT,
            "--data.path",
            prepared_sft,
        )
    )
    want = {r["step"]: r["loss"] for r in read_metrics(dp8)}
    got = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "dp16-from-dp8")}
    rel = max(abs(got[s] - want[s]) / want[s] for s in got)
    print(f"dp=8 checkpoint of step 20 continued at dp=16: max relative loss difference {rel:.3g}")
    assert sorted(got) == list(range(21, 31)) and rel <= 1e-5, (got, want)


@pytest.mark.slow
def test_dp8_vs_dp16_local_mean_fails_and_names_the_step(tmp_path):
    naive = ("--loss.normalization", "local_mean")
    proc, summary = invariance(tmp_path, "--dp", "8", "16", "--steps", "10", *batch(2), *naive)
    assert proc.returncode == 1, proc.stderr
    (cmp,) = summary["comparisons"]
    assert cmp["first_bad_step"] is not None and cmp["max_rel"] > 1e-3
    assert f"first step beyond rtol 1e-05: {cmp['first_bad_step']} " in proc.stdout


@pytest.mark.slow
def test_fsdp_ddp_hsdp_agree_at_dp8(tmp_path):
    modes = ("--modes", "fsdp", "ddp", "hsdp")
    proc, summary = invariance(tmp_path, "--dp", "8", *modes, "--steps", "10", *batch(1))
    assert proc.returncode == 0, proc.stderr
    errs = _max_rel(summary)
    assert set(errs) == {"ddp-8x1-lb1", "hsdp-2x4-lb1"} and max(errs.values()) <= 1e-5, errs


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dp", "3", "8"], "global batch 16 does not split over dp=3"),
        (["--dp", "8"], "one layout has nothing to compare with"),
        (["--dp", "8", "--modes", "hsdp", "--replicas", "8"], "hsdp at dp=8 needs --replicas"),
        (["--dp", "8", "16", "--training.sed", "1"], "training.sed"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message):
    proc, _ = invariance(tmp_path, *args, *batch(2), timeout=120)
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "inv").exists()


def test_dry_run_prints_one_command_per_layout(tmp_path):
    modes = ("--modes", "fsdp", "hsdp")
    proc, _ = invariance(tmp_path, "--dp", "8", "16", *modes, "--dry-run", *batch(2), timeout=120)
    assert proc.returncode == 0
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("NPROC=8 ") and lines[-1].startswith("NPROC=16 ")
    assert "--parallelism.dp_replicate 2 --parallelism.dp_shard 8" in lines[-1]
    assert "--training.local_batch_size 2" in lines[0] and "--training.local_batch_size 1" in lines[-1]
    assert not (tmp_path / "inv").exists()
