"""What a training step issues, counted (tests/workers/step_counts.py, 4 CPU ranks, debug model,
2 microbatches per rank): no host sync between log steps, and exactly the collectives the design
calls for on the main and the diagnostics groups, so extra communication cannot creep in.

The expected counts follow from the structure, per step with M microbatches, U FSDP units (the
blocks and the root), L blocks, B DDP buckets:
- FSDP all-gathers each unit's parameters in every forward and, for the R blocks that reshard
  after forward, again in backward: M (U + R). R = L - 1 (not the last block, not the root)
  with parallelism.reshard_after_forward = always; 0 where the params stay gathered until
  backward (auto, for a model this small);
- it reduce-scatters every unit's gradient on each microbatch that syncs: M U, or U when sync is
  skipped on non-final microbatches (and on measured steps, so the probe sees whole steps);
  on gloo each reduce-scatter is one all-to-all (titanlite.distributed.parallelize); HSDP adds
  one all-reduce across replicas per reduce-scatter;
- DDP all-reduces each bucket on the final microbatch: B;
- the loss normaliser is one all-reduce of the step's valid-token count; the gradient-norm clip
  under FSDP one functional all-reduce of the sharded norms (DTensor);
- diagnostics, measured step: `exact` reduces with an all-to-all (for DDP, plus an all-gather
  of the reduced shards) and adds a gather and a Gram all-reduce on its own group;
  `sketch` keeps the reduction and gathers twice on its own group (statistics, sketches); an
  unmeasured step issues nothing extra;
- a log step reads the metrics with one all-reduce, whatever the configuration (a mixture of
  experts' expert load included: it rides the metrics' read).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def counts(step_counts):
    return step_counts


def test_no_host_sync_outside_log_steps(counts):
    results = counts["host_syncs"]
    assert set(results) == {"fsdp_sketch", "ddp_exact_skip", "fsdp_moe"}
    for case, phases in results.items():
        assert phases.get("non_log", {}) == {}, (case, phases)
        # The instrument works: each of the 4 log steps (1, 3, 6, 7) reads the trainer's metrics
        # once and the diagnostics' once.
        assert phases["log"] == {"tolist": 8}, (case, phases)
    # Qwen3-MoE (train_configs/debug_moe.toml): its expert load rides the same reads
    assert counts["qwen3_moe"]["log"] == {"tolist": 8}, counts["qwen3_moe"]


RS = "alltoall_base"  # FSDP's reduce-scatter as titanlite does it on gloo


def expected(case: str, c: dict) -> dict:
    m, u = c["micro"], c["units"]
    gathers = m * (u + c["resharding"])
    tokens_and_clip = {"allreduce": 1, "all_reduce": 1}  # token count; FSDP's norm
    fsdp = {"_allgather_base": gathers, RS: m * u, **tokens_and_clip}
    skipped = {**fsdp, RS: u}
    # a measured step on the diagnostics' group: the gather, the Gram's all-reduce or the sketches'
    # gather, and the straggler barrier as the step starts (an all-reduce of one value)
    exact_probe = {"allgather": 1, "allreduce": 2}
    sketch_probe = {"allgather": 2, "allreduce": 1}
    return {
        "fsdp": {"main": fsdp},
        "fsdp_unmeasured": {"main": fsdp},
        "fsdp_reshard": {"main": fsdp},
        "fsdp_skip_sync": {"main": skipped},
        "ddp": {"main": {"allreduce": 1 + c.get("buckets", 0)}},
        "hsdp": {"main": {**fsdp, "allreduce": m * u + 1}},
        "fsdp_exact": {"main": skipped, "diagnostics": exact_probe},
        # The sketch adds up per microbatch, so a measured step reduces as an unmeasured one.
        "fsdp_sketch": {"main": fsdp, "diagnostics": sketch_probe},
        "fsdp_auto_accum4": {"main": fsdp, "diagnostics": sketch_probe},
        "ddp_exact": {
            "main": {
                "alltoall_base": c.get("buckets", 0),
                "allgather": c.get("buckets", 0),
                "allreduce": 1,
            },
            "diagnostics": exact_probe,
        },
        "hsdp_sketch": {"main": {**fsdp, "allreduce": m * u + 1}, "diagnostics": sketch_probe},
        # tests/fork_moe.py: the step-statistics pass's sums join the token count's all-reduce; its
        # forwards (no gradient) gather what the step's first forward would have, and once more
        # per microbatch each block that frees its parameters after forward
        "fsdp_moe": {"main": fsdp},
        "fsdp_moe_reshard": {"main": {**fsdp, "_allgather_base": gathers + m * c["resharding"]}},
        "ddp_moe": {"main": {"allreduce": 1 + c.get("buckets", 0)}},
    }[case]


def test_collectives_per_step_are_exactly_the_designed_ones(counts):
    results = counts["collectives"]
    assert len(results) == 14
    # auto keeps this small model's params gathered from forward to backward; always does not
    resharding = {case: c["resharding"] for case, c in results.items() if "buckets" not in c}
    assert resharding == {
        case: c["layers"] - 1 if case in ("fsdp_reshard", "fsdp_moe_reshard") else 0
        for case, c in results.items()
        if "buckets" not in c
    }
    for case, c in results.items():
        assert c["micro"] == (4 if case.endswith("accum4") else 2), (case, c)
        assert c["units"] == c["layers"] + 1 or "buckets" in c, (case, c)
        assert c["step"] == expected(case, c), (case, c["step"], expected(case, c))
        assert c["log"] == {"main": {"allreduce": 1}}, (case, c["log"])


def test_measured_steps_hold_no_unsharded_gradient_by_default(counts):
    """Between microbatches FSDP holds unsharded gradients only where the reduction is skipped:
    skip_grad_sync on, or a measured step the user asked `exact` for. A measured step under the
    default method holds none (the sketch adds up per microbatch), at accumulation 2 and 4 and
    under HSDP; the memory estimate counts exactly what is held."""
    results = counts["collectives"]
    holding = {"fsdp_skip_sync", "fsdp_exact"}
    for case, c in results.items():
        if "buckets" in c:
            continue  # DDP holds its whole gradient on every step, measured or not
        want = 4 * c["params"] if case in holding else 0
        assert c["held_grad_bytes"] == want, (case, c["held_grad_bytes"], want)
        assert c["estimated_held_bytes"] == want, (case, c["estimated_held_bytes"], want)
    assert results["fsdp_auto_accum4"]["method"] == "sketch"
    assert results["fsdp_exact"]["method"] == "exact"


def test_window_mean_leaves_out_skipped_steps(counts):
    """Log steps 1, 3, 6, 7; steps 2 and 5 have no valid token. Step 3's window (2, 3) trained
    only step 3, so its mean is step 3's loss, not half of it; step 6's averages steps 4 and 6.
    Every step has its row, the skipped ones without a loss."""
    rows = {r["step"]: r for r in counts["metrics"]}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6, 7]
    assert [s for s, r in rows.items() if r["skipped"]] == [2, 5] and rows[2][
        "loss"
    ] is None is rows[5]["loss"]
    recs = {s: r for s, r in rows.items() if r["row"] == "log"}
    assert sorted(recs) == [1, 3, 6, 7]
    assert recs[6]["loss_window_mean"] == pytest.approx(
        (rows[4]["loss"] + rows[6]["loss"]) / 2, rel=1e-12
    )
    assert recs[3]["skipped_steps"] == 1 and recs[3]["loss_window_steps"] == 1
    assert recs[3]["loss_window_mean"] == pytest.approx(recs[3]["loss"], rel=1e-12)
    assert recs[6]["skipped_steps"] == 1 and recs[6]["loss_window_steps"] == 2
    assert recs[7]["loss_window_mean"] == pytest.approx(recs[7]["loss"], rel=1e-12)


@pytest.mark.parametrize(
    "run, layers, experts, top_k",
    [("moe_metrics", 2, 4, 2), ("qwen3_moe_metrics", 4, 8, 2)],
)
def test_a_mixture_of_experts_reports_its_expert_load_at_log_steps(
    counts, run, layers, experts, top_k
):
    """tests/fork_moe.py and Qwen3-MoE (train_configs/debug_moe.toml) in training: every log
    step's row (1, 3, 6, 7) holds the expert load of its window per MoE layer, read with the
    log step's reads above; the other rows hold none. The figures agree with each other: the
    worst layer has the largest max/min, the most loaded expert holds at least an even share
    and at most 1/top_k of a layer's slots (a token picks an expert once), the least at most an
    even share. The diagnostics' record of a measured step holds each loss term's spread over the
    ranks beside the cross entropy's."""
    rows = {r["step"]: r for r in counts[run]}
    logged = {s for s, r in rows.items() if r["row"] == "log"}
    assert logged == {1, 3, 6, 7} and {s for s, r in rows.items() if "expert_load" in r} == logged
    names = [str(i) for i in range(layers)]
    for step in sorted(logged):
        load = rows[step]["expert_load"]
        assert list(load["max_min"]) == list(load["cv"]) == names, (step, load)
        assert all(x >= 1 for x in load["max_min"].values()), (step, load)
        assert all(0 <= x < 1 for x in load["cv"].values()), (step, load)
        assert load["max_min"][load["worst"]] == max(load["max_min"].values()), (step, load)
        most, least = load["most"], load["least"]
        assert 1 <= most["x_even"] <= experts / top_k and 0 <= least["x_even"] <= 1, (step, load)
        assert most["share"] == pytest.approx(most["x_even"] / experts, rel=1e-12)
        assert {most["layer"], least["layer"]} <= set(names), (step, load)
        assert 0 <= most["expert"] < experts and 0 <= least["expert"] < experts, (step, load)
        # the diagnostics (every log step here measures) add each loss term's spread over ranks
        spread = {f"term_{name}_std" for name in rows[step]["terms"]}
        assert spread and spread <= set(rows[step]["diag"]), (step, rows[step]["diag"])
