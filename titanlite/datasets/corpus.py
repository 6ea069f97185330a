"""Where text comes from: the running interpreter's standard library, or the user's files.

The stdlib is real text that exists on every machine with Python, so the default data needs no
download. For SFT it also yields (signature + docstring -> body) pairs whose lengths vary a lot,
so the number of valid tokens really differs between ranks.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import sys
import sysconfig
import textwrap
from pathlib import Path

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


def source_name(file: str) -> str:
    """A source file as people name it: "stdlib:json.decoder" for the built-in data, else the path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    path = Path(file)
    if path.suffix == ".py" and path.is_relative_to(root):
        return "stdlib:" + ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    return file


@functools.lru_cache(maxsize=1)
def corpus_fingerprint() -> str:
    """Changes when the interpreter's stdlib does (names and sizes of the files)."""
    h = hashlib.sha256(sys.version.encode())
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in stdlib_files():
        h.update(f"{f.relative_to(root)}:{f.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


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
