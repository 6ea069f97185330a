"""Gradient exactness and init invariance over FSDP/DDP/HSDP, dp in {1, 2, 4}, accum in {1, 2, 4};
packed sequences against their records one by one; the eval loss at every dp;
tied embeddings in every mode; the reduce dtype honoured by FSDP and DDP; the GPU's default
configuration (bf16 parameters, checkpointing, chunked loss, packing, compile) within bf16
rounding of the fp32 reference.

One torchrun per world size runs every case (tests/workers/exactness.py); these tests read its
results. Labels are deliberately imbalanced: a rank-microbatch with no valid token at all, and
ranks whose valid-token counts differ by 10x or more.
"""

from __future__ import annotations

import pytest
from fork_tp_controls import TP_CONTROLS
from helpers import BF16_GRAD_TOL, BF16_U

from titanlite.analysis.check_cases import MODES
from titanlite.analysis.model_check import verdicts

WORLDS = (1, 2, 4)
TOL = 1e-5


@pytest.fixture(scope="module")
def results(exactness):
    assert tuple(exactness) == WORLDS
    return exactness


@pytest.mark.parametrize("world", WORLDS)
def test_gradient_equals_single_process_global_batch(results, world):
    cases = [c for c in results[world]["cases"] if c["norm"] == "global"]
    modes = {(c["mode"], c["accum"]) for c in cases}
    assert modes >= {(m, a) for m in ("fsdp", "ddp", "hsdp") for a in (1, 2, 4)}
    for c in cases:
        assert c["max_rel_err"] <= TOL, c
        assert (
            abs(c["logged_loss"] - results[world]["ref_loss"]) <= TOL * results[world]["ref_loss"]
        ), c


@pytest.mark.parametrize("world", WORLDS)
def test_local_mean_control_is_measurably_wrong(results, world):
    cases = [c for c in results[world]["cases"] if c["norm"] == "local_mean"]
    assert cases
    for c in cases:
        assert c["max_rel_err"] > 1e3 * TOL, c


def test_labels_really_are_imbalanced(results):
    """The exactness test is only meaningful if the imbalance it claims is there."""
    for world in (2, 4):
        case = next(c for c in results[world]["cases"] if c["accum"] == 4)
        assert case["min_micro_tokens"] == 0  # some rank has a microbatch without a valid token
        tokens = case["rank_tokens"]
        assert max(tokens) >= 10 * max(1, min(tokens))


def test_both_sync_modes_are_covered(results):
    seen = {(c["mode"], c["skip_grad_sync"]) for c in results[4]["cases"]}
    assert {("fsdp", True), ("fsdp", False), ("hsdp", True), ("hsdp", False), ("ddp", True)} <= seen


def test_activation_checkpointing_changes_neither_init_nor_gradient(results):
    cases = [c for w in WORLDS for c in results[w]["cases"] if c["activation_checkpoint"] != "none"]
    assert {(c["mode"], c["activation_checkpoint"]) for c in cases} == {
        (m, ac) for m in ("fsdp", "ddp") for ac in ("full", "selective")
    }
    assert len(cases) == 4 * len(WORLDS)
    assert all(c["max_rel_err"] <= TOL for c in cases)


def test_chunked_loss_inside_the_model_is_exact_in_every_mode(results):
    """The output projection and cross entropy 5 positions at a time, inside the root's forward
    (FSDP has the head unsharded there), recomputed chunk by chunk in backward: the same reduced
    gradient and logged loss as the single-process reference, tied head included."""
    for w in WORLDS:
        cases = [c for c in results[w]["cases"] + results[w]["tied_cases"] if c["loss_chunk"]]
        assert {(c["mode"], c["tied"]) for c in cases} == {
            ("fsdp", False),
            ("ddp", False),
            ("hsdp", False),
            ("fsdp", True),
        }
        assert all(c["max_rel_err"] <= TOL for c in cases), cases


