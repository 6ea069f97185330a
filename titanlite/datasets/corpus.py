"""Where text comes from: the running interpreter's standard library, or the user's files.

The stdlib is real text that exists on every machine with Python, so the default data needs no
download. For SFT it also yields (signature + docstring -> body) pairs whose lengths vary a lot,
so the number of valid tokens really differs between ranks.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import sys
import sysconfig
import textwrap
from pathlib import Path

from titanlite.datasets.chat import check_messages
from titanlite.errors import UserError

_SKIP_TOP = {"site-packages", "test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip"}


@functools.lru_cache(maxsize=1)
def stdlib_files() -> tuple[Path, ...]:
    """The stdlib's .py files (tests, GUI and vendored code left out), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        top = path.relative_to(root).parts[0]
        if top in _SKIP_TOP or top.startswith("config-") or "__pycache__" in path.parts:
            continue
        files.append(path)
    if not files:
        raise UserError(f"no stdlib sources under {root}; set data.path to your own data")
    return tuple(files)


@functools.lru_cache(maxsize=1)
def corpus_fingerprint() -> str:
    """Changes when the interpreter's stdlib does (names and sizes of the files)."""
    h = hashlib.sha256(sys.version.encode())
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in stdlib_files():
        h.update(f"{f.relative_to(root)}:{f.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


def user_files(path: str) -> list[Path]:
    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    else:
        files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".jsonl") and f.is_file())
    if not files:
        raise UserError(f"data.path '{path}' holds no .txt or .jsonl file; add some or fix the path")
    for f in files:
        if f.suffix not in (".txt", ".jsonl"):
            raise UserError(f"data file '{f}' is neither .txt nor .jsonl; convert it or remove it")
    return files


def files_fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def read_jsonl(path: Path) -> list[dict]:
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"data file '{path}' line {lineno} is not valid JSON ({e.msg}); fix or remove that line"
                ) from None
            if not isinstance(rec, dict):
                raise UserError(
                    f"data file '{path}' line {lineno} is not a JSON object; each line must be {{...}}"
                )
            records.append(rec)
    return records


def pretrain_documents(path: str) -> list[str]:
    """Documents for pretraining: a .txt file is one document, a .jsonl line's "text" is one."""
    if not path:
        return [f.read_text(encoding="utf-8", errors="replace") for f in stdlib_files()]
    docs = []
    for f in user_files(path):
        if f.suffix == ".txt":
            docs.append(f.read_text(encoding="utf-8", errors="replace"))
            continue
        for i, rec in enumerate(read_jsonl(f), 1):
            if not isinstance(rec.get("text"), str):
                raise UserError(
                    f"data file '{f}' record {i} has no string field \"text\"; pretraining jsonl needs one"
                )
            docs.append(rec["text"])
    return docs


def sft_records_from_files(path: str) -> list[dict]:
    """SFT records, each either chat (`messages`: role/content dicts) or alpaca (instruction,
    optional input, output)."""
    records = []
    for f in user_files(path):
        if f.suffix != ".jsonl":
            raise UserError(f"SFT data file '{f}' must be .jsonl of chat or alpaca records")
        for i, rec in enumerate(read_jsonl(f), 1):
            if "messages" in rec:
                records.append(
                    {"messages": check_messages(rec["messages"], f"SFT data file '{f}' record {i}")}
                )
                continue
            for key in ("instruction", "output"):
                if not isinstance(rec.get(key), str):
                    raise UserError(
                        f"SFT data file '{f}' record {i} has no string field \"{key}\"; records need "
                        '"messages" (chat) or instruction, input (optional) and output (alpaca)'
                    )
            records.append(
                {
                    "instruction": rec["instruction"],
                    "input": str(rec.get("input", "")),
                    "output": rec["output"],
                }
            )
    if not records:
        raise UserError(f"SFT data '{path}' has no records; add some jsonl lines")
    return records


def stdlib_sft_records(max_output_chars: int = 3000) -> list[dict]:
    """One record per documented stdlib function: signature + docstring -> body."""
    root = Path(sysconfig.get_paths()["stdlib"])
    records = []
    for f in stdlib_files():
        source = f.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        lines = source.splitlines()
        module = ".".join(f.relative_to(root).with_suffix("").parts)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if len(node.body) < 2 or ast.get_docstring(node) is None:
                continue
            doc_end = node.body[0].end_lineno
            func = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            split = doc_end - node.lineno + 1
            func_lines = func.splitlines()
            head, body = "\n".join(func_lines[:split]), "\n".join(func_lines[split:])
            if not body.strip() or len(body) > max_output_chars:
                continue
            records.append(
                {
                    "instruction": f"Write the body of `{node.name}` from the Python module `{module}`.",
                    "input": head,
                    "output": body,
                }
            )
    return records
