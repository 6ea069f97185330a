"""Checkpoint, resume, restart and reshard through the launcher (2- and 4-rank CPU runs, debug
model with its output head tied to the embedding as in Llama 3.2, the built-in SFT set prepared
by scripts/prepare_data.py and read memory-mapped, 6 steps, checkpoints every 3; the untied
model's reshard: tests/test_invariance.py, with --long).

- a worker SIGKILLed at a random step, with one restart allowed (MAX_RESTARTS), is restarted by
  torchrun and the run resumes by itself: per-step losses bitwise equal to the run that never
  stopped; killed without restarts, the launcher names the rank and its log, and the same
  command continues it bitwise (DDP with dropout: RNG states resume too), and its checkpoint
  continues at dp=4 with one dropout stream on every rank (the seed rule);
- a Ctrl-C (SIGINT to the launcher) finishes the step, writes a checkpoint and exits 130 with one
  line; the same command continues bitwise and says that its changed optimizer.lr is not applied;
- a checkpoint written at dp=2 FSDP continues at dp=4 FSDP, at dp=2 DDP and at dp=1 x tp=2
  within 1e-5;
- a run killed inside the save of step 6 leaves that checkpoint unpublished: the restart loads
  step 3 and finishes, equal to the uninterrupted run;
- async_mode: a run killed inside the background write resumes from the previous async
  checkpoint bitwise, and a failed background write stops the run at the next save;
- a checkpoint trained on something else or written by another run, a checkpoint folder that
  cannot be one: one line, exit 2, before any worker starts, nothing touched.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from helpers import HANG_S, STARTUP, check, read_metrics, train

from titanlite.components.checkpoint.index import damage, file_record, find, quarantine_damaged
from titanlite.errors import UserError
from titanlite.tools.records import read_records

STEPS = 6
BASE = [
    "--config",
    "train_configs/debug_sft.toml",
    "--model.flavor",
    "debugmodel_tied",
    "--training.steps",
    str(STEPS),
    "--metrics.log_every",
    "1",
    "--metrics.enable_tensorboard",
    "false",
]
DATA: list[str] = []  # --data.path: the built-in SFT set prepared by the script (set by `ref`)
DDP = ("--parallelism.dp_replicate", "2")
DROPOUT = ("--model.dropout", "0.1")  # the DDP runs: the dropout RNG must resume exactly too
# the DDP runs: an alert registered from outside the package (tests/toy_alert.py), whose own state
# must resume too: it fires at the 5th measured step of the run
TOY = ("--model.import_module", "toy_alert")


CKPT = ("--checkpoint.every", "3", "--checkpoint.at_end", "true")


def run(tmp: Path, name: str, *extra: str, nproc: int = 2, ok: bool = True, restarts: int = 0):
    where = ("--job.dump_folder", str(tmp), "--job.run_name", name)
    launch = ("--max-restarts", str(restarts))
    proc = train(
        nproc,
        *BASE,
        *DATA,
        *where,
        *extra,
        timeout=HANG_S,
        launcher="titanlite.launch",
        launch=launch,
    )
    if ok:
        check(proc)
    return proc


def losses(tmp: Path, name: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(tmp / name)}


def listing(folder: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
    )


@pytest.fixture(scope="module")
def ref(tmp_path_factory, prepared_sft):
    """Uninterrupted runs (FSDP with checkpoints at steps 3 and 6, and DDP), on data prepared by
    scripts/prepare_data.py (mid-epoch: 48 of 5,318 records)."""
    DATA[:] = ["--data.path", prepared_sft]
    tmp = tmp_path_factory.mktemp("ckpt")
    run(tmp, "fsdp", *CKPT)
    run(tmp, "ddp", *DDP, *DROPOUT, *TOY)
    return tmp


@pytest.mark.slow
def test_worker_killed_mid_run_is_restarted_and_resumes_bitwise(ref):
    """Killed at step 2 the restart starts over (no checkpoint yet); at 4 or 5 it resumes from 3."""
    step = random.randint(2, 5)
    kill = ("--faults.sigkill_step", str(step), "--faults.sigkill_rank", "1")
    proc = run(ref, "restarted", *CKPT, *kill, restarts=1)
    assert "titanlite: rank 1 was killed by SIGKILL; restarting the workers" in proc.stderr, (
        step,
        proc.stderr,
    )
    assert losses(ref, "restarted") == losses(ref, "fsdp"), step
    folder = ref / "restarted" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000003", "step-00000006"]
    state = json.loads((folder / "step-00000006" / "state.json").read_text())
    assert (
        state["step"] == 6
        and state["scheduler"]["last_epoch"] == 6
        and state["diagnostics"]["monitor"]
    )
    assert state["run_folder"] == str((ref / "restarted").resolve())
    assert len(list((ref / "restarted" / "logs").glob("*/attempt_1/1/stderr.log"))) == 1


@pytest.mark.slow
def test_killed_rank_is_named_and_the_same_command_continues(ref):
    kill = ("--faults.sigkill_step", "5", "--faults.sigkill_rank", "1")
    proc = run(ref, "ddp-resumed", *DDP, *DROPOUT, *TOY, *CKPT, *kill, ok=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    summary = proc.stderr.strip().splitlines()[-1]
    assert (
        summary.startswith("titanlite: rank 1 was killed by SIGKILL;")
        and "its full log: " in summary
    )
    assert Path(summary.split("its full log: ")[1]).is_file()
    run(ref, "ddp-resumed", *DDP, *DROPOUT, *TOY, *CKPT)
    assert losses(ref, "ddp-resumed") == losses(ref, "ddp")
    # the toy alert, resumed from step 3 with its count, fires at step 5 as in the run never stopped
    for name in ("ddp", "ddp-resumed"):
        toy = [
            (e["step"], e["ranks"], e["cause"])
            for e in read_records(ref / name / "events.jsonl")
            if e["name"] == "toy_alert"
        ]
        assert toy == [(5, [1], "a test's alert: nothing is wrong")], (name, toy)
    # The seed rule (titanlite.tools.seeds) across a reshard: the dp=2 dropout checkpoint of step 3
    # continues at dp=4 with every rank reading the same data, so the ranks' per-sequence losses
    # are equal exactly when their dropout masks are, i.e. when every rank continues one stream.
    shutil.copytree(
        ref / "ddp-resumed/checkpoints/step-00000003", ref / "dp4-seeds/checkpoints/step-00000003"
    )
    same = ("--parallelism.dp_replicate", "4", "--faults.same_data", "true")
    run(ref, "dp4-seeds", *DROPOUT, *TOY, *same, nproc=4)
    records = [
        json.loads(x) for x in (ref / "dp4-seeds/diagnostics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [4, 5, 6]
    for r in records:
        per_rank = [[x["loss"] for x in rank] for rank in r["rank_samples"]]
        assert len(per_rank) == 4 and all(p == per_rank[0] for p in per_rank), (r["step"], per_rank)


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_the_same_command_continues_bitwise(ref):
    """The SIGINT reaches the launcher as step 3 starts; the ranks agree to stop after step 3 (at
    its log step's end, where they settle), or 4 or 5 (the flag read one step late)."""
    proc = run(ref, "stopped", *CKPT, "--faults.signal_step", "3", ok=False)
    assert proc.returncode == 130, proc.stderr[-3000:]
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("titanlite:")]
    lines = sorted({ln for ln in said if not ln.startswith(STARTUP)})  # every rank's stop line
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    stop = int(lines[0].split("after step ")[1].split(";")[0])
    assert stop in (3, 4, 5) and f"checkpoint step-{stop} (saved in " in lines[0]
    assert "rerun the same command to continue" in lines[0]
    folder = ref / "stopped" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == sorted({"step-00000003", f"step-{stop:08d}"})
    proc = run(ref, "stopped", *CKPT, "--optimizer.lr", "1e-3")
    out = proc.stdout + proc.stderr
    assert (
        f"resumed from step {stop} ({folder / f'step-{stop:08d}'}, written at fsdp 1x2, 2 rank(s))"
        in out
    )
    assert "resume: optimizer.lr was 0.0008, now 0.001: not applied" in out
    assert losses(ref, "stopped") == losses(ref, "fsdp")
    # The summary counts the steps this invocation ran, and names the newest checkpoint.
    assert f"done: {STEPS - stop} steps ({stop + 1}-{STEPS}, resumed after step {stop}) in " in out
    assert f"checkpoint {folder / f'step-{STEPS:08d}'}" in out and "alerts: none" in out


