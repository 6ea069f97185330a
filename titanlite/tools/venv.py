"""Every script runs from a fresh clone with nothing activated, like `./run_train.sh`: a script
calls `use_project_venv()` before its first import outside the standard library, and an
interpreter without titanlite's dependencies (a system `python3`) executes it again under the
project's (`.venv/` or `TITANLITE_PYTHON`, made by scripts/env.sh on first use). Standard library
only: scripts/env.sh runs it (`python titanlite/tools/venv.py [dev]`, exit 1: something missing).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What running titanlite needs (pyproject.toml's dependencies, by import name), then the tests.
CORE = (
    "torch",
    "torchdata",
    "tensorboard",
    "sentencepiece",
    "tokenizers",
    "safetensors",
    "jinja2",
    "numpy",
    "pyarrow",
    "matplotlib",
)
DEV = (
    "pytest",
    "ruff",
    "transformers",
    "importlinter",
    "md_link_checker",
    "gguf",
    "accelerate",
    "hypothesis",
    "xdist",
)
_AGAIN = "TITANLITE_VENV_EXEC"  # set on the second execution: never a third


def missing(dev: bool = False) -> list[str]:
    """The dependencies this interpreter cannot import (found without importing them)."""
    return [m for m in CORE + (DEV if dev else ()) if importlib.util.find_spec(m) is None]


def _stopped_while_starting(signum: int, frame) -> None:
    """A Ctrl-C or SIGTERM while the script imports (seconds, before its front door is up):
    one line, nothing written yet (titanlite.tools.cli takes over from there)."""
    name = signal.Signals(signum).name
    line = f"{Path(sys.argv[0]).stem}: stopped by {name} as it started; nothing was written"
    print(line, file=sys.stderr, flush=True)
    os._exit(128 + signum)


def use_project_venv(dev: bool = False) -> None:
    """Return if this interpreter has what the script needs; else execute the script again under
    the project's interpreter (scripts/env.sh installs it once, printing that it does)."""
    if sys._getframe(1).f_globals.get("__name__") == "__main__":  # a script run, not one imported
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _stopped_while_starting)
    if not missing(dev) or os.environ.get(_AGAIN):
        return
    env_sh = ROOT / "scripts" / "env.sh"
    script = 'source "$1" "$2" >&2 && printf %s "$PY"'
    cmd = ["bash", "-c", script, "env", str(env_sh), "dev" if dev else ""]
    found = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if found.returncode != 0:
        sys.exit(found.returncode)  # env.sh printed why
    env = dict(os.environ, **{_AGAIN: "1"})
    if os.environ.get("TITANLITE_PYTHON"):  # used as it is: titanlite from this tree
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.execve(found.stdout, [found.stdout, *sys.argv], env)


if __name__ == "__main__":  # scripts/env.sh: does $PY hold everything, titanlite installed too?
    incomplete = missing(dev=sys.argv[1:] == ["dev"]) or not importlib.util.find_spec("titanlite")
    sys.exit(1 if incomplete else 0)
