"""The cluster rehearsal (titanlite/rehearsal): the job as rank 0 of W ranks on torch's fake process
group, against a real 2-rank run, FSDP's analytic volume, the memory estimate and the diagnostics'
formula; its plan over generated configs; the front door; the torch internals it stands on."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest
from helpers import HANG_S, REPO, check, torchrun
from hypothesis import given, settings
from hypothesis import strategies as st

from titanlite.components.evaluate import Evaluator
from titanlite.components.run.plan import REHEARSAL_FILE, resume_plan
from titanlite.config import parse_args
from titanlite.config.job_config import Diagnostics, Eval
from titanlite.config.layout import rehearsal_batch
from titanlite.config.manager import load_config, to_toml
from titanlite.diagnostics.probe import prev_prime
from titanlite.diagnostics.step_record import SCALARS
from titanlite.distributed import groups
from titanlite.errors import UserError
from titanlite.rehearsal import meter

MiB = 2**20


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """tests/workers/rehearsal.py: one torchrun of 2 ranks, a real step then the rehearsals."""
    tmp = tmp_path_factory.mktemp("rehearsal")
    check(
        torchrun(
            2,
            "tests/workers/rehearsal.py",
            str(tmp / "out.json"),
            str(tmp / "runs"),
            timeout=HANG_S,
        )
    )
    return json.loads((tmp / "out.json").read_text())


def _wire(report: dict) -> float:
    return sum(report["traffic_bytes"].values())


def test_collective_bytes_are_fsdps_volume_with_its_padding(runs):
    """Per step, params kept gathered: one all-gather of every parameter and one reduce-scatter
    of every gradient, fp32, each dim 0 padded to a multiple of W; a rank sends (W-1)/W of each."""
    for world in ("2", "8", "64", "1024"):
        r, padded = runs["rehearsed"][world], runs["padded"][world]
        w = int(world)
        analytic = 2 * padded * 4 * (w - 1) / w
        assert _wire(r) == pytest.approx(analytic, rel=0.05), world
        assert r["host_reads"] == 0, (world, r["steps"])
    # at 1,024 ranks the debug model's 256-row weights are padded to 1,024 rows: the padding counts
    assert runs["padded"]["1024"] > 2 * runs["params"]


def test_a_rehearsal_draws_only_its_own_shard_of_the_initial_weights(runs):
    """Training draws every parameter in full (the same weights at any layout); a rehearsal never
    reads its weights, so it draws rank 0's shard alone: a 30B model starts in seconds, not
    tens of minutes."""
    assert runs["drawn"]["real"] == runs["params"]
    for world in ("2", "8", "64", "1024"):
        assert runs["drawn"][world] == runs["padded"][world] // int(world), world


def test_tensor_memory_falls_with_w_as_the_estimate_says(runs):
    r = runs["rehearsed"]
    params = runs["params"]
    # 2 -> 64 ranks: the sharded params and AdamW's moments (12 bytes a param) shrink; the
    # estimate also shards the gradients (16 bytes), which do not yet exist at the step's peak
    drop = r["2"]["peak_bytes"] - r["64"]["peak_bytes"]
    shrink = 1 / 2 - 1 / 64
    assert 12 * params * shrink * 0.95 <= drop <= 16 * params * shrink * 1.05
    assert r["2"]["estimate_bytes"] - r["64"]["estimate_bytes"] == pytest.approx(
        16 * params * shrink, rel=0.01
    )
    # 64 -> 1,024: FSDP's padding makes the gathered params grow (kept gathered: all of them at
    # the peak), as the estimate counts it; the estimate also pads the largest unit's gradients,
    # which do not exist at the forward's peak
    rise = r["1024"]["peak_bytes"] - r["64"]["peak_bytes"]
    padded_params = (runs["padded"]["1024"] - params) * 4
    assert (
        padded_params * 0.95
        <= rise
        <= (r["1024"]["estimate_bytes"] - r["64"]["estimate_bytes"]) * 1.05
    )
    for name, report in r.items():  # the estimate stays above the peak, and within 20% of it
        # (a model's own sequence exchange, and a tensor split's exchange buffers, are not
        # traced: see their tests)
        if name not in ("cp2-8", "cp4-8", "tp2-none-4", "tp2-selective-4"):
            assert report["peak_bytes"] < report["estimate_bytes"] <= 1.2 * report["peak_bytes"], (
                name
            )
    # the activations it traced are those the tracker finds alive at a real 2-rank step's peak. The
    # tracker files a gathered weight that no module's own forward reads (Llama's head, used by the
    # loss inside the root's forward) under Activation: what Parameter lacks of the params kept
    # gathered whole plus this rank's shard (world 2: no padding) goes back to Parameter.
    traced = r["2"]["estimate_parts"]["activation_bytes"]
    real = runs["real"]["peak_parts"]
    misfiled = runs["padded"]["2"] * 4 * (1 + 1 / 2) - real["Parameter"]
    assert 0 <= misfiled <= params * 4 and traced == pytest.approx(
        real["Activation"] - misfiled, rel=0.01
    )


def test_a_step_of_several_microbatches_is_tracked(runs):
    """Accumulation 2 (two forwards a step): one microbatch's activations at a time, so a lower
    peak than one microbatch of twice the sequences."""
    accumulated, whole = runs["rehearsed"]["accum-2"], runs["rehearsed"]["2"]
    assert accumulated["layout"]["grad_accum"] == 2 and whole["layout"]["grad_accum"] == 1
    assert 0 < accumulated["peak_bytes"] < whole["peak_bytes"]
    assert _wire(accumulated) >= _wire(whole)  # FSDP reduces (and may gather) per microbatch


def test_a_rehearsed_step_matches_a_real_two_rank_step(runs):
    real, rehearsed = runs["real"], runs["rehearsed"]["2"]
    assert rehearsed["peak_bytes"] == pytest.approx(real["peak_bytes"], rel=0.15)
    real_wire = sum(op["wire"] for ops in real["collectives"].values() for op in ops.values())
    assert _wire(rehearsed) == pytest.approx(real_wire, rel=0.05)
    assert real["host_reads"] == {}


def test_the_diagnostics_bytes_follow_their_formula(runs):
    """A measured step at W ranks of n sequences each: one all-gather of every rank's record
    (step_record.SCALARS + 4 n float64) and the start barrier's one-float all-reduce; exact adds the all-reduce of the
    W x W float64 Gram, sketch the all-gather of every rank's k float32 sketch."""
    n, k = 4, prev_prime(Diagnostics().sketch_dim)  # sequences a rank; the sketch's dimensions
    for case, w, method in (
        ("exact-64", 64, "exact"),
        ("sketch-64", 64, "sketch"),
        ("auto-1024", 1024, "sketch"),
    ):
        share = (w - 1) / w
        common = share * w * (len(SCALARS) + 4 * n) * 8 + 2 * share * 4
        formula = {"exact": common + 2 * share * w * w * 8, "sketch": common + share * w * k * 4}[
            method
        ]
        r = runs["rehearsed"][case]
        assert r["layout"]["diagnostics"] == method, (
            case
        )  # auto: the sketch past sketch_dim / 4 ranks
        d = r["diagnostics"]
        assert sum(d["traffic_bytes"].values()) == pytest.approx(formula, rel=0.05), case
        assert d["record_bytes"] > 0 and d["host_s"] > 0


