"""Loss-curve invariance, checked with the tools a user runs (scripts/invariance.py, which launches
one run per layout and gives scripts/compare_runs.py's verdict; compare_runs.py itself).

Debug Llama, the built-in SFT set prepared by scripts/prepare_data.py (valid tokens differ
between ranks), CPU fp32, global batch 16, dropout with masks keyed by sample, 4 steps (past a
warmup of 2, into the cosine decay): dp=8 (local batch 1 x accumulation 2) vs dp=16 (1 x 1), run
once for the module (dp8_dp16). With --long: the dp=8 run's checkpoint of step 2, copied into a
new run folder, continues at dp=16 on the same curve; DDP and HSDP 2x4 at dp=8 give the FSDP dp=8
run's curve. The naive local_mean control, dp=2 (one microbatch of 8) vs dp=4 (one of 4), 3
steps, must fail the verdict and name the step. --localize names the module of each bug planted
in tests/fork_planted.py and tests/fork_moe.py (three of the six with --long). titanlite's
Qwen3-MoE trains one curve with its loss terms at dp=1 and 2 (8 and 16 with --long). (Accumulation
against a single process: tests/test_distributed.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import HANG_S, REPO, check, read_metrics, tensorboard_items, train

from titanlite.config.layout import loss_chunk

CONFIG = "train_configs/debug_sft.toml"
TOOL = [sys.executable, "scripts/invariance.py", "--config", CONFIG]
QUIET = ["--metrics.enable_tensorboard", "false"]
# Dropout with masks keyed by sample (titanlite.ops.dropout): a dropout run is dp-invariant too.
DROPOUT = ("--model.dropout", "0.1", "--model.dropout_masks", "sample")


def batch(local: int) -> list[str]:
    return ["--training.global_batch_size", "16", "--training.local_batch_size", str(local)]


def invariance(
    tmp_path, *args: str, timeout: float = HANG_S
) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "inv"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [*TOOL, *args, *QUIET, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    path = out / "compare" / "compare.json"
    return proc, json.loads(path.read_text()) if path.exists() else {}


def _max_rel(summary: dict) -> dict[str, float]:
    return {c["other"].rsplit("/", 1)[-1]: c["max_rel"] for c in summary["comparisons"]}


STEPS, SAVED = 4, 2  # the shared runs' steps; the dp=8 checkpoint continued at dp=16
WARMUP = ("--lr_scheduler.warmup_steps", "2")  # steps 3 and 4 in the cosine decay


def shared(data: str) -> tuple[str, ...]:
    """What every run of dp8_dp16 and test_fsdp_ddp_hsdp_agree_at_dp8 trains: the same curve."""
    return ("--steps", str(STEPS), *batch(1), "--data.path", data, *DROPOUT, *WARMUP)


@pytest.fixture(scope="module")
def dp8_dp16(tmp_path_factory, prepared_sft) -> tuple[subprocess.CompletedProcess, dict, Path]:
    """One invariance run, FSDP dp=8 vs dp=16 (checkpoints every SAVED steps), for the module:
    its dp=8 run is also the checkpoint continued at dp=16 and the reference of DDP and HSDP.
    Returns the tool's process, its compare.json and the runs' folder."""
    tmp = tmp_path_factory.mktemp("dp8-dp16")
    proc, summary = invariance(
        tmp, "--dp", "8", "16", *shared(prepared_sft), "--checkpoint.every", str(SAVED)
    )
    return proc, summary, tmp / "inv"


@pytest.mark.slow
def test_dp8_vs_dp16_same_curve(dp8_dp16):
    """On data prepared by scripts/prepare_data.py (the built-in SFT set), read memory-mapped."""
    proc, summary, inv = dp8_dp16
    assert proc.returncode == 0, proc.stderr
    (cmp,) = summary["comparisons"]
    assert cmp["steps"] == STEPS and cmp["max_rel"] <= 1e-5, cmp["max_rel"]
    losses = [r["loss"][0] for r in cmp["rows"]]
    assert losses[-1] < losses[1]  # it trains (step 1 has few valid tokens)
    assert "PASS" in proc.stdout and (inv / "compare/compare.png").exists()
    assert "local batch 1 x accum 2" in proc.stdout and "local batch 1 x accum 1" in proc.stdout


@pytest.mark.slow
@pytest.mark.long  # a reshard in CI: tests/test_checkpoint.py (dp=2 to dp=4, FSDP to DDP)
def test_dp8_checkpoint_continues_at_dp16(tmp_path, dp8_dp16, prepared_sft):
    """The dp=8 run's step-SAVED checkpoint (FSDP over 8, the untied model), copied into a new
    run folder, continues as FSDP over 16 on the same curve."""
    dp8 = dp8_dp16[2] / "fsdp-1x8-lb1"
    assert (dp8 / "metrics.jsonl").exists(), (
        "the shared dp=8 run failed: see the dp=8 vs dp=16 test"
    )
    saved = f"checkpoints/step-{SAVED:08d}"
    shutil.copytree(dp8 / saved, tmp_path / "dp16-from-dp8" / saved)
    source = ("--checkpoint.load_step", str(SAVED))
    where = ("--job.dump_folder", str(tmp_path), "--job.run_name", "dp16-from-dp8")
    check(
        train(
            16,
            "--config",
            CONFIG,
            "--training.steps",
            str(STEPS),
            "--metrics.log_every",
            "1",
            *batch(1),
            *QUIET,
            *source,
            *where,
            *DROPOUT,
            *WARMUP,
            "--data.path",
            prepared_sft,
        )
    )
    want = {r["step"]: r["loss"] for r in read_metrics(dp8)}
    got = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "dp16-from-dp8")}
    rel = max(abs(got[s] - want[s]) / want[s] for s in got)
    print(
        f"dp=8 checkpoint of step {SAVED} continued at dp=16: max relative loss difference {rel:.3g}"
    )
    assert sorted(got) == list(range(SAVED + 1, STEPS + 1)) and rel <= 1e-5, (got, want)


@pytest.mark.slow
def test_local_mean_fails_and_names_the_step(tmp_path):
    """dp=2 (one microbatch of 8) vs dp=4 (one of 4), 3 steps: step 1 parts on the logged loss
    alone (the weights are still equal), the next on the updates too."""
    naive = ("--loss.normalization", "local_mean")
    proc, summary = invariance(tmp_path, "--dp", "2", "4", "--steps", "3", *batch(8), *naive)
    assert proc.returncode == 1, proc.stderr
    (cmp,) = summary["comparisons"]
    assert cmp["steps"] == 3 and cmp["first_bad_step"] is not None and cmp["max_rel"] > 1e-3
    assert f"first step beyond rtol 1e-05: {cmp['first_bad_step']} " in proc.stdout


@pytest.mark.slow
@pytest.mark.long  # the modes' curves bitwise at dp=4: tests/test_golden.py; their gradients: test_distributed.py
def test_fsdp_ddp_hsdp_agree_at_dp8(tmp_path, dp8_dp16, prepared_sft):
    """DDP and HSDP 2x4 at dp=8 (scripts/invariance.py: HSDP against DDP), then both against
    dp8_dp16's FSDP dp=8 run of the same settings (scripts/compare_runs.py)."""
    proc, summary = invariance(
        tmp_path, "--dp", "8", "--modes", "ddp", "hsdp", *shared(prepared_sft)
    )
    assert proc.returncode == 0, proc.stderr
    assert set(_max_rel(summary)) == {"hsdp-2x4-lb1"}
    fsdp = dp8_dp16[2] / "fsdp-1x8-lb1"
    assert (fsdp / "metrics.jsonl").exists(), (
        "the shared dp=8 run failed: see the dp=8 vs dp=16 test"
    )
    runs = [str(fsdp), *(str(tmp_path / "inv" / name) for name in ("ddp-8x1-lb1", "hsdp-2x4-lb1"))]
    out = tmp_path / "vs-fsdp"
    cmd = [sys.executable, "scripts/compare_runs.py", *runs, "--invariance", "--out", str(out)]
    judged = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    print(judged.stdout[-3000:], judged.stderr[-3000:])
    assert judged.returncode == 0, judged.stderr
    against_fsdp = json.loads((out / "compare.json").read_text())
    errs = _max_rel(against_fsdp)
    assert set(errs) == {"ddp-8x1-lb1", "hsdp-2x4-lb1"} and max(errs.values()) <= 1e-5, errs
    assert all(c["steps"] == STEPS for c in against_fsdp["comparisons"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dp", "3", "8"], "global batch 16 does not split over dp=3"),
        (["--dp", "8"], "one layout has nothing to compare with"),
        (["--dp", "2", "4", "--layouts", "dp=2", "dp=4"], "give the layouts to compare once"),
        (["--layouts", "dp=2", "cp=2"], "--layouts 'cp=2' needs one dp=N"),
        (["--layouts", "dp=2", "dp=2,dp=4"], "--layouts 'dp=2,dp=4' needs one dp=N"),
        (
            ["--layouts", "dp=2", "dp=2,xx=2"],
            "--layouts 'dp=2,xx=2': parallelism.axes names 'xx', which is no mesh axis",
        ),
        (
            ["--layouts", "dp=4", "dp=2,tp=3"],
            "training.seq_len 256 does not split into 3 equal pieces",
        ),
        (["--dp", "8", "--modes", "hsdp", "--replicas", "8"], "hsdp at dp=8 needs --replicas"),
        (["--dp", "8", "16", "--training.sed", "1"], "training.sed"),
        (
            ["--dp", "8", "16", "--debug.fingerprint_step", "3"],
            "invariance fixes debug.fingerprint_step (1 in every run, and the step --localize reruns)",
        ),
        (
            ["--dp", "8", "16", "--training.steps=5"],
            "invariance fixes training.steps (set by --steps) in its runs; drop --training.steps",
        ),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message):
    proc, _ = invariance(tmp_path, *args, *batch(2), timeout=HANG_S)
    assert proc.returncode == 2 and message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "inv").exists()