@pytest.mark.slow
def test_reshard_dp2_to_dp4_to_ddp_and_to_a_tensor_split(ref):
    """The step-3 checkpoint copied into a new run folder continues at another layout: dp=4, DDP,
    and dp=1 x tp=2 (every parameter then a slice of what the checkpoint holds whole)."""
    split = ("--parallelism.axes", '["tp=2"]', "--diagnostics.enable", "false")
    for name, nproc, extra in (("dp4", 4, ()), ("to-ddp", 2, DDP), ("to-tp", 2, split)):
        shutil.copytree(
            ref / "fsdp/checkpoints/step-00000003", ref / name / "checkpoints/step-00000003"
        )
        run(ref, name, *extra, nproc=nproc)
    want = losses(ref, "fsdp")
    for name in ("dp4", "to-ddp", "to-tp"):
        got = losses(ref, name)
        assert sorted(got) == [4, 5, 6]  # a new run folder: it starts after the checkpoint
        assert max(abs(got[s] - want[s]) / want[s] for s in got) <= 1e-5, (name, got, want)


@pytest.mark.slow
def test_kill_inside_save_keeps_the_previous_checkpoint(ref):
    ckpt = ("--checkpoint.every", "3", "--checkpoint.at_end", "true")
    proc = run(ref, "save-killed", *ckpt, "--faults.sigkill_in_save", "6", ok=False)
    assert proc.returncode != 0
    folder = ref / "save-killed" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000003", "step-00000006.tmp"]
    assert not (folder / "step-00000006.tmp" / "complete").exists()
    proc = run(ref, "save-killed", *ckpt)
    assert "resumed from step 3" in proc.stdout + proc.stderr
    assert losses(ref, "save-killed") == losses(ref, "fsdp")
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000003", "step-00000006"]


