"""A first set-up talks: each phase (the venv, torch, the rest; the built-in tokenizer and data,
prepared once) says what it does and how long it took, and an installer's own output shows only
when it fails."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from helpers import REPO

from titanlite.datasets.build import _built_once
from titanlite.errors import UserError
from titanlite.tools.process import phase, quietly


def _env_phase(*command: str) -> subprocess.CompletedProcess:
    """scripts/env.sh's titanlite_phase around `command` (TITANLITE_PYTHON: nothing installed)."""
    script = 'source scripts/env.sh && titanlite_phase "making a thing" "$@"'
    env = {**os.environ, "TITANLITE_PYTHON": sys.executable}
    return subprocess.run(
        ["bash", "-c", script, "phase", *command], cwd=REPO, env=env, capture_output=True, text=True
    )


def test_the_shell_set_up_phases_time_themselves_and_keep_the_noise_back():
    ok = _env_phase("bash", "-c", "echo pip says a lot; echo more >&2")
    assert ok.returncode == 0 and ok.stdout == "", ok
    assert ok.stderr == "titanlite: making a thing ... done in 0s\n", ok.stderr
    bad = _env_phase("bash", "-c", "echo the reason it failed; exit 3")
    assert bad.returncode == 1, bad
    assert bad.stderr.startswith("titanlite: making a thing ... failed after 0s; its output:\n")
    assert "the reason it failed" in bad.stderr


def test_the_python_set_up_phases_do_the_same(capsys):
    with phase("setup", "fetching"):
        quietly([sys.executable, "-c", "print('noise')"], "fetching failed")
    assert capsys.readouterr().err == "setup: fetching ... done in 0s\n"
    failing = [sys.executable, "-c", "print('why'); raise SystemExit(2)"]
    with (
        pytest.raises(
            UserError, match=r"^fetching failed; check the network \(its output is above\)$"
        ),
        phase("setup", "fetching"),
    ):
        quietly(failing, "fetching failed; check the network")
    err = capsys.readouterr().err
    assert err.startswith("setup: fetching ...") and "why" in err and err.endswith(" failed\n"), err


def test_a_cache_file_built_once_says_what_and_how_long(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="titanlite")
    path = tmp_path / "tok.model"
    _built_once(path, lambda: path.write_text("x"), "training the built-in tokenizer")
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == f"training the built-in tokenizer (once, into {tmp_path}) ..."
    assert said[1].startswith("training the built-in tokenizer: done in ") and said[1].endswith("s")
    caplog.clear()
    _built_once(path, lambda: pytest.fail("built twice"), "training the built-in tokenizer")
    assert caplog.records == []  # there already: nothing to say
