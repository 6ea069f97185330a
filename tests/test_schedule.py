"""One schedule rule (titanlite.config.fields.schedule/due: every N steps, 0: never; the end of a
run a switch of its own) for checkpoints, evals, logs, measured steps and replica checks, and the
keys it renamed (titanlite.config.moved): an old config, flag, config.toml or checkpoint state
means what it meant, with one note, and a resume never reports a moved key as changed."""

from __future__ import annotations

import re
from dataclasses import fields
from types import SimpleNamespace

import pytest
from helpers import every_section
from hypothesis import given, settings
from hypothesis import strategies as st

from titanlite.components.checkpoint.checkpointer import Checkpointer
from titanlite.components.checkpoint.resume import flat_config, resume_changes
from titanlite.components.evaluate import Evaluator
from titanlite.config import load_config
from titanlite.config.job_config import JobConfig
from titanlite.config.manager import NOTES_SHOWN_ENV
from titanlite.config.moved import MOVED_KEYS, Split, new_values
from titanlite.diagnostics.component import Diagnostics
from titanlite.diagnostics.replicas import ReplicaCheck
from titanlite.errors import UserError

# What each periodic action did under its old key, written out once as the reference.
OLD_RULES = {
    "checkpoint.interval": lambda step, n, last: n > 0 and (step % n == 0 or step == last),
    "eval.interval": lambda step, n, last: step == last or (n > 0 and step % n == 0),
    "diagnostics.interval": lambda step, n, last, first=0: step <= first or step % n == 0,
    "diagnostics.replica_check_interval": lambda step, n, last: n > 0 and step % n == 0,
}


def _due(key: str, cfg: JobConfig, step: int) -> bool:
    """The new code's decision for the action `key` named, at `step` of cfg."""
    if key == "checkpoint.interval":
        return Checkpointer.due(SimpleNamespace(cfg=cfg), step)
    if key == "eval.interval":
        return Evaluator.due(SimpleNamespace(cfg=cfg), step)
    if key == "diagnostics.interval":
        return Diagnostics.is_measured(SimpleNamespace(cfg=cfg.diagnostics), step)
    check = SimpleNamespace(enabled=cfg.diagnostics.replica_check_every > 0)
    check.every = cfg.diagnostics.replica_check_every
    return ReplicaCheck.due(check, step)


@settings(derandomize=True, database=None, max_examples=150, deadline=None)
@given(
    key=st.sampled_from(sorted(OLD_RULES)),
    n=st.integers(0, 12),
    first=st.integers(0, 6),
    last=st.integers(1, 40),
    as_flag=st.booleans(),
)
def test_an_old_schedule_key_saves_evaluates_and_measures_at_the_same_steps(key, n, first, last, as_flag):
    """Any old value, from a file or a flag: the same steps act as under the old rule."""
    if key == "diagnostics.interval":
        n = max(n, 1)  # the old key refused 0
    section, name = key.split(".")
    steps = ["--training.steps", str(last), "--diagnostics.measure_first", str(first)]
    if as_flag:
        cfg = load_config(None, [*steps, f"--{key}", str(n)])
    else:
        cfg = _from_toml(f"[{section}]\n{name} = {n}\n", steps)
    old = OLD_RULES[key]
    for step in range(1, last + 1):
        was = old(step, n, last, first) if key == "diagnostics.interval" else old(step, n, last)
        assert _due(key, cfg, step) == was, (key, n, step, last)


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
    for old, entry in MOVED_KEYS.items():
        section, name = old.split(".")
        new = next(iter(new_values(old, 1 if isinstance(entry, Split) else None)))
        value = _other_value(defaults, new)
        if isinstance(entry, Split):
            value = 7
        sections.setdefault(section, []).append(f"{name} = {_toml(value)}")
        expected.update(new_values(old, value))
    text = "\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in sections.items())
    (tmp_path / "old.toml").write_text(text)
    cfg = load_config(str(tmp_path / "old.toml"))
    flat = flat_config(cfg)
    assert {k: flat[k] for k in expected} == expected
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for old in MOVED_KEYS:  # by name, or among the keys that moved section under their names
        (sec, key), new = old.split("."), str(MOVED_KEYS[old])
        group = rf"\[{sec}\] [^;]*\b{key}\b[^;]* -> \[{new.split('.')[0]}\]"
        assert f"{old} -> " in err[0] or re.search(group, err[0]), old
    assert "checkpoint.interval -> checkpoint.every + checkpoint.at_end" in err[0]
    (tmp_path / "both.toml").write_text("[checkpoint]\ninterval = 5\nat_end = false\n")
    with pytest.raises(UserError, match="sets both 'checkpoint.interval' and 'checkpoint.at_end'"):
        load_config(str(tmp_path / "both.toml"))
    with pytest.raises(UserError, match="checkpoint.interval"):
        load_config(None, ["--checkpoint.interval", "often"])


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
    return ("true" if value else "false") if isinstance(value, bool) else repr(value).replace("'", '"')


def test_a_resume_compares_old_settings_by_their_new_names(monkeypatch):
    """A checkpoint whose state.json kept the old names: the same settings report nothing; a
    changed one is reported under its new name; a split one by each key it changed."""
    monkeypatch.setenv(NOTES_SHOWN_ENV, "1")
    now = load_config(
        None, ["--checkpoint.every", "5", "--checkpoint.at_end", "true", "--faults.same_data", "false"]
    )
    before = flat_config(now)
    for old in MOVED_KEYS:
        for new in new_values(old, 5 if isinstance(MOVED_KEYS[old], Split) else 0):
            value = before.pop(new)
        before[old] = 5 if isinstance(MOVED_KEYS[old], Split) else value
    state = {"config": before, "step": 4}
    assert resume_changes(state, now) == []
    later = load_config(
        None, ["--checkpoint.every", "10", "--checkpoint.at_end", "true", "--metrics.log_every", "1"]
    )
    assert resume_changes(state, later) == [
        "resume: metrics.log_every was 10, now 1: applied from step 5",
        "resume: checkpoint.every was 5, now 10: applied from step 5",
    ]


def test_every_periodic_key_is_a_schedule_field():
    """The class, from the schema itself: no key keeps an old name, and every field whose doc
    says it acts every N steps is a schedule field (its rule, 0 allowed); none named *_interval
    or *_freq remains."""
    docs = {f"{name}.{f.name}": f for name, s in every_section() for f in fields(s)}
    assert not set(MOVED_KEYS) & set(docs)
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
