"""One schedule rule (titanlite.config.fields.schedule/due: every N steps, 0: never; the end of a
run a switch of its own) for checkpoints, evals, logs, measured steps and replica checks, and the
keys it renamed (titanlite.config.manager.moved_keys): an old config, flag or config.toml means
what it meant, with one note."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
from helpers import every_section

from titanlite.components.checkpoint.resume import flat_config
from titanlite.config import load_config
from titanlite.config.job_config import JobConfig
from titanlite.config.manager import NOTES_SHOWN_ENV, moved_keys
from titanlite.errors import UserError


def _from_toml(text: str, overrides: list[str]) -> JobConfig:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "old.toml"
        path.write_text(text)
        return load_config(str(path), overrides)


def test_every_moved_key_lands_with_one_note(tmp_path, capsys, monkeypatch):
    """Every entry of the table, in one old file: each new key holds what the old one meant, one
    note names them all, and a file that sets an old and a new key that disagree is refused."""
    monkeypatch.delenv(NOTES_SHOWN_ENV, raising=False)
    defaults = dict(every_section())
    sections: dict[str, list[str]] = {}
    expected = {}
    for old, new in moved_keys().items():
        section, name = old.split(".")
        value = _other_value(defaults, new)
        sections.setdefault(section, []).append(f"{name} = {_toml(value)}")
        expected[new] = value
    text = "\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in sections.items())
    (tmp_path / "old.toml").write_text(text)
    cfg = load_config(str(tmp_path / "old.toml"))
    flat = flat_config(cfg)
    assert {k: flat[k] for k in expected} == expected
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for old, new in moved_keys().items():
        (sec, key), new_sec = old.split("."), new.split(".")[0]
        assert re.search(rf"\[{sec}\] [^;]*\b{key}\b[^;]* -> \[{new_sec}\]", err[0]), old
    (tmp_path / "both.toml").write_text("[debug]\nspike_step = 5\n[faults]\nspike_step = 6\n")
    with pytest.raises(UserError, match="sets both 'debug.spike_step' and 'faults.spike_step'"):
        load_config(str(tmp_path / "both.toml"))
    # an old run folder's switches at their defaults ask for no plugin
    (tmp_path / "quiet.toml").write_text("[debug]\nspike_step = -1\nsync_debug = false\n")
    assert load_config(str(tmp_path / "quiet.toml")).faults is None


def _other_value(defaults: dict, key: str):
    """A value of `key`'s type that is not its default (so a lost mapping shows)."""
    section, name = key.split(".")
    value = getattr(defaults[section], name)
    (f,) = [f for f in fields(defaults[section]) if f.name == name]
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):
        return next(c for c in f.metadata.get("choices", ()) if c != value)
    return [3] if isinstance(value, list) else value + 3


def _toml(value) -> str:
    return (
        ("true" if value else "false") if isinstance(value, bool) else repr(value).replace("'", '"')
    )


def test_every_periodic_key_is_a_schedule_field():
    """The class, from the schema itself: no key keeps an old name, and every field whose doc
    says it acts every N steps is a schedule field (its rule, 0 allowed); none named *_interval
    or *_freq remains."""
    docs = {f"{name}.{f.name}": f for name, s in every_section() for f in fields(s)}
    assert not set(moved_keys()) & set(docs)
    periodic = {k for k, f in docs.items() if "every this many steps" in f.metadata["help"]}
    assert periodic == {
        "eval.every",
        "metrics.log_every",
        "checkpoint.every",
        "diagnostics.every",
        "diagnostics.replica_check_every",
    }
    for key in periodic:
        assert "every this many steps; 0: never" in docs[key].metadata["help"], key
        assert docs[key].metadata["bounds"] == {">=": 0}, key
    assert not [k for k in docs if k.endswith(("_interval", "_freq", ".interval"))]
