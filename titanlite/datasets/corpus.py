"""Where text comes from: the interpreter's standard library (real text on every machine, no
download), or the user's files of SUFFIXES' kinds. A piece, the unit of reading and of memory,
is a byte range of a large jsonl (a line belongs to the range its first byte is in), one row
group of a parquet file, or one whole file; every document keeps its file and row.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import json
import os
import sys
import sysconfig
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titanlite.datasets.records import SFT_COLUMNS, sft_record
from titanlite.errors import UserError, first_line

STDLIB = Path(sysconfig.get_paths()["stdlib"])
_SKIP_TOP = {"site-packages", "test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip"}


def _module(path: Path) -> str:
    """A stdlib file's dotted module name."""
    return ".".join(path.relative_to(STDLIB).with_suffix("").parts)


@functools.lru_cache(maxsize=1)
def stdlib_files() -> tuple[Path, ...]:
    """The stdlib's .py files (tests, GUI and vendored code left out), in a fixed order."""
    files = []
    for path in sorted(STDLIB.rglob("*.py")):
        top = path.relative_to(STDLIB).parts[0]
        if top in _SKIP_TOP or top.startswith("config-") or "__pycache__" in path.parts:
            continue
        files.append(path)
    if not files:
        raise UserError(f"no stdlib sources under {STDLIB}; set data.path to your own data")
    return tuple(files)


def source_name(file: str) -> str:
    """A source file as people name it: "stdlib:json.decoder" for the built-in data, else the path."""
    path = Path(file)
    if path.suffix == ".py" and path.is_relative_to(STDLIB):
        return "stdlib:" + _module(path).removesuffix(".__init__")
    return file


@functools.lru_cache(maxsize=1)
def corpus_fingerprint() -> str:
    """Changes when the interpreter's stdlib does (names and sizes of the files)."""
    h = hashlib.sha256(sys.version.encode())
    for f in stdlib_files():
        h.update(f"{f.relative_to(STDLIB)}:{f.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def stdlib_sft_records(max_output_chars: int = 3000) -> list[dict]:
    """One record per documented stdlib function: signature + docstring -> body."""
    records = []
    for f in stdlib_files():
        source = f.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        lines, module = source.splitlines(), _module(f)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if len(node.body) < 2 or ast.get_docstring(node) is None:
                continue
            func = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])).splitlines()
            split = node.body[0].end_lineno - node.lineno + 1  # the signature and docstring
            head, body = "\n".join(func[:split]), "\n".join(func[split:])
            if body.strip() and len(body) <= max_output_chars:
                what = f"Write the body of `{node.name}` from the Python module `{module}`."
                records.append({"instruction": what, "input": head, "output": body})
    return records


