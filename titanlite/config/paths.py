"""Paths in a config mean what the user typed: a relative path, on the command line or in a
config file, is read from the folder the command was run in (the caller's folder), though
run_train.sh and the launcher work from the checkout. run_train.sh passes that folder to the
launcher (`--caller-cwd`), which hands it to its workers in CALLER_ENV; any other entry point's
caller is its own working folder.

The config fields that hold paths say so (titanlite.config.fields.opt: path="file" or, for
data.path's mixture 'a:0.7,b:0.3', path="mixture"); `resolve_paths` makes each relative one
absolute when the caller's folder is not the working folder, so every later reader (the
preflight, the workers, the run folder's config.toml) names the same file."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from titanlite.config.job_config import sections

CALLER_ENV = "TITANLITE_CALLER_CWD"
# one dataset of a mixture: a path, then its weight after the last colon
_WEIGHTED = re.compile(r"^(.*):([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")


def caller_folder() -> Path:
    """The folder the user ran the command in."""
    return Path(os.environ.get(CALLER_ENV) or os.getcwd())


def resolved(value: str) -> str:
    """`value` as read from the caller's folder: unchanged when empty, absolute, under ~ or when
    the caller's folder is the working folder; else joined to the caller's folder."""
    if not value.strip() or Path(value).expanduser().is_absolute():
        return value
    caller = caller_folder()
    if caller.resolve() == Path.cwd().resolve():
        return value
    return str(caller / value)


def mixture_items(path: str) -> list[tuple[str, float | None]]:
    """data.path's datasets as typed: [(path, weight or None)], [] for an empty path."""
    if not path.strip():
        return []
    out = []
    for item in path.split(","):
        m = _WEIGHTED.match(item.strip())
        out.append((m.group(1), float(m.group(2))) if m else (item.strip(), None))
    return out


def resolve_paths(cfg: Any, how: Callable[[str], str] = resolved) -> None:
    """Every path field of `cfg` (a JobConfig) as read from the caller's folder (`how` of each
    path), in place."""
    for _, section in sections(cfg):
        for f in fields(section):
            kind, value = f.metadata.get("path"), getattr(section, f.name)
            if kind == "file":
                setattr(section, f.name, how(value))
            elif kind == "mixture":
                items = mixture_items(value)
                if any(how(n) != n for n, _ in items):  # else as typed, weights and all
                    joined = ",".join(how(n) + (f":{w!r}" if w is not None else "") for n, w in items)
                    setattr(section, f.name, joined)


def absolute(value: str) -> str:
    """A path as an absolute one, from this process's working folder (empty stays empty)."""
    return str(Path(value).expanduser().absolute()) if value.strip() else value