def test_initial_weights_are_bitwise_identical_across_dp_and_mode(results):
    hashes = {c["init_hash"] for w in WORLDS for c in results[w]["cases"]}
    hashes |= {results[w]["ref_hash"] for w in WORLDS}
    assert len(hashes) == 1


@pytest.mark.parametrize("world", WORLDS)
def test_the_logged_gradient_norm_is_the_reduced_gradients_norm_in_every_mode(results, world):
    """clip_grad_norm_'s norm of a known gradient (tensors of a million values, where a float32
    norm on a CPU drifts about 1e-5) equals its float64 norm taken whole, at every sharding, so
    two layouts' logged norms differ only as their gradients do."""
    cases = results[world]["grad_norm_cases"]
    assert [c["mode"] for c in cases] == ["fsdp", "ddp", "hsdp"] and cases[0]["largest"] >= 2**20
    for c in cases:
        assert c["logged"] == pytest.approx(c["reference"], rel=1e-12, abs=0), c
    assert cases[0]["reference"] == results[1]["grad_norm_cases"][0]["reference"]


@pytest.mark.parametrize("world", WORLDS)
def test_tied_embeddings_stay_tied_with_exact_gradient_and_init_in_every_mode(results, world):
    """Llama 3.2's layout: the output head is the embedding. DDP materialises an unsharded
    model, whose to_empty() would give the head a parameter of its own, left uninitialised."""
    cases = results[world]["tied_cases"]
    assert {c["mode"] for c in cases} == {"fsdp", "ddp", "hsdp"}
    for c in cases:
        assert c["tied"], c
        assert c["max_rel_err"] <= TOL, c
        assert c["init_hash"] == results[world]["tied_ref_hash"], c


@pytest.mark.parametrize("world", (2, 4))
def test_bf16_reduce_is_honoured_by_fsdp_and_ddp(results, world):
    """training.mixed_precision_reduce = bfloat16: every reduced gradient value is a bf16
    number (a float32 reduction of float32 gradients leaves almost none so, as the float32
    cases show), within bf16 rounding of the exact gradient."""
    cases = results[world]["reduce_cases"]
    assert {c["mode"] for c in cases} == {"fsdp", "ddp"}
    for c in cases:
        assert c["reduce_dtype"] == "bfloat16" and c["bf16_values"], c
        # One rounding of each gradient, then the reduction's partial sums (3 at dp 4), random
        # in sign: sqrt(4) u. Measured 0.7u to 0.8u.
        assert 1e-6 < c["max_rel_err"] <= 2 * BF16_U, c
    fp32 = [c for c in results[world]["cases"] if c["mode"] in ("fsdp", "ddp") and c["accum"] == 2]
    assert fp32 and not any(c["bf16_values"] for c in fp32)


@pytest.mark.parametrize("world", WORLDS)
def test_gpu_defaults_in_bf16_stay_within_bf16_rounding_of_the_fp32_reference(results, world):
    """bf16 parameters (FSDP's mixed precision, DDP's autocast) with fp32 and bf16 reduction,
    activation checkpointing, the chunked loss and packed sequences, in every mode: the gradient
    within BF16_GRAD_TOL of the fp32 single-process one and the logged loss within u of its; and
    really computed in bf16 (more than u/4 off, where fp32 is 1e-6 off)."""
    cases = results[world]["bf16_cases"]
    covered = {
        (
            c["mode"],
            c["reduce_dtype"][:4],
            c["activation_checkpoint"],
            c["loss_chunk"] > 0,
            c["packed"],
        )
        for c in cases
    }
    modes = ("fsdp", "ddp", "hsdp")
    assert covered >= {(m, r, "none", False, False) for m in modes for r in ("floa", "bflo")}
    assert covered >= {(m, "floa", "none", True, False) for m in modes}  # chunked loss
    assert covered >= {(m, "floa", "none", False, True) for m in modes}  # packed
    assert covered >= {(m, "floa", ac, False, False) for m, ac in
                       (("fsdp", "selective"), ("ddp", "selective"), ("fsdp", "full"), ("hsdp", "full"))}  # fmt: skip
    for c in cases:
        ref_loss = c.get("ref_loss", results[world]["ref_loss"])
        assert c["param_dtype"] == "bfloat16" and BF16_U / 4 < c["max_rel_err"] <= BF16_GRAD_TOL, c
        assert abs(c["logged_loss"] - ref_loss) <= BF16_U * ref_loss, c


