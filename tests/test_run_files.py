"""The run folder's one writer (titanlite.components.run.files, and TensorBoard's through
titanlite.components.metrics) and its one reader (titanlite.tools.records), in process: every
record whole or not at all on a full or read-only disk (the error injected at the writer, as
debug.write_error does, not with mounts), a file removed under the run written again, one
replaced by a folder or a run folder gone stopping the run in one line, and the modes the
user's umask gives. The whole-run versions are catalogue cases (tests/faults/cases_run_folder.py)."""

from __future__ import annotations

import errno
import os
import shutil
import stat

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
    files = RunFiles(
        tmp_path,
        lambda name: OSError(code, os.strerror(code)) if failing["on"] else None,
        tmp_path / "checkpoints",
    )
    files.append("metrics.jsonl", [_rec(1), _rec(2)])
    failing["on"] = True
    with pytest.raises(TrainingError) as e:
        files.append("metrics.jsonl", [_rec(3)])  # half of it lands, then the error
    line = str(e.value)
    assert "\n" not in line and says in line and "metrics.jsonl" in line, line
    assert "records up to step 2 are whole" in line and "newest checkpoint is step 2" in line, line
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl", cut_off="refuse")] == [1, 2]
    files.close()


def test_a_file_removed_under_the_run_is_written_again_and_a_folder_in_its_place_stops_it(tmp_path, caplog):
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


def test_tensorboard_made_again_after_tb_is_removed_and_a_full_disk_stops_the_run(tmp_path):
    full = {"on": False}
    writer = MetricsWriter(
        tmp_path, 10, True, inject=lambda name: OSError(errno.ENOSPC, "no space") if full["on"] else None
    )
    writer.write_scalars("train", {"step": 1, "loss": 2.0})
    shutil.rmtree(tmp_path / "tb")
    writer.check()
    writer.write_scalars("train", {"step": 2, "loss": 1.5})  # the thread's failure, recovered
    assert list(tensorboard_dir(tmp_path).glob("events.out.tfevents.*"))
    full["on"] = True
    with pytest.raises(TrainingError, match="TensorBoard's writer .* disk full"):
        writer.write_scalars("train", {"step": 3, "loss": 1.0})
    writer.close()


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
