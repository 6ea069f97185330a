"""A first set-up talks: each phase (the venv, torch, the rest; the built-in tokenizer and data,
prepared once) says what it does and how long it took, and an installer's own output shows only
when it fails."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import HANG_S, REPO, load_script

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


def _smollm2_folder(path, **changed) -> None:
    """What scripts/setup_smollm2.py leaves at --out, as far as its check reads it: config.json
    (with `changed` keys) and a whole model.safetensors."""
    import json

    import torch
    from safetensors.torch import save_file

    setup = load_script("setup_smollm2")
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**setup.SMOLLM2, **changed, "rope_theta": 1e5}))
    save_file({"model.norm.weight": torch.ones(4)}, str(path / "model.safetensors"))


def test_setup_smollm2_keeps_its_folder_and_refuses_any_other(tmp_path, capsys):
    """--out that holds the folder the script makes: said, exit 0 (nothing fetched); one that
    holds anything else (other files, another model: each key of its config changed, the
    config without its whole weights) is refused in one line, exit 2, and left as it was;
    nothing or an empty folder is made."""
    setup = load_script("setup_smollm2")
    ours = tmp_path / "ours"
    _smollm2_folder(ours)
    assert setup.main(["--out", str(ours)]) == 0
    assert capsys.readouterr().out == f"setup_smollm2: {ours} holds SmolLM2-135M-Instruct already\n"
    others = {"other files": tmp_path / "other-files"}
    (others["other files"]).mkdir()
    (others["other files"] / "notes.txt").write_text("mine")
    for key, value in setup.SMOLLM2.items():
        other = 1 + value if isinstance(value, int) and not isinstance(value, bool) else None
        others[key] = tmp_path / f"other-{key}"
        _smollm2_folder(others[key], **{key: other})
    for what, cut in (("no weights", 0), ("cut weights", 40)):
        others[what] = tmp_path / what.replace(" ", "-")
        _smollm2_folder(others[what])
        weights = others[what] / "model.safetensors"
        if cut:
            weights.write_bytes(weights.read_bytes()[:cut])
        else:
            weights.unlink()
    for what, folder in others.items():
        before = sorted((p.name, p.stat().st_size) for p in folder.iterdir())
        capsys.readouterr()
        assert setup.main(["--out", str(folder)]) == 2, what
        err = capsys.readouterr().err
        assert (
            err.startswith(f"setup_smollm2: error: --out '{folder}' ") and err.count("\n") == 1
        ), err
        assert (what in setup.SMOLLM2) == ("holds another model" in err and what in err), err
        assert sorted((p.name, p.stat().st_size) for p in folder.iterdir()) == before, what
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not setup.made_already(empty) and not setup.made_already(tmp_path / "none")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.parametrize("to", ["shell", "group", "shell-then-group"])
def test_a_stop_during_an_install_phase_is_one_line_and_stops_what_it_ran(tmp_path, sig, to):
    """A Ctrl-C or SIGTERM while a phase runs (pip, say): to the shell alone, to its process
    group (a terminal), or the shell first and then its group (`timeout -s INT`, CI systems).
    One line, exit 128 + signal, and the phase's processes (a shell function's children too)
    are gone when the shell has exited."""
    mark = tmp_path / "pid"
    # a phase as titanlite_torch is one: a shell function whose child does the work
    script = (
        'source scripts/env.sh && slow() { echo pip says a lot; sleep 600 & echo $! > "$MARK"; wait; }'
        ' && titanlite_phase "making a thing" slow'
    )
    env = {**os.environ, "TITANLITE_PYTHON": sys.executable, "MARK": str(mark)}
    proc = subprocess.Popen(
        ["bash", "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    while not (mark.is_file() and mark.read_text().strip()):  # the event: the phase's work runs
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    worker = int(mark.read_text())
    if to in ("shell", "shell-then-group"):
        os.kill(proc.pid, sig)
    if to in ("group", "shell-then-group"):
        os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert re.fullmatch(
        rf"titanlite: making a thing \.\.\. stopped by {sig.name} after \d+s; run the same command again to finish the set-up\n",
        err,
    ), err
    assert not _alive(worker)


@pytest.mark.parametrize(
    "variable, value, says",
    [
        ("TITANLITE_PYTHON", "{tmp}/missing/python", "is not a program that can be run"),
        ("TITANLITE_PYTHON", "{tmp}", "is not a program that can be run"),
        ("TITANLITE_PYTHON", "{tmp}/plain-file", "is not a program that can be run"),
        ("TITANLITE_PYTHON", "true", "is not a Python 3.10 or newer"),
        ("TITANLITE_PYTHON", "/bin/sh", "is not a Python 3.10 or newer"),
        ("TITANLITE_VENV", "{tmp}/plain-file", "is a file, not a folder"),
    ],
)
def test_a_wrong_interpreter_or_venv_variable_is_one_line_naming_it(
    tmp_path, variable, value, says
):
    """Each way TITANLITE_PYTHON or TITANLITE_VENV can point at the wrong thing: one line naming
    the variable, what is wrong and the fix, exit 2, nothing installed or written."""
    (tmp_path / "plain-file").write_text("")
    value = value.format(tmp=tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TITANLITE_")}
    env[variable] = value
    proc = subprocess.run(
        ["bash", "-c", "source scripts/env.sh && echo sourced"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.startswith(f"titanlite: error: {variable}={value} {says}; "), proc.stderr
    assert proc.stderr.count("\n") == 1 and f"unset {variable}" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain-file"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_while_env_sh_checks_the_interpreter_is_one_line_not_an_install(tmp_path, sig):
    """A stop that lands while env.sh looks at what an interpreter holds (its check of the
    packages) is one line and 128 + signal, never taken for a missing package."""
    fake = tmp_path / "python"
    # the version check runs the real interpreter; the package check is where the stop lands
    fake.write_text(
        f'#!/bin/sh\ncase "$1" in -c) exec {sys.executable} "$@";; esac\n'
        f"kill -{sig.name[3:]} $PPID\nexit 1\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "TITANLITE_PYTHON": str(fake)}
    proc = subprocess.run(
        ["bash", "-c", "source scripts/env.sh && echo sourced"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=HANG_S,
    )  # fmt: skip
    assert proc.returncode == 128 + sig and proc.stdout == "", proc
    assert proc.stderr == (
        f"titanlite: stopped by {sig.name} while checking what {fake} holds; nothing was changed\n"
    )
