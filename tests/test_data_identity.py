"""A run knows its data by content (titanlite.datasets.prepare.content_key, computed once as a
folder is prepared), so a resume compares what it trains on, not where it lives: the same inputs
prepared anywhere have one key; a file added, or one record edited, gives another; a checkpoint
resumes on its data moved elsewhere and refuses other data at the same path in one line, unless
data.accept_change (then it says what changed). Whole runs: the catalogue's data cases
(tests/faults/cases_data.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from titanlite.components.checkpoint.index import file_record, step_dir
from titanlite.components.checkpoint.resume import check_resumable
from titanlite.config import load_config
from titanlite.config.fields import identity
from titanlite.datasets.corpus import discover
from titanlite.datasets.prepare import prepare
from titanlite.datasets.prepared import Prepared
from titanlite.datasets.spec import data_identity
from titanlite.datasets.tokenizer import Tokenizer, builtin_tokenizer_path, train_builtin_tokenizer
from titanlite.errors import UserError
from titanlite.tools.cache import cache_dir


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    path = builtin_tokenizer_path(cache_dir(""), 2048)
    if not path.exists():
        train_builtin_tokenizer(path, 2048)
    return Tokenizer(path.read_bytes(), f"builtin:{path.name}")


def _raw(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True)
    src = Path(__file__).resolve().parents[1] / "titanlite"
    for name in names:
        shutil.copy(src / name, folder / Path(name).name)
    return folder


def _prepared(tmp: Path, raw: Path, tok, name: str) -> Prepared:
    prepare([f for f in discover(str(raw))], tmp / name, tok, say=lambda _: None)
    return Prepared(tmp / name)


def test_the_content_key_is_what_the_data_holds_not_where_it_is(tmp_path, tok):
    a = _raw(tmp_path / "a", "datasets/README.md", "components/README.md")
    b = Path(
        shutil.copytree(a, tmp_path / "elsewhere" / "b")
    )  # the same files, another path and time
    keys = {
        name: _prepared(tmp_path, raw, tok, name).content for name, raw in (("pa", a), ("pb", b))
    }
    assert keys["pa"] and keys["pa"] == keys["pb"]
    (b / "more.md").write_text("another document\n" * 40)
    assert _prepared(tmp_path, b, tok, "pb-more").content != keys["pa"]
    (b / "more.md").unlink()
    text = (b / "README.md").read_text()
    (b / "README.md").write_text(text.replace("the", "teh", 1))  # one word of one record
    assert _prepared(tmp_path, b, tok, "pb-edited").content != keys["pa"]


def _checkpoint(run: Path, cfg, data: list[dict]) -> Path:
    """A checkpoint's step folder with the state.json a save writes, recording `data`."""
    step = step_dir(run / "checkpoints", 2)
    step.mkdir(parents=True)
    state = {"step": 2, "identity": identity(cfg), "data": data}
    (step / "state.json").write_text(json.dumps({**state, "files": file_record(step)}))
    (step / "complete").write_text("2\n")
    return run / "checkpoints"


def test_a_resume_compares_data_by_content(tmp_path, tok):
    a = _prepared(tmp_path, _raw(tmp_path / "a", "datasets/README.md"), tok, "pa")
    cfg = load_config(None, ["--data.path", str(a.folder)])
    saved = data_identity(cfg)
    assert saved == [{"content": a.content, "weight": 1.0, "path": str(a.folder)}]
    run = tmp_path / "run"
    folder = _checkpoint(run, cfg, saved)
    moved = Path(shutil.move(str(a.folder), tmp_path / "moved"))
    cfg = load_config(None, ["--data.path", str(moved)])
    assert check_resumable(folder, 2, cfg, run, data_identity(cfg)) is None
    other = _prepared(tmp_path, _raw(tmp_path / "b", "components/README.md"), tok, "pb")
    shutil.rmtree(moved)
    shutil.copytree(other.folder, moved)  # another preparation at the same path
    with pytest.raises(UserError) as e:
        check_resumable(folder, 2, cfg, run, data_identity(cfg))
    line = str(e.value)
    assert (
        f"'{moved}' holds other data than the run trained on" in line
        and "--data.accept_change true" in line
    )
    cfg = load_config(None, ["--data.path", str(moved), "--data.accept_change", "true"])
    assert "holds other data" in check_resumable(folder, 2, cfg, run, data_identity(cfg))


