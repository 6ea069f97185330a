"""The repository's shape holds: size budgets (train.py is the loop, no module grows past one
screenful of concerns, the README stays a guide) and every link in every README resolves
(md-link-checker: relative paths and section anchors; web addresses are not fetched, tests run
offline). The layer order is checked by import-linter in scripts/test.sh."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import REPO

TRAIN_LINES, MODULE_LINES, README_LINES = 300, 400, 400


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
