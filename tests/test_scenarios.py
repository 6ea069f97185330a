"""scripts/diagnose_scenarios.py at dp=4 (debug model, pretraining data, 30 steps, faults from
the first step, on_alert = stop): every injected fault moves the metric that should detect it and
raises the alert that names it (and its rank), which stops that run, and the detection table says
when; shuffled labels raise no alert but one naming rank 2 (they hurt only once the model has
learned more than 30 steps teach it); a straggler is named with how late it is; the healthy run
stays silent and records every rank's wait and data loading time. The data faults (ranks handed
the same sequences, a stuck loader, per-rank shuffle seeds) are caught exactly, at the first step
the data shows them. --replay over the same folders raises the same alerts. dp 2 and 8, faults
that start mid-run and the long runs are the benchmark's (titanlite/diagnostics/README.md); the
rules at dp 2, 4 and 8 on synthetic streams: tests/test_detection.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import HANG_S, REPO, load_script


def _alerts(row: dict) -> list[tuple[str, list[int]]]:
    return [(a["name"], a["ranks"]) for a in row["alerts"]]


@pytest.mark.slow
def test_faults_move_their_metrics_and_raise_their_alerts(tmp_path, capsys):
    cmd = [
        sys.executable,
        "scripts/diagnose_scenarios.py",
        "--dp",
        "4",
        "--steps",
        "30",
        "--onset",  # the ongoing faults from the first step: the rules that compare ranks name them
        "1",
        "--out",
        str(tmp_path),
    ]
    cmd += ["--scenarios", "healthy", "same_data", "corrupt_labels", "grad_noise", "replica_flip"]
    cmd += ["stuck_loader", "slow_rank", "S1-2", "S1-3"]
    cmd += ["--diagnostics.on_alert", "stop", "--metrics.enable_tensorboard", "false"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_S)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "scenarios.json").read_text())

    ok = rows["healthy"]
    assert ok["alerts"] == [] and ok["steps"] == 30 and ok["stopped"] is None
    assert ok["loss_std"] > 0 and ok["cos_mean"] < 0.9

    # Every rank handed rank 0's sequences: caught at step 1 from the indices; the metrics agree
    # (no dispersion, aligned gradients).
    same = rows["same_data"]
    assert _alerts(same) == [("identical_data", [1, 2, 3])] and same["steps_to_detection"] == 1
    assert same["steps"] == 1 and "identical_data" in same["stopped"]
    (first,) = [
        json.loads(x)
        for x in (tmp_path / "same_data" / "diagnostics.jsonl").read_text().splitlines()
    ]
    assert first["loss_std"] < 1e-6 * first["rank_loss"][0] and first["cos_mean_pairwise"] > 0.99

    bad = rows["corrupt_labels"]  # rank 2's labels shuffled: rank 2 drives the loss range
    assert (
        bad["loss_max_rank"] == 2 and bad["loss_max_rank_share"] >= 0.5 > ok["loss_max_rank_share"]
    )
    assert all(
        alert == ("single_rank_outlier", [2]) for alert in _alerts(bad)
    )  # none, or naming rank 2

    noisy = rows["grad_noise"]  # rank 1's gradient drowned in noise: its norm and its direction
    assert noisy["grad_norm_cv"] > 3 * ok["grad_norm_cv"]
    # Lowest cosine to the others in most steps (chance: 1 in 4). Not in every step: each other
    # rank's "others" holds rank 1's noise too, so their cosines drop with it: the share depends
    # on the data order (92% of the steps with the stored permutation, 75% with the computed one).
    assert noisy["cos_min_rank"] == 1 and noisy["cos_min_rank_share"] >= 0.6
    assert noisy["cos_to_others_min"] < ok["cos_to_others_min"] / 2
    assert ("faulty_worker", [1]) in _alerts(noisy) and noisy["stopped"]
    _alert_names_its_samples(tmp_path / "grad_noise", 1, capsys)

    flip = rows["replica_flip"]  # a bit of rank 3's weights flips as step 5 starts: seen after it
    assert flip["steps"] == 5 and _alerts(flip) == [("replica_drift", [3])], flip
    assert flip["steps_to_detection"] == 1 and "replica_drift" in flip["stopped"]

    # Rank 3's data loading takes half its step time more: the others wait for it at the step's
    # start, which every measured step records (from step 2: the fault times the step before);
    # named once 7 of the last slow_window = 10 measured steps show it (a busy machine may hide
    # a step or two), without a burn-in.
    slow = rows["slow_rank"]
    assert _alerts(slow) == [("slow_rank", [3])] and 10 <= slow["detected_step"] <= 13, slow
    assert slow["steps"] == slow["detected_step"]
    (alert,) = [
        json.loads(x) for x in (tmp_path / "slow_rank" / "events.jsonl").read_text().splitlines()
    ]
    late = alert["values"]
    assert late["share"] > 0.2 and late["load_s"] > 10 * late["others_load_s"], late
    healthy = [
        json.loads(x) for x in (tmp_path / "healthy" / "diagnostics.jsonl").read_text().splitlines()
    ]
    assert all(min(r["rank_wait_s"]) >= 0 and r["rank_load_s"][0] > 0 for r in healthy), healthy[-1]
    assert healthy[0]["step_s"] is None  # no step before the first
    assert all(r["step_s"] > 0 for r in healthy[1:])

    stuck = rows["stuck_loader"]  # rank 3 repeats step 5's batch: its tokens repeat at step 6
    assert (
        _alerts(stuck) == [("stale_batch", [3])] and stuck["detected_step"] == 6 == stuck["steps"]
    )
    for name, ranks in (("S1-2", [0]), ("S1-3", [0, 1, 2, 3])):  # per-rank shuffle seeds
        assert (
            _alerts(rows[name]) == [("data_order_mismatch", ranks)] and rows[name]["steps"] == 1
        ), name
    assert all(r["other_alerts"] == [] for n, r in rows.items() if n != "corrupt_labels"), rows
    assert "detection" in proc.stdout and (tmp_path / "scenarios.png").stat().st_size > 10_000
    assert (tmp_path / "noise_scale.png").stat().st_size > 10_000

    # The rules replayed over the recorded steps raise what the runs raised (in this process).
    assert load_script("diagnose_scenarios").main(["--replay", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "replayed.json").read_text())
    for name, row in rows.items():
        assert again[name]["alerts"] == row["alerts"], (name, again[name]["alerts"], row["alerts"])


def _alert_names_its_samples(run_dir, rank: int, capsys) -> None:
    """The alert carries the named rank's sequences of its step (index, tokens, loss, sources), its
    console line the highest-loss ones; scripts/inspect_step.py lists the same from the folder."""
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    alert = next(a for a in events if a["ranks"] == [rank])
    samples = alert["samples"]
    assert len(samples) == 2 and {s["rank"] for s in samples} == {rank}, (
        samples
    )  # 2 sequences per rank
    assert all(s["tokens"] > 0 and s["loss"] > 0 and s["sources"] for s in samples), samples
    inspect = load_script("inspect_step")  # in this process: one start-up less per call
    capsys.readouterr()  # what the test printed so far
    args = [str(run_dir), "--step", str(alert["step"])]
    assert inspect.main([*args, "--rank", str(rank), "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["index"], r["loss"], r["sources"]) for r in rows] == [
        (s["index"], s["loss"], s["sources"]) for s in samples
    ]
    assert all(r["index"] == r["assigned"] and r["text"] and r["targets"] > 0 for r in rows), rows
    assert inspect.main(args) == 0
    text = capsys.readouterr().out
    assert (
        len(text.splitlines()) == 2 * 8 and "stdlib:" in text
    )  # the whole global batch of 8, 2 lines each
    assert inspect.main([str(run_dir.parent), *args[1:]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inspect_step: error: ") and "has no config.toml" in err, err
