"""Detection at any world size, on synthetic streams of measured-step records: the per-sample
rank test (its null calibration, its power, which rank at dp=2), the gradient norm against a
rank's own history, stragglers, and the batch-size advice. Real runs: tests/test_scenarios.py."""

from __future__ import annotations

import itertools
import math
import random
import re
import statistics

import pytest

from titanlite.config.job_config import Alerts
from titanlite.diagnostics.alerts import AlertMonitor
from titanlite.diagnostics.rank_sum import (
    max_step_score,
    rank_scores,
    reachable,
    threshold,
    window_score,
)
from titanlite.diagnostics.step_record import PER_SEQUENCE, fold_replicas

ONSET, STEPS = 40, 80


def stream(world, per_rank, seed=0, fault=None):
    """Healthy measured steps at `world` ranks: the loss falls 7 -> 4 while each step's level
    jumps at random (a different batch), and the step's sequences are dealt to the ranks at random
    (what the sampler does); `fault(t, rec)` edits a step."""
    rng = random.Random(seed)
    for t in range(1, STEPS + 1):
        level = 7 - 3 * t / STEPS + rng.gauss(0, 0.3)
        values = [level + rng.gauss(0, 0.5) for _ in range(world * per_rank)]
        rng.shuffle(values)
        samples = [
            [{"index": 1000 * t + r * per_rank + i, "content": rng.random(), "tokens": 256, "loss": values[r * per_rank + i]}
             for i in range(per_rank)]
            for r in range(world)
        ]  # fmt: skip
        step_s = 0.5 + rng.gauss(0, 0.02)
        rec = {
            "step": t,
            "rank_tokens": [256 * per_rank] * world,
            "rank_samples": samples,
            "data_order": [7 + t] * world,
            "rank_grad_norm": [1.0 / (1 + t / 20) * (1 + rng.gauss(0, 0.1)) for _ in range(world)],
            "cos_matrix": [[1.0 if i == j else 0.1 for j in range(world)] for i in range(world)],
            "rank_wait_s": [abs(rng.gauss(0.01, 0.01)) for _ in range(world)],
            "rank_load_s": [0.002] * world,
            "step_s": step_s,
        }
        _losses(rec)
        yield fault(t, rec) if fault else rec


def _losses(rec):
    """The per-rank loss fields from the samples (what stats.step_metrics computes)."""
    rec["rank_loss"] = [sum(s["loss"] for s in rank) / len(rank) for rank in rec["rank_samples"]]
    mean = sum(rec["rank_loss"]) / len(rec["rank_loss"])
    rec["loss_std"] = math.sqrt(
        sum((x - mean) ** 2 for x in rec["rank_loss"]) / len(rec["rank_loss"])
    )


def run(records, world, cfg=None):
    mon = AlertMonitor(cfg or Alerts(), [f"host{r}" for r in range(world)], batch_unit=world)
    return [a for rec in records for a in mon.update(rec)]


def named(alerts, name):
    return [(a.step, a.ranks) for a in alerts if a.name == name]


def test_rank_scores_are_the_mann_whitney_statistic():
    samples = [[3.0, 1.0, 2.0], [2.0, 5.0], [0.5, 4.0, 2.0, 6.0]]
    for r, z in enumerate(rank_scores(samples)):
        mine = samples[r]
        rest = [x for j, xs in enumerate(samples) if j != r for x in xs]
        u = sum((x > y) + 0.5 * (x == y) for x in mine for y in rest)  # ties count one half
        n, m = len(mine), len(rest)
        assert z == pytest.approx((u - n * m / 2) / math.sqrt(n * m * (n + m + 1) / 12))
    assert rank_scores([[1.0], []]) == [None, None]


@pytest.mark.parametrize("world,per_rank", [(2, 4), (4, 2), (8, 2)])
def test_the_null_is_calibrated(world, per_rank):
    """Exchangeable data at a loose alpha: |Z| > z* in about alpha of the (step, rank) tests,
    summed over ranks as the union bound counts them (one test at dp=2)."""
    alpha, window, steps = 0.02, 10, 6000
    rng = random.Random(world)
    z_star = threshold(alpha, world)
    scores, hits, tests = [], 0, 0
    for _ in range(steps):
        values = [
            rng.expovariate(1.0) for _ in range(world * per_rank)
        ]  # skewed: rank-based is exact
        scores.append(
            rank_scores([values[r * per_rank : (r + 1) * per_rank] for r in range(world)])
        )
        if len(scores) >= window:
            ranks = 1 if world == 2 else world
            hits += sum(
                abs(window_score([s[r] for s in scores[-window:]])) > z_star for r in range(ranks)
            )
            tests += 1
    rate = hits / tests
    assert 0.5 * alpha < rate < 1.5 * alpha, rate


