"""The repository's shape holds: size budgets (train.py is the loop, no module grows past one
screenful of concerns, the README stays a guide), every link in every README resolves
(md-link-checker: relative paths and section anchors; web addresses are not fetched, tests run
offline), and every measured block of a README is what its committed figures file renders to.
The layer order is checked by import-linter in scripts/test.sh."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from helpers import REPO, load_script

TRAIN_LINES, MODULE_LINES, README_LINES = 300, 400, 400
# A figures file (by the start of its name) -> the script and function that render it: the
# script writes the file, a README holds its rendering between
# `<!-- figures: PATH -->` and `<!-- end figures -->` (PATH relative to the README).
RENDERERS = {"gpu_check": ("gpu_check", "markdown")}
BLOCK = re.compile(r"<!-- figures: (\S+) -->\n(.*?)<!-- end figures -->", re.S)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _tracked(pattern: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / p for p in out.stdout.split()]


def test_size_budgets():
    assert _lines(REPO / "titanlite/train.py") <= TRAIN_LINES
    modules = sorted(REPO.glob("titanlite/**/*.py"))
    assert len(modules) > 50  # the glob found the package
    over = {str(p.relative_to(REPO)): n for p in modules if (n := _lines(p)) > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines: {over}; split them by concern"
    readme = _lines(REPO / "README.md")
    assert readme <= README_LINES, f"README.md has {readme} lines; reference text goes beside its code"


def test_every_readme_link_resolves():
    readmes = _tracked("*.md")
    assert REPO / "README.md" in readmes and REPO / "tests/README.md" in readmes
    cmd = [sys.executable, "-m", "md_link_checker", "--no-urls", *map(str, readmes)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_measured_blocks_are_rendered_from_their_files():
    blocks = [(md, path, body) for md in _tracked("*.md") for path, body in BLOCK.findall(md.read_text())]
    assert len(blocks) >= 2, "no measured block found"
    for md, path, body in blocks:
        source = md.parent / path
        script, fn = RENDERERS[source.name.split("-")[0]]
        want = getattr(load_script(script), fn)(json.loads(source.read_text()))
        assert body == want, f"{md.relative_to(REPO)}'s block of {path} is not its rendering; paste:\n{want}"
