"""Bad, empty or damaged data files and prepared folders, and the data cache."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from faults.fixtures import (
    copy_prepared,
    data,
    edit_meta,
    mounted,
    own_cache,
    prepared,
    truncate,
)
from faults.harness import (
    CKPT,
    REPO,
    Broke,
    Catalogue,
    case,
    expect,
    listing,
    losses,
    refused,
    trains,
    unchanged,
)


# data: raw files, prepared folders, the cache
def _data_arg(file: str, *extra: str) -> Callable[[Catalogue], tuple[str, ...]]:
    return lambda c: ("--data.path", str(data(c) / file), *extra)


trains("data", "good jsonl (baseline)", _data_arg("good.jsonl"))
for _name, _file, _says in (
    ("an empty .jsonl", "empty.jsonl", "empty.jsonl"),
    ("random bytes as .jsonl", "random.jsonl", "line 1"),
    ("a malformed line in the middle of a .jsonl", "malformed.jsonl", "line 14"),
    ("every other line without text", "half.jsonl", "text"),
    ("no line with text", "notext.jsonl", "text"),
    ("parquet with the column content", "content.parquet", "text"),
    ("a .txt of 1 byte", "tiny.txt", "sequences"),
    ("a non-UTF-8 byte in a .jsonl", "nonutf8.jsonl", "line 21"),
):
    case("data", _name)(lambda c, n=_name, f=_file, s=_says: refused(c, n, _data_arg(f)(c), s))
trains("data", "non-UTF-8 bytes in a .txt (decoded leniently)", _data_arg("nonutf8.txt"))


@case("data", "a mixture weight of -1", cheap=True)
def _(c: Catalogue) -> None:
    d = data(c)
    refused(
        c, "mixture -1", ("--data.path", f"{d / 'good.jsonl'}:0.7,{d / 'sft.jsonl'}:-1"), "weight"
    )


@case("data", "a mixture weight abc", cheap=True)
def _(c: Catalogue) -> None:
    d = data(c)
    refused(
        c, "mixture abc", ("--data.path", f"{d / 'good.jsonl'}:0.7,{d / 'sft.jsonl'}:abc"), "abc"
    )


trains("data", "a prepared folder (baseline)", lambda c: ("--data.path", str(prepared(c))))


def _damaged_prepared(
    name: str, damage: Callable[[Path], None], says: str, cheap: bool = True
) -> None:
    @case("data", name, cheap)
    def _(c: Catalogue) -> None:
        folder = copy_prepared(c, re.sub(r"\W+", "_", name))
        damage(folder)
        refused(c, name, ("--data.path", str(folder)), says)


_damaged_prepared(
    "a prepared shard's .tokens cut short",
    lambda f: truncate(f / "shard-00001.tokens", 100),
    "shard-00001",
)
_damaged_prepared(
    "a prepared shard's .tokens deleted",
    lambda f: (f / "shard-00001.tokens").unlink(),
    "shard-00001",
)
_damaged_prepared(
    "meta.json: a shard's token count edited",
    edit_meta(lambda m: m["shards"][0].__setitem__("tokens", m["shards"][0]["tokens"] + 7)),
    "shard-00000",
)
_damaged_prepared(
    "meta.json: dtype and vocabulary edited",
    edit_meta(
        lambda m: (
            m.__setitem__("dtype", "int32"),
            m["tokenizer"].__setitem__("vocab_size", 100000),
        )
    ),
    "",
)
_damaged_prepared(
    "meta.json: only tokenizer.vocab_size edited",
    edit_meta(lambda m: m["tokenizer"].__setitem__("vocab_size", 50000)),
    "vocab_size",
    cheap=False,  # the workers build the tokenizer the folder is compared with
)
_damaged_prepared(
    "meta.json: the tokenizer's fingerprint edited",
    edit_meta(lambda m: m["tokenizer"].__setitem__("fingerprint", "0" * 16)),
    "tokeniz",
    cheap=False,
)
_damaged_prepared(
    "meta.json cut at 300 bytes", lambda f: truncate(f / "meta.json", 300), "meta.json"
)


@case("data", "a prepared offsets.npy value overwritten (unused without document masks)")
def _(c: Catalogue) -> None:
    import numpy as np

    folder = copy_prepared(c, "offsets")
    offsets = np.load(folder / "shard-00000.offsets.npy")
    offsets[3] += 5
    np.save(folder / "shard-00000.offsets.npy", offsets)
    dump = c.dump("offsets")
    expect(c.run(dump, ("--training.steps", "2", "--data.path", str(folder))), 0)
    good = c.dump("offsets-good")
    expect(c.run(good, ("--training.steps", "2", "--data.path", str(prepared(c)))), 0)
    if losses(dump / "run") != losses(good / "run"):
        raise Broke("the losses differ from the undamaged folder's")


@case("data", "the auto-prepared cache with a shard cut short")
def _(c: Catalogue) -> None:
    env = own_cache(c, c.work / "cache-damaged")
    dump = c.dump("cache-damaged")
    expect(c.start(dump, ("--training.steps", "1"), "first", env).finish(), 0)
    shard = next(Path(env["TITANLITE_CACHE"]).glob("prepared-pretrain-*/shard-00000.tokens"))
    truncate(shard, shard.stat().st_size // 2)
    expect(c.start(dump, ("--training.steps", "1"), "second", env).finish(), 2, "prepare it again")
    shutil.rmtree(shard.parent)
    expect(c.start(dump, ("--training.steps", "1"), "third", env).finish(), 0)


trains(
    "data",
    "SFT records (baseline)",
    lambda c: ("--data.mode", "sft", "--data.path", str(data(c) / "sft.jsonl")),
)
trains(
    "data",
    "SFT records whose outputs are all empty",
    lambda c: ("--data.mode", "sft", "--data.path", str(data(c) / "sft_empty.jsonl")),
)
trains(
    "data",
    "SFT records, half the outputs empty",
    lambda c: ("--data.mode", "sft", "--data.path", str(data(c) / "sft_half.jsonl")),
)


@case("data", "the data cache on a full 128 KiB tmpfs")
def _(c: Catalogue) -> None:
    with mounted(c.work / "mnt-cache", "128k") as cache:
        env = own_cache(c, cache)
        dump = c.dump("cache-full")
        expect(c.start(dump, ("--training.steps", "1"), env=env).finish(), 3, "disk full")
        if list(cache.rglob(".shard-*")):
            raise Broke("a partial shard was left")
        unchanged({}, dump)


# what a run trains on, changed under it between a run and its resume
def _resumed_on(name: str, make, change, code: int, says: str) -> None:
    """A 2-step run with a checkpoint on `make(c, work)`'s data path; `change(c, work, path)` (it
    returns the data path to resume with); the same command to step 4 must end `code` (0: it
    resumes; 2: one line holding `says`, the run folder untouched)."""

    @case("data", name)
    def _(c: Catalogue) -> None:
        work, dump = c.dump(name + "-data"), c.dump(name)
        path = make(c, work)
        expect(c.run(dump, ("--training.steps", "2", *CKPT, "--data.path", str(path))), 0)
        path = change(c, work, path)
        before = listing(dump)
        r = c.run(dump, ("--training.steps", "4", *CKPT, "--data.path", str(path)))
        expect(r, code, says)
        if code == 2:
            unchanged(before, dump)


def _raw_folder(c: Catalogue, work: Path) -> Path:
    (work / "raw").mkdir()
    shutil.copy(data(c) / "good.jsonl", work / "raw" / "a.jsonl")
    return work / "raw"


def _add_file(c: Catalogue, work: Path, path: Path) -> Path:
    rows = (data(c) / "good.jsonl").read_text().splitlines()
    (path / "b.jsonl").write_text("\n".join(reversed(rows)) + "\n")
    return path


def _edit_row(c: Catalogue, work: Path, path: Path) -> Path:
    f = path / "a.jsonl"
    rows = f.read_text().splitlines()
    rows[0] = json.dumps({"text": "an edited first record " * 20})
    f.write_text("\n".join(rows) + "\n")
    return path


def _copied_prepared(c: Catalogue, work: Path) -> Path:
    return Path(shutil.copytree(prepared(c), work / "prep"))


def _moved(c: Catalogue, work: Path, path: Path) -> Path:
    return Path(shutil.move(str(path), str(work / "moved-elsewhere")))


def _replaced(c: Catalogue, work: Path, path: Path) -> Path:
    """Another preparation (the same records in reverse order) at the same path."""
    shutil.rmtree(path)
    rows = (data(c) / "good.jsonl").read_text().splitlines()
    (work / "reversed.jsonl").write_text("\n".join(reversed(rows)) + "\n")
    proc = subprocess.run(
        [sys.executable, "scripts/prepare_data.py", "--tokenizer", "builtin", "--out", str(path), "--shard-mb", "0.05", str(work / "reversed.jsonl")],
        cwd=REPO, env=c.env, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"prepare_data.py failed: {proc.stderr[-2000:]}")
    return path


_resumed_on("a raw data folder gained a file before the resume", _raw_folder, _add_file, 2, "data")
_resumed_on("a raw data file edited before the resume", _raw_folder, _edit_row, 2, "data")
_resumed_on(
    "a prepared folder replaced by another before the resume",
    _copied_prepared,
    _replaced,
    2,
    "data",
)
_resumed_on("a prepared folder moved, resumed from its new path", _copied_prepared, _moved, 0, "")


def _gz_cut(c: Catalogue, work: Path) -> Path:
    import gzip

    blob = gzip.compress((data(c) / "good.jsonl").read_bytes())
    (work / "cut.jsonl.gz").write_bytes(blob[: len(blob) // 2])
    return work / "cut.jsonl.gz"


def _garbage_parquet(c: Catalogue, work: Path) -> Path:
    (work / "bad.parquet").write_bytes(b"PAR1" + b"\x00garbage" * 100)
    return work / "bad.parquet"


for _name, _make, _says in (
    ("a .jsonl.gz cut short", _gz_cut, "cut.jsonl.gz"),
    ("a .parquet file of garbage", _garbage_parquet, "bad.parquet"),
):

    @case("data", _name)
    def _(c: Catalogue, name=_name, make=_make, says=_says) -> None:
        work = c.dump(name + "-data")
        refused(c, name, ("--data.path", str(make(c, work)), "--training.steps", "2"), says)


_damaged_prepared(
    "a prepared shard's rows.npy cut short",
    lambda f: truncate(f / "shard-00001.rows.npy", 60),
    "rows.npy",
)
_damaged_prepared(
    "a prepared shard's offsets.npy cut short",
    lambda f: truncate(f / "shard-00001.offsets.npy", 60),
    "offsets.npy",
)