@pytest.mark.slow
def test_refusals_come_before_any_worker_and_touch_nothing(ref, tmp_path):
    """Each refusal is one line from the launcher, run in this process and stopped where it would
    start the workers (tests/faults/harness.py in_process): none is reached."""
    from faults.harness import in_process

    def refused(tmp: Path, name: str, *extra: str):
        where = ("--job.dump_folder", str(tmp), "--job.run_name", name)
        r = in_process([*BASE, *DATA, *where, *extra], nproc=2)
        assert (
            r.code == 2 and r.err.startswith("titanlite: error: ") and len(r.err.splitlines()) == 1
        ), r
        return r.err

    folder = ref / "fsdp" / "checkpoints"
    before = listing(ref / "fsdp")
    cases = [
        ("fsdp", ("--training.seed", "7"), "trained on something else (training.seed"),
        ("fsdp", ("--model.flavor", "debugmodel"), "trained on something else (model.flavor"),
        ("fsdp", ("--training.seq_len", "128"), "trained on something else (training.seq_len"),
        (
            "other",
            ("--checkpoint.folder", str(folder), "--checkpoint.load_step", "4"),
            "(complete: 3, 6)",
        ),
        ("other", ("--checkpoint.folder", str(folder)), "holds the checkpoints of run '"),
    ]
    for name, extra, needle in cases:
        err = refused(ref, name, *extra)
        assert needle in err, err
    assert "checkpoint.initial_load_path = '" + str(folder / "step-00000006") in err
    assert listing(ref / "fsdp") == before and not (ref / "other").exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for ck, needle in (
        (blocker, "is a file; point checkpoint.folder at a folder"),
        (blocker / "ck", "is a file"),
    ):
        err = refused(tmp_path, "unwritable", *CKPT, "--checkpoint.folder", str(ck))
        assert needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.slow