def test_compile_keeps_the_bf16_numbers(results):
    """The GPU default compiled (FSDP, bf16, selective checkpointing; one case, compiling is
    slow on a CPU): within the bf16 bound of the fp32 reference, and its loss within u of the
    eager run's. The probe under compile: tests/test_diagnostics.py."""
    cases = results[2]["bf16_cases"]
    (compiled,) = [c for c in cases if c["compile"]]
    key = ("mode", "reduce_dtype", "activation_checkpoint", "loss_chunk", "packed")
    (eager,) = [c for c in cases if not c["compile"] and all(c[k] == compiled[k] for k in key)]
    assert (compiled["mode"], compiled["activation_checkpoint"]) == ("fsdp", "selective")
    assert BF16_U / 4 < compiled["max_rel_err"] <= BF16_GRAD_TOL, compiled
    assert abs(compiled["logged_loss"] - eager["logged_loss"]) <= BF16_U * eager["logged_loss"]


@pytest.mark.parametrize("world", WORLDS)
def test_packed_sequences_train_as_their_records_one_by_one_in_every_mode(results, world):
    """Packed SFT: records sharing sequences (positions restart per record, so attention stays
    inside each) give the gradient and loss of every record run as a sequence of its own, at
    every dp and mode: packing keeps dp invariance."""
    cases = results[world]["packed_cases"]
    assert {c["mode"] for c in cases} == {"fsdp", "ddp", "hsdp"}
    for c in cases:
        assert c["max_rel_err"] <= TOL, c
        assert abs(c["logged_loss"] - c["ref_loss"]) <= TOL * c["ref_loss"], c


def test_eval_loss_is_the_same_at_every_dp_and_eval_batch(results):
    """The held-out loss (summed loss and valid tokens all-reduced) at dp 1, 2, 4 and eval batch
    1 or 3 (the last round padded with label-less items): one value to 1e-6; the model is left
    in training mode."""
    cases = [c for w in WORLDS for c in results[w]["eval_cases"]]
    assert {(c["world"], c["batch"]) for c in cases} == {(w, b) for w in WORLDS for b in (1, 3)}
    base = cases[0]
    for c in cases:
        assert c["tokens"] == base["tokens"] > 0 and c["sequences"] == 13, c
        assert abs(c["loss"] - base["loss"]) <= 1e-6 * base["loss"], (c, base)
        assert c["training"], c


@pytest.mark.parametrize("world", WORLDS)
def test_generation_keeps_every_rank_in_lockstep_under_fsdp(results, world):
    """Decoding under FSDP (every forward collective): greedy and top-p continuations are the
    same on every rank, though each rank's sampling generator has its own seed (rank 0's choice is
    broadcast), and greedy equals the unsharded model's."""
    g = results[world]["generate"]
    assert len(g["every_rank"]) == world
    assert all(r == g["every_rank"][0] for r in g["every_rank"])
    greedy, sampled = g["every_rank"][0]
    assert greedy == g["unsharded"] and all(len(x) == 8 for x in greedy + sampled)