def _u_null(n, m):
    """The exact null distribution of the Mann-Whitney U of n values against m (no ties): the
    number of orderings with each U, by the recursion on the largest value, over C(n + m, n)."""
    counts = {(0, j): [1] for j in range(m + 1)} | {(i, 0): [1] for i in range(n + 1)}
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            top = [0] * j + counts[(i - 1, j)]  # the largest value is one of the i: it beats all j
            rest = counts[(i, j - 1)]  # or one of the j: it beats none
            counts[(i, j)] = [a + (rest[u] if u < len(rest) else 0) for u, a in enumerate(top)]
    return [c / math.comb(n + m, n) for c in counts[(n, m)]]


@pytest.mark.parametrize("world,per_rank", [(2, 4), (4, 2), (8, 2), (2, 8)])
def test_the_default_threshold_keeps_its_false_alarm_rate_exactly(world, per_rank):
    """At the default alpha the rate is far too small to measure by sampling, so compute it: the
    exact tail of the window's Stouffer sum (the per-step null of U convolved over the window),
    per rank tested, summed over ranks, is at most alpha and not needlessly below it (the layouts
    of the healthy recordings: 4.3e-6 at dp=2, 2.0e-6 at dp=4, 1.7e-6 at dp=8)."""
    cfg = Alerts()
    n, rest = per_rank, per_rank * (world - 1)
    step = _u_null(n, rest)
    window = [1.0]
    for _ in range(cfg.rank_test_window):
        window = [sum(window[k] * step[u - k] for k in range(len(window)) if 0 <= u - k < len(step))
                  for u in range(len(window) + len(step) - 1)]  # fmt: skip
    mean, sd = n * rest / 2, math.sqrt(n * rest * (n + rest + 1) / 12)
    z_star, k = threshold(cfg.rank_test_alpha, world), cfg.rank_test_window
    tail = sum(p for u, p in enumerate(window) if abs(u - k * mean) / (sd * math.sqrt(k)) > z_star)
    rate = tail * (1 if world == 2 else world)
    assert cfg.rank_test_alpha / 10 < rate <= cfg.rank_test_alpha, rate


def test_a_layout_that_cannot_reach_the_threshold_is_known():
    # one sequence per rank at dp=8: a perfect outlier reaches z = 1.53 per step, 4.83 over 10 < 4.85
    assert max_step_score(1, 8) * math.sqrt(10) < threshold(1e-5, 8)
    assert not reachable(1, 8, 10, 1e-5) and reachable(2, 8, 10, 1e-5) and reachable(4, 2, 10, 1e-5)
    # brute force: the largest U of one rank among 8 single values over all cuts is 7 = n(N-n)
    assert max(sum(a[0] > b for b in a[1:]) for a in itertools.permutations(range(8))) == 7


def _shift(rank, by, start=ONSET):
    def fault(t, rec):
        if t >= start:
            for s in rec["rank_samples"][rank]:
                s["loss"] += by
            _losses(rec)
        return rec

    return fault


@pytest.mark.parametrize("world,per_rank", [(2, 4), (4, 2), (8, 2)])
def test_healthy_streams_raise_nothing(world, per_rank):
    for seed in range(3):
        assert run(stream(world, per_rank, seed), world) == []


@pytest.mark.parametrize("world,per_rank,rank", [(2, 4, 1), (4, 4, 2), (8, 2, 5)])
def test_a_rank_with_bad_labels_is_named_within_10_steps(world, per_rank, rank):
    alerts = run(stream(world, per_rank, fault=_shift(rank, 2.0)), world)
    hits = named(alerts, "single_rank_outlier")
    assert hits and hits[0][1] == [rank] and ONSET <= hits[0][0] < ONSET + 10, alerts
    first = next(a for a in alerts if a.name == "single_rank_outlier")
    assert "per-sample rank test z = +" in first.message
    # the repeats name the same rank, at dp=2 too, once the fault fills the history
    assert {tuple(r) for _, r in hits} == {(rank,)} and len(hits) >= 2, hits
    assert all(a.step >= ONSET for a in alerts), alerts  # other alerts too may see it; none before