def test_layouts_launch_each_world_from_all_its_axes(tmp_path):
    """--layouts: each run's world is dp times its axes, its axes passed to it; --dp its short form."""
    layouts = ("--layouts", "dp=4", "dp=2,cp=2", "--modes", "fsdp", "ddp")
    proc, _ = invariance(tmp_path, *layouts, "--dry-run", *batch(2))
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 4, proc.stderr
    assert all(line.startswith("NPROC=4 ") for line in lines)
    assert [line.count("--parallelism.axes '[\"cp=2\"]'") for line in lines] == [0, 0, 1, 1]
    assert (
        "--job.run_name fsdp-1x2-cp2-lb2" in lines[2] and "--job.run_name ddp-2x1-cp2" in lines[3]
    )
    short, _ = invariance(tmp_path, "--dp", "4", "2", "--dry-run", *batch(2))
    long, _ = invariance(tmp_path, "--layouts", "dp=4", "dp=2", "--dry-run", *batch(2))
    assert short.returncode == 0 and short.stdout == long.stdout


def test_dry_run_prints_one_command_per_layout(tmp_path):
    modes = ("--modes", "fsdp", "hsdp")
    proc, _ = invariance(
        tmp_path, "--dp", "8", "16", *modes, "--dry-run", *batch(2), timeout=HANG_S
    )
    assert proc.returncode == 0
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("NPROC=8 ") and lines[-1].startswith("NPROC=16 ")
    assert "--parallelism.dp_replicate 2 --parallelism.dp_shard 8" in lines[-1]
    assert (
        "--training.local_batch_size 2" in lines[0] and "--training.local_batch_size 1" in lines[-1]
    )
    assert not (tmp_path / "inv").exists()
    # with --localize: the step to rerun is known once the runs are compared, which it says
    proc, _ = invariance(
        tmp_path, "--dp", "8", "16", "--dry-run", "--localize", *batch(2), timeout=HANG_S
    )
    lines = proc.stdout.strip().splitlines()
    assert (
        proc.returncode == 0
        and len(lines) == 3
        and lines[-1].startswith("# --localize: once these runs are done")
    )


