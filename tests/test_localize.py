"""The first divergence between two layouts' fingerprints (titanlite.analysis.localize over
titanlite.components.fingerprints), in one process: two layouts are the same global batch cut
into different microbatches. A correct model's fingerprints agree; batch statistics part at the
module that takes them, an auxiliary loss normalised by local tokens at the module it reads.
(The whole tool, with ranks, checkpoints and a rank-seeded noise: tests/test_invariance.py.)"""

from __future__ import annotations

import fork_planted  # noqa: F401  (registers the planted forks)
import pytest
import torch
import torch.distributed as dist
from fork_model import ForkArgs, ForkLM
from fork_moe import MoEArgs, MoELM
from fork_planted import AuxLocalLM, BatchStatsLM

from titanlite.analysis.localize import first_divergence, walk
from titanlite.components.fingerprints import Recorder, merge, summary
from titanlite.components.loss import sequence_losses
from titanlite.datasets.batch import Microbatch
from titanlite.distributed.param_init import ParamInit
from titanlite.models.step import LossPath
from titanlite.ops.cross_entropy import IGNORE_INDEX

ROWS, SEQ, VOCAB = 4, 16, 64


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "f"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, VOCAB, (2, ROWS, SEQ), generator=g)
    labels[0, 4:] = IGNORE_INDEX  # unequal valid tokens per sequence
    labels[2, 10:] = IGNORE_INDEX
    return tokens, labels


def _fingerprints(cls: type, cuts: list[int], args_cls: type = ForkArgs) -> dict:
    """One step of `cls` on the batch cut into microbatches at `cuts`, fingerprinted."""
    model = cls(args_cls(vocab_size=VOCAB, max_seq_len=SEQ))
    model.init_weights(ParamInit(model, 0))
    tokens, labels = _batch()
    bounds = [0, *cuts, ROWS]
    rec = Recorder(model, lambda m, n: list(range(bounds[m], bounds[m] + n)))
    losses, total, logged = rec.losses(sequence_losses), (labels != IGNORE_INDEX).sum(), 0.0
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        loss = (
            losses(
                model, Microbatch(tokens[lo:hi], labels[lo:hi]), LossPath(own=True, chunk=5)
            ).ce.sum()
            / total
        )
        loss.backward()
        logged += loss.detach()
    rec.parameters(model)
    return {"step": 1, **rec.gather(logged)}


@pytest.mark.parametrize(
    "cls, where", [(ForkLM, None), (BatchStatsLM, "tokens forward"), (AuxLocalLM, "router grad")]
)
def test_a_layout_change_parts_at_the_planted_module_only(one_rank, cls, where):
    whole, halves = _fingerprints(cls, []), _fingerprints(cls, [2])
    found = first_divergence(whole, halves, 1e-5)
    assert (found.where if found else None) == where, found and found.line()
    if found:
        assert found.line().startswith(f"first divergence: {where} at step 1: ")
    assert first_divergence(whole, whole, 0.0) is None


def test_a_token_major_output_is_fingerprinted_per_sequence(one_rank):
    """A router reads the tokens flattened ([B*S, dim] -> [B*S, experts]): its output and the
    gradient into it are summed per sequence like any other, the same over any cut of the batch,
    so --localize can name a router."""
    whole, halves = _fingerprints(MoELM, [], MoEArgs), _fingerprints(MoELM, [1, 3], MoEArgs)
    routers = [k for k in whole["order"] if ".router " in k]
    forward, backward = (
        [f"layers.{i}.router forward" for i in (0, 1)],
        [f"layers.{i}.router grad" for i in (1, 0)],
    )
    assert routers == forward + backward, routers
    assert len(whole["records"]["layers.0.router forward"]) == ROWS
    assert first_divergence(whole, halves, 1e-5) is None


def test_the_walk_is_forwards_then_gradients_then_reductions_then_the_output():
    order = [
        "a forward",
        "b forward",
        "(model) forward",
        "(model) grad",
        "b grad",
        "a grad",
        "w reduced grad",
    ]
    assert walk({"order": order}) == [
        "a forward", "b forward", "(model) grad", "b grad", "a grad", "w reduced grad", "(model) forward"
    ]  # fmt: skip
    rec = {
        "step": 3,
        "order": order,
        "loss": 1.0,
        "records": {k: {"0": [1.0, 1.0, 1.0]} for k in order},
    }
    bent = {
        **rec,
        "records": {
            **rec["records"],
            "(model) forward": {"0": [2.0, 4.0, 2.0]},
            "a grad": {"0": [1.0, 1.0, 2.0]},
        },
    }
    assert first_divergence(rec, bent, 1e-5).where == "a grad"  # before the output that it explains
    missing = {**rec, "records": {k: v for k, v in rec["records"].items() if k != "b grad"}}
    assert first_divergence(rec, missing, 1e-5).where.startswith("b grad (not run")
    assert first_divergence(rec, {**rec, "loss": 1.1}, 1e-5).where == "loss"


def test_a_split_sequence_sums_to_the_whole():
    """Pieces of a sequence on different ranks (context parallelism) add to its fingerprint."""
    x = torch.randn(3, 12, 5)
    pieces = torch.tensor(summary(x[:, :7]), dtype=torch.float64) + torch.tensor(
        summary(x[:, 7:]), dtype=torch.float64
    )
    assert torch.allclose(pieces, torch.tensor(summary(x), dtype=torch.float64), rtol=1e-12)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_a_tensor_splits_ranks_count_what_they_compute_alike_once(dp, tp):
    """Generated over dp x tp worlds (tp innermost): a value every rank of a tensor split holds
    alike (a block run whole, the losses) counts once per split, pieces and slices add; so the
    merged record is the unsplit layout's whatever the degree."""
    g = torch.Generator().manual_seed(dp * 10 + tp)
    whole = {d: torch.randn(4, 8, generator=g) for d in range(dp)}  # each dp rank's own rows
    everyone = []
    for d in range(dp):
        pieces = whole[d].chunk(tp, dim=1)
        for t in range(tp):
            row = 10 * d  # each dp rank's sequence
            everyone.append(
                {
                    "replicated forward": {row: summary(whole[d].reshape(1, -1))[0]},
                    "split forward": {row: summary(pieces[t].reshape(1, -1))[0]},
                }
            )
    merged: dict = {}
    merge(everyone, tp, merged)
    for d in range(dp):
        want = summary(whole[d].reshape(1, -1))[0]
        for key in ("replicated forward", "split forward"):
            assert merged[key][10 * d] == pytest.approx(want, rel=1e-12), (key, d)