def test_at_dp2_a_fault_without_a_shared_history_names_both_ranks():
    alerts = run(stream(2, 4, fault=_shift(1, 2.0, start=1)), 2)
    first = next(a for a in alerts if a.name == "single_rank_outlier")
    assert first.ranks == [0, 1] and "both named" in first.message and first.step <= 10, (
        first.message
    )
    # from a shared history, a rank that moved the other way (its loss fell) is named as well
    low = run(stream(2, 4, fault=_shift(0, -2.0)), 2)
    assert named(low, "single_rank_outlier")[0][1] == [0] and "lower losses" in low[0].message, low


def _noisy(rank, start=ONSET, factor=10.0):
    def fault(t, rec):
        if t >= start:
            rec["rank_grad_norm"][rank] *= factor
        return rec

    return fault


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_noisy_gradient_is_named_against_the_ranks_own_history(world):
    alerts = run(stream(world, 2, fault=_noisy(1)), world)
    hits = named(alerts, "faulty_worker")
    assert hits and hits[0][1] == [1] and ONSET <= hits[0][0] < ONSET + 10, alerts
    assert all(a.ranks == [1] for a in alerts), alerts
    # all ranks' norms rising together (a learning-rate change) is the trend, not a fault
    together = run(stream(world, 2, fault=lambda t, rec: {**rec, "rank_grad_norm": [10 * x for x in rec["rank_grad_norm"]]} if t >= ONSET else rec), world)  # fmt: skip
    assert together == []


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_rank_handed_few_tokens_is_not_called_noisy(world):
    """SFT: a rank whose steps hold few valid tokens has a larger token-mean gradient by chance
    alone (the noise scales as 1/sqrt(tokens)); its noise per token is what it always was. Two
    such steps in a row put the median of a rank's last 3 norms at 4x its history."""
    rng = random.Random(world)
    signal, trace = (
        0.05,
        100.0,
    )  # |G|^2 and tr(Sigma) per token: noise-dominated, as in the recordings
    short = {ONSET, ONSET + 1, ONSET + 20, ONSET + 21}

    def records():
        for t in range(1, STEPS + 1):
            tokens = [rng.randint(150, 350) for _ in range(world)]
            if t in short:
                tokens[1] = rng.randint(8, 20)  # short answers
            norms = [math.sqrt(signal + trace / n) * (1 + rng.gauss(0, 0.05)) for n in tokens]
            cos = [
                [1.0 if i == j else signal / (norms[i] * norms[j]) for j in range(world)]
                for i in range(world)
            ]
            losses = [5.0 + rng.gauss(0, 0.3) for _ in range(world)]
            yield {"step": t, "rank_tokens": tokens, "rank_loss": losses, "loss_std": statistics.pstdev(losses),
                   "rank_grad_norm": norms, "cos_matrix": cos}  # fmt: skip

    recs = list(records())
    assert (
        recs[ONSET]["rank_grad_norm"][1] > 3 * recs[ONSET - 2]["rank_grad_norm"][1]
    )  # the raw norm
    assert [a for a in run(recs, world) if a.name == "faulty_worker"] == []
    noisy = _noisy(1)  # the same steps with real noise on rank 1 are named
    assert named(run([noisy(r["step"], r) for r in records()], world), "faulty_worker")[0][1] == [1]


def test_at_dp2_norms_apart_from_the_start_name_both_ranks():
    alerts = run(stream(2, 2, fault=_noisy(1, start=1)), 2)
    assert named(alerts, "faulty_worker") == [(alerts[0].step, [0, 1])], alerts
    assert "cannot tell which one is off" in alerts[0].message


def _late(rank, by, start=ONSET):
    def fault(t, rec):
        if t >= start:  # the others wait for it; it waits for no one
            rec["rank_wait_s"] = [
                0.001 if r == rank else w + by for r, w in enumerate(rec["rank_wait_s"])
            ]
            rec["rank_load_s"][rank] += by
            rec["step_s"] += by
        return rec

    return fault


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_straggler_is_named_with_how_late_it_is(world):
    alerts = run(stream(world, 2, fault=_late(world - 1, 0.5)), world)
    hits = named(alerts, "slow_rank")
    assert hits and hits[0][1] == [world - 1] and ONSET <= hits[0][0] < ONSET + 10, alerts
    msg = next(a.message for a in alerts if a.name == "slow_rank")
    assert re.search(
        r", 5\d\d ms \(5\d% of a step\) after the others' median; there its data loading took 502 ms, the others' 2 ms$",
        msg,
    ), msg
    # late by less than slow_margin (10%) of a step, as rank 0 is when it logs every step of a
    # fast one: not a straggler worth an alert
    assert named(run(stream(world, 2, fault=_late(0, 0.03)), world), "slow_rank") == []