def test_full_disk_fails_the_save_loudly_and_keeps_the_previous(tmp_path):
    """The last rank's shard write fails inside DCP (as on a full disk) at step 6."""
    proc = run(
        tmp_path,
        "full",
        "--checkpoint.every",
        "3",
        "--checkpoint.at_end",
        "true",
        "--faults.fail_save_step",
        "6",
        ok=False,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert f"checkpoint save at step 6 failed: disk full under '{tmp_path}/" in line, proc.stderr[
        -2000:
    ]
    assert "No space left on device" in line and "then rerun the same command" in line
    assert "the checkpoint of step 3 is intact" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == [
        "step-00000003"
    ]


@pytest.mark.slow
def test_async_save_resumes_exactly_and_reports_failures(ref, tmp_path):
    """Killed inside the background write of step 4 (DCP's files written, not yet published), the
    restart resumes from step 2, itself written in the background, and ends bitwise equal; a
    full disk in the background write of step 4 fails the run at the next save, exit 3."""
    ckpt = (
        "--checkpoint.every",
        "2",
        "--checkpoint.at_end",
        "true",
        "--checkpoint.async_mode",
        "async",
    )
    assert run(ref, "async", *ckpt, "--faults.sigkill_in_save", "4", ok=False).returncode != 0
    folder = ref / "async" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002", "step-00000004.tmp"]
    proc = run(ref, "async", *ckpt)
    said = proc.stdout + proc.stderr
    assert "resumed from step 2" in said
    saved = [line for line in said.splitlines() if "r0] checkpoint: " in line and "step 4" in line]
    assert len(saved) == 1 and "(async: training waited " in saved[0], saved  # one save, one time
    assert losses(ref, "async") == losses(ref, "fsdp")
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000004", "step-00000006"]

    proc = run(tmp_path, "async-full", *ckpt, "--faults.fail_save_step", "4", ok=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert f"checkpoint save at step 4 failed: disk full under '{tmp_path}/" in line, proc.stderr[
        -2000:
    ]
    assert "No space left on device" in line and "then rerun the same command" in line
    assert "the checkpoint of step 2 is intact" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "async-full" / "checkpoints").iterdir()) == [
        "step-00000002"
    ]
    assert max(losses(tmp_path, "async-full")) == 6  # reported at the next save, step 6


def _truncate(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size)


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        f.write(data)


def _edit_state(folder: Path, **changes) -> None:
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**state, **changes}))


