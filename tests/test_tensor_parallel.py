"""A tensor split's rules and pieces in one process: what a run with one refuses, in one line,
before any worker starts (generated over the keys and degrees); the head and key-value counts a
degree must divide; the vocabulary slices the vocab-parallel loss reads against DTensor's own
cut; the memory estimate's prices per rank. Its exactness at dp x tp in every mode:
tests/test_distributed.py (the exactness worker)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

from titanlite.config import JobConfig
from titanlite.config.layout import resolve_layout
from titanlite.errors import UserError
from titanlite.models.common.tensor_parallel import check_tensor_split
from titanlite.models.llama3 import Llama3, Llama3Args
from titanlite.models.registry import build_meta_model
from titanlite.ops.vocab_parallel import vocab_slice
from titanlite.tools.memory import estimate_memory
from titanlite.validation import validate

# (key, value, words of its refusal): what a run with a tensor split cannot do in this version
REFUSED = [
    ("model.dropout", 0.1, "dropout on the residual stream's pieces"),
    ("training.compile", True, "compiling blocks whose tensors are DTensors"),
]


def _config(degree: int, **values) -> JobConfig:
    cfg = JobConfig()
    cfg.parallelism.axes = [f"tp={degree}"]
    cfg.diagnostics.enable = False
    cfg.training.global_batch_size, cfg.training.local_batch_size = 8, 1
    for key, value in values.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.mark.parametrize("key, value, words", REFUSED)
@pytest.mark.parametrize("degree", [2, 4])
def test_what_a_tensor_split_cannot_do_is_refused_in_one_line(key, value, words, degree):
    validate(_config(degree), 2 * degree)  # the run itself is fine
    with pytest.raises(UserError) as e:
        validate(_config(degree, **{key: value}), 2 * degree)
    line = str(e.value)
    assert line.startswith(f"{key} with parallelism.axes tp={degree}: {words}") and "\n" not in line


@pytest.mark.parametrize("method", ["auto", "exact", "sketch"])
@pytest.mark.parametrize("degree", [2, 4])
def test_the_diagnostics_run_with_a_tensor_split_in_every_mode(degree, method):
    """The sketch runs in every mode; exact replaces the gradient's reduction, which it cannot
    under hsdp nor under ddp with a tensor split (torch's replicate all-reduces inside FSDP): one
    line before any worker starts, and `auto` picks the sketch there."""
    for mode, replicate in (("fsdp", 1), ("hsdp", 2), ("ddp", 2)):
        cfg = _config(degree, **{"diagnostics.enable": True, "diagnostics.method": method})
        cfg.parallelism.mode, cfg.parallelism.dp_replicate = mode, replicate
        world = 2 * replicate * degree if mode == "hsdp" else 2 * degree
        if mode != "fsdp" and method == "exact":
            with pytest.raises(UserError) as e:
                validate(cfg, world)
            line = str(e.value)
            assert line.startswith(
                "diagnostics.method 'exact' needs fsdp or ddp without a tensor split (under "
                f"{mode} "
            )
            assert line.endswith("use diagnostics.method = 'sketch' or 'auto'") and "\n" not in line
        else:
            want = "sketch" if mode != "fsdp" and method == "auto" else None
            got = validate(cfg, world).diagnostics_method
            assert got == (want or got) and got in ("exact", "sketch")
        cfg.diagnostics.enable = False
        validate(cfg, world)


@pytest.mark.parametrize("seq_len, degree", [(6, 4), (9, 2), (10, 4), (8, 3)])
def test_a_sequence_the_tensor_split_cannot_cut_into_equal_pieces_is_refused(seq_len, degree):
    cfg = _config(degree, **{"training.seq_len": seq_len})
    with pytest.raises(UserError, match=f"training.seq_len {seq_len} does not split into {degree}"):
        resolve_layout(cfg, degree)


CASES = [
    c for c in itertools.product([4, 6, 8], [1, 2, 3], [48, 96], [2, 3, 4]) if c[0] % c[1] == 0
]


@pytest.mark.parametrize("heads, kv_heads, hidden, degree", CASES)
def test_head_and_hidden_counts_a_degree_does_not_divide_are_refused(
    heads, kv_heads, hidden, degree
):
    """Generated: a refusal exactly when some count is not a multiple of the degree, naming the
    first block's count and a degree that fits."""
    args = Llama3Args(
        dim=48, n_layers=1, n_heads=heads, n_kv_heads=kv_heads, vocab_size=64, hidden_dim=hidden
    )
    with torch.device("meta"):
        model = Llama3(args)
    counts = {
        "attention heads": heads,
        "key-value heads": kv_heads,
        "feed-forward hidden units": hidden,
    }
    bad = [(what, n) for what, n in counts.items() if n % degree]
    if not bad:
        check_tensor_split(model, degree)
        return
    with pytest.raises(UserError) as e:
        check_tensor_split(model, degree)
    what, n = bad[0]
    assert f"has {n} {what}, which {degree} ranks cannot split evenly" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_model_build_refuses_a_degree_its_heads_do_not_take():
    """Where every run's model is built (the preflight too, before torchrun): debugmodel's 16
    heads at tp=3."""
    cfg = _config(3)
    with pytest.raises(UserError, match="16 attention heads, which 3 ranks cannot split"):
        build_meta_model(cfg, 2048)
    build_meta_model(_config(4), 2048)


@pytest.mark.parametrize(
    "vocab, ranks", itertools.product([64, 100, 2048, 151936, 7], [1, 2, 3, 4, 8])
)
def test_the_vocabulary_slices_are_dtensors_shards(vocab, ranks):
    """Each rank's [lo, hi) is the rows DTensor's Shard(0) gives it (ceil-sized pieces, an
    empty one past the end), and the slices tile the vocabulary in rank order."""
    covered = 0
    for rank in range(ranks):
        lo, hi = vocab_slice(vocab, ranks, rank)
        size, offset = Shard.local_shard_size_and_offset(vocab, ranks, rank)
        assert hi - lo == size and (lo == offset or size == 0)
        assert lo == covered
        covered = hi
    assert covered == vocab


def test_the_memory_estimate_prices_what_a_tensor_parallel_rank_holds():
    """At tp=2 a rank holds half of every matrix (the norms whole), half the logits and, with
    activation checkpointing, half the activations; FSDP's shards split what is left."""
    args = Llama3Args(dim=64, n_layers=2, n_heads=4, vocab_size=256, multiple_of=16)
    with torch.device("meta"):
        model = Llama3(args)
    common = dict(local_batch=2, seq_len=32, param_dtype=torch.float32, mode="fsdp", shard=2)
    one = estimate_memory(model, args, activation_checkpoint="full", **common)
    two = estimate_memory(model, args, activation_checkpoint="full", tensor_split=2, **common)
    vectors = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    assert two.states_bytes == pytest.approx((one.states_bytes + 16 * vectors / 2) / 2)
    assert two.logits_bytes == one.logits_bytes / 2
    assert two.activation_bytes == one.activation_bytes / 2
    assert two.gathered_bytes == pytest.approx(one.gathered_bytes / 2)
