"""The run folder's one writer (titanlite.components.run.files, and TensorBoard's through
titanlite.components.metrics) and its one reader (titanlite.tools.records), in process: every
record whole or not at all on a full or read-only disk (the error injected at the writer, as
faults.write_error does, not with mounts), a file removed under the run written again, one
replaced by a folder or a run folder gone stopping the run in one line, and the modes the
user's umask gives. The whole-run versions are catalogue cases (tests/faults/cases_run_folder.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import threading
import time

import pytest

from titanlite.components.metrics import MetricsWriter, tensorboard_dir
from titanlite.components.run.files import RunFiles
from titanlite.errors import TrainingError, UserError
from titanlite.tools.cache import atomic_write_bytes
from titanlite.tools.records import read_json, read_records


def _rec(step: int) -> dict:
    return {"step": step, "loss": 1.0 / step, "text": "x" * 200}


@pytest.mark.parametrize(
    "code, says",
    [
        (errno.ENOSPC, "disk full"),
        (errno.EDQUOT, "quota"),
        (errno.EROFS, "read-only"),
        (errno.EIO, "Input/output"),
    ],
)
def test_a_failed_append_leaves_every_record_whole_and_says_what_was_kept(tmp_path, code, says):
    (tmp_path / "checkpoints" / "step-00000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000002" / "complete").write_text("2\n")
    failing = {"on": False}
    files = RunFiles(tmp_path, tmp_path / "checkpoints")
    files.fail_write = lambda name: OSError(code, os.strerror(code)) if failing["on"] else None
    files.append("metrics.jsonl", [_rec(1), _rec(2)])
    failing["on"] = True
    with pytest.raises(TrainingError) as e:
        files.append("metrics.jsonl", [_rec(3)])  # half of it lands, then the error
    line = str(e.value)
    assert "\n" not in line and says in line and "metrics.jsonl" in line, line
    assert "records up to step 2 are whole" in line and "newest checkpoint is step 2" in line, line
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl", cut_off="refuse")] == [1, 2]
    files.close()


def test_a_file_removed_under_the_run_is_written_again_and_a_folder_in_its_place_stops_it(
    tmp_path, caplog
):
    files = RunFiles(tmp_path)
    files.append("diagnostics.jsonl", [_rec(1)])
    (tmp_path / "diagnostics.jsonl").unlink()
    files.check()  # every log step: found, made again
    files.append("diagnostics.jsonl", [_rec(2)])
    assert [r["step"] for r in read_records(tmp_path / "diagnostics.jsonl")] == [2]
    assert "removed or replaced" in caplog.text
    (tmp_path / "diagnostics.jsonl").unlink()
    (tmp_path / "diagnostics.jsonl").mkdir()
    with pytest.raises(TrainingError, match="is a folder now"):
        files.append("diagnostics.jsonl", [_rec(3)])
    shutil.rmtree(tmp_path)
    with pytest.raises(TrainingError, match="run folder .* was removed"):
        files.check()


def test_a_run_folder_moved_under_the_run_stops_it_naming_where_it_went(tmp_path):
    run, moved = tmp_path / "run", tmp_path / "elsewhere"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "checkpoints" / "step-00000002" / "complete").write_text("2\n")
    files = RunFiles(run, checkpoints=run / "checkpoints")
    files.append("metrics.jsonl", [_rec(3)])
    run.rename(moved)
    with pytest.raises(TrainingError) as stop:
        files.check()
    assert str(stop.value) == (
        f"the run folder {run} was moved to {moved} while the run wrote to it; the run stopped: its records up "
        f"to step 3 are whole, its newest checkpoint is step 2; move it back to {run}, then rerun the same "
        "command to resume"
    )


def test_tensorboard_made_again_after_tb_is_removed_and_a_full_disk_stops_the_run(tmp_path):
    full = {"on": False}
    writer = MetricsWriter(tmp_path, 10, True)
    writer.files.fail_write = lambda name: OSError(errno.ENOSPC, "no space") if full["on"] else None
    writer.write_scalars("train", {"step": 1, "loss": 2.0})
    shutil.rmtree(tmp_path / "tb")
    writer.check()
    writer.write_scalars("train", {"step": 2, "loss": 1.5})  # the thread's failure, recovered
    assert list(tensorboard_dir(tmp_path).glob("events.out.tfevents.*"))
    full["on"] = True
    with pytest.raises(
        TrainingError, match="TensorBoard's writer .* disk full.*; the run stopped: .* make room"
    ):
        writer.write_scalars("train", {"step": 3, "loss": 1.0})
    writer.close()


def test_a_failure_in_tensorboards_writer_thread_is_one_line_without_the_threads_traceback(
    tmp_path, monkeypatch
):
    printed = []  # what Python's hook for a thread's uncaught exception would print
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_value))
    writer = MetricsWriter(tmp_path, 10, True)
    writer.write_scalars("train", {"step": 1, "loss": 2.0})
    records = writer._sinks[0]._writer._get_file_writer().event_writer._async_writer._writer

    def full(data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    records.write = full  # as the disk under tb/ filling: the failure is in the writer's own thread
    with pytest.raises(TrainingError, match="TensorBoard's writer .* disk full"):
        writer.write_scalars("train", {"step": 2, "loss": 1.0})
    writer.close()
    assert printed == []


def test_files_get_the_mode_the_umask_gives(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "a.json", b"{}")
        files = RunFiles(tmp_path)
        files.append("metrics.jsonl", [_rec(1)])
        files.close()
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"a.json": 0o644, "metrics.jsonl": 0o644}, modes


def test_the_reader_skips_a_cut_last_line_or_refuses_it_and_names_a_damaged_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert [r["step"] for r in read_records(path)] == [1, 2]
    with pytest.raises(UserError, match="last line .3. is cut off"):
        read_records(path, cut_off="refuse")
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(UserError, match="line 2 is not a JSON record"):
        read_records(path)
    for text, says in (("{garbage", "not valid JSON"), ("[1, 2]", "a JSON list, not an object")):
        (tmp_path / "run.json").write_text(text)
        with pytest.raises(UserError, match=says):
            read_json(tmp_path / "run.json")


def test_run_json_keeps_the_layout_every_step_ran_at_through_resumes_and_rewinds(tmp_path):
    """Generated session histories (resumes at other world sizes, rewinds to an older step):
    run.json rewritten by each start still answers, for every step of the surviving timeline,
    the layout it ran at (what scripts/inspect_step.py splits a step's batch by)."""
    import random

    from titanlite.components.run.folder import _with_earlier, layout_at

    rng = random.Random(0)
    for case in range(200):
        run_dir = tmp_path / f"case{case}"
        run_dir.mkdir()
        timeline: dict[int, int] = {}  # step -> the world it ran at
        last, resume = 0, None
        for _ in range(rng.randint(1, 5)):
            world = rng.choice([1, 2, 4, 8])
            info = _with_earlier(
                run_dir, {"world_size": world, "local_batch_size": 8 // world}, resume
            )
            (run_dir / "run.json").write_text(json.dumps(info))
            start = (resume or 0) + 1
            last = start + rng.randint(0, 6)
            timeline = {s: w for s, w in timeline.items() if s < start} | dict.fromkeys(
                range(start, last + 1), world
            )
            resume = (
                rng.randint(1, last) if rng.random() < 0.3 else last
            )  # a rewind, or the newest step
        info = json.loads((run_dir / "run.json").read_text())
        got = {s: layout_at(info, s)["world_size"] for s in timeline}
        assert got == timeline, (case, info)


def test_a_run_folder_renamed_between_launches_stays_one_tensorboard_run(tmp_path):
    """TensorBoard names a run by its folder: events in <run>/tb, never in a folder named after
    the run, so a renamed run folder resumes into the same TensorBoard run, its repeated steps
    purged."""
    from helpers import tensorboard_items

    first, renamed = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    writer = MetricsWriter(first, 10, True)
    for step in (1, 2, 3):
        writer.write_scalars("train", {"step": step, "loss": 1.0 / step})
    writer.close()
    first.rename(renamed)
    time.sleep(1.1)  # event files sort by their second: each writer's comes after the one before
    writer = MetricsWriter(renamed, 10, True, purge_step=3)  # resumed from the step-2 checkpoint
    writer.write_scalars("train", {"step": 3, "loss": 0.3})
    writer.close()
    assert not [p for p in (renamed / "tb").iterdir() if p.is_dir()]
    scalars, _ = tensorboard_items(renamed / "tb")
    assert {s: v for (tag, s), v in scalars.items() if tag == "1_loss"} == pytest.approx(
        {1: 1.0, 2: 0.5, 3: 0.3}
    )


def test_an_unreadable_run_json_on_resume_is_said_and_a_missing_one_is_not(tmp_path, caplog):
    from titanlite.components.run.folder import _with_earlier

    info = {"world_size": 4}
    assert (
        _with_earlier(tmp_path, info, 6) == info and "unreadable" not in caplog.text
    )  # copied checkpoint
    (tmp_path / "run.json").write_text("{garbage")
    assert _with_earlier(tmp_path, info, 6) == info
    assert "run.json is unreadable: the layouts of the steps before 7 are not kept" in caplog.text


def test_tensorboard_meeting_a_removed_run_folder_says_the_run_folder(tmp_path):
    """Whichever writer meets it first, a run folder removed under a live run is named as such."""
    run = tmp_path / "run"
    run.mkdir()
    writer = MetricsWriter(run, 10, True)
    writer.write_scalars("train", {"step": 1, "loss": 2.0})
    shutil.rmtree(run)
    with pytest.raises(
        TrainingError, match=f"the run folder {run} was removed while the run wrote to it"
    ):
        writer.write_scalars("train", {"step": 2, "loss": 1.5})
    writer.close()
