"""Checkpoint, resume and reshard through the trainer's CLI (2- and 4-rank CPU runs, debug model
with its output head tied to the embedding as in Llama 3.2, the built-in SFT set prepared by
scripts/prepare_data.py and read memory-mapped, 6 steps,
checkpoints every 3; the untied model's reshard is in tests/test_invariance.py).

- a run killed by SIGKILL at step 5 and started again with the same command continues from its
  step-3 checkpoint: per-step losses bitwise equal to the run that never stopped, FSDP and DDP
  (with dropout: RNG states resume too);
- a checkpoint written at dp=2 FSDP continues at dp=4 FSDP and at dp=2 DDP within 1e-5;
- a run killed inside the save of step 6 leaves that checkpoint unpublished: the restart loads
  step 3 and finishes, equal to the uninterrupted run;
- async_mode: a run killed inside the background write resumes from the previous async
  checkpoint bitwise, and a failed background write stops the run at the next save;
- a checkpoint trained on something else, or an unwritable folder, is a one-line error and
  touches nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import check, read_metrics, train

STEPS = 6
BASE = [
    "--config",
    "train_configs/debug_sft.toml",
    "--model.flavor",
    "debugmodel_tied",
    "--training.steps",
    str(STEPS),
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
]
DATA: list[str] = []  # --data.path: the built-in SFT set prepared by the script (set by `ref`)
DDP = ("--parallelism.dp_replicate", "2")
DROPOUT = ("--model.dropout", "0.1")  # the DDP runs: the dropout RNG must resume exactly too


def run(tmp: Path, name: str, *extra: str, nproc: int = 2, ok: bool = True):
    where = ("--job.dump_folder", str(tmp), "--job.run_name", name)
    proc = train(nproc, *BASE, *DATA, *where, *extra, timeout=600, launcher="titanlite.launch")
    if ok:
        check(proc)
    return proc


def losses(tmp: Path, name: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(tmp / name)}


def listing(folder: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
    )


@pytest.fixture(scope="module")
def ref(tmp_path_factory, prepared_sft):
    """Uninterrupted runs (FSDP and DDP) and a FSDP run killed at step 5, then restarted, all on
    data prepared by scripts/prepare_data.py (mid-epoch: 48 of 5,318 records)."""
    DATA[:] = ["--data.path", prepared_sft]
    tmp = tmp_path_factory.mktemp("ckpt")
    run(tmp, "fsdp")
    run(tmp, "ddp", *DDP, *DROPOUT)
    ckpt = ("--checkpoint.interval", "3")
    killed = run(tmp, "fsdp-resumed", *ckpt, "--debug.sigkill_step", "5", ok=False)
    assert killed.returncode != 0
    run(tmp, "fsdp-resumed", *ckpt)
    return tmp


@pytest.mark.slow
def test_resume_after_sigkill_is_bitwise_exact(ref):
    want = losses(ref, "fsdp")
    assert losses(ref, "fsdp-resumed") == want and sorted(want) == list(range(1, STEPS + 1))
    folder = ref / "fsdp-resumed" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000003", "step-00000006"]
    state = json.loads((folder / "step-00000006" / "state.json").read_text())
    assert state["step"] == 6 and state["scheduler"]["last_epoch"] == 6 and state["diagnostics"]["monitor"]


@pytest.mark.slow
def test_ddp_resume_is_bitwise_exact(ref):
    ckpt = ("--checkpoint.interval", "3")
    assert (
        run(ref, "ddp-resumed", *DDP, *DROPOUT, *ckpt, "--debug.sigkill_step", "5", ok=False).returncode != 0
    )
    run(ref, "ddp-resumed", *DDP, *DROPOUT, *ckpt)
    assert losses(ref, "ddp-resumed") == losses(ref, "ddp")


@pytest.mark.slow
def test_reshard_dp2_to_dp4_and_fsdp_to_ddp(ref):
    source = ("--checkpoint.folder", str(ref / "fsdp-resumed" / "checkpoints"), "--checkpoint.load_step", "3")
    run(ref, "dp4", *source, nproc=4)
    run(ref, "to-ddp", *source, *DDP)
    want = losses(ref, "fsdp")
    for name in ("dp4", "to-ddp"):
        got = losses(ref, name)
        assert sorted(got) == [4, 5, 6]  # a new run folder: it starts after the checkpoint
        assert max(abs(got[s] - want[s]) / want[s] for s in got) <= 1e-5, (name, got, want)


@pytest.mark.slow
def test_kill_inside_save_keeps_the_previous_checkpoint(ref):
    ckpt = ("--checkpoint.interval", "3")
    proc = run(ref, "save-killed", *ckpt, "--debug.sigkill_in_save", "6", ok=False)
    assert proc.returncode != 0
    folder = ref / "save-killed" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000003", "step-00000006.tmp"]
    assert not (folder / "step-00000006.tmp" / "complete").exists()
    proc = run(ref, "save-killed", *ckpt)
    assert "resumed from step 3" in proc.stdout + proc.stderr
    assert losses(ref, "save-killed") == losses(ref, "fsdp")
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000003", "step-00000006"]


@pytest.mark.slow
def test_mismatched_checkpoint_or_unwritable_folder_fails_cleanly(ref, tmp_path):
    folder = ref / "fsdp-resumed" / "checkpoints"
    before = listing(ref / "fsdp-resumed")
    for extra, key in (
        (("--training.seed", "7"), "training.seed"),
        (("--model.flavor", "debugmodel"), "model.flavor"),  # another model (the data fixes the vocabulary)
        (("--training.seq_len", "128"), "training.seq_len"),
    ):
        proc = run(ref, "fsdp-resumed", *extra, ok=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        errors = {line for line in proc.stderr.splitlines() if "titanlite: error" in line}  # every rank's
        assert len(errors) == 1 and "trained on something else" in min(errors) and key in min(errors)
    assert listing(ref / "fsdp-resumed") == before
    proc = run(ref, "other", "--checkpoint.folder", str(folder), "--checkpoint.load_step", "4", ok=False)
    assert proc.returncode == 2 and "no complete checkpoint of that step (complete: 3, 6)" in proc.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    proc = run(
        tmp_path,
        "unwritable",
        "--checkpoint.interval",
        "3",
        "--checkpoint.folder",
        str(blocker / "ck"),
        ok=False,
    )
    assert proc.returncode == 3 and "checkpoint save at step 3 failed" in proc.stderr
    assert "no earlier checkpoint exists" in proc.stderr


@pytest.mark.slow
def test_full_disk_fails_the_save_loudly_and_keeps_the_previous(tmp_path):
    """The last rank's shard write fails inside DCP (as on a full disk) at step 6."""
    proc = run(tmp_path, "full", "--checkpoint.interval", "3", "--debug.fail_save_step", "6", ok=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "checkpoint save at step 6 failed" in proc.stderr and "No space left on device" in proc.stderr
    assert "the checkpoint of step 3 is intact" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == ["step-00000003"]


@pytest.mark.slow
def test_async_save_resumes_exactly_and_reports_failures(ref, tmp_path):
    """Killed inside the background write of step 4 (DCP's files written, not yet published), the
    restart resumes from step 2, itself written in the background, and ends bitwise equal; a
    full disk in the background write of step 4 fails the run at the next save, exit 3."""
    ckpt = ("--checkpoint.interval", "2", "--checkpoint.async_mode", "async")
    assert run(ref, "async", *ckpt, "--debug.sigkill_in_save", "4", ok=False).returncode != 0
    folder = ref / "async" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002", "step-00000004.tmp"]
    proc = run(ref, "async", *ckpt)
    assert "resumed from step 2" in proc.stdout + proc.stderr
    assert losses(ref, "async") == losses(ref, "fsdp")
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000004", "step-00000006"]

    proc = run(tmp_path, "async-full", *ckpt, "--debug.fail_save_step", "4", ok=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "checkpoint save at step 4 failed" in proc.stderr and "No space left on device" in proc.stderr
    assert "the checkpoint of step 2 is intact" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "async-full" / "checkpoints").iterdir()) == ["step-00000002"]
    assert max(losses(tmp_path, "async-full")) == 6  # reported at the next save, step 6