def test_a_context_parallel_fork_is_rehearsed_with_its_axis(runs):
    """tests/fork_cp.py at 8 ranks as dp=8, 4 x cp=2 and 2 x cp=4, one sequence a microbatch:
    the cp axis in the mesh, its all-to-alls measured, the diagnostics measuring the replicas,
    and each rank's activations (the tensor-level tracker's) falling with cp as it holds a
    smaller piece of the sequence. The estimate traces one piece on the model unsplit, so the
    buffers of the model's own exchange (the whole sequence's positions and mask, the
    all-to-alls' outputs) are not in it: from 10% under the peak to 30% over."""
    r = {cp: runs["rehearsed"][f"cp{cp}-8"] for cp in (1, 2, 4)}
    acts = {cp: x["peak_parts"]["Activation"] for cp, x in r.items()}
    print("activations per rank by cp:", acts)
    assert acts[2] < 0.7 * acts[1] and acts[4] < 0.8 * acts[2]
    for cp in (2, 4):
        assert r[cp]["layout"]["axes"] == {"cp": cp} and r[cp]["layout"]["dp_shard"] == 8 // cp
        assert r[cp]["traffic_bytes"]["cp"] > 0 and r[cp]["diagnostics"]["record_bytes"] > 0
        print(f"cp={cp}: estimate {r[cp]['estimate_bytes'] / r[cp]['peak_bytes']:.2f} x the peak")
        assert 0.9 * r[cp]["peak_bytes"] <= r[cp]["estimate_bytes"] <= 1.3 * r[cp]["peak_bytes"], cp