def test_a_fork_model_written_from_the_contract_passes_the_model_check(results):
    """tests/fork_model.py, written only from the registry's docstring and registered from
    outside the package, through scripts/check_model.py's cases: every mode at accumulation 1
    and 2 on unequal tokens, packed with the loss in chunks; gradient, logged loss and initial
    weights equal one process's."""
    checks = [results[w]["fork_check"] for w in WORLDS]
    for c in checks:
        assert {(x["mode"], x["packed"], x["loss_chunk"]) for x in c["cases"]} == {
            (m, p, 5 if p else 0) for m in ("fsdp", "ddp", "hsdp") for p in (False, True)
        }
    failed = [(what, detail) for what, ok, detail in verdicts(checks) if not ok]
    assert not failed and len(verdicts(checks)) > 3 * len(WORLDS) * 3, failed


def test_every_loss_term_a_model_adds_is_exact_and_the_per_microbatch_formula_is_not(results):
    """tests/fork_moe.py through scripts/check_model.py's cases at dp 1, 2 and 4, accumulation 1
    and 2, fsdp, ddp and hsdp, the loss whole and in chunks: the load-balancing loss over the
    whole step (the statistics pass) and the z-loss give one process's gradient and terms, at
    coefficients 0.001 and 0.1. transformers' formula applied to each microbatch is exact only at
    one microbatch in one process: its gradient and its term fail everywhere else."""
    for flavor in ("tiny", "strong"):
        checks = [results[w]["moe_checks"][f"fork_moe/{flavor}"] for w in WORLDS]
        lines = verdicts(checks)
        failed = [(what, detail) for what, ok, detail in lines if not ok]
        terms = {what.split()[1] for what, _, _ in lines if what.startswith("term ")}
        assert not failed and terms == {"aux", "z"} and len(lines) == 3 * 27 + 1, failed
    control = [results[w]["moe_checks"]["fork_moe_local/tiny"] for w in WORLDS]
    passed = {
        what
        for what, ok, _ in verdicts(control)
        if ok and what.startswith(("gradient", "term aux"))
    }
    alone = {
        f"{k} dp=1 {m} accum=1 unequal tokens"
        for k in ("gradient", "term aux")
        for m in ("fsdp", "ddp", "hsdp")
    }
    assert passed == alone, sorted(passed ^ alone)


def test_qwen3_moe_is_exact_at_every_layout(results):
    """titanlite's Qwen3-MoE (flavors tiny and tiny_strong: two MoE layers around a dense one)
    through scripts/check_model.py's cases at dp 1, 2 and 4: fsdp, ddp and hsdp at accumulation
    1 and 2 on unequal tokens and on packed documents with the loss in chunks, and the same
    with tp=2 at world 2 and 4 (attention and the dense layer split, the experts whole). The gradient, the
    logged loss, the load-balancing term over the step (tiny: the layers pooled at 0.001, as
    transformers'; tiny_strong: each layer's own at 0.1) and the z-loss (with 0.1) equal one
    process's; so do the initial weights."""
    for flavor, want in (("tiny", {"aux"}), ("tiny_strong", {"aux", "z"})):
        checks = [results[w]["moe_checks"][f"qwen3_moe/{flavor}"] for w in WORLDS]
        lines = verdicts(checks)
        failed = [(what, detail) for what, ok, detail in lines if not ok]
        terms = {what.split()[1] for what, _, _ in lines if what.startswith("term ")}
        per_case = 1 + len(want)  # the gradient's line and a line per term
        # 27 data-parallel cases at dp 1, 2, 4; 12 with tp=2 (3 modes x unequal, packed at world 2, 4)
        assert not failed and terms == want and len(lines) == per_case * (27 + 12) + 1, failed


