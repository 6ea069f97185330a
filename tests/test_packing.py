"""Packed SFT and document masks: the packing plan, positions that restart per document, the
model's per-document attention (a packed sequence = its records one by one), the held-out split.
Across ranks and layouts: tests/test_distributed.py (packed_cases, eval_cases)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from titanlite.config import parse_args
from titanlite.datasets.build import build_dataset, build_eval_dataset, build_tokenizer, collate
from titanlite.datasets.prepared import Prepared
from titanlite.datasets.sequences import (
    HeldOut,
    PackedSFTDataset,
    SFTDataset,
    best_fit_decreasing,
    restart_positions,
)
from titanlite.distributed.param_init import ParamInit
from titanlite.models.attention import attend, block_document_mask, dense_document_mask
from titanlite.models.llama3 import Llama3, Llama3Args
from titanlite.ops.cross_entropy import IGNORE_INDEX, cross_entropy_per_sample

ARGS = Llama3Args(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, multiple_of=16, max_seq_len=32
)


def _reference_bfd(costs: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing by brute force: each item, longest first, into the fullest bin it fits."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        fits = [b for b in range(len(bins)) if room[b] >= costs[i]]
        b = min(fits, key=lambda b: (room[b], b), default=None)
        if b is None:
            bins.append([])
            room.append(capacity)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= costs[i]
    return bins


def test_best_fit_decreasing_matches_brute_force_and_holds_every_item_once():
    rng = np.random.default_rng(0)
    for _ in range(300):
        capacity = int(rng.integers(1, 40))
        costs = rng.integers(1, capacity + 1, int(rng.integers(1, 60)))
        members, starts = best_fit_decreasing(costs, capacity)
        assert sorted(members.tolist()) == list(range(len(costs)))
        loads = [
            int(costs[members[a:b]].sum()) for a, b in zip(starts[:-1], starts[1:], strict=True)
        ]
        assert max(loads) <= capacity
        assert len(loads) == len(_reference_bfd(costs.tolist(), capacity))


def test_restart_positions_count_from_each_document_start():
    got = restart_positions(np.array([3, 5]), 9)
    assert got.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert restart_positions(np.array([0, 9]), 4).tolist() == [0, 1, 2, 3]  # a start past the end


def _model(args: Llama3Args = ARGS) -> Llama3:
    model = Llama3(args)
    model.init_weights(ParamInit(model, 3))
    return model


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("tied", [False, True])
def test_a_packed_sequence_gives_its_records_losses_and_gradients(tied):
    """Three records packed into one sequence of 32 (padding after them) with positions that
    restart per record: each record's summed loss and the total gradient equal those of the
    records run one by one, to 1e-6 in fp32. Without the positions, attention crosses records."""
    torch.manual_seed(0)
    model = _model(dataclasses.replace(ARGS, tie_embeddings=tied))
    recs = [torch.randint(0, 50, (n,)) for n in (9, 13, 5)]
    labels = [r[1:].clone() for r in recs]
    labels[1][:4] = IGNORE_INDEX  # a prompt
    inputs = torch.zeros(1, 32, dtype=torch.long)
    packed_labels = torch.full((1, 32), IGNORE_INDEX)
    at, starts = 0, []
    for r, y in zip(recs, labels, strict=True):
        inputs[0, at : at + len(y)], packed_labels[0, at : at + len(y)] = r[:-1], y
        starts.append(at)
        at += len(y)
    positions = torch.from_numpy(restart_positions(np.array([*starts, at]), 32))[None]

    per_token = torch.nn.functional.cross_entropy(
        model(inputs, positions=positions)[0],
        packed_labels[0],
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    packed_sums = [per_token[s : s + len(y)].sum() for s, y in zip(starts, labels, strict=True)]
    sum(packed_sums).backward()
    packed_grad = _grads(model)
    model.zero_grad()
    alone = [
        cross_entropy_per_sample(model(r[None, :-1]), y[None])[0]
        for r, y in zip(recs, labels, strict=True)
    ]
    sum(alone).backward()
    for a, b in zip(packed_sums, alone, strict=True):
        assert abs(a.item() - b.item()) <= 1e-6 * abs(b.item())
    assert ((packed_grad - _grads(model)).norm() / _grads(model).norm()).item() <= 1e-6
    leaky = cross_entropy_per_sample(model(inputs), packed_labels)[0]
    assert abs(leaky.item() - sum(alone).item()) > 1e-3


def test_positions_of_one_document_are_plain_causal_attention_and_flex_matches_dense():
    torch.manual_seed(1)
    model = _model()
    x = torch.randint(0, 50, (2, 32))
    whole = torch.arange(32).expand(2, 32)
    torch.testing.assert_close(model(x, positions=whole), model(x), rtol=1e-6, atol=1e-6)
    positions = torch.from_numpy(restart_positions(np.array([7, 20, 29]), 32)).expand(2, 32)
    q, k, v = torch.randn(3, 2, 4, 32, 8).unbind(0)
    with pytest.warns(UserWarning, match="flex_attention called without torch.compile"):
        flex = attend(q, k, v, block_document_mask(positions))  # CUDA's path, run eagerly here
    torch.testing.assert_close(
        flex, attend(q, k, v, dense_document_mask(positions)), rtol=1e-5, atol=1e-6
    )


def _cfg(*args: str, seq_len: int = 128):
    base = ["--training.global_batch_size", "4", "--training.local_batch_size", "2"]
    return parse_args([*base, "--training.seq_len", str(seq_len), *args])[0]


def test_packed_sft_holds_every_record_once_as_it_is_alone(prepared_sft):
    """Every record of the built-in SFT set (that has a label to train) is in exactly one pack,
    with the inputs and labels it has alone, positions restarting at it, and its source in the
    trace; at seq_len 1,024 padding falls from most of the unpacked set to a few percent."""
    seq = 1024
    cfg = _cfg("--data.mode", "sft", "--data.path", prepared_sft, seq_len=seq)
    tok = build_tokenizer(cfg)
    data = Prepared(prepared_sft)
    alone = SFTDataset(data, seq, tok.pad_id)
    packed = PackedSFTDataset(data, seq, tok.pad_id)
    seen = []
    for i in range(len(packed)):
        inputs, labels, positions = packed[i]
        records = packed.records(i).tolist()
        starts = np.flatnonzero(positions == 0)
        trace = packed.trace(i)
        assert [t["row"] for t in trace] == [data.source(r)["row"] for r in records]
        assert len(starts) == len(records) + (packed.content_slots(i) < seq)  # padding: one more
        for r, a in zip(records, starts, strict=False):
            n = int(packed.slots[r])
            x, y = alone[r]
            assert (inputs[a : a + n] == x[:n]).all() and (labels[a : a + n] == y[:n]).all()
        seen += records
    slots = packed.slots
    assert sorted(seen) == np.flatnonzero(slots > 0).tolist()
    pad_alone = 1 - sum(alone.content_slots(i) for i in range(len(alone))) / (seq * len(alone))
    pad_packed = 1 - sum(packed.content_slots(i) for i in range(len(packed))) / (seq * len(packed))
    print(
        f"padding: unpacked {pad_alone:.1%}, packed {pad_packed:.1%} ({len(alone)} -> {len(packed)} sequences)"
    )
    assert pad_alone > 0.5 and pad_packed < 0.05

    cfg = _cfg(
        "--data.mode", "sft", "--data.path", prepared_sft, "--data.packing", "true", seq_len=seq
    )
    built = build_dataset(cfg, tok)
    assert len(built) == len(packed) and all(
        (a == b).all() for a, b in zip(built[5], packed[5], strict=True)
    )
    batch = collate([built[0], built[1]])
    assert batch.positions.shape == batch.inputs.shape == (2, seq)


def test_document_mask_positions_restart_at_each_pretraining_document():
    cfg = _cfg("--data.document_mask", "true")
    ds = build_dataset(cfg, build_tokenizer(cfg))
    restarts = 0
    for i in range(0, 40, 3):
        inputs, labels, positions = ds[i]
        assert (labels[:-1] == inputs[1:]).all()
        starts = {t["tokens"][0] == 0 for t in ds.trace(i)}
        expect = [0] + [a for a in np.flatnonzero(positions == 0).tolist() if a > 0]
        pieces = ds.trace(i)
        # every document after the window's first begins at a 0; the first one at slot 0
        offsets = np.cumsum([0] + [t["tokens"][1] - t["tokens"][0] for t in pieces[:-1]]).tolist()
        assert expect == [o for o in offsets if o < 128], (expect, offsets)
        restarts += len(expect) - 1
        assert starts
    assert restarts > 0
    plain = build_dataset(_cfg(), build_tokenizer(cfg))
    assert len(plain[0]) == 2 and (plain[0][0] == ds[0][0]).all()


def test_held_out_split_is_disjoint_complete_and_decided_by_seed_alone():
    for n in (7, 9_999, 10_000, 23_456):
        held = HeldOut(n, 0.05, seed=3)
        train = held.indices("train", np.arange(held.size("train")))
        evals = held.indices("eval", np.arange(held.size("eval")))
        assert sorted(np.concatenate([train, evals]).tolist()) == list(range(n))
        if n >= 10_000:
            assert abs(len(evals) / n - 0.05) < 0.01
    a, b = HeldOut(30_000, 0.01, 1), HeldOut(30_000, 0.01, 2)
    assert (
        a.indices("eval", np.arange(300))
        == HeldOut(30_000, 0.01, 1).indices("eval", np.arange(300))
    ).all()
    assert not (a.indices("eval", np.arange(300)) == b.indices("eval", np.arange(300))).all()


def test_eval_fraction_holds_records_out_of_training_packs(prepared_sft):
    base = ("--data.mode", "sft", "--data.path", prepared_sft, "--data.packing", "true")
    cfg = _cfg(*base, "--eval.fraction", "0.1")
    tok = build_tokenizer(cfg)
    train, held = build_dataset(cfg, tok), build_eval_dataset(cfg, tok)
    train_rows = {t["row"] for i in range(len(train)) for t in train.trace(i)}
    eval_rows = {t["row"] for i in range(len(held)) for t in held.trace(i)}
    assert train_rows and eval_rows and not train_rows & eval_rows
    assert 0.07 < len(eval_rows) / (len(train_rows) + len(eval_rows)) < 0.13
    capped = build_eval_dataset(
        _cfg(*base, "--eval.fraction", "0.1", "--eval.max_sequences", "5"), tok
    )
    assert len(capped) == 5 and capped.trace(4) == held.trace(4 * len(held) // 5)
    assert build_eval_dataset(_cfg(*base), tok) is None
