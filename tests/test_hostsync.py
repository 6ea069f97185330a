"""No host sync between log steps: every way to read a tensor on the host is counted."""

from __future__ import annotations

import json

from helpers import check, torchrun


def test_no_host_sync_outside_log_steps(tmp_path):
    out = tmp_path / "counts.json"
    check(torchrun(2, "tests/workers/hostsync.py", str(out), str(tmp_path / "runs")))
    results = json.loads(out.read_text())
    assert set(results) == {"fsdp_accum2_sft", "ddp_accum2_skip"}
    for case, counts in results.items():
        assert counts["non_log"] == {}, (case, counts)
        # The instrument works: each of the 4 log steps (1, 3, 6, 7) reads the trainer's metrics
        # once and the diagnostics' once.
        assert counts["log"] == {"tolist": 8}, (case, counts)
