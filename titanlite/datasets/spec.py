"""What `data.path` names, checked without torch (the preflight runs this before torchrun starts):
empty (the built-in data), one path, or a mixture `a:0.7,b:0.3`. Each path is a prepared folder
(scripts/prepare_data.py) or raw inputs, which the trainer prepares into its cache on first use,
up to RAW_LIMIT_BYTES (larger inputs are prepared once, with every core, by the script).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from titanlite.config.command_line import mixture_items
from titanlite.datasets.corpus import discover, stdlib_files
from titanlite.datasets.prepared import Prepared, is_prepared
from titanlite.errors import UserError

RAW_LIMIT_BYTES = 2 << 30


def parse_data_path(path: str) -> list[tuple[str, float]]:
    """[(path, weight)]: [] for the built-in data, weights normalised to sum to 1."""
    parts = mixture_items(path)
    if not parts:
        return []
    if len(parts) == 1:
        return [(parts[0][0], 1.0)]
    if any(w is None or w <= 0 for _, w in parts) or any(not name for name, _ in parts):
        raise UserError(
            f"data.path '{path}' lists several datasets; give each a positive weight: 'a:0.7,b:0.3'"
        )
    total = sum(w for _, w in parts)
    return [(name, w / total) for name, w in parts]


def check_data(mode: str, path: str, key: str = "data.path") -> None:
    """Every dataset of data.path (or `key`'s) exists; a prepared one is complete, intact and of
    this mode; raw inputs are of known kinds and small enough to prepare on the fly."""
    for name, _ in parse_data_path(path):
        p = Path(name).expanduser()
        if not p.exists():
            raise UserError(
                f"{key} '{name}' does not exist; point it at a prepared folder, a data file or folder, "
                "or leave it empty for the built-in data"
            )
        if is_prepared(p):
            Prepared(p).check_mode(mode)
            continue
        size = sum(f.stat().st_size for f in discover(p))
        if size > RAW_LIMIT_BYTES:
            raise UserError(
                f"{key} '{name}' holds {size / 2**30:.1f} GiB of raw data; prepare it once with every core "
                f"(./scripts/prepare_data.py --tokenizer TOKENIZER --mode {mode} --out FOLDER {name}) "
                f"and point {key} at FOLDER"
            )


def check_data_files(cfg) -> None:
    """data.path and eval.path (a JobConfig's) name data that exists and fits data.mode."""
    check_data(cfg.data.mode, cfg.data.path)
    e = cfg.eval
    if e.path:
        if len(parse_data_path(e.path)) != 1:
            raise UserError(
                f"eval.path '{e.path}' names several datasets; give one (no mixture weights)"
            )
        check_data(cfg.data.mode, e.path, "eval.path")


def check_data_tokenizer(path: str, tokenizer_path: str) -> None:
    """Prepared datasets were tokenized with the run's tokenizer (the built-in one is trained on
    first use, so the trainer checks that case itself)."""
    from titanlite.datasets.tokenizer import load_tokenizer

    folders = [Path(n).expanduser() for n, _ in parse_data_path(path)]
    prepared = [p for p in folders if is_prepared(p)]
    if prepared and tokenizer_path:
        tok = load_tokenizer(tokenizer_path)
        for p in prepared:
            Prepared(p).check_tokenizer(tok)


def data_identity(cfg, path: str | None = None) -> list[dict] | None:
    """What data.path (or `path`) trains on, by content: [{"content", "weight", "path"}]; None for
    synthetic data, raw inputs or the built-in data (the workers prepare them and know it then)."""
    if cfg.data.mode == "synthetic":
        return None
    out = []
    for name, weight in parse_data_path(cfg.data.path if path is None else path) or [("", 1.0)]:
        folder = Path(name).expanduser()
        if not name or not is_prepared(folder):
            return None
        out.append({"content": Prepared(folder).content, "weight": weight, "path": name})
    return out


def _inputs(cfg, name: str) -> tuple[str | None, list[tuple[str, int]]]:
    """What one dataset of a data path is made of, read from the inputs themselves: a prepared
    folder's content key and the sources its meta.json lists, or raw inputs' files as discovered
    (the built-in data: the stdlib files it prepares), each as (absolute path, bytes)."""
    folder = Path(name).expanduser()
    if name and is_prepared(folder):
        data = Prepared(folder)
        return data.content, [(s["path"], s["bytes"]) for s in data.meta.get("sources", [])]
    if not name:
        built_in = stdlib_files() if cfg.data.mode == "pretrain" else ()
        return None, [(str(f.resolve()), f.stat().st_size) for f in built_in]
    return None, [(str(f.resolve()), f.stat().st_size) for f in discover(folder)]


def _digest(path: str) -> str | None:
    """A file's content hash, None where it is gone (a prepared folder's source may be)."""
    h = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def _shared(ours: list[tuple[str, int]], theirs: list[tuple[str, int]]) -> list[str]:
    """The files of `ours` that are in `theirs`: the same file, or a copy of it (the same bytes,
    not none; only files of equal size are read)."""
    paths = {p for p, _ in theirs}
    by_size: dict[int, list[str]] = {}
    for p, size in theirs:
        by_size.setdefault(size, []).append(p)
    digests: dict[str, str | None] = {}

    def digest(p: str) -> str | None:
        if p not in digests:
            digests[p] = _digest(p)
        return digests[p]

    out = []
    for p, size in ours:
        same = p in paths
        if not same and size and size in by_size and digest(p) is not None:
            same = any(digest(q) == digest(p) for q in by_size[size])
        if same:
            out.append(p)
    return out


def eval_overlap(cfg) -> str | None:
    """The note naming the training data eval.path holds (its eval loss is then no held-out
    loss), else None. Decided from the inputs themselves, prepared or not: a prepared folder's
    content key and sources, raw inputs' files, compared by path and by content."""
    if not cfg.eval.path or cfg.data.mode == "synthetic":
        return None
    key, held = _inputs(cfg, cfg.eval.path)
    for name, _ in parse_data_path(cfg.data.path) or [("", 1.0)]:
        their_key, theirs = _inputs(cfg, name)
        where = f"data.path '{name}'" if name else "the built-in data (data.path empty)"
        same = key is not None and key == their_key
        shared = held if same else _shared(held, theirs)
        if not (same or shared):
            continue
        if same or len(shared) == len(held) == len(theirs):
            what = f"eval.path holds the same data as {where}"
        elif len(shared) == len(held):
            what = f"eval.path's {len(held)} file(s) are all in {where}"
        else:
            files = ", ".join(shared[:3]) + (
                f" and {len(shared) - 3} more" if len(shared) > 3 else ""
            )
            what = f"eval.path shares {len(shared)} of its {len(held)} files with {where} ({files})"
        return (
            f"{what}: its eval loss is not a held-out loss; point eval.path at data the run does "
            "not train on, or use eval.fraction"
        )
    return None
