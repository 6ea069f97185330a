"""scripts/bench.py end to end at a tiny size (2 ranks, 2 rounds): it runs, prints its table and
writes every ratio and count. Speed itself is never asserted here (shared, noisy machines):
the figures come from the benchmark, in scripts/README.md."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import HANG_S, REPO


def test_bench_reports_ratios_and_counts(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "scripts/bench.py",
        "--dp",
        "2",
        "--reps",
        "2",
        "--only",
        "loss",
        "diagnostics",
        "reduce-scatter",
        "packing",
        "dropout",
    ]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=HANG_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())["dp"]["2"]
    diag = {"diag-default", "diag-sketch-every", "diag-exact-every"}
    dropout = {"dropout-stream", "dropout-sample"}
    assert set(report["configs"]) == {
        "baseline",
        "titanlite",
        "native-rs",
        "unpacked",
        "packed",
        *diag,
        *dropout,
    }
    # Packed SFT (data.packing) holds less padding and more target tokens per step than one
    # record per sequence, on the same built-in SFT data at seq_len 1024.
    packed, unpacked = report["configs"]["packed"], report["configs"]["unpacked"]
    assert packed["padding_pct"] < 5 < unpacked["padding_pct"], (packed, unpacked)
    assert packed["targets_per_step"] > 2 * unpacked["targets_per_step"], (packed, unpacked)
    assert report["groups"]["packing"]["reference"] == "unpacked"
    assert report["groups"]["dropout"]["reference"] == "dropout-stream"
    assert set(report["groups"]["diagnostics"]["ratios"]) == diag
    assert report["probe_hook"]["units"] == 7  # the debug model's 6 blocks + the root
    for name, row in report["configs"].items():
        assert row["host_syncs"] == 0 and row["tokens_per_s_per_rank"] > 0, (name, row)
    # The exact loss path adds one collective, the token-count all-reduce; gloo's reduce-scatter
    # and titanlite's all-to-all are one call each.
    ops = {n: report["configs"][n]["collective_ops"]["main"] for n in report["configs"]}
    # A measured step: the gather, the Gram's all-reduce and the start barrier (stragglers.py) on
    # the diagnostics' group; an unmeasured one: nothing there.
    assert report["configs"]["diag-exact-every"]["collectives"]["diagnostics"] == 3
    assert report["configs"]["diag-default"]["collectives"].get("diagnostics", 0) == 0
    assert ops["titanlite"]["allreduce"] == ops["baseline"].get("allreduce", 0) + 1
    assert ops["titanlite"]["alltoall_base"] == ops["native-rs"]["_reduce_scatter_base"]
    for group, ref, other in (
        ("loss", "baseline", "titanlite"),
        ("reduce-scatter", "native-rs", "titanlite"),
    ):
        assert report["groups"][group]["reference"] == ref
        ratio = report["groups"][group]["ratios"][other]
        assert ratio["wall"]["n"] == 2 and ratio["cpu"]["ratio"] > 0
    # The profiler's breakdown covers the step: every part measured, nothing counted twice.
    for name in ("baseline", "titanlite"):
        parts = report["breakdown"][name]
        assert set(parts) == {
            "forward",
            "backward",
            "all_gather",
            "reduce",
            "clip",
            "optimizer",
            "data",
            "other",
        }
        assert all(
            parts[p] > 0 for p in ("forward", "backward", "all_gather", "reduce", "optimizer")
        ), parts
        assert parts["other"] >= 0 and parts["backward"] > parts["forward"], parts
    assert "step-time breakdown, host ms per step" in proc.stdout
    assert (
        "loss: titanlite / baseline" in proc.stdout
        and "reduce-scatter: titanlite / native-rs" in proc.stdout
    )


def test_bench_bad_override_is_one_line(tmp_path):
    cmd = [
        sys.executable,
        "scripts/bench.py",
        "--dp",
        "2",
        "--training.sed",
        "1",
        "--out",
        str(tmp_path / "b.json"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and "training.sed" in proc.stderr
    assert not (tmp_path / "b.json").exists()