def _tensor_split(copies: int, late: tuple[int, int] | None = None):
    """A stream's per-replica times as `copies` ranks per replica measure them (a tensor split),
    folded back by the diagnostics' own fold. `late`: (replica, copy), the one rank that reaches
    the start barrier half a step late from ONSET (its data loading); the barrier spans every
    rank, so all the others, its partners too, wait for it."""

    def fault(t, rec):
        rows = []
        for r, (w, load) in enumerate(zip(rec["rank_wait_s"], rec["rank_load_s"], strict=True)):
            for c in range(copies):
                if late is not None and t >= ONSET:
                    w_c, load_c = (0.001, load + 0.5) if (r, c) == late else (w + 0.5, load)
                else:
                    w_c, load_c = w * (1 + c), load  # a tensor split's ranks arrive a little apart
                rows.append({"loss_sum": 0.0, "tokens": 0.0, "norm_sq": 0.0, "order": 0.0,
                             "load_s": load_c, "wait_s": w_c, "step_s": rec["step_s"], "terms": [],
                             **{f: [] for f in PER_SEQUENCE}})  # fmt: skip
        folded, _ = fold_replicas(rows, [[0.0] * len(rows) for _ in rows], 1, True, copies)
        rec["rank_wait_s"] = [f["wait_s"] for f in folded]
        rec["rank_load_s"] = [f["load_s"] for f in folded]
        return rec

    return fault


@pytest.mark.parametrize("world, copies", [(2, 2), (4, 2), (4, 4)])
def test_a_straggler_in_a_tensor_split_names_its_replica(world, copies):
    """The start barrier spans every rank and times the stretch before the step's forward (the
    tensor split's own all-reduces run inside it, untimed). A replica is its split's ranks: a late
    rank is named by its replica's index, whichever of its ranks it is; a healthy split raises
    nothing."""
    assert named(run(stream(world, 2, fault=_tensor_split(copies)), world), "slow_rank") == []
    for copy in (0, copies - 1):
        alerts = run(stream(world, 2, fault=_tensor_split(copies, (world - 1, copy))), world)
        hits = named(alerts, "slow_rank")
        assert hits and hits[0][1] == [world - 1] and ONSET <= hits[0][0] < ONSET + 10, alerts


def _noise_scale(ratio):
    def fault(t, rec):
        tokens = sum(rec["rank_tokens"])
        rec.update(noise_scale_tokens=ratio * tokens, batch_tokens=tokens, batch_sequences=8)
        return rec

    return fault


def test_the_batch_size_advice_is_a_note_for_the_next_run():
    cfg = Alerts()
    notes = run(stream(4, 2, fault=_noise_scale(40.0)), 4, cfg)
    (note,) = notes
    assert note.name == "batch_size_advice" and not note.is_alert and note.step == cfg.advice_steps
    assert note.line().startswith(
        "NOTE batch_size_advice at step 50: the gradient noise scale B_simple"
    )
    # 40x a batch of 8 sequences, in steps of dp x local batch = 4: 320 sequences
    assert "a larger batch" in note.message and "--training.global_batch_size 320" in note.message
    small = run(stream(4, 2, fault=_noise_scale(0.05)), 4)
    assert (
        len(small) == 1
        and "a smaller batch" in small[0].message
        and "global_batch_size 4 " in small[0].message
    )
    assert (
        run(stream(4, 2, fault=_noise_scale(2.0)), 4) == []
    )  # within advice_ratio: nothing to say


def test_the_advice_is_renewed_when_the_noise_scale_moves_a_further_fold():
    """B_simple grows over a long run: a ratio 4x beyond the one last advised on is advised again
    (with the earlier figure); one within that fold is not."""
    cfg = Alerts(advice_steps=10)

    def growing(by):
        def fault(t, rec):
            return _noise_scale(10.0 if t < 30 else 10.0 * by)(t, rec)

        return fault

    notes = run(stream(4, 2, fault=growing(5)), 4, cfg)
    assert [n.step for n in notes] == [10, 39], notes
    assert (
        "(advised at 10x before)" in notes[1].message
        and "global_batch_size 400" in notes[1].message
    )
    assert [n.step for n in run(stream(4, 2, fault=growing(2)), 4, cfg)] == [10]


