"""The spike guard (spike_guard.skip): its decisions against a host reference, and in a
one-rank run, where a spike's step must leave the model exactly as a skipped empty step does."""

from __future__ import annotations

import json
import shutil
import statistics

import pytest
import torch
from helpers import load_script, read_metrics
from test_cli import SMALL, single

from titanlite.components.spike_guard import SpikeGuard
from titanlite.config import JobConfig


def _guard(window: int = 4, min_history: int = 3, k: float = 2.0) -> SpikeGuard:
    cfg = JobConfig().spike_guard
    cfg.skip, cfg.window, cfg.min_history, cfg.k = (
        "grad_norm",
        window,
        min_history,
        k,
    )
    return SpikeGuard(cfg, torch.device("cpu"), None)


def _feed(
    guard: SpikeGuard, values: list[float], skipped: set[int] = frozenset()
) -> list[list[float]]:
    return [
        guard.check(
            torch.tensor(0.0), torch.tensor(v, dtype=torch.float64), torch.tensor(i in skipped)
        ).tolist()
        for i, v in enumerate(values)
    ]


def test_decisions_match_mean_plus_k_std_of_the_applied_history():
    values = [1.0, 1.2, 0.9, 5.0, 1.1, 9.0, 8.0, 1.0, 1.3, 7.0, 1.2, 1.1]
    out = _feed(_guard(), values, skipped={8})
    history: list[float] = []
    want_spikes, in_a_row = [], 0
    for i, v in enumerate(values):
        if i == 8:  # skipped for another reason: neither judged nor remembered
            want_spikes.append(0.0)
            in_a_row = 0
            continue
        recent = history[-4:]
        spike = len(recent) >= 3 and v > statistics.fmean(recent) + 2 * statistics.pstdev(recent)
        if spike:
            assert out[i][2] == pytest.approx(
                statistics.fmean(recent) + 2 * statistics.pstdev(recent)
            )
        else:
            history.append(v)
        in_a_row = in_a_row + 1 if spike else 0
        want_spikes.append(float(spike))
        assert out[i][3] == in_a_row, i
    assert [o[0] for o in out] == want_spikes
    assert want_spikes[3] == want_spikes[5] == want_spikes[6] == 1.0  # two in a row: 9.0 then 8.0


def test_state_round_trip_decides_the_same_even_with_another_window():
    values = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 3.0, 1.0, 1.1, 2.5]
    whole = _feed(_guard(window=4), values)
    first = _guard(window=4)
    _feed(first, values[:6])
    resumed = _guard(window=4)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # through state.json
    assert _feed(resumed, values[6:]) == whole[6:] and whole[6][0] == whole[9][0] == 1.0
    wider = _guard(window=8)  # a wider window keeps the 4 values it was given, oldest first
    wider.load_state_dict(first.state_dict())
    assert int(wider.count) == 4 and wider.history[:4].tolist() == values[2:6]


STEPS = ["--training.steps", "10", "--checkpoint.every", "5", "--checkpoint.at_end", "true"]
GUARD = ["--spike_guard.skip", "grad_norm", "--spike_guard.min_history", "4"]
SPIKE = ["--faults.spike_step", "7"]


def _run(tmp_path, name: str, *args: str):
    proc = single(*SMALL, *STEPS, *args, "--job.dump_folder", str(tmp_path), "--job.run_name", name)
    losses = (
        {r["step"]: r["loss"] for r in read_metrics(tmp_path / name)}
        if proc.returncode == 0
        else {}
    )
    return proc, losses


def test_a_spike_is_skipped_exactly_like_an_empty_step_and_a_resumed_run_decides_the_same(
    tmp_path, capsys
):
    proc, guarded = _run(tmp_path, "guarded", *GUARD, *SPIKE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = [json.loads(x) for x in (tmp_path / "guarded/events.jsonl").read_text().splitlines()]
    assert [(e["name"], e["step"]) for e in events] == [("spike_skipped", 7)], events
    assert "grad_norm" in events[0]["message"] and "its optimizer update was skipped" in proc.stderr
    # The event names the step's sequences (unmeasured at dp 1: from the data order), as
    # inspect_step lists them.
    capsys.readouterr()
    assert (
        load_script("inspect_step").main([str(tmp_path / "guarded"), "--step", "7", "--json"]) == 0
    )
    listed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["index"], x["sources"]) for x in events[0]["samples"]] == [
        (x["index"], x["sources"]) for x in listed
    ]
    assert "samples: r0 #" in proc.stderr

    # The same data and LR schedule with step 7 empty instead: bitwise the same weights after.
    _, empty = _run(tmp_path, "empty", "--faults.ignore_all_labels_steps", "7")
    assert all(guarded[s] == empty[s] for s in (8, 9, 10)), (guarded, empty)
    _, applied = _run(tmp_path, "applied", *SPIKE)  # without the guard the spike is applied
    assert applied[8] != guarded[8] and applied[6] == guarded[6]

    # Resumed from step 5 in a new folder: the history comes back, step 7 is skipped again.
    step5 = "checkpoints/step-00000005"
    shutil.copytree(tmp_path / "guarded" / step5, tmp_path / "resumed" / step5)
    proc, resumed = _run(tmp_path, "resumed", *GUARD, *SPIKE, "--checkpoint.load_step", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert resumed == {s: guarded[s] for s in range(6, 11)}, (resumed, guarded)


def test_more_spikes_in_a_row_than_allowed_stop_the_run(tmp_path):
    proc, _ = _run(tmp_path, "stop", *GUARD, *SPIKE, "--spike_guard.max_consecutive", "0")
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert (
        "titanlite: stopped: the spike guard skipped 1 steps in a row, up to step 7" in proc.stderr
    )