# Planted invariance bugs (tests/fork_planted.py, tests/fork_moe.py), each at dp=1 (one microbatch
# of 4) against dp=2 (2 each), so which sequences share a microbatch changes too: the step a
# verdict fails at (the curves or the gradient at step 1), what fails there, and the module
# --localize must name. At step 1 the runs' own fingerprints are compared; a later step is rerun
# from the reference's checkpoint of the step before.
PLANTED = {
    "fork_batch_stats": (1, "loss", "tokens forward"),
    "fork_aux_local": (1, "loss", "router grad"),
    "fork_rank_noise": (1, "gradient", "noise.gate reduced grad"),
    "fork_late_noise": (2, "loss", "noise forward"),
    "fork_mlp_noise": (1, "gradient", "layers.0.down forward"),  # passes the loss verdict at step 1
    "fork_moe_local": (
        1,
        "loss term aux",
        "layers.1.router grad",
    ),  # the loss passes; its term does not
}
FORK = (
    "--config", "train_configs/debug_model.toml",
    "--model.flavor", "tiny",
    "--training.global_batch_size", "4",
    "--training.local_batch_size", "4",
    "--training.seq_len", "64",
    "--loss.chunk_logits_mib", "0.01",  # the loss inside the model, where the auxiliary loss joins it
    "--optimizer.lr", "0.02",
    "--lr_scheduler.warmup_steps", "1",
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "model",
    [*(pytest.param(m, marks=pytest.mark.long) for m in ("fork_batch_stats", "fork_aux_local", "fork_rank_noise")),
     "fork_late_noise", "fork_mlp_noise", "fork_moe_local"],
)  # fmt: skip
def test_localize_names_the_module_of_each_planted_bug(tmp_path, model):
    """A failing comparison offers --localize; with it, the runs in --out are reused and the first
    parting step is compared module by module from the same state, naming the planted bug's
    module. The loss-only verdict passes fork_mlp_noise at step 1 and the per-microbatch
    load-balancing loss everywhere; the gradient verdict fails both at step 1."""
    step, what, where = PLANTED[model]
    module = "fork_moe" if model.startswith("fork_moe") else "fork_planted"
    cmd = [
        sys.executable,
        "scripts/invariance.py",
        *FORK,
        "--model.name",
        model,
        "--model.import_module",
        module,
    ]
    if (
        model == "fork_mlp_noise"
    ):  # equal microbatches (2 x accum 2 against 2 x 1): only the noise differs
        cmd += ["--training.local_batch_size", "2"]
    cmd += ["--dp", "1", "2", "--steps", str(step + 1), *QUIET, "--out", str(tmp_path / "inv")]
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "PYTHONWARNINGS": "ignore"}
    failed = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)
    print(failed.stdout[-2000:], failed.stderr[-2000:])
    assert (
        failed.returncode == 1
        and f"to find where they part, add --localize: step {step} " in failed.stdout
    )
    gradient = next(
        ln for ln in failed.stdout.splitlines() if ln.startswith(("PASS gradient", "FAIL gradient"))
    )
    assert gradient.startswith("FAIL gradient at step 1:") == (what == "gradient" or step == 1), (
        gradient
    )
    (cmp,) = json.loads((tmp_path / "inv" / "compare" / "compare.json").read_text())["comparisons"]
    loss_rel = {r["step"]: r["rel"] for r in cmp["rows"]}
    if what == "gradient" or model == "fork_moe_local":  # a loss-only verdict would pass this step
        assert loss_rel[step] <= 1e-5, loss_rel
    if what == "gradient":  # the curves pass at the step the gradient fails
        assert f"first step beyond rtol 1e-05: {step} " not in failed.stdout
    else:
        assert f"first step beyond rtol 1e-05: {step} " in failed.stdout
        assert (", loss term aux)" in failed.stdout) == (what == "loss term aux")
    if (
        step > 1
    ):  # --dry-run: the commands that would rerun the step from the same state, nothing run
        dry = subprocess.run(
            [*cmd, "--localize", "--dry-run"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
        lines = dry.stdout.splitlines()
        assert dry.returncode == 1 and sum(ln.startswith("NPROC=") for ln in lines) == 3, dry.stdout
        assert sum(ln.startswith("cp -r ") for ln in lines) == 2 and lines[-1].startswith(
            f"the commands above localize step {step}"
        ), dry.stdout
        assert not (tmp_path / "inv" / f"localize-step{step}").exists()
    found = subprocess.run(
        [*cmd, "--localize"], cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S
    )
    print(found.stdout[-3000:], found.stderr[-3000:])
    assert found.returncode == 1 and "are compared again (--localize)" in found.stdout
    (line,) = [ln for ln in found.stdout.splitlines() if ln.startswith("first divergence: ")]
    assert line.startswith(f"first divergence: {where} at step {step}: "), line
    assert ("[base]" in found.stdout) == (step > 1)
    assert ("from their own fingerprints" in found.stdout) == (step == 1)


@pytest.mark.slow
def test_a_models_loss_terms_are_the_same_with_the_loss_chunked_or_whole(tmp_path):
    """tests/fork_moe.py (load-balancing loss over the whole step, z-loss) at dp=1 (local batch
    4: the loss in chunks of 32 positions) and dp=2 (local batch 2: the whole sequence): one loss
    path, so the same curves and the same terms, each logged per step (metrics.jsonl, the
    console, the summary, TensorBoard after the four main curves); the gradient at step 1 agrees."""
    cmd = [
        sys.executable,
        "scripts/invariance.py",
        *FORK,
        "--model.name",
        "fork_moe",
        "--model.import_module",
        "fork_moe",
    ]
    cmd += [
        "--loss.chunk_logits_mib",
        "1",
        "--dp",
        "1",
        "2",
        "--steps",
        "3",
        "--out",
        str(tmp_path / "inv"),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0 and "(and the loss terms aux, z) <= rtol 1e-05" in proc.stdout
    assert "PASS gradient at step 1: " in proc.stdout
    assert (loss_chunk(1, 4, 64, 2048), loss_chunk(1, 2, 64, 2048)) == (
        32,
        0,
    )  # the debug config's vocabulary
    for run in ("fsdp-1x1-lb4", "fsdp-1x2-lb2"):
        folder = tmp_path / "inv" / run
        rows = [
            r
            for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
            if "terms" in r
        ]
        assert [r["step"] for r in rows] == [1, 2, 3] and all(
            set(r["terms"]) == {"aux", "z"} for r in rows
        )
        assert all(
            r["loss_total"] == pytest.approx(r["loss"] + sum(r["terms"].values()), rel=1e-12)
            for r in rows
        )
        # transformers' coefficient 0.001 times E * sum_e f_e P_e, which is 1 when routing is even
        assert all(0.0009 < r["terms"]["aux"] < 0.004 for r in rows), rows
        log = "\n".join(f.read_text() for f in folder.glob("logs/**/*") if f.is_file())
        assert re.search(
            r"step 3/3 \| loss [\d.]+ \| aux [\d.e-]+, z [\d.e-]+, total [\d.]+ \|", log
        ), log[-2000:]
        assert (
            "loss terms at step 3: aux " in log and "(the loss above is the cross entropy)" in log
        )
        scalars, _ = tensorboard_items(folder / "tb")
        for r in rows:
            got = {
                name: scalars[(f"5_loss_terms/{name}", r["step"])] for name in ("aux", "z", "total")
            }
            assert got == pytest.approx({**r["terms"], "total": r["loss_total"]}, rel=1e-6)


# titanlite's Qwen3-MoE through its debug config at the model check's size (tiny_strong: each
# layer's load-balancing loss at 0.1 and a z-loss), global batch 16 of 32 tokens, 3 steps
QWEN3_MOE = (
    "--config", "train_configs/debug_moe.toml",
    "--model.flavor", "tiny_strong",
    "--training.global_batch_size", "16",
    "--training.local_batch_size", "1",
    "--training.seq_len", "32",
    "--steps", "3",
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "dp", [("1", "2"), pytest.param(("8", "16"), marks=pytest.mark.long)], ids="-".join
)
def test_qwen3_moe_trains_one_curve_with_its_terms_at_any_dp(tmp_path, dp):
    """The debug Qwen3-MoE at dp 1 and 2 (microbatches of one sequence: accumulation 16 and 8;
    with --long dp 8 and 16, accumulation 2 and 1): the loss curve, both loss terms at every step
    and every gradient at step 1 equal the first layout's (scripts/invariance.py's verdict). The
    layouts' exactness at dp 4 and more cases: tests/test_distributed.py."""
    proc, summary = invariance(tmp_path, "--dp", *dp, *QWEN3_MOE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    comparisons = summary["comparisons"]
    assert len(comparisons) == len(dp) - 1 and all(c["steps"] == 3 for c in comparisons)
    judged = "(and the loss terms aux, z) <= rtol 1e-05"
    assert proc.stdout.count(judged) == len(dp) - 1 and "FAIL" not in proc.stdout
    assert all(set(r["terms"]) == {"aux", "z"} for c in comparisons for r in c["rows"])
    assert proc.stdout.count("PASS gradient at step 1: ") == len(dp) - 1


# tests/fork_cp.py (context parallelism from outside the package) through the trainer: packed
# SFT documents whose boundaries cross the pieces, the loss's valid tokens unequal, eval at the end.
CONTEXT = (
    "--config", CONFIG,
    "--model.name", "fork_cp",
    "--model.import_module", "fork_cp",
    "--model.flavor", "tiny",
    "--data.packing", "true",
    "--training.seq_len", "256",
    "--training.local_batch_size", "2",
    "--metrics.log_every", "1",
    "--eval.fraction", "0.1",
    "--eval.max_sequences", "8",
    *QUIET,
)  # fmt: skip
SPLIT = ("--parallelism.axes", '["cp=2"]')


def _context_runs(
    tmp_path, batch: int, steps: int, runs: dict[str, tuple[int, tuple[str, ...]]]
) -> list[Path]:
    """Train each of `runs` (name: ranks, extra flags) on the same global batch; their folders,
    after checking that the logged and eval losses agree with the first run's to 1e-5."""
    common = (*CONTEXT, "--training.global_batch_size", str(batch), "--training.steps", str(steps))
    for name, (nproc, extra) in runs.items():
        check(
            train(
                nproc, *common, *extra, "--job.dump_folder", str(tmp_path), "--job.run_name", name
            )
        )
    curves = []
    for name in runs:
        losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / name) if "loss" in r}
        evals = [
            json.loads(x)["loss"] for x in (tmp_path / name / "eval.jsonl").read_text().splitlines()
        ]
        assert sorted(losses) == list(range(1, steps + 1)) and len(evals) == 1, (
            name,
            losses,
            evals,
        )
        curves.append([*losses.values(), *evals])
    rel = max(abs(x - y) / abs(x) for c in curves[1:] for x, y in zip(curves[0], c, strict=True))
    print(f"{' vs '.join(runs)}: max relative loss difference {rel:.3g}")
    assert rel <= 1e-5
    return [tmp_path / name for name in runs]


@pytest.mark.slow
def test_a_context_parallel_fork_trains_on_the_data_parallel_curve_and_diagnoses_its_replicas(
    tmp_path,
):
    """dp=2 against dp=2 x cp=2 (each replica's sequences split over 2 ranks): the same curve,
    and the same diagnostics, as the pieces of each replica are summed into it."""
    plain, split = _context_runs(tmp_path, 4, 3, {"dp2": (2, ()), "dp2xcp2": (4, SPLIT)})
    diag = [
        [json.loads(x) for x in (run / "diagnostics.jsonl").read_text().splitlines()]
        for run in (plain, split)
    ]
    assert [r["step"] for r in diag[0]] == [r["step"] for r in diag[1]] == [1, 2, 3]
    for a, b in zip(*diag, strict=True):
        for key in ("loss_std", "cos_mean_pairwise", "rank_loss", "rank_grad_norm", "rank_tokens"):
            x, y = np.atleast_1d(a[key]), np.atleast_1d(b[key])
            assert np.allclose(x, y, rtol=1e-4, atol=1e-7), (key, a[key], b[key])
        assert a["alerts"] == b["alerts"] == []


@pytest.mark.slow
@pytest.mark.long
def test_dp4_and_dp2_by_cp2_give_the_same_curve(tmp_path):
    """dp=4 against dp=2 x cp=2, 20 steps, fp32."""
    _context_runs(tmp_path, 8, 20, {"dp4": (4, ()), "dp2xcp2": (4, SPLIT)})


@pytest.mark.long  # each control's gradient at tp=2 in every mode: tests/test_distributed.py
def test_a_tensor_split_defect_fails_on_the_gradient_and_localize_names_it_across_kinds(tmp_path):
    """tests/fork_tp_controls.py's norms left unreduced over tp, at dp=2 against dp=1 x tp=2: the
    curves agree, the step-1 gradient does not, and --localize (fingerprints summed over the
    tensor split's pieces and slices) names the first norm weight's reduced gradient."""
    cmd = [
        *TOOL[:2],
        "--config",
        "train_configs/debug_model.toml",
        *("--model.import_module", "fork_tp_controls", "--model.name", "tp_control_unreduced_norm"),
        *("--model.flavor", "tiny", "--layouts", "dp=2", "dp=1,tp=2", "--steps", "2"),
        *("--localize", *QUIET, "--out", str(tmp_path / "inv")),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 1
    assert "PASS fsdp-1x1-tp2-lb4 vs fsdp-1x2-lb4: 2 steps" in proc.stdout
    assert "FAIL gradient at step 1: largest relative difference" in proc.stdout
    assert "first divergence: layers.0.attention_norm.weight reduced grad at step 1" in proc.stdout