def test_a_mixture_of_experts_is_estimated_by_its_own_figure(runs):
    """Qwen3-MoE (its routing not traceable on fake tensors) at 2 ranks: the estimate's
    activations are the model's own activation_bytes, within 15% of the tensor tracker's at the
    step's peak (the forward's end), the misfiled gathered weights set apart as for the Llama
    (world 2, every dim 0 even: no padding); the expert load's counts travel with the step's
    token count, on the normaliser's group, with no collective of their own."""
    r = runs["rehearsed"]["moe-2"]
    est, peak = r["estimate_parts"], r["peak_parts"]
    assert est["activations_from"] == "the model's own activation_bytes()"
    misfiled = r["params"] * 4 * (1 + 1 / 2) - peak["Parameter"]
    assert 0 <= misfiled <= r["params"] * 4
    print(
        f"MoE activations: estimate {est['activation_bytes'] / (peak['Activation'] - misfiled):.3f} x the tracker's"
    )
    assert est["activation_bytes"] == pytest.approx(peak["Activation"] - misfiled, rel=0.15)
    assert set(r["traffic_bytes"]) == {"dp_shard"}


def test_a_record_at_1024_ranks_keeps_summaries_not_pairs(runs):
    """At 1,024 ranks a record holds each rank's figures and summaries, not the 1,024^2 pairs:
    under 1 MB (rank 0's host time on it is scripts/rehearse_sweep.py's to measure)."""
    assert runs["rehearsed"]["auto-1024"]["diagnostics"]["record_bytes"] < 2**20
    assert runs["rehearsed"]["exact-64"]["diagnostics"]["record_bytes"] > 0


# How close the whole model's figures derived from its first blocks come to the whole model
# measured: memory within 5% (the estimate's terms for the blocks not run), traffic within 1%
# (FSDP's, from the parameters' shapes)
PART_MEMORY_TOLERANCE, PART_TRAFFIC_TOLERANCE = 0.05, 0.01


@pytest.mark.parametrize(("part", "whole"), [("partial-8", "8"), ("partial-always-8", "always-8")])
def test_a_rehearsal_on_part_of_the_model_derives_the_whole_models_figures(runs, part, whole):
    """The debug model (6 blocks) at world 8, its first 2 blocks run and the other 4 derived,
    against the whole model measured: params kept gathered, and resharded after forward."""
    p, w = runs["rehearsed"][part], runs["rehearsed"][whole]
    assert p["blocks"] == {"run": 2, "of": 6} and w["blocks"] == {"run": 6, "of": 6}
    assert w["measured"] is None and p["params"] == w["params"] == runs["params"]
    measured = p["measured"]
    # the part alone is well below the whole: the derivation adds the other blocks' share
    assert measured["peak_bytes"] < 0.97 * w["peak_bytes"]
    assert sum(measured["traffic_bytes"].values()) < 0.8 * _wire(w)
    print(
        f"{part}: peak {p['peak_bytes'] / w['peak_bytes']:.4f}, sent {_wire(p) / _wire(w):.4f} x the whole's"
    )
    assert p["peak_bytes"] == pytest.approx(w["peak_bytes"], rel=PART_MEMORY_TOLERANCE)
    assert p["traffic_bytes"]["dp_shard"] == pytest.approx(
        w["traffic_bytes"]["dp_shard"], rel=PART_TRAFFIC_TOLERANCE
    )
    assert p["estimate_bytes"] == pytest.approx(w["estimate_bytes"], rel=1e-6)
    assert measured["compute_ratio"] > 1 and p["compute_s"] > measured["compute_s"]
    if p["diagnostics"] is not None:  # what a measured step adds: the part's own steps compared
        assert abs(p["diagnostics"]["step_s"]) < measured["compute_s"]


@pytest.mark.parametrize("case", ["2", "8", "64", "1024", "accum-2", "always-8"])
def test_the_plans_traffic_is_the_measured_traffic(runs, case):
    """FSDP's bytes per step from the parameters' shapes (kept gathered or resharded, padded,
    accumulated), before any step, against the step's own collectives."""
    r = runs["rehearsed"][case]
    planned = r["plan"]["traffic_bytes"]
    assert set(planned) == {"dp_shard"}
    assert planned["dp_shard"] == pytest.approx(r["traffic_bytes"]["dp_shard"], rel=0.01), case


