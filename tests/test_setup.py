"""A first set-up talks: each phase (the venv, torch, the rest; the built-in tokenizer and data,
prepared once) says what it does and how long it took, and an installer's own output shows only
when it fails."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from helpers import REPO, load_script

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
