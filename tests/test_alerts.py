"""Each alert fires on a stream of measured steps that provokes it and stays silent on a healthy
one. Streams are synthetic records with the fields stats.step_metrics produces. Real runs with
injected faults: tests/test_scenarios.py."""

from __future__ import annotations

import random
import sysconfig

import pytest

from titanlite.config.job_config import Diagnostics
from titanlite.diagnostics.alerts import CAUSES, Alert, AlertMonitor

WORLD, STEPS = 4, 60


def record(step, losses, cos=0.2, agree=None, tokens=None, norms=None):
    """`agree[r]`: rank r's cosine with every other rank (pairwise = the smaller of the two)."""
    tokens = tokens or [100] * WORLD
    agree = agree or [cos] * WORLD
    mean = sum(losses) / len(losses)
    std = (sum((x - mean) ** 2 for x in losses) / len(losses)) ** 0.5
    return {
        "step": step,
        "rank_loss": losses,
        "rank_tokens": tokens,
        "loss_std": std,
        "cos_mean_pairwise": cos,
        "cos_matrix": [
            [1.0 if i == j else min(agree[i], agree[j]) for j in range(WORLD)] for i in range(WORLD)
        ],
        "rank_grad_norm": norms or [1.0] * WORLD,
    }


def healthy(seed=0, fault=None):
    """Loss falling 8 -> 5, every rank noisy in the same way; `fault(step, rec)` edits a step."""
    rng = random.Random(seed)
    for t in range(1, STEPS + 1):
        base = 8 - 3 * t / STEPS
        rec = record(
            t,
            [base + rng.gauss(0, 0.2) for _ in range(WORLD)],
            cos=0.2 + rng.gauss(0, 0.05),
            agree=[0.2 + rng.gauss(0, 0.08) for _ in range(WORLD)],
            tokens=[rng.randint(50, 500) for _ in range(WORLD)],
            norms=[1.0 + rng.gauss(0, 0.3) ** 2 for _ in range(WORLD)],
        )
        yield fault(t, rec) if fault else rec


def run(stream) -> list:
    cfg = Diagnostics()
    cfg.trend_burn_in = 20  # the synthetic streams are short; the real default waits longer
    mon = AlertMonitor(cfg, [f"host{r}" for r in range(WORLD)])
    return [a for rec in stream for a in mon.update(rec)]


@pytest.mark.parametrize("seed", range(5))
def test_healthy_runs_raise_nothing(seed):
    assert run(healthy(seed)) == []


def _spike(t, rec):
    if t == 40:
        mean = sum(rec["rank_loss"]) / WORLD
        return record(t, [mean + d for d in (-2.0, 2.0, -2.0, 2.0)], tokens=[100] * WORLD)
    return rec


def _with_losses(t, rec, losses):
    """`rec` with new per-rank losses (and their dispersion), everything else kept."""
    return dict(rec, rank_loss=losses, loss_std=record(t, losses)["loss_std"])


def _rising(t, rec):
    """Dispersion grows 10% per measured step (which ranks sit high rotates) as the loss falls."""
    spread = 0.02 * 1.1**t
    mean = sum(rec["rank_loss"]) / WORLD
    signs = [(-1) ** ((r + t) % 2) for r in range(WORLD)]
    return _with_losses(t, rec, [mean + spread * d for d in signs])


def _bad_rank(t, rec):
    losses = list(rec["rank_loss"])
    losses[2] *= 1.15
    return _with_losses(t, rec, losses)


def _same(t, rec):
    return record(t, [rec["rank_loss"][0]] * WORLD, 1.0)


def _drop(t, rec):
    rec["cos_mean_pairwise"] = 0.7 if t < 30 else 0.0
    return rec


def _faulty(t, rec):
    """Rank 1's gradient points nowhere the others do."""
    for j in range(WORLD):
        if j != 1:
            rec["cos_matrix"][1][j] = rec["cos_matrix"][j][1] = 0.0
    return rec


def _noisy_device(t, rec):
    """Rank 1's gradient is 8x larger than the others' (noise added before the reduction)."""
    rec["rank_grad_norm"][1] = 8.0
    return rec


@pytest.mark.parametrize(
    "fault, name, ranks",
    [
        (_spike, "dispersion_spike", []),
        (_rising, "dispersion_rising_loss_falling", []),
        (_bad_rank, "single_rank_outlier", [2]),
        (_same, "identical_data", []),
        (_drop, "cosine_drop", []),
        (_faulty, "faulty_worker", [1]),
        (_noisy_device, "faulty_worker", [1]),
    ],
)
def test_each_alert_fires_when_provoked(fault, name, ranks):
    alerts = run(healthy(1, fault))
    fired = [a for a in alerts if a.name == name]
    assert fired, [a.line() for a in alerts]
    assert fired[0].ranks == ranks and fired[0].hosts == [f"host{r}" for r in ranks]
    assert fired[0].cause == CAUSES[name] and name in fired[0].line()
    assert len(fired) <= STEPS // Diagnostics().alert_window + 1  # cooldown: no flood


def test_two_ranks_raise_no_dispersion_alerts():
    """With two ranks, one is always the higher and the std is one pairwise difference:
    persistence, spikes and trends there are chance, not a bad batch or a desync."""
    mon = AlertMonitor(Diagnostics(), ["a", "b"])
    stream = [
        {
            "step": t,
            "rank_loss": [5.0 + 0.01 * t * (1 + (t % 7 == 0) * 9), 5.0],
            "rank_tokens": [100, 100],
            "loss_std": 0.005 * t * (1 + (t % 7 == 0) * 9),
            "cos_mean_pairwise": 0.2,
        }
        for t in range(1, 3 * STEPS)
    ]
    assert [a for rec in stream for a in mon.update(rec)] == []


def test_nothing_fires_before_min_steps():
    assert run(list(healthy(1, _same))[: Diagnostics().alert_min_steps]) == []


def test_alert_line_names_the_highest_loss_samples_by_source():
    root = sysconfig.get_paths()["stdlib"]
    samples = [
        {"rank": 2, "index": 7 + i, "tokens": 100, "loss": loss, "sources": [{"file": f, "row": 3}]}
        for i, (loss, f) in enumerate(
            [
                (2.0, "/data/a.jsonl"),
                (9.5, f"{root}/json/decoder.py"),
                (None, "/data/b.jsonl"),
                (4.0, "/x.txt"),
            ]
        )
    ]
    samples[0]["sources"].append({"file": "/data/a.jsonl", "row": 4})
    alert = Alert("single_rank_outlier", 21, [2], ["h"], "rank 2 ...", samples=samples)
    line = alert.line()
    assert line.endswith(
        "highest-loss samples: r2 #8 stdlib:json.decoder row 3 (100 tok, loss 9.500), r2 #10 /x.txt row 3 "
        "(100 tok, loss 4.000), r2 #7 /data/a.jsonl row 3 +1 doc(s) (100 tok, loss 2.000); 1 more in "
        "events.jsonl (scripts/inspect_step.py shows them)"
    ), line
    assert Alert("cosine_drop", 3, [], [], "m").line().endswith(CAUSES["cosine_drop"])