def test_an_sft_batch_is_judged_by_its_mean_tokens():
    """SFT batches hold 250 or 2,500 valid tokens by turns: B_simple of 6,000 tokens is 2.4x or
    24x a step's batch, 4.4x their mean. One note, about the mean batch."""

    def varying(t, rec):
        tokens = 250 if t % 2 else 2500
        rec.update(noise_scale_tokens=6000.0, batch_tokens=tokens, batch_sequences=8)
        return rec

    (note,) = run(stream(4, 2, fault=varying), 4)
    assert "batch of 1,375 tokens" in note.message, note.message


def test_ongoing_faults_start_at_fault_from_step():
    import time

    import torch

    from titanlite.datasets.batch import Microbatch
    from titanlite.faults.inject import Faults
    from titanlite.faults.switches import FaultSwitches
    from titanlite.tools.hooks import Step

    labels = torch.arange(64).reshape(2, 32)
    batch = Microbatch(labels, labels)
    faults = Faults(
        FaultSwitches(corrupt_labels_rank=1, fault_from_step=3), seed=0, rank=1, world=2
    )
    assert torch.equal(faults.microbatch(Step(2, False, None), 0, batch).labels, labels)
    shuffled = faults.microbatch(Step(3, False, None), 0, batch).labels
    assert not torch.equal(shuffled, labels) and torch.equal(shuffled.sort(-1).values, labels)
    faults.close()
    slow = Faults(
        FaultSwitches(slow_rank=0, slow_factor=3.0, fault_from_step=3), seed=0, rank=0, world=2
    )
    added = []
    for step in (1, 2, 3):
        slow.slow_loader(step)
        added.append(slow._slept)
        time.sleep(0.05)  # the rank's own work of the step
    slow.close()
    # before fault_from_step nothing; then (slow_factor - 1) x its own step time, which is >= 0.05 s
    assert added[:2] == [0.0, 0.0] and added[2] >= 2 * 0.05, added


def test_a_run_resumed_at_another_dp_starts_its_history_again():
    """The rules' statistics depend on the ranks and the sequences each scores: at dp=4 with 2 per
    rank, a history from dp=2 with 4 would read as a drift the layout made. The resumed rules
    start again (a note says so), keep the ranks named so far, and still name a noisy gradient."""
    first = AlertMonitor(Alerts(), ["host0", "host1"], per_rank=4)
    for rec in itertools.islice(stream(2, 4), 30):
        first.update(rec)
    first.named["faulty_worker"] = {1}
    resumed = AlertMonitor(Alerts(), [f"host{r}" for r in range(4)], per_rank=2)
    note = resumed.load_state_dict(first.state_dict())
    assert "resumed at dp=4 with 2 sequence(s) per rank per step" in note and "dp=2 with 4" in note
    assert (
        resumed.seen == 0
        and not resumed.history
        and not resumed.states["single_rank_outlier"]["scores"]
    )
    assert resumed.named == {"faulty_worker": {1}}
    # at dp=4 from step 31: after the burn-in, a noisy gradient is still named
    later = [rec for rec in stream(4, 2, fault=_noisy(3)) if rec["step"] > 30]
    alerts = [a for rec in later for a in resumed.update(rec)]
    assert named(alerts, "faulty_worker")[0][1] == [3], alerts


def test_no_advice_from_a_noise_scale_that_is_not_positive():
    # the same data on every rank: the ranks' gradients agree and B_simple comes out <= 0
    assert run(stream(4, 2, fault=_noise_scale(-0.001)), 4) == []


def test_at_dp2_a_lasting_fault_keeps_the_rank_named_when_the_ranks_parted():
    from titanlite.diagnostics.rank_sum import rank_outlier

    scores = [(t, [-2.3, 2.3]) for t in range(91, 101)]  # rank 1 above rank 0 in every step
    quiet = lambda *_: False  # noqa: E731
    both = rank_outlier(scores, [], Alerts(), quiet)
    assert both.ranks == [0, 1] and "both named" in both.message
    kept = rank_outlier(scores, [], Alerts(), quiet, named={1})
    assert kept.ranks == [1] and "rank 1 is the one named when the ranks parted" in kept.message
