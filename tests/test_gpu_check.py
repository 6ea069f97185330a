"""scripts/gpu_check.sh --smoke: every section of the GPU check on the CPU with tiny shapes, so
the script a GPU owner runs cannot rot between the times a GPU is at hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import check

REPO = Path(__file__).resolve().parents[1]


def test_smoke_runs_every_section_and_its_checks_hold(tmp_path):
    out = tmp_path / "gc"
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    check(proc)
    result = json.loads((out / "gpu_check.json").read_text())
    speed = result["speed"]["rows"]
    assert [(r["ac"], r["compile"]) for r in speed] == [
        ("none", False),
        ("selective", False),
        ("full", False),
    ]
    assert all(
        r["rc"] == 0 and r["tokens_per_s"] > 0 and r["peak_gib"] > 0 and r["est_gib"] > 0
        for r in speed
    )
    # less activation memory is estimated the more is recomputed
    est = {r["ac"]: r["est_gib"] for r in speed}
    assert est["none"] > est["selective"] > est["full"]
    assert all(r["largest"] >= 1 and r["estimate_admits"] >= 1 for r in result["batch"]["rows"])
    accum = result["accum"]
    assert (
        accum["steps"] == 6
        and accum["param_dtype"] == "float32"
        and accum["max_rel"] <= accum["rtol_last"] == 1e-5
        and accum["ok"]
        and accum["margin"] >= 1
    )
    probe = result["probe"]["rows"]
    assert {(r["world"], r["method"]) for r in probe} == {
        (w, m) for w in (8, 16) for m in ("exact", "sketch")
    }
    assert all(r["ms"] > 0 and r["of_step_pct"] > 0 for r in probe)
    hf = {r["dtype"]: r for r in result["hf"]["rows"]}
    # bf16: titanlite's and transformers' errors against transformers' fp32 logits, each measured
    assert hf["float32"]["max_rel"] <= 1e-4 and hf["bfloat16"]["max_rel"] <= hf["bfloat16"]["tol"]
    assert (
        0 < hf["float32"]["max_rel"] < hf["bfloat16"]["max_rel"]
        and hf["bfloat16"]["hf_max_rel"] > 0
    )
    assert result["sync"] == {"skipped": "no GPU", "ok": True}
    assert result["determinism"] == {"steps": 6, "ok": True, "differ": []}
    packing = result["packing"]["rows"]
    assert [r["packed"] for r in packing] == [False, True]
    assert all(
        r["rc"] == 0 and r["targets_per_step"] > 0 and r["targets_per_s"] > 0 for r in packing
    )
    rehearsed = result["rehearse"]["rows"]
    assert [(r["name"], r["world"]) for r in rehearsed] == [("rehearse-sync", 8)]
    assert all(
        r["rc"] == 0 and r["host_reads"] == 0 and 0 < r["peak_gib"] < r["est_gib"]
        for r in rehearsed
    )
    assert not any(r["sync_debug"] for r in rehearsed)  # sync_debug is a CUDA mode
    moe, experts = result["moe"]["rows"], result["moe"]["experts"]
    assert [r["flavor"] for r in moe] == [w["flavor"] for w in experts] == ["debugmodel"]
    assert all(r["rc"] == 0 and r["tokens_per_s"] > 0 and r["est_gib"] > 0 for r in moe)
    # the two ways on this CPU: the same bf16 sums, both timed
    assert all(w["max_rel"] <= w["tol"] and w["grouped_ms"] > 0 < w["loop_ms"] for w in experts)
    tp = result["tp"]
    assert [r["name"] for r in tp["rows"]] == ["tp-none", "tp-1"] and tp["ok"]
    assert all(r["rc"] == 0 and r["tokens_per_s"] > 0 for r in tp["rows"])
    assert tp["max_rel"] <= float(tp["rtol"]) == 1e-5  # fp32 here: one summation order apart
    table = (out / "gpu_check.md").read_text()
    assert "| selective | off |" in table and "Largest local batch at seq 128" in table
    assert "SFT on the built-in set at seq 512: one record per sequence " in table
    assert "Deterministic mode, the same steps twice: 6 steps, pass." in table
    assert "Rehearsal rehearse-sync: one rank of 8: peak " in table
    assert "| debugmodel | " in table and "| experts: grouped | loop |" in table
    assert "Tensor-parallel plan at tp=1 vs none: largest relative loss difference" in table


def test_full_check_refuses_a_machine_without_gpu_in_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path / "x")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "gpu_check: error: no GPU here (nvidia-smi lists none); run it on a GPU machine, or --smoke on a CPU"
    )
    assert not (tmp_path / "x").exists()
