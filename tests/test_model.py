from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from titanlite.distributed.param_init import ParamInit
from titanlite.models.llama3 import Llama3, Llama3Args, llama3_flavors
from titanlite.models.llama3.model import ffn_hidden_dim, rope_frequencies
from titanlite.ops.dropout import keyed_dropout, sample_keys


@pytest.mark.parametrize(
    "flavor, vocab, params",
    [("1B", 128256, 1_235_814_400), ("8B", 128256, 8_030_261_248)],
)
def test_flavor_shapes_match_llama(flavor, vocab, params):
    args = dataclasses.replace(llama3_flavors[flavor], vocab_size=vocab, max_seq_len=8192)
    with torch.device("meta"):
        model = Llama3(args)
    assert sum(p.numel() for p in model.parameters()) == params


def test_debugmodel_shapes():
    args = llama3_flavors["debugmodel"]
    assert (args.dim, args.n_layers, args.n_heads) == (256, 6, 16)
    assert ffn_hidden_dim(args) == 768
    assert ffn_hidden_dim(llama3_flavors["1B"]) == 8192


def test_rope_scaling_keeps_high_and_divides_low_frequencies():
    args = llama3_flavors["8B"]
    plain = rope_frequencies(dataclasses.replace(args, rope_scaling_factor=None))
    scaled = rope_frequencies(args)
    assert torch.equal(scaled[:4], plain[:4])
    torch.testing.assert_close(scaled[-1], plain[-1] / 8)


def test_forward_is_causal_and_tied_embeddings_share_storage():
    args = Llama3Args(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=50,
        multiple_of=16,
        max_seq_len=12,
        tie_embeddings=True,
    )
    model = Llama3(args)
    model.init_weights(ParamInit(model, 0))
    assert model.output.weight is model.tok_embeddings.weight
    x = torch.randint(0, 50, (2, 12))
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 1) % 50
    out_x, out_y = model(x), model(y)
    assert out_x.shape == (2, 12, 50)
    torch.testing.assert_close(out_x[:, :8], out_y[:, :8])  # the future does not leak
    assert not torch.allclose(out_x[:, 8:], out_y[:, 8:])


def test_forward_with_labels_and_default_arguments_returns_each_sequences_loss():
    """labels alone (loss_chunk left at 0): the whole sequence's loss at once, equal to cross
    entropy of the logits; a chunk of 5 positions gives the same sums."""
    from titanlite.ops.cross_entropy import IGNORE_INDEX, cross_entropy_per_sample

    args = Llama3Args(dim=32, n_layers=2, n_heads=4, vocab_size=50, multiple_of=16, max_seq_len=12)
    model = Llama3(args)
    model.init_weights(ParamInit(model, 0))
    x = torch.randint(0, 50, (2, 12))
    y = torch.randint(0, 50, (2, 12))
    y[1, :4] = IGNORE_INDEX
    want = cross_entropy_per_sample(model(x), y)
    assert want.shape == (2,)
    torch.testing.assert_close(model(x, labels=y), want)
    torch.testing.assert_close(model(x, labels=y, loss_chunk=5), want)


def test_param_init_depends_on_seed_and_name_only():
    args = Llama3Args(dim=32, n_layers=2, n_heads=4, vocab_size=50, multiple_of=16, max_seq_len=8)
    a, b, c = Llama3(args), Llama3(args), Llama3(args)
    a.init_weights(ParamInit(a, 1))
    b.init_weights(ParamInit(b, 1))
    c.init_weights(ParamInit(c, 2))
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), n
        if "norm" not in n:
            assert not torch.equal(pa, pc), n
    wq0, wq1 = a.layers[0].attention.wq.weight, a.layers[1].attention.wq.weight
    assert not torch.equal(wq0, wq1)  # same shape, different name: different draw


def test_flops_per_token_count_the_output_head_tied_or_not():
    """Llama 3.2 1B (tied) at seq 2048: 6 x (16 blocks + final norm + the 128256 x 2048 head)
    + 12 x 16 x 2048 x 2048 = 8.22e9 FLOPs per token, from its shapes written out here. Tying
    the head to the embedding changes no matmul, so the count must not change."""
    dim, layers, kv, hidden, vocab, seq = 2048, 16, 512, 8192, 128256, 2048
    block = 2 * dim * dim + 2 * dim * kv + 3 * dim * hidden + 2 * dim
    want = 6 * (layers * block + dim + vocab * dim) + 12 * layers * dim * seq
    assert want == 8_220_192_768
    got = {}
    for tied in (True, False):
        args = dataclasses.replace(
            llama3_flavors["1B"], vocab_size=vocab, max_seq_len=seq, tie_embeddings=tied
        )
        with torch.device("meta"):
            got[tied] = Llama3(args).num_flops_per_token(seq)
    assert got == {True: want, False: want}


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts aten ops by name (overload packet), e.g. 'mm', 'silu'."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["none", "selective", "full"])
def test_activation_checkpointing_recomputes_what_its_kind_says(kind):
    """Backward of one block: full recomputes matmuls and attention, selective only the pointwise
    ops (SwiGLU's silu, the norms' rsqrt) and keeps the matmul and attention outputs; the
    gradient is the same in all three."""
    from titanlite.distributed.parallelize import checkpoint_block

    args = Llama3Args(
        dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=50, multiple_of=16, max_seq_len=8
    )
    model = Llama3(args)
    model.init_weights(ParamInit(model, 0))
    model.layers[0] = checkpoint_block(model.layers[0], kind)
    x = torch.randint(0, 50, (2, 8))
    loss = model(x).square().mean()
    with _OpCounter() as backward:
        loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.layers[0].parameters()])
    plain = Llama3(args)
    plain.init_weights(ParamInit(plain, 0))
    plain(x).square().mean().backward()
    torch.testing.assert_close(
        grads, torch.cat([p.grad.flatten() for p in plain.layers[0].parameters()])
    )
    n = backward.counts
    gradient_mms = 2 * 8  # input and weight gradients of 7 linears and the head
    attention = sum(
        v for k, v in n.items() if k.startswith("_scaled_dot_product") and "backward" not in k
    )
    recomputed = n.get("silu", 0) + n.get("rsqrt", 0)
    assert (n["mm"] > gradient_mms, attention > 0) == (kind == "full",) * 2, n
    assert (recomputed > 0) == (kind != "none"), n