def test_llama3_is_exact_with_a_tensor_split_in_every_mode(results):
    """titanlite's Llama 3 (the model check's size, head untied and tied) through
    scripts/check_model.py's cases: at dp x tp = 1 x 2 and 2 x 2 in fsdp, ddp and hsdp, on
    unequal tokens and on packed documents with the vocab-parallel loss in chunks, the gradient,
    its norm (the one clipping reads, over parameters on two meshes), the logged loss and the
    initial weights are one process's; so are its plain data-parallel cases at dp 1, 2 and 4."""
    for flavor in ("tiny", "tiny_tied"):
        checks = [results[w]["tensor_checks"][f"llama3/{flavor}"] for w in WORLDS]
        split = {
            (r["world"], c["mode"], c["packed"])
            for r in checks
            for c in r["cases"]
            if c["axis"] == "tp"
        }
        assert split == {(w, m, p) for w in (2, 4) for m in MODES for p in (False, True)}
        failed = [(what, detail) for what, ok, detail in verdicts(checks) if not ok]
        assert not failed, failed


@pytest.mark.parametrize("control", TP_CONTROLS)
def test_each_planted_tensor_parallel_defect_fails_on_the_gradient_with_the_loss_exact(
    results, control
):
    """tests/fork_tp_controls.py: the backward's sum over tp left out, a vocab-parallel loss
    differentiated on each rank's slice alone, a norm's replicated weight whose gradient is never
    summed over tp, a router's counts all-reduced in place over tp. Each fails the model check's
    gradient at every tensor-split case, in every mode, while its logged cross entropy is one
    process's; its plain data-parallel cases pass (the router's load-balancing term, which the
    doubled counts scale, fails with its gradient)."""
    checks = [results[w]["tensor_checks"][f"{control}/tiny"] for w in WORLDS]
    cases = [c for r in checks for c in r["cases"]]
    split = [c for c in cases if c["axis"] == "tp"]
    assert len(split) == 12 and all(c["max_rel_err"] > 1e3 * TOL for c in split), split
    assert all(abs(c["logged"]["loss"] / c["ref"]["loss"] - 1) <= TOL for c in split), split
    assert all(c["max_rel_err"] <= TOL for c in cases if not c["axis"])
    lines = verdicts(checks)
    failed = {what for what, ok, _ in lines if not ok}
    assert {w for w, _, _ in lines if w.startswith("gradient") and "x tp=2" in w} <= failed
    assert all("x tp=2" in w and w.startswith(("gradient", "term aux")) for w in failed), failed


def test_a_context_parallel_fork_is_exact_at_every_split(results):
    """tests/fork_cp.py (Ulysses attention over the cp axis, written from the contract's
    axis rules for a sequence split): at dp x cp = 1 x 2 and 2 x 2 in every mode, on unequal tokens and
    packed documents (whose boundaries cross the pieces), the gradient and logged loss are one
    process's; so are its plain data-parallel cases at dp 1, 2 and 4."""
    checks = [results[w]["context_check"] for w in WORLDS]
    split = {
        (r["world"], c["mode"], c["packed"])
        for r in checks
        for c in r["cases"]
        if c["axis"] == "cp"
    }
    assert split == {
        (w, m, p) for w in (2, 4) for m in ("fsdp", "ddp", "hsdp") for p in (False, True)
    }
    failed = [(what, detail) for what, ok, detail in verdicts(checks) if not ok]
    assert not failed and sum("x cp=2" in what for what, _, _ in verdicts(checks)) == 12, failed


def test_dropout_keyed_by_sample_is_exact_at_any_layout(results):
    """With model.dropout_masks = "sample" a dropout run's gradient is one process's at every
    dp, accumulation and mode, checkpointing included: dropout runs are dp-invariant. Masks from
    torch's RNG, cut over 2 microbatches, are not (the control)."""
    for w in WORLDS:
        cases = results[w]["dropout_cases"]
        keyed = [c for c in cases if c["keyed"]]
        assert {(c["mode"], c["activation_checkpoint"]) for c in keyed} == {
            ("fsdp", "none"),
            ("ddp", "none"),
            ("hsdp", "none"),
            ("fsdp", "full"),
        }
        assert all(c["dropout"] == 0.3 and c["max_rel_err"] <= TOL for c in keyed), keyed
        (stream,) = [c for c in cases if not c["keyed"]]
        assert stream["max_rel_err"] > 1e3 * TOL, stream