def test_a_checkpoint_without_contents_is_compared_by_path_as_before(tmp_path, tok):
    a = _prepared(tmp_path, _raw(tmp_path / "a", "datasets/README.md"), tok, "pa")
    cfg = load_config(None, ["--data.path", str(a.folder)])
    run = tmp_path / "run"
    folder = _checkpoint(run, cfg, None)
    moved = Path(shutil.move(str(a.folder), tmp_path / "moved"))
    cfg = load_config(None, ["--data.path", str(moved)])
    with pytest.raises(UserError, match="data.path: checkpoint .* config"):
        check_resumable(folder, 2, cfg, run, data_identity(cfg))


# How eval.path relates to data.path, each from nothing prepared yet (the first run): (data.path,
# eval.path, what the note says of them or None for no note, the dataset it names), paths in
# `overlap_assets`.
SAME, PART, SHARES = "holds the same data as", "file(s) are all in", "shares 1 of its 2 files with"
OVERLAPS = {
    "the same raw file": ("a/README.md", "a/README.md", SAME, "a/README.md"),
    "a copy of the raw file": ("a/README.md", "copy/README.md", SAME, "a/README.md"),
    "a copy of the raw folder": ("a", "copy", SAME, "a"),
    "a file of the raw folder": ("ab", "a/README.md", PART, "ab"),
    "a folder holding the training file": ("a/README.md", "ab", SHARES, "a/README.md"),
    "the raw file's preparation": ("a", "pa", SAME, "a"),
    "a preparation and its raw file": ("pa", "a/README.md", SAME, "pa"),
    "a copy of the preparation": ("pa", "pa-copy", SAME, "pa"),
    "one dataset of a mixture": ("b/README.md:0.5,a/README.md:0.5", "copy", SAME, "a/README.md"),
    "other data": ("a", "b", None, None),
    "other data, prepared": ("pa", "b/README.md", None, None),
}


@pytest.fixture(scope="module")
def overlap_assets(tmp_path_factory, tok) -> Path:
    """a/README.md, its copy in copy/, ab/ (that file and another), b/ (the other), pa (a/
    prepared, as scripts/prepare_data.py does) and its copy pa-copy."""
    root = tmp_path_factory.mktemp("overlap")
    _raw(root / "a", "datasets/README.md")
    _raw(root / "copy", "datasets/README.md")
    _raw(root / "b", "components/README.md")
    (root / "ab").mkdir()
    shutil.copy(root / "a" / "README.md", root / "ab" / "README.md")
    shutil.copy(root / "b" / "README.md", root / "ab" / "other.md")
    _prepared(root, root / "a", tok, "pa")
    shutil.copytree(root / "pa", root / "pa-copy")
    return root


@pytest.mark.parametrize("case", OVERLAPS, ids=list(OVERLAPS))
def test_eval_data_that_is_training_data_is_named_on_a_first_run(overlap_assets, tmp_path, case):
    """The comparison reads the inputs themselves (a prepared folder's content key and sources,
    raw files by path and by content), so with an empty cache, before any run has prepared
    anything, an eval.path that holds training data is named in one note, and other data is not."""
    from titanlite.preflight import startup_notes

    root = overlap_assets
    train, held, says, named = OVERLAPS[case]
    data = ",".join(str(root / item) for item in train.split(","))
    cache = tmp_path / "empty-cache"
    argv = ["--data.path", data, "--eval.path", str(root / held), "--data.cache_dir", str(cache)]
    notes = [n for n in startup_notes(load_config(None, argv), 1) if "eval.path" in n]
    assert not cache.exists()  # nothing was prepared to decide it
    if says is None:
        assert notes == []
        return
    (note,) = notes
    assert f"{says} data.path '{root / named}'" in note, note
    assert "not a held-out loss" in note, note
