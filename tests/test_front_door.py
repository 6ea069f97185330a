"""Every argument of every script, and every variable of the launcher's environment, through the
one front door (titanlite.tools.cli): each argument is enumerated from the layer itself and gets
each bad kind that applies to it (text, a fraction, nan, inf, negative, zero, huge, not a
choice, a file where a folder is wanted and the reverse, a read-only folder, a missing path);
each must be refused in one line naming the argument and the value, exit 2, nothing written.
Numbers are also generated (hypothesis, derandomised): a value is taken exactly when it is
finite and within the declared bounds."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO
from hypothesis import given, settings
from hypothesis import strategies as st

import titanlite.tools.paths as paths
from titanlite.components.run import torchrun
from titanlite.errors import UserError
from titanlite.tools.cli import NUMBERS, Arg, Script


def _entries() -> list[Path]:
    """Every script a user runs: each file under scripts/ that runs as a program."""
    return sorted(
        p for p in (REPO / "scripts").rglob("*.py") if 'if __name__ == "__main__":' in p.read_text()
    )


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# scripts/peer/run_torchtitan.py is torchtitan's entry point under torchrun (its arguments are
# torchtitan's own): not one of titanlite's front doors.
NOT_OURS = {"run_torchtitan"}
SCRIPTS: dict[str, Script] = {
    p.stem: _load(p).SCRIPT
    for p in _entries()
    if p.stem not in NOT_OURS and "SCRIPT" in p.read_text()
}


def test_every_script_goes_through_the_front_door():
    missing = [p.name for p in _entries() if p.stem not in NOT_OURS and p.stem not in SCRIPTS]
    assert not missing, f"scripts without a SCRIPT = Script(...): {missing}"
    assert len(SCRIPTS) >= 18
    for name, script in SCRIPTS.items():
        for a in script.args:
            if a.kind in NUMBERS:  # the layer refuses a number without an upper bound when declared
                assert a.at_most is not None or a.below is not None, (name, a.name)


class Assets:
    """Paths of each kind in a temporary folder; `read_only` is a folder this process may not
    write to (made so by the layer's one permission check, which root would pass)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.file = tmp / "a-file.txt"
        self.file.write_text("x")
        self.folder = tmp / "a-folder"
        self.folder.mkdir()
        self.full = tmp / "full"
        self.full.mkdir()
        (self.full / "something").write_text("x")
        self.read_only = tmp / "read-only"
        self.read_only.mkdir()
        self.fifo = tmp / "a-fifo"  # exists, but a reader or writer of it would block
        os.mkfifo(self.fifo)

    def good(self, a: Arg) -> str:
        if a.kind in NUMBERS:
            for v in (a.at_least, None if a.above is None else a.above + 1, 1, 0.5):
                if v is not None:
                    text = str(int(v)) if a.kind == "int" else repr(float(v))
                    try:
                        a.check(text)
                        return text
                    except UserError:
                        continue
            raise AssertionError(f"no good value for {a.name}")
        if a.kind == "choice":
            return a.choices[0]
        if a.kind in ("file", "path"):
            return str(self.file)
        if a.kind == "folder":
            return str(self.folder)
        if a.kind in ("out_folder", "new_folder"):
            return str(self.tmp / "new-out")
        if a.kind == "out_file":
            return str(self.tmp / "out.json")
        return "x"

    def bad(self, a: Arg) -> list[tuple[str, str]]:
        """(kind of mistake, value) for every mistake that applies to `a`."""
        out: list[tuple[str, str]] = []
        if a.kind in NUMBERS:
            out += [
                ("text", "abc"),
                ("nan", "nan"),
                ("inf", "inf"),
                ("-inf", "-inf"),
                ("huge", "1" + "0" * 30),
            ]
            out += [("fraction", "1.5")] if a.kind == "int" else []
            low = a.at_least if a.at_least is not None else a.above
            out += [("negative", "-1")] if low is not None and low >= 0 else []
            out += (
                [("zero", "0")]
                if (a.above is not None and a.above >= 0) or (a.at_least or 0) > 0
                else []
            )
        elif a.kind == "choice":
            out.append(("not a choice", "no-such-choice"))
        elif a.kind == "name":
            out += [("a path", "../escaped"), ("a slash", "a/b"), ("too long", "x" * 300)]
        elif a.kind == "file":
            out += [("a folder", str(self.folder)), ("missing", str(self.tmp / "missing"))]
            out.append(("a fifo", str(self.fifo)))
        elif a.kind == "folder":
            out += [("a file", str(self.file)), ("missing", str(self.tmp / "missing"))]
        elif a.kind == "path":
            out.append(("missing", str(self.tmp / "missing")))
        elif a.kind in ("out_folder", "new_folder"):
            out += [("a file", str(self.file)), ("read-only", str(self.read_only / "out"))]
            out += [("not empty", str(self.full))] if a.kind == "new_folder" else []
        elif a.kind == "out_file":
            out += [("a folder", str(self.folder)), ("read-only", str(self.read_only / "out.json"))]
            out.append(("a fifo", str(self.fifo)))
        return out


def listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def _argv(script: Script, assets: Assets, replace: Arg | None = None, value: str = "") -> list[str]:
    """The required arguments with good values, and `replace` (if any) with `value`."""
    argv: list[str] = []
    for a in script.args:
        if a is not replace and not (a.positional or a.required):
            continue
        given = value if a is replace else assets.good(a)
        values = [given] * (2 if a.nargs == 2 else 1)
        argv += (
            values
            if a.positional
            else [a.flags[-1], *values]
            if a.kind != "switch"
            else [a.flags[-1]]
        )
    return argv


def _never(args) -> int:
    raise AssertionError("the script's body ran")


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_argument_refuses_each_bad_kind_in_one_line(name, tmp_path, monkeypatch, capsys):
    script = SCRIPTS[name]
    assets = Assets(tmp_path)
    monkeypatch.setattr(
        paths, "writable", lambda folder: assets.read_only not in (folder, *folder.parents)
    )
    script.parse(_argv(script, assets))  # the good values pass
    before = listing(tmp_path)
    for a in script.args:
        for mistake, value in assets.bad(a):
            code = script.run(_never, _argv(script, assets, a, value))
            err = capsys.readouterr().err.strip()
            what = f"{name} {a.name} {mistake} ({value[:40]})"
            assert code == 2, what
            assert len(err.splitlines()) == 1 and err.startswith(f"{script.prog}: error: "), (
                what,
                err,
            )
            assert a.name in err and value[:40] in err, (what, err)
    if script.overrides:
        for bad in (["--training.steps", "abc"], ["--no-such-flag", "1"]):
            assert script.run(_never, [*_argv(script, assets), *bad]) == 2, (name, bad)
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and bad[0].lstrip("-").split(".")[0] in err, err
    assert listing(tmp_path) == before, "a refusal wrote something"


NUMBER_ARGS = [
    pytest.param(a, id=f"{name} {a.name}")
    for name, s in sorted(SCRIPTS.items())
    for a in s.args
    if a.kind in NUMBERS
] + [
    pytest.param(a, id=f"environment {a.name}") for a in torchrun.VARS.values() if a.kind in NUMBERS
]


@pytest.mark.parametrize("arg", NUMBER_ARGS)
@settings(derandomize=True, database=None, max_examples=60, deadline=None)
@given(x=st.one_of(st.floats(), st.integers(min_value=-(2**70), max_value=2**70)))
def test_a_number_is_taken_exactly_when_finite_and_in_bounds(arg: Arg, x):
    text = repr(x) if isinstance(x, float) else str(x)
    bounds = [
        (arg.at_least, lambda v, b: v >= b),
        (arg.above, lambda v, b: v > b),
        (arg.at_most, lambda v, b: v <= b),
        (arg.below, lambda v, b: v < b),
    ]
    whole = isinstance(x, int)
    ok = (
        (whole or arg.kind == "float")
        and math.isfinite(x)
        and all(b is None or f(x, b) for b, f in bounds)
    )
    if ok:
        assert arg.check(text) == x
    else:
        with pytest.raises(UserError, match=arg.name):
            arg.check(text)


@pytest.mark.parametrize("name", sorted(torchrun.VARS))
def test_every_launcher_variable_refuses_each_bad_kind(name, tmp_path, monkeypatch):
    a = torchrun.VARS[name]
    assets = Assets(tmp_path)
    monkeypatch.setattr(
        paths, "writable", lambda folder: assets.read_only not in (folder, *folder.parents)
    )
    torchrun.torchrun_args(
        {"NGPU": "0", name: assets.good(a)} if a.kind != "text" else {"NGPU": "0"}
    )
    for mistake, value in assets.bad(a):
        with pytest.raises(UserError, match=name) as e:
            torchrun.torchrun_args({"NGPU": "0", name: value})
        assert value[:40] in str(e.value), (mistake, str(e.value))
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "env, says",
    [
        ({"NNODES": "2"}, "NODE_RANK"),
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK"),
        ({"NNODES": "2", "NODE_RANK": "1"}, "MASTER_ADDR"),
        ({"NODE_RANK": "1"}, "NODE_RANK"),
        (
            {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h", "MAX_RESTARTS": "1"},
            "MAX_RESTARTS",
        ),
        ({"NPROC": "2", "LOG_RANK": "2"}, "LOG_RANK"),
        ({"NPROC": "2", "LOG_RANK": "0,,x"}, "LOG_RANK"),
    ],
)
def test_launcher_variables_that_disagree_are_one_line(env, says):
    with pytest.raises(UserError, match=says):
        torchrun.torchrun_args({"NGPU": "0", **env})


def test_a_master_port_in_use_is_refused_before_torchrun():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(UserError, match=f"MASTER_PORT {port} is in use"):
            torchrun.torchrun_args({"NGPU": "0", "MASTER_PORT": str(port)})
    rdzv, env = torchrun.torchrun_args(
        {"NGPU": "0", "NPROC": "3", "LOG_RANK": "2,0", "MASTER_PORT": str(port)}
    )
    assert (
        rdzv[rdzv.index("--master_port") + 1] == str(port)
        and rdzv[-1] == "0,2"
        and env["OMP_NUM_THREADS"]
    )


def test_a_script_launched_as_a_user_would_refuses_in_one_line(tmp_path):
    """The front door as a process, once: what a user types."""
    proc = subprocess.run(
        [sys.executable, "scripts/compare_runs.py", str(tmp_path), str(tmp_path), "--rtol", "nan"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert (
        proc.returncode == 2
        and proc.stderr
        == "compare_runs: error: --rtol is 'nan'; it must be a finite number > 0 and <= 1\n"
    )
    assert list(tmp_path.iterdir()) == []


_FIRST_LOOK = """
import contextlib, io, json, runpy, sys
out = []
for words in json.loads(sys.argv[1]):
    sys.argv = ["titanlite.launch", "--from-env", "--caller-cwd", sys.argv[2], *words]
    err, code = io.StringIO(), None
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_module("titanlite.launch", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
    out.append([words, code, err.getvalue(), "torch" in sys.modules])
print(json.dumps(out))
"""


def _typos(tmp: Path) -> list[list[str]]:
    """Each section's name misspelt, each key's name misspelt and each typed key given a value
    of another type, a missing config and data file, a bad --rehearse: typed as a user would."""
    from dataclasses import fields

    from titanlite.config import JobConfig
    from titanlite.config.job_config import sections

    cases = [["--config", str(tmp / "missing.toml")], ["--data.path", str(tmp / "missing.txt")]]
    cases += [["--rehearse", "0"], ["--eval.path", str(tmp / "missing.jsonl")], ["steps", "3"]]
    for name, section in sections(JobConfig()):
        cases.append([f"--{name}x.{fields(section)[0].name}", "1"])
        for f in fields(section):
            cases.append([f"--{name}.{f.name}x", "1"])
            value = getattr(section, f.name)
            if isinstance(value, (bool, int, float)) or f.metadata.get("choices"):
                cases.append([f"--{name}.{f.name}", "no-such-value"])
    return cases


def test_a_typo_is_answered_before_torch_is_imported(tmp_path):
    """The launcher as run_train.sh runs it: each mistake (_typos) is one line and exit 2 with
    torch never imported (its answer then takes the interpreter's start, not torch's import:
    scripts/bench_refusal.py times it). One process runs every case, the module's top anew each
    time; NPROC is bad, so a case the first look let through would stop at the launcher's check
    of it, not train."""
    cases = _typos(tmp_path)
    env = {**os.environ, "NPROC": "not-a-number"}
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_LOOK, json.dumps(cases), str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert len(results) == len(cases) > 100
    for words, code, err, torch_imported in results:
        assert code == 2 and err.count("\n") == 1 and err.startswith("titanlite: error: "), (
            words,
            err,
        )
        assert not torch_imported, (words, err)
    assert not list(tmp_path.iterdir())
