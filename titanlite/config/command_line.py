"""The command line's words, read in one place: the config file (DEFAULT_CONFIG when none is
named), `--rehearse W` (--rehearsal.world W) and the `--section.key value` overrides.

A relative path, on the command line or in a config, means what the user typed: it is read from
the caller's folder (run_train.sh passes it; workers get it in CALLER_ENV), and `resolve_paths`
makes it absolute so every later reader names the same file."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from titanlite.config.fields import whole_number
from titanlite.config.job_config import REHEARSAL_WORLD_MAX, JobConfig, sections
from titanlite.config.manager import HELP_FLAGS, check_values, load_config, words
from titanlite.errors import UserError

ROOT = Path(__file__).resolve().parents[2]  # the checkout
DEFAULT_CONFIG = "train_configs/debug_model.toml"  # of the checkout: the config when none is named
CALLER_ENV = "TITANLITE_CALLER_CWD"
# one dataset of a mixture: a path, then its weight after the last colon
_WEIGHTED = re.compile(r"^(.*):([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")


def wants_help(argv: list[str]) -> bool:
    """-h or --help in a flag's place (not as another flag's value)."""
    i = 0
    while i < len(argv):
        if argv[i] in HELP_FLAGS:
            return True
        i += 1 if "=" in argv[i] or not argv[i].startswith("--") else 2
    return False


def _config_file(pairs: list[tuple[str, str | None]]) -> str | None:
    files = [v for n, v in pairs if n == "config"]
    if len(files) > 1:
        raise UserError(
            f"--config is given {len(files)} times ({', '.join(repr(f) for f in files)}); pass one file"
        )
    if files and not (files[0] or "").strip():
        raise UserError(
            "--config is empty; pass a .toml file, or leave --config out for the default config"
        )
    return resolved(files[0]) if files else None


def launcher_words(argv: list[str]) -> list[str]:
    """The launcher's words as the workers read them: `--config FILE` first (resolved, or the
    default), `--rehearse W` as `--rehearsal.world W`, the overrides as typed."""
    pairs = words(argv)
    path = _config_file(pairs)
    rehearse = [n for n, _ in pairs if n in ("rehearse", "rehearsal.world")]
    if len(rehearse) > 1:
        raise UserError(
            "--rehearse (or --rehearsal.world) is given more than once; give one --rehearse W"
        )
    out = ["--config", path if path is not None else str(ROOT / DEFAULT_CONFIG)]
    for name, value in pairs:
        if name in HELP_FLAGS or name == "config":
            continue
        if name == "rehearse":
            world = (value or "").strip()
            if not whole_number(world) or not 1 <= int(world) <= REHEARSAL_WORLD_MAX:
                raise UserError(
                    f"--rehearse {value!r}: give the number of ranks to rehearse, a whole number from 1 to "
                    f"{REHEARSAL_WORLD_MAX:,} (or leave --rehearse out to train)"
                )
            out += ["--rehearsal.world", str(int(world))]
        else:
            out += [f"--{name}", value or ""]
    return out


def parse_args(argv: list[str], notes: list[str] | None = None) -> tuple[JobConfig, str | None]:
    """The config and its file from `--config FILE` (at most one) plus overrides, in any order;
    relative paths are the caller's; `notes` as load_config's."""
    pairs = words(argv)
    path = _config_file(pairs)
    given = [(n, v or "") for n, v in pairs if n != "config" and n not in HELP_FLAGS]
    overrides = [w for n, v in given for w in (f"--{n}", v)]
    for name, times in Counter(n for n, _ in given).items():  # the last applies: said, not silent
        if times > 1 and notes is not None:
            last = next(v for n, v in reversed(given) if n == name)
            notes.append(
                f"--{name} is given {times} times on the command line: the last, {last!r}, applies"
            )
    cfg = load_config(path, overrides, notes)
    resolve_paths(cfg)
    return cfg, path


def first_look(argv: list[str]) -> JobConfig:
    """The launcher's words as it checks them before importing torch, so that a typo is answered
    in a moment: run_train.sh's `--caller-cwd DIR` (relative paths mean that folder), the config
    file, every key's name, type, choices and bounds, `--rehearse W`. Raises UserError; its
    notes are left for the full check (titanlite.preflight), which says them once."""
    if argv[:1] == ["--caller-cwd"]:
        if len(argv) < 2 or not Path(argv[1]).is_dir():
            raise UserError(
                f"--caller-cwd needs the folder the command was run in, got {argv[1:2]}"
            )
        os.environ[CALLER_ENV] = str(Path(argv[1]).absolute())  # as the launcher sets it
        argv = argv[2:]
    cfg, _ = parse_args(launcher_words(argv), notes=[])
    check_values(cfg)
    return cfg


def resolved(value: str) -> str:
    """`value` as read from the caller's folder: unchanged when empty, absolute, under ~ or when
    the caller's folder is the working folder; else joined to the caller's folder."""
    if not value.strip() or Path(value).expanduser().is_absolute():
        return value
    caller = Path(os.environ.get(CALLER_ENV) or os.getcwd())  # where the user ran the command
    if caller.resolve() == Path.cwd().resolve():
        return value
    return str(caller / value)


def _exists(name: str) -> bool:
    """Whether `name`, read from the caller's folder, is a file or folder."""
    return bool(name.strip()) and Path(resolved(name)).expanduser().exists()


def mixture_items(path: str) -> list[tuple[str, float | None]]:
    """data.path's datasets as typed: [(path, weight or None)], [] for an empty path. A path that
    exists as given is a path, whatever commas and colons its name holds; so is each item of a
    mixture (`a:0.7,b:0.3`): the longest run of comma-separated words that names an existing path
    (alone, or before its weight) is one item, else one word is."""
    if not path.strip():
        return []
    words = path.split(",")
    out: list[tuple[str, float | None]] = []
    i = 0
    while i < len(words):
        for j in range(len(words), i, -1):
            item = ",".join(words[i:j]).strip()
            m = _WEIGHTED.match(item)
            if _exists(item) or (j == i + 1 and not m):
                out.append((item, None))
                break
            if m and (_exists(m.group(1)) or j == i + 1):
                out.append((m.group(1), float(m.group(2))))
                break
        i = j
    return out


def resolve_paths(cfg: Any, how: Callable[[str], str] = resolved) -> None:
    """Every path field of `cfg` (a JobConfig) as `how` reads it (the caller's folder), in place."""
    for _, section in sections(cfg):
        for f in fields(section):
            kind, value = f.metadata.get("path"), getattr(section, f.name)
            if kind == "file":
                setattr(section, f.name, how(value))
            elif kind == "mixture":
                items = mixture_items(value)
                if any(how(n) != n for n, _ in items):  # else as typed, weights and all
                    joined = ",".join(
                        how(n) + (f":{w!r}" if w is not None else "") for n, w in items
                    )
                    setattr(section, f.name, joined)


def absolute(value: str) -> str:
    """A path as an absolute one, from this process's working folder (empty stays empty)."""
    return str(Path(value).expanduser().absolute()) if value.strip() else value