@pytest.mark.parametrize("ac", ["none", "selective"])
def test_a_tensor_split_is_priced_by_what_its_rank_holds_and_sends(runs, ac):
    """dp=2 x tp=2 (world 4): the estimate, which prices a rank's slices of the matrices, its share
    of the activations, the inputs its split blocks keep whole and its vocabulary rows, within
    15% of the tracker's peak (the exchanges' transient buffers are not priced: a few percent
    under it here); the plan's bytes on dp_shard (FSDP's gathers of the slices) and on tp (the
    residual stream around each split block, again under checkpointing, and the loss's
    all-reduces) those the step sent."""
    r = runs["rehearsed"][f"tp2-{ac}-4"]
    assert r["layout"]["axes"] == {"tp": 2}, r["layout"]
    assert r["estimate_bytes"] == pytest.approx(r["peak_bytes"], rel=0.15), r
    planned = r["plan"]["traffic_bytes"]
    assert set(planned) == {"dp_shard", "tp"}
    for group, sent in planned.items():
        assert sent == pytest.approx(r["traffic_bytes"][group], rel=0.01), (ac, group)
    # the tp group carries more under checkpointing (the blocks' forward exchanges again)
    if ac == "selective":
        assert planned["tp"] > runs["rehearsed"]["tp2-none-4"]["plan"]["traffic_bytes"]["tp"]


def test_the_figures_that_need_no_step_come_before_the_first(runs):
    """The plan (params, estimate per rank, traffic, the verdict by the estimate, what the steps
    run) is logged before the model is built and before step 1."""
    lines = runs["logged"]["partial-8"]
    plan = next(i for i, line in enumerate(lines) if "rehearsal plan of rank 0 of 8" in line)
    first = next(i for i, line in enumerate(lines) if line.startswith("rehearsal: step 1/"))
    assert plan < first
    text = lines[plan]
    for said in (
        "params, 6 blocks)",
        "est. memory per rank",
        "on dp_shard (FSDP's",
        "fits an 80 GB device by the estimate: yes",
        "first 2 of the 6 blocks",
    ):
        assert said in text, (said, text)
    table = next(line for line in lines if "rehearsal of rank 0 of 8" in line)
    assert "measured on the first 2 of the model's 6 blocks" in table


@pytest.mark.parametrize(
    ("more", "blocks"),
    [([], 0), (["--training.seq_len", "8192"], 0), (["--training.seq_len", "8192", "--training.local_batch_size", "8"], 2),
     (["--rehearsal.blocks", "0", "--training.seq_len", "8192", "--training.local_batch_size", "8"], 0),
     (["--rehearsal.blocks", "3"], 3), (["--rehearsal.blocks", "6"], 0), (["--rehearsal.blocks", "2", "--parallelism.dp_replicate", "8", "--parallelism.dp_shard", "1"], 0)],
)  # fmt: skip
def test_a_cpu_rehearsal_runs_part_of_a_model_whose_step_is_slow_here(more, blocks):
    """auto: the first 2 blocks on a CPU where a whole step is above 10^13 FLOPs (the debug model
    at seq 8,192 with 8 sequences a microbatch: 1.2e13; with 1: 1.5e12), else the whole model; a
    count at or above the model's, or a layout whose traffic is not planned (DDP), runs the
    whole; config.toml then records what ran."""
    from titanlite.rehearsal.plan import make_plan

    cfg, _ = parse_args(["--rehearsal.world", "8", "--training.local_batch_size", "1", *more])
    plan = make_plan(cfg)
    assert plan.blocks == cfg.rehearsal.blocks == blocks and plan.n_blocks == 6, plan.why
    # a part keeps the whole model's resharding ('auto' decides by the model's size)
    assert (cfg.parallelism.reshard_after_forward != "auto") == (blocks > 0)