DAMAGE = {  # how a step folder gets damaged -> what the line names
    "distcp cut": (lambda d: _truncate(d / "__0_0.distcp", 1000), "__0_0.distcp holds 1,000 bytes"),
    "distcp deleted": (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
    "metadata deleted": (lambda d: (d / ".metadata").unlink(), ".metadata is missing"),
    "rng cut": (lambda d: _truncate(d / "rng-rank1.pt", 100), "rng-rank1.pt holds 100 bytes"),
    "rng flipped": (
        lambda d: _overwrite(d / "rng-rank0.pt", 200, b"\xff\x00\xff"),
        "rng-rank0.pt does not match",
    ),
    "state cut": (lambda d: _truncate(d / "state.json", 1000), "state.json is unreadable"),
    "state step edited": (
        lambda d: _edit_state(d, step=40),
        "state.json says step 40, its folder step 6",
    ),
    "file record gone": (lambda d: _edit_state(d, files=None), "state.json records no file sizes"),
}


@pytest.mark.slow
def test_damaged_checkpoints_are_found_before_the_run_folder_opens(ref, tmp_path):
    """Every kind of damage the catalogue tried, on the newest of two checkpoints: the resume
    picks the older intact one, load_step naming the damaged one is refused in one line, and the
    holder of the run lock sets the damaged one aside (never resumed, never pruned)."""
    src = ref / "fsdp" / "checkpoints"
    for name, (hurt, needle) in DAMAGE.items():
        folder = Path(shutil.copytree(src, tmp_path / name.replace(" ", "-")))
        hurt(folder / "step-00000006")
        assert damage(folder / "step-00000006").startswith(needle.split(" holds")[0]), name
        assert needle in damage(folder / "step-00000006"), name
        assert find(folder, -1) == 3, name
        with pytest.raises(UserError, match="checkpoint.load_step 6: .* is damaged"):
            find(folder, 6)
        quarantine_damaged(folder)
        assert sorted(p.name for p in folder.iterdir()) == [
            "step-00000003",
            "step-00000006.damaged",
        ], name


def _unseen_damage(step: Path) -> None:
    """The head of a shard overwritten, and its record rewritten to match: damage as a shard too
    large for a checksum (over CHECKSUM_MAX_BYTES) would carry it past the verification."""
    _overwrite(step / "__0_0.distcp", 0, b"\x00" * 64)
    _edit_state(step, files=file_record(step))


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_and_one_that_fails_to_load_is_set_aside(ref):
    """Through the launcher: step 6 cut short is set aside with one line and the run resumes
    from step 3, bitwise; step 6 damaged where no size or checksum looks (the head of a shard
    overwritten) fails inside DCP: exit 3 in one line, set aside, and the same command falls back."""
    for name, hurt in (
        ("fallback", lambda d: _truncate(d / "__0_0.distcp", 1000)),
        ("load-fails", _unseen_damage),
    ):
        shutil.copytree(ref / "fsdp", ref / name, ignore=shutil.ignore_patterns("run.lock", "logs"))
        hurt(ref / name / "checkpoints" / "step-00000006")
        proc = run(ref, name, *CKPT, ok=name == "fallback")
        if name == "load-fails":
            assert proc.returncode == 3, proc.stderr[-3000:]
            assert (
                "failed to load" in proc.stderr
                and "set aside as step-00000006.damaged" in proc.stderr
            )
            proc = run(ref, name, *CKPT)
        else:
            assert (
                "__0_0.distcp holds 1,000 bytes" in proc.stderr
                and "set aside as step-00000006.damaged" in (proc.stderr)
            )
        assert "resumed from step 3" in proc.stdout + proc.stderr, name
        assert losses(ref, name) == losses(ref, "fsdp"), name
        folder = ref / name / "checkpoints"
        assert sorted(p.name for p in folder.iterdir()) == [
            "step-00000003",
            "step-00000006",
            "step-00000006.damaged",
        ], name


# (ranks, parallelism flags, how the resume line names that layout): every axis, as the plan
# line names a layout (config.layout.mesh_text)
WRITTEN_AT = [
    (2, (), "fsdp 1x2, 2 rank(s)"),
    (2, ("--parallelism.mode", "ddp", "--parallelism.dp_replicate", "2"), "ddp 2x1, 2 rank(s)"),
    (4, ("--parallelism.dp_replicate", "2"), "hsdp 2x2, 4 rank(s)"),
    (4, ("--parallelism.axes", '["cp=2"]'), "fsdp 1x2xcp=2, 4 rank(s)"),
    (8, ("--parallelism.dp_replicate", "2", "--parallelism.axes", '["cp=2"]'), "hsdp 2x2xcp=2, 8 rank(s)"),
    (4, ("--parallelism.axes", '["cp=2", "tp=2"]'), "fsdp 1x1xcp=2xtp=2, 4 rank(s)"),
]  # fmt: skip


@pytest.mark.parametrize("world, flags, named", WRITTEN_AT, ids=[w[2] for w in WRITTEN_AT])
def test_the_resume_line_names_every_axis_a_checkpoint_was_written_at(world, flags, named):
    """From its state.json (the config it saved, at the world size it ran), never the data-parallel
    degree alone; a saved config that no longer resolves names its ranks."""
    from titanlite.components.checkpoint.resume import flat_config, written_at
    from titanlite.config import load_config

    args = ["--training.global_batch_size", "16", "--training.local_batch_size", "2", *flags]
    state = {"world_size": world, "config": flat_config(load_config(None, args))}
    assert written_at(state) == named
    assert written_at({**state, "world_size": 3}) == "3 rank(s)"
