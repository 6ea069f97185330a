"""Reading what a run folder holds: JSONL files of records (metrics, diagnostics, events, eval,
samples) and JSON files (run.json, a checkpoint's state.json). The one reader of them: a file
that cannot be read is one UserError naming it, never a traceback. A JSONL line can only be cut
off at the end of a file, by a run killed while writing (components/run/files.py writes whole
records): readers skip it, or, when a verdict depends on every record, refuse it. Also the number
formats the reports of them share (the console line, the run comparison, the scripts' tables)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python < 3.11
    import tomli as tomllib

from titanlite.errors import UserError


def read_records(path: Path, cut_off: str = "skip") -> list[dict]:
    """The records of a JSONL file (none if it does not exist). A last line cut off is skipped
    (`cut_off = "skip"`) or one UserError ("refuse"); a bad line elsewhere is one UserError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is unreadable ({e})") from None
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if isinstance(rec, dict):
            out.append(rec)
            continue
        if i == len(lines) and not text.endswith("\n"):
            if cut_off == "skip":
                break
            raise UserError(
                f"{path}: its last line ({i}) is cut off (was the run killed while writing?); "
                "delete that line to use the records before it"
            )
        raise UserError(f"{path}: line {i} is not a JSON record; the file is damaged")
    return out


def read_json(path: Path, what: str = "") -> dict[str, Any]:
    """A JSON object file (run.json, state.json, config.json), or one UserError naming it and
    `what` it should be."""
    hint = f"; {what}" if what else ""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} is missing{hint}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}){hint}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a JSON {type(data).__name__}, not an object{hint}")
    return data


def read_toml(path: Path, what: str = "") -> dict[str, Any]:
    """A TOML file (a run folder's config.toml), or one UserError naming it and `what` it should be."""
    hint = f"; {what}" if what else ""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} is missing{hint}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}){hint}") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"{path} is not valid TOML ({e}){hint}") from None


REHEARSAL_FILE = "rehearsal.json"  # a rehearsal's report, and the mark that its folder is one
# What a folder given to a tool as a run folder holds (folder_kind), each kind in words.
RUN_FOLDER_KINDS = {
    "run": "a training run's folder",
    "no steps": "the folder of a training run that logged no step (it stopped before its first log step)",
    "rehearsal": f"a rehearsal's folder: one rank rehearsed on a fake process group and trained no real step (its figures: {REHEARSAL_FILE})",
}


def folder_kind(path: Path) -> str:
    """What `path` (an existing folder) holds, as a key of RUN_FOLDER_KINDS; a folder that is no
    run's is one UserError. The one reader of that for every tool given a run folder (the
    comparison, inspect_step, the checkpoint reader): each says what kind of folder it was given
    where it cannot use it."""
    for name in ("config.toml", "run.json"):
        if not (path / name).is_file():
            raise UserError(
                f"{path} has no {name}, so it is not a titanlite run folder; give "
                "<dump_folder>/<run_name> (outputs/<run> by default)"
            )
    if (path / REHEARSAL_FILE).is_file():
        return "rehearsal"
    logged = any("step" in r for r in read_records(path / "metrics.jsonl"))
    return "run" if logged else "no steps"


def metrics_rows(path: Path, logged: bool = False) -> list[dict]:
    """metrics.jsonl's rows, a row per step (titanlite.components.step_window); `logged`: the log
    steps' only, the rows that carry the window's figures (throughput, memory, MFU, ETA). A row
    without "row" (written before rows per step) is a log step's."""
    rows = read_records(path)
    return [r for r in rows if r.get("row", "log") == "log"] if logged else rows


def fmt(value: Any, spec: str) -> str:
    """`format(value, spec)`, or "-" for a missing value (a skipped step, an empty rank)."""
    return "-" if value is None else format(value, spec)


def format_duration(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