@settings(max_examples=200, deadline=None)
@given(
    world=st.integers(1, 4096),
    local=st.integers(1, 64),
    global_batch=st.integers(1, 10**5),
    steps=st.integers(3, 50),
)
def test_a_rehearsal_plan_holds_for_any_batch(world, local, global_batch, steps):
    """The global batch splits over W ranks, keeps the config's where it can, and every key a
    rehearsal sets is a valid value of its field (the config round-trips through config.toml)."""
    batch = rehearsal_batch(global_batch, local, world)
    assert batch % (world * local) == 0
    assert (batch == global_batch) == (global_batch % (world * local) == 0)
    cfg, _ = parse_args(
        [
            "--rehearsal.world", str(world), "--rehearsal.steps", str(steps),
            "--training.local_batch_size", str(local), "--training.global_batch_size", str(global_batch),
        ]
    )  # fmt: skip
    assert cfg.training.global_batch_size == batch and cfg.training.steps == steps
    assert not cfg.checkpoint.saves and not cfg.eval.at_end and cfg.eval.every == 0
    again = load_config(None, [])
    assert again.rehearsal.world == 0  # a plain config is untouched


EVAL_SWITCHES = [
    f.name for f in dataclasses.fields(Eval) if f.name == "every" or f.type in (bool, "bool")
]


@pytest.mark.parametrize("name", EVAL_SWITCHES)
def test_a_rehearsal_never_evaluates_as_its_note_says(name):
    """Every eval switch (the schedule and each bool of [eval]) turned on beside an eval set: the
    rehearsal's note says "no ... eval", and no step, nor the start, evaluates."""
    notes: list[str] = []
    value = "3" if name == "every" else "true"
    cfg, _ = parse_args(
        ["--rehearsal.world", "8", "--eval.fraction", "0.1", f"--eval.{name}", value], notes
    )
    assert any("no checkpoint, eval," in n for n in notes), notes
    evaluator = Evaluator([], None, 1, None, cfg)
    assert not cfg.eval.at_start
    assert not any(evaluator.due(step) for step in range(1, cfg.training.steps + 1))


def test_config_round_trip_of_a_rehearsal(tmp_path):
    cfg, _ = parse_args(["--rehearsal.world", "64", "--checkpoint.every", "5", "--eval.every", "3"])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert load_config(str(path)) == cfg


def test_a_rehearsal_and_a_training_run_never_share_a_folder(tmp_path):
    real, _ = parse_args(["--job.dump_folder", str(tmp_path)])
    rehearsal, _ = parse_args(["--job.dump_folder", str(tmp_path), "--rehearsal.world", "8"])
    rehearsed, trained = tmp_path / "rehearsed", tmp_path / "trained"
    for folder in (rehearsed, trained):
        folder.mkdir()
        (folder / "config.toml").write_text(to_toml(rehearsal if folder is rehearsed else real))
    (rehearsed / REHEARSAL_FILE).write_text("{}")
    with pytest.raises(UserError, match="holds a rehearsal, which trained nothing"):
        resume_plan(real, rehearsed, restarted=False)
    with pytest.raises(UserError, match="holds a training run"):
        resume_plan(rehearsal, trained, restarted=False)
    assert resume_plan(rehearsal, rehearsed, restarted=False) == (None, None)  # rehearsed again


def test_the_torch_internals_it_needs_are_there_or_named(monkeypatch):
    import torch.distributed as dist

    assert isinstance(groups.fake_store(), dist.Store)
    assert meter.mem_tracker() is not None
    monkeypatch.setattr(groups, "FAKE_MODULE", "torch.no_such_module")
    with pytest.raises(RuntimeError, match="torch.no_such_module"):
        groups.fake_store()
    monkeypatch.setattr(meter, "MEM_TRACKER", "torch.distributed._tools.mem_tracker.NoSuchTracker")
    with pytest.raises(RuntimeError, match="NoSuchTracker"):
        meter.mem_tracker()


def test_run_train_rehearses_and_its_folder_cannot_be_trained(tmp_path):
    env = {**os.environ, "NPROC": "2"}
    cmd = [
        "./run_train.sh",
        "--rehearse",
        "16",
        "--job.dump_folder",
        str(tmp_path),
        "--job.run_name",
        "plan",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rehearsal of rank 0 of 16" in proc.stdout + proc.stderr
    report = json.loads((tmp_path / "plan" / REHEARSAL_FILE).read_text())
    assert (
        report["world"] == 16 and report["layout"]["dp_shard"] == 16 and report["host_reads"] == 0
    )
    assert not (tmp_path / "plan" / "checkpoints").exists()
    cmd = ["./run_train.sh", "--job.dump_folder", str(tmp_path), "--job.run_name", "plan"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert (
        lines[-1].startswith("titanlite: error: run folder") and "holds a rehearsal" in lines[-1]
    ), proc.stderr
