"""Each alert fires on a stream of measured steps that provokes it and stays silent on a healthy
one. Streams are synthetic records with the fields stats.step_metrics produces. Real runs with
injected faults: tests/test_scenarios.py; recorded ones (tests/recordings/) replay to the alerts
they raised. An alert registered from outside the package: tests/test_checkpoint.py."""

from __future__ import annotations

import dataclasses
import itertools
import random
import sysconfig
from pathlib import Path

import pytest

from titanlite.config.job_config import Alerts
from titanlite.diagnostics.alerts import Alert, AlertMonitor
from titanlite.diagnostics.catalogue import BUILT_IN
from titanlite.diagnostics.registry import REGISTRY, AlertSpec, Check, Finding, cause, register
from titanlite.diagnostics.replay import compared, load_recording, replay
from titanlite.diagnostics.rules import shared_mismatch
from titanlite.diagnostics.scenarios import detection, expected, scenarios
from titanlite.diagnostics.step_record import RECORD_VERSION, SHARED
from titanlite.errors import UserError

RECORDINGS = sorted((Path(__file__).parent / "recordings").glob("*.json.xz"))

WORLD, STEPS = 4, 60
TP = 2  # ranks per replica in rank_shared (a tensor split)


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
        # What each rank read: 2 sequences, indices from one shared order, token fingerprints
        rec["rank_samples"] = [
            [
                {"index": 8 * t + 2 * r + i, "content": rng.random(), "tokens": 100, "loss": 5.0}
                for i in range(2)
            ]
            for r in range(WORLD)
        ]
        rec["data_order"] = [1000 + t] * WORLD
        # Every rank's values of what all must share: a tensor split of 2 ranks per replica, the
        # gradient norm a few ulps apart as a backend reducing in another order would leave it
        norm = 1.0 + rng.random()
        rec["replica_ranks"] = TP
        rec["rank_shared"] = {
            "tokens": [float(sum(rec["rank_tokens"]))] * (WORLD * TP),
            "grad_norm": [norm * (1 + 2e-7 * rng.random()) for _ in range(WORLD * TP)],
            "skip": [0.0] * (WORLD * TP),
        }
        yield fault(t, rec) if fault else rec


def run(stream) -> list:
    cfg = Alerts()
    cfg.trend_burn_in, cfg.trend_window = 20, 36  # the synthetic streams are short
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


def _copied_share(t, rec):
    """From step 30, ranks 1 and 3 are handed rank 0's sequences."""
    if t >= 30:
        for r in (1, 3):
            rec["rank_samples"][r] = [dict(x) for x in rec["rank_samples"][0]]
    return rec


_STUCK: list = []


def _stuck_loader(t, rec):
    """From step 30, rank 2's loader delivers step 30's tokens again; its sampler moves on."""
    if t == 30:
        _STUCK[:] = [x["content"] for x in rec["rank_samples"][2]]
    if t >= 30:
        for x, c in zip(rec["rank_samples"][2], _STUCK, strict=True):
            x["content"] = c
    return rec


def _rank0_order(t, rec):
    """Rank 0's sampler shuffles with its own seed (S1-2)."""
    rec["data_order"][0] += 7
    return rec


def _per_rank_order(t, rec):
    """Every rank's sampler has its own seed (S1-3)."""
    rec["data_order"] = [h + 7 * r for r, h in enumerate(rec["data_order"])]
    return rec


@pytest.mark.parametrize(
    "fault, name, ranks, step",
    [
        (_copied_share, "identical_data", [1, 3], 30),
        (_stuck_loader, "stale_batch", [2], 31),
        (_rank0_order, "data_order_mismatch", [0], 1),
        (_per_rank_order, "data_order_mismatch", [0, 1, 2, 3], 1),
    ],
)
def test_data_checks_fire_at_once_and_name_the_ranks(fault, name, ranks, step):
    """Exact checks of what ranks read: no burn-in, the first step the data shows it."""
    alerts = run(healthy(2, fault))
    assert [(a.name, a.ranks, a.step) for a in alerts][:1] == [(name, ranks, step)], [
        a.line() for a in alerts
    ]
    assert all(a.name == name for a in alerts) and alerts[0].cause == cause(name)