SUFFIXES = {
    ".txt": "txt",
    ".md": "txt",  # Markdown is plain text
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl.gz",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
KNOWN = ", ".join(SUFFIXES)


def kind_of(path: Path, default: str | None = None) -> str | None:
    """The kind a file's name says; `default` for others (the built-in data's .py files: "txt")."""
    return next((kind for end, kind in SUFFIXES.items() if path.name.endswith(end)), default)


def _arrow_order(folder: Path, files: list[Path]) -> list[Path]:
    """A `save_to_disk` folder lists its files in state.json; follow that order when present."""
    try:
        state = json.loads((folder / "state.json").read_text())
        names = [d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return files
    listed = [folder / n for n in names if (folder / n) in set(files)]
    return listed + [f for f in files if f not in set(listed)]


def discover(path: str | Path, note: Callable[[str], None] | None = None) -> list[Path]:
    """The input files a path names, in a fixed order: the file, or every file of a known kind
    under a folder but hidden and cache-* ones (`note` hears how many others there were)."""
    p = Path(path).expanduser()
    if p.is_file():
        if kind_of(p) is None:
            raise UserError(f"data file '{p}' is not one of {KNOWN}; convert it or remove it")
        return [p]
    if not p.is_dir():
        raise UserError(f"data path '{p}' does not exist; point it at a file or folder of {KNOWN}")
    files, other = [], Counter()
    for f in sorted(p.rglob("*")):
        hidden = any(part.startswith(".") for part in f.relative_to(p).parts)
        if hidden or f.name.startswith("cache-") or not f.is_file():
            continue
        if kind_of(f) is not None:
            files.append(f)
        else:
            other[f.suffix or "(no suffix)"] += 1
    if other and note is not None:
        kinds = ", ".join(f"{n} {suffix}" for suffix, n in other.most_common())
        note(
            f"data path '{p}': {sum(other.values())} file(s) of no readable kind left out ({kinds}); read: {KNOWN}"
        )
    by_folder: dict[Path, list[Path]] = {}
    for f in files:
        by_folder.setdefault(f.parent, []).append(f)
    files = [g for folder, group in by_folder.items() for g in _arrow_order(folder, group)]
    if not files:
        raise UserError(f"data path '{p}' holds no {KNOWN} file; add some or fix the path")
    return files


@dataclass(frozen=True)
class Piece:
    source: int  # index into the list of input files
    path: str
    kind: str
    start: int = 0  # jsonl: byte range; parquet: row group (start only)
    stop: int = -1
    nbytes: int = 0  # about how much text it holds (planning and progress)


def plan_pieces(files: list[Path], piece_bytes: int) -> list[Piece]:
    """Every input file cut into pieces of about `piece_bytes`, in input order."""
    pieces = []
    for i, f in enumerate(files):
        kind, size = kind_of(f, "txt"), f.stat().st_size
        if kind == "jsonl" and size > piece_bytes:
            for start in range(0, size, piece_bytes):
                stop = min(start + piece_bytes, size)
                pieces.append(Piece(i, str(f), kind, start, stop, stop - start))
        elif kind == "parquet":
            meta = _parquet(f).metadata
            for g in range(meta.num_row_groups):
                nbytes = meta.row_group(g).total_byte_size
                pieces.append(Piece(i, str(f), kind, g, g + 1, nbytes))
        else:
            pieces.append(Piece(i, str(f), kind, 0, -1, size))
    return pieces


def _parquet(path: Path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise UserError(
            f"data file '{path}' is not a readable parquet file ({first_line(e)})"
        ) from None


def _lines(piece: Piece) -> Iterator[tuple[int, bytes, int]]:
    """(row within the piece, line, byte offset of the line) of a jsonl or jsonl.gz piece."""
    opener = gzip.open if piece.kind == "jsonl.gz" else open
    try:
        with opener(piece.path, "rb") as fh:
            stop = piece.stop if piece.stop >= 0 else float("inf")
            pos = piece.start
            if pos > 0:  # the line holding byte start-1 belongs to the previous piece
                fh.seek(pos - 1)
                pos += len(fh.readline()) - 1
            for row, line in enumerate(fh):
                if pos >= stop:
                    break
                yield row, line, pos
                pos += len(line)
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise UserError(
            f"data file '{piece.path}' cannot be read ({first_line(e)}); replace it"
        ) from None


def _arrow_batches(piece: Piece, columns: list[str]) -> Iterator[tuple[int, list[dict]]]:
    """(first row, rows as dicts) per record batch of a parquet row group or an arrow file."""
    import pyarrow as pa

    try:
        if piece.kind == "parquet":
            pf = _parquet(Path(piece.path))
            present = [c for c in columns if c in pf.schema_arrow.names]
            batches = pf.read_row_group(piece.start, columns=present).to_batches()
        else:
            source = pa.memory_map(piece.path)
            try:
                batches = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        row = 0
        for batch in batches:
            names = [c for c in columns if c in batch.schema.names]
            rows = batch.select(names).to_pylist() if names else [{}] * batch.num_rows
            yield row, rows
            row += len(rows)
    except UserError:
        raise
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise UserError(
            f"data file '{piece.path}' cannot be read ({first_line(e)}); replace it"
        ) from None


def read_piece(piece: Piece, mode: str, text_field: str) -> Iterator[tuple[int, Any]]:
    """(row within the piece, document): text for pretraining, a checked record for SFT, None for
    a blank jsonl line (which counts: rows are line numbers)."""
    if piece.kind == "txt":
        if mode == "sft":
            raise UserError(
                f"SFT data file '{piece.path}' is .txt; SFT needs records (jsonl, parquet or arrow)"
            )
        try:
            text = Path(piece.path).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise UserError(
                f"data file '{piece.path}' cannot be read ({e.strerror}); fix or remove it"
            ) from None
        yield 0, text
    elif piece.kind in ("jsonl", "jsonl.gz"):
        for row, line, offset in _lines(piece):
            if not line.strip():
                yield row, None
                continue
            where = functools.partial(_where_line, piece, offset, row)
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise UserError(
                    f"data file '{piece.path}' {where()} is not valid JSON ({first_line(e)}); fix or remove that line"
                ) from None
            yield row, _document(rec, piece, mode, text_field, where)
    else:
        columns = list(SFT_COLUMNS) if mode == "sft" else [text_field]
        for first, batch in _arrow_batches(piece, columns):
            for row, rec in enumerate(batch, first):
                where = functools.partial(_where_row, piece, row)
                yield row, _document(rec, piece, mode, text_field, where)


def _where_line(piece: Piece, offset: int, row: int) -> str:
    """A jsonl line's 1-based number (error messages only: reads the file up to it)."""
    if piece.kind == "jsonl.gz":
        return f"line {row + 1}"
    with open(piece.path, "rb") as fh:
        line = fh.read(offset).count(b"\n") + 1
    return f"line {line}"


def _where_row(piece: Piece, row: int) -> str:
    if piece.kind == "parquet":  # rows of the earlier row groups come first
        meta = _parquet(Path(piece.path)).metadata
        row += sum(meta.row_group(g).num_rows for g in range(piece.start))
    return f"row {row}"


def _document(rec: Any, piece: Piece, mode: str, text_field: str, where) -> Any:
    if mode == "sft":
        return sft_record(rec, f"SFT data file '{piece.path}' {where()}")
    text = rec.get(text_field) if isinstance(rec, dict) else None
    if not isinstance(text, str):
        raise UserError(
            f"data file '{piece.path}' {where()} has no string field \"{text_field}\"; set "
            f"data.text_field (prepare_data.py --text-field) to the field that holds the text"
        )
    return text


def files_fingerprint(files: list[Path]) -> list[dict]:
    """What identifies the inputs: path, size and modification time of every file."""
    stats = [(Path(f).resolve(), os.stat(f)) for f in files]
    return [{"path": str(p), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns} for p, st in stats]
