"""The fault catalogue's cheap part: every case that must stop before any worker starts (bad
values, files, names, environment, prepared folders, Hugging Face weights) runs through the
launcher's own code and holds. The rest of the catalogue is scripts/fault_catalogue.py without
--cheap (benchmark-style: minutes)."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import REPO


def test_every_case_stopped_before_the_workers_holds(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/fault_catalogue.py", "--cheap", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    rows = [ln for ln in proc.stdout.splitlines() if re.match(r"^(HELD|BROKE|SKIPPED) ", ln)]
    assert proc.returncode == 0 and not [r for r in rows if not r.startswith("HELD")], (
        proc.stdout + proc.stderr[-3000:]
    )
    assert len(rows) >= 49, proc.stdout  # the catalogue's preflight-level cases, none lost
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