@pytest.mark.parametrize("name", SHARED)
@pytest.mark.parametrize("rank", range(WORLD * TP))
def test_a_rank_that_disagrees_on_a_shared_value_is_named(name, rank):
    """One rank's global token count, gradient norm or skip flag off at one step (a tensor-parallel
    rank's among them): shared_scalar_mismatch at that step, naming its replica, and the rank
    in its values and message; nothing at the other steps."""

    def off(t, rec):
        if t == 3:
            values = rec["rank_shared"][name]
            values[rank] = values[rank] * 1.01 if name == "grad_norm" else values[rank] + 1
        return rec

    alerts = run(itertools.islice(healthy(3, off), 5))  # the check needs no burn-in
    assert [(a.name, a.step, a.ranks, a.values) for a in alerts] == [
        ("shared_scalar_mismatch", 3, [rank // TP], {"ranks": [rank]})
    ], [a.line() for a in alerts]
    assert f"rank(s) [{rank}]" in alerts[0].message


def test_ranks_that_share_no_majority_are_all_named():
    """Half the ranks hold one gradient norm and half another: no majority, every rank named."""
    found = shared_mismatch({"grad_norm": [1.0, 1.0, 2.0, 2.0]}, 2)
    assert found is not None and found.values == {"ranks": [0, 1, 2, 3]} and found.ranks == [0, 1]
    assert shared_mismatch({"grad_norm": [float("nan")] * 4}, 2) is None  # not known: no finding


def test_the_exact_identical_data_check_speaks_for_the_statistical_one():
    """Every rank handed rank 0's batch: the losses agree too, but one alert per window, the one
    that names the ranks."""

    def same_batch(t, rec):
        same = _same(t, rec)
        same.update(rank_samples=[rec["rank_samples"][0]] * WORLD, data_order=rec["data_order"])
        return same

    alerts = run(healthy(4, same_batch))
    assert [(a.name, a.ranks, a.step) for a in alerts] == [
        ("identical_data", [1, 2, 3], t) for t in (1, 21, 41)
    ]


def test_a_rank_a_data_check_names_is_not_blamed_on_its_device():
    """A stuck loader's rank memorises its batch, so its gradient parts from the others': the
    stale_batch alert names the cause, faulty_worker stays quiet about that rank."""

    def stuck_and_apart(t, rec):
        rec = _stuck_loader(t, rec)
        for j in range(WORLD):
            if j != 2 and t >= 30:
                rec["cos_matrix"][2][j] = rec["cos_matrix"][j][2] = -0.5
        return rec

    alerts = run(healthy(5, stuck_and_apart))
    assert {(a.name, tuple(a.ranks)) for a in alerts} == {("stale_batch", (2,))}, [
        a.line() for a in alerts
    ]


def _legit_repeats(t, rec):
    """What healthy data may do: a tiny dataset hands a rank the same sequences again (same
    indices, same tokens), and two ranks get duplicate documents (same tokens, other indices)."""
    if t >= 20:
        rec["rank_samples"][1] = [
            dict(x, index=i, content=0.5) for i, x in enumerate(rec["rank_samples"][1])
        ]
        dup = rec["rank_samples"][2]
        rec["rank_samples"][3] = [
            dict(x, content=d["content"]) for x, d in zip(rec["rank_samples"][3], dup, strict=True)
        ]
    return rec


def test_legitimate_repeats_raise_no_data_alert():
    assert run(healthy(3, _legit_repeats)) == []


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
    assert fired[0].cause == cause(name) and name in fired[0].line()
    assert len(fired) <= STEPS // Alerts().window + 1  # cooldown: no flood


def test_two_ranks_raise_no_dispersion_alerts():
    """With two ranks, one is always the higher and the std is one pairwise difference:
    persistence, spikes and trends there are chance, not a bad batch or a desync."""
    mon = AlertMonitor(Alerts(), ["a", "b"])
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
    assert run(list(healthy(1, _same))[: Alerts().min_steps]) == []


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
    assert Alert("cosine_drop", 3, [], [], "m").line().endswith(cause("cosine_drop"))


def test_there_are_recordings():
    assert len(RECORDINGS) >= 2, RECORDINGS


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.name.split(".")[0])
def test_the_recordings_replay_to_the_alerts_they_raised(path):
    """Healthy and fault runs of scripts/diagnose_scenarios.py at dp 2 and 4, kept with `--keep`:
    a replay raises the alerts the runs raised, at the same steps, word for word; and each fault
    is named by the alert and rank(s) the scenario table says, nothing else fires (repeats of that
    alert aside), and the healthy runs raise nothing."""
    runs = load_recording(path)
    assert set(runs) == set(scenarios(2)), sorted(runs)
    for name, run in runs.items():
        got = [
            a.to_dict() for a in replay(run["records"], Alerts(**run["alerts"]), run["batch_unit"])
        ]
        assert compared(got) == compared(run["raised"]), name
        world = len(run["records"][0]["rank_loss"])
        want = expected(world, run["faults"].get("fault_from_step", 1))[name]
        found = detection([a for a in got + run["kept"] if a["level"] == "alert"], want)
        assert found["expected"] == "none" or found["detected_step"] is not None, (name, found)
        assert all(a["name"] == (want or ("-",))[0] for a in found["other_alerts"]), (name, found)
        assert want is not None or not [a for a in got if a["level"] == "alert"], (name, got)


def test_a_state_of_another_format_starts_the_history_again_and_says_so():
    """A checkpoint's runner state of another version is not read: the rules start again, one
    note says why, and the runner then judges as a fresh one."""
    first = AlertMonitor(Alerts(), [f"host{r}" for r in range(WORLD)])
    for rec in list(healthy(3))[:30]:
        first.update(rec)
    old = {**first.state_dict(), "version": 1}
    resumed, fresh = (AlertMonitor(Alerts(), [f"host{r}" for r in range(WORLD)]) for _ in range(2))
    note = resumed.load_state_dict(old)
    assert note is not None and "another format (version 1" in note and "start again" in note, note
    assert resumed.state_dict() == fresh.state_dict()


def test_a_resume_at_another_layout_starts_the_rules_history_again():
    """Half the sequences per rank after a resume: the spread of per-rank losses rises by
    construction (a sqrt(2) here). Continued at the same layout that reads as a dispersion
    rising while the loss falls (the control); at the new layout the rules start their history
    again, with a note, and stay quiet."""
    cfg = Alerts()
    cfg.trend_burn_in, cfg.trend_window = 20, 36
    hosts = [f"host{r}" for r in range(WORLD)]
    rng = random.Random(5)

    def stream(steps, spread):
        return [
            record(
                t,
                [8 - 3 * t / 160 + rng.gauss(0, spread) for _ in range(WORLD)],
                norms=[1.0] * WORLD,
            )
            for t in steps
        ]

    before, after = stream(range(1, 81), 0.1), stream(range(81, 161), 0.1 * 2**0.5)
    first = AlertMonitor(cfg, hosts, per_rank=4)
    for rec in before:
        first.update(rec)
    fired = {}
    for per_rank in (4, 2):
        mon = AlertMonitor(cfg, hosts, per_rank=per_rank)
        note = mon.load_state_dict(first.state_dict())
        assert (note is None) == (per_rank == 4), note
        fired[per_rank] = {a.name for rec in after for a in mon.update(rec) if a.is_alert}
    assert "dispersion_rising_loss_falling" in fired[4], fired
    assert not fired[2], fired
    assert "dp=4 with 2 sequence(s) per rank" in note and "had dp=4 with 4" in note


def _spec(**change) -> AlertSpec:
    base = {"name": "mine", "cause": "why", "checks": (Check(lambda ctx: None),)}
    return AlertSpec(**{**base, **change})


@pytest.mark.parametrize(
    "change, said",
    [
        ({"name": "my alert"}, "not an identifier"),
        ({"cause": " "}, "no cause"),
        ({"level": "warning"}, "level 'warning'"),
        ({"source": "eval"}, "source 'eval'"),
        ({"checks": ()}, "no check"),
        ({"thresholds": ("my_limit",)}, "not [alerts] fields"),
        ({"defaults": {"window": 3}}, "are [alerts] fields"),
    ],
)
def test_a_registration_mistake_is_one_line_at_import(change, said):
    before = dict(REGISTRY)
    with pytest.raises(UserError, match="alert .* cannot be registered") as e:
        register(_spec(**change))
    assert said in str(e.value) and "\n" not in str(e.value) and before == REGISTRY


def test_every_threshold_belongs_to_an_alert_and_every_alert_has_a_cause():
    claimed = {t for spec in BUILT_IN for t in spec.thresholds}
    assert claimed == {f.name for f in dataclasses.fields(Alerts)}
    assert all(spec.cause and REGISTRY[spec.name] is spec for spec in BUILT_IN)


def test_an_alert_is_named_by_its_record_whatever_its_finding_says():
    """A check whose finding names no registered alert (a typo) raises its record's alert, with
    the record's cause: no KeyError at run time."""
    mon = AlertMonitor(Alerts(), ["h0", "h1"])
    alerts = mon._raise(REGISTRY["slow_rank"], 7, Finding("typo_name", [1], "late"))
    assert [(a.name, a.cause, a.hosts) for a in alerts] == [
        ("slow_rank", cause("slow_rank"), ["h1"])
    ]


def test_a_record_from_a_newer_titanlite_is_refused_in_one_line():
    rec = {**next(healthy()), "version": RECORD_VERSION + 1}
    with pytest.raises(UserError, match="newer than this titanlite"):
        replay([rec], Alerts())


@pytest.mark.parametrize("seed", range(8))
def test_each_check_judges_from_the_measured_step_it_claims(seed):
    """Check.first_judged, which the start-up note and the summary quote, against the runner, over
    generated [alerts] configs: each check of every measured-step alert is first asked at the
    measured step it claims, and the trend rule (whose own guard waits longer) first fires there
    on a stream that rises from the start."""
    rng = random.Random(seed)
    cfg = Alerts()
    cfg.min_steps = rng.randint(1, 10)
    cfg.trend_burn_in, cfg.trend_window = rng.randint(0, 30), rng.randint(12, 24)
    mon = AlertMonitor(cfg, [f"host{r}" for r in range(WORLD)])
    asked: dict[tuple[str, int], int] = {}

    def spy(key, fn):
        def check(ctx):
            asked.setdefault(key, mon.seen)
            return fn(ctx)

        return check

    mon.specs = tuple(
        dataclasses.replace(
            s,
            checks=tuple(
                dataclasses.replace(c, fn=spy((s.name, i), c.fn)) for i, c in enumerate(s.checks)
            ),
        )
        for s in mon.specs
    )
    fired: dict[str, int] = {}
    for rec in healthy(seed, _rising):
        for alert in mon.update(rec):
            fired.setdefault(alert.name, mon.seen)
    checked = 0
    for spec in (s for s in mon.specs if s.source == "measured"):
        for i, check in enumerate(spec.checks):
            if check.needs is None:
                assert asked[(spec.name, i)] == check.first_judged(cfg), (spec.name, i, cfg)
                checked += 1
    trend = REGISTRY["dispersion_rising_loss_falling"].checks[0]
    assert fired["dispersion_rising_loss_falling"] == trend.first_judged(cfg) <= STEPS, (fired, cfg)
    assert checked >= 10  # not vacuous: the exact checks and the windowed rules