def test_dropout_keyed_by_sample_draws_each_sequences_mask_from_its_key_alone():
    keys = sample_keys(7, 100, 8, torch.device("cpu"))
    x = torch.ones(8, 64, 32)
    y = keyed_dropout(x, 0.25, keys, site=3)
    dropped = (y == 0).float().mean(dim=(1, 2))
    assert ((dropped - 0.25).abs() < 0.03).all(), dropped  # 2,048 elements a sequence
    kept = torch.tensor(1 / 0.75).item()  # scaled, so the expectation is unchanged
    assert set(y.unique().tolist()) == {0.0, kept}
    # The same sequence (stream position 104) anywhere in any batch gets the same mask.
    alone = keyed_dropout(
        torch.ones(1, 64, 32), 0.25, sample_keys(7, 104, 1, torch.device("cpu")), 3
    )
    assert torch.equal(alone[0], y[4])
    # Another site, seed or sequence draws another mask; p = 0 is the identity.
    assert not torch.equal(keyed_dropout(x, 0.25, keys, 4), y)
    assert not torch.equal(
        keyed_dropout(x, 0.25, sample_keys(8, 100, 8, torch.device("cpu")), 3), y
    )
    assert not torch.equal(y[0], y[1])
    assert keyed_dropout(x, 0.0, keys, 3) is x


def test_llama_dropout_keyed_by_sample_in_training_only():
    args = Llama3Args(
        dim=32, n_layers=2, n_heads=4, vocab_size=64, multiple_of=16, max_seq_len=16, dropout=0.5
    )
    model = Llama3(args)
    model.init_weights(ParamInit(model, 0))
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    keys = sample_keys(1, 0, 4, torch.device("cpu"))
    a, b = model(tokens, sample_keys=keys), model(tokens, sample_keys=keys)
    assert torch.equal(a, b)  # no RNG drawn: the keys decide
    assert torch.equal(model(tokens[2:], sample_keys=keys[2:]), a[2:])
    assert not torch.equal(model(tokens), a)
    model.eval()
    assert torch.equal(model(tokens, sample_keys=keys), model(tokens))


@pytest.mark.parametrize(
    "layout, qk_norm, kv_heads",
    [("pairs", False, 2), ("halves", True, 2), ("pairs", True, 4), ("halves", False, 1)],
)
def test_shared_blocks_run_on_a_split_of_their_heads_and_hidden_units(layout, qk_norm, kv_heads):
    """models/common's attention and SwiGLU take their head counts and widths from their
    projections' outputs, so a tensor-parallel split (wq, wk, wv, w1, w3 by output rows, wo, w2
    by input columns) runs the same block code on each part, and the parts' outputs sum to the
    whole block's, at every rope layout, with and without q/k norms, for grouped and plain heads."""
    from titanlite.models.common.attention import Attention
    from titanlite.models.common.feed_forward import SwiGLU
    from titanlite.models.common.rope import rope_frequencies, rope_lookup, rope_tables

    dim, heads, head_dim, hidden, parts = 32, 4, 8, 48, 2
    eps = 1e-6 if qk_norm else None
    attention = Attention(dim, heads, kv_heads, head_dim, layout, qk_norm_eps=eps)
    attention.init_weights(ParamInit(attention, 0), out_std=0.02)
    swiglu = SwiGLU(dim, hidden)
    swiglu.init_weights(ParamInit(swiglu, 0), out_std=0.02, up_std=0.02)
    x = torch.randn(2, 6, dim, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_lookup(*rope_tables(rope_frequencies(head_dim, 10000.0), 8), 6)
    whole = (attention(x, cos, sin), swiglu(x))
    assert len({n for n, _ in attention.named_parameters()}) == (6 if qk_norm else 4)

    def split(module, by_rows: tuple[str, ...], by_cols: tuple[str, ...], part: int):
        piece = copy.deepcopy(module)
        for name in by_rows + by_cols:
            w = getattr(piece, name).weight
            cut = w.chunk(parts, dim=0 if name in by_rows else 1)[part]
            setattr(piece, name, torch.nn.Linear(*reversed(cut.shape), bias=False))
            getattr(piece, name).weight.data.copy_(cut)
        return piece

    # a kv head the split cannot share out stays whole on each part (torchtitan's rule too)
    kv_split = ("wk", "wv") if kv_heads % parts == 0 else ()
    summed = [0, 0]
    for part in range(parts):
        summed[0] = summed[0] + split(attention, ("wq", *kv_split), ("wo",), part)(x, cos, sin)
        summed[1] = summed[1] + split(swiglu, ("w1", "w3"), ("w2",), part)(x)
    for got, want in zip(summed, whole, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
