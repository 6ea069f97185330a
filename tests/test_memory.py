"""The memory estimate counts what a measured step holds: unsharded gradients only where the
method or the layout keeps them across microbatches (tests/test_step_counts.py checks the same
bytes against what FSDP really holds), and refuses in one line that names the setting."""

from __future__ import annotations

import pytest
import torch

import titanlite.tools.memory as memory
from titanlite.config import parse_args
from titanlite.config.layout import resolve_layout
from titanlite.distributed.param_init import ParamInit
from titanlite.errors import UserError
from titanlite.models.registry import build_meta_model
from titanlite.ops.cross_entropy import cross_entropy_per_sample
from titanlite.tools.activations import (
    ACTIVATION_FALLBACK,
    ROUGH_RANGE,
    activation_bytes,
    saved_activations,
)

ACCUM4 = ["--training.global_batch_size", "16", "--training.local_batch_size", "1"]  # 4 ranks
P, BLOCK = 1000, 100
GRAM = 8.0 * 4 * 4  # either method's float64 dp x dp Gram, at dp = 4
SKETCH_BYTES = GRAM + 4.0 * (2 * 2**20 + 2 * 4 * 1024)
EXACT_BYTES = GRAM + 3 * 4.0 * BLOCK


def config(*argv: str):
    cfg, _ = parse_args(["--config", "train_configs/debug_model.toml", *ACCUM4, *argv])
    return cfg, resolve_layout(cfg, 4)


@pytest.mark.parametrize(
    "argv, method, held, diag",
    [
        ([], "sketch", 0, SKETCH_BYTES),  # fsdp, accumulation 4: auto sums sketches per microbatch
        (
            ["--diagnostics.method", "exact"],
            "exact",
            4 * P,
            EXACT_BYTES,
        ),  # asked for: it holds them
        (["--parallelism.skip_grad_sync", "on"], "exact", 4 * P, EXACT_BYTES),  # held on every step
        (
            ["--parallelism.dp_replicate", "4"],
            "exact",
            0,
            EXACT_BYTES,
        ),  # ddp: its grads are counted
        (["--parallelism.dp_replicate", "2"], "sketch", 0, SKETCH_BYTES),  # hsdp
        (["--training.global_batch_size", "4"], "exact", 0, EXACT_BYTES),  # one microbatch
        (["--diagnostics.enable", "false", "--diagnostics.method", "exact"], "exact", 0, 0.0),
    ],
)
def test_measured_step_bytes(argv, method, held, diag):
    cfg, layout = config(*argv)
    assert layout.diagnostics_method == method
    assert memory.measured_step_bytes(cfg, layout, P, BLOCK) == (held, diag)


def test_refusal_names_the_setting_that_holds_gradients(monkeypatch):
    """With memory for the default measured step but not for exact's held gradients: exact is
    refused with a line naming diagnostics.method; auto fits."""
    cfg, layout = config("--diagnostics.method", "exact")
    meta = build_meta_model(cfg, 512)
    params = sum(p.numel() for p in meta.model.parameters())
    base = memory.estimate_memory(
        meta.model,
        meta.args,
        local_batch=1,
        seq_len=cfg.training.seq_len,
        param_dtype=torch.float32,
        activation_checkpoint="none",
        shard=4,
    ).total_bytes
    budget = base + SKETCH_BYTES + 2 * params  # room for the sketch, half of exact's 4 B/param
    monkeypatch.setattr(memory, "available_bytes", lambda device: (budget, "test budget"))
    check = memory.check_memory
    with pytest.raises(
        UserError, match=r"diagnostics.method = 'exact' keeps \d+\.\d\d GiB of unsharded .* 'auto'"
    ):
        check(meta, cfg, layout, torch.device("cpu"), torch.float32)
    cfg, layout = config()  # auto
    check(meta, cfg, layout, torch.device("cpu"), torch.float32)


def test_params_stay_gathered_where_they_cost_little_and_the_estimate_counts_them():
    """reshard_after_forward = auto keeps the whole model's gathered params from forward to
    backward when they take <= 5% of a rank's memory; the estimate then counts all of them
    (tests/test_step_counts.py sees the backward all-gathers go)."""
    cfg, layout = config()
    keeps = memory.keeps_gathered_params
    assert keeps(cfg, 10**6, 4, 80e6) and not keeps(cfg, 10**6, 4, 79e6)  # 4 MB vs 5% of 80 MB
    cfg.parallelism.reshard_after_forward = "never"
    assert keeps(cfg, 10**9, 2, 1e9)
    cfg.parallelism.reshard_after_forward = "always"
    assert not keeps(cfg, 10, 4, 1e12)
    meta = build_meta_model(cfg, 512)
    params = sum(p.numel() for p in meta.model.parameters())
    block = sum(p.numel() for p in meta.model.layers[0].parameters())
    root = params - len(meta.model.layers) * block  # embedding, final norm, head: kept gathered
    small, large = (
        memory.job_estimate(meta, cfg, layout, torch.bfloat16, available)
        for available in (1e6, 1e12)
    )
    # the root's params, a block's and the next's (prefetched), the root's and a block's
    # gradients in bf16, and that block's in the fp32 of the reduce-scatter
    grads = (root + block) * 2 + block * 4
    one = (root + 2 * block) * 2 + grads
    assert root < block and small.gathered_bytes == one
    cfg.parallelism.reshard_after_forward = "auto"
    small, large = (
        memory.job_estimate(meta, cfg, layout, torch.bfloat16, available)
        for available in (1e6, 1e12)
    )
    assert small.gathered_bytes == one and large.gathered_bytes == params * 2 + grads


def _kept_by_a_real_forward(model: torch.nn.Module, seq: int, loss_chunk: int) -> int:
    """Bytes autograd keeps for backward in a real CPU forward and loss of one sequence: every
    saved tensor's storage once, by address, the model's own weights and buffers apart."""
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            kept[s.data_ptr()] = s.nbytes()
        return t

    tokens = torch.randint(0, 64, (1, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if loss_chunk:
            model(tokens, labels=tokens, loss_chunk=loss_chunk)
        else:
            cross_entropy_per_sample(model(tokens), tokens)
    return sum(kept.values())


@pytest.mark.parametrize(
    "name, flavor, dtype, chunk",
    [
        ("llama3", "debugmodel", torch.float32, 0),
        ("llama3", "debugmodel_tied", torch.bfloat16, 32),
        ("fork_lm", "tiny", torch.float32, 0),
        ("fork_lm", "tiny", torch.float32, 16),
    ],
)
def test_traced_activations_are_what_a_real_forward_keeps(name, flavor, dtype, chunk):
    """The estimate's activations come from a trace on fake tensors (no memory): they must be
    what a real forward of the same model keeps for backward, byte for byte, for titanlite's
    model and a fork's, whole loss or in chunks; a model's blocks are charged separately."""
    import fork_model  # noqa: F401  (registers fork_lm)

    seq = 64
    cfg, _ = parse_args(
        [
            "--config",
            "train_configs/debug_model.toml",
            "--model.name",
            name,
            "--model.flavor",
            flavor,
        ]
        + ["--training.seq_len", str(seq)]
    )
    meta = build_meta_model(cfg, 256)
    saved = saved_activations(meta.model, seq, dtype, chunk)
    assert len(saved.blocks) == len(meta.model.layers) and min(saved.blocks) > 0
    real = meta.spec.model_cls(meta.args).to(dtype)
    assert sum(saved.blocks) + saved.rest == _kept_by_a_real_forward(real, seq, chunk)


def test_a_forward_that_cannot_be_traced_uses_the_models_own_figure_and_says_so():
    """A mixture of experts dispatched on the tokens that chose them (torch.nonzero) cannot run on
    fake tensors: the estimate takes the model's own activation_bytes (with the loss path's
    log-probabilities, which the model's figure leaves to the loss) and says so; without one,
    the rough per-layer figure, saying how rough. A traced model's says "traced"."""
    import fork_moe

    cfg, _ = parse_args(
        [
            "--config",
            "train_configs/debug_model.toml",
            "--model.import_module",
            "fork_moe",
            "--model.flavor",
            "tiny",
        ]
        + [
            "--model.name",
            "fork_moe_sparse",
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "2",
        ]
    )
    layout = resolve_layout(cfg, 2)
    meta = build_meta_model(cfg, 256)
    with pytest.raises(Exception, match="nonzero|data-dependent|Dynamic"):
        saved_activations(meta.model, 64, torch.float32, 0, True)
    est = memory.job_estimate(meta, cfg, layout, torch.float32, 1e12)
    blocks, rest = meta.model.activation_bytes(64, torch.float32)
    log_probs = 64 * 256 * 4 + 4  # the loss path's, whole sequence at once: what a trace would see
    assert est.activations_from == "the model's own activation_bytes()"
    assert (
        est.activation_bytes == 2 * (sum(blocks) + rest + log_probs)
        and "(the model's own activation_bytes())" in est.summary()
    )
    own = fork_moe.SparseMoELM.activation_bytes
    del fork_moe.SparseMoELM.activation_bytes
    try:
        rough = memory.job_estimate(meta, cfg, layout, torch.float32, 1e12)
    finally:
        fork_moe.SparseMoELM.activation_bytes = own
    assert rough.activations_from.startswith(
        "rough: 34 x dim per token per layer, 0.9 to 1.6x the traced figure"
    )
    cfg.model.name = "fork_moe"
    assert (
        memory.job_estimate(
            build_meta_model(cfg, 256), cfg, layout, torch.float32, 1e12
        ).activations_from
        == "traced"
    )
    dense, sparse = (
        fork_moe.MoELM(meta.args),
        fork_moe.SparseMoELM(meta.args),
    )  # one model, dispatched two ways
    dense.init_weights(ParamInit(dense, 0))
    sparse.load_state_dict(dense.state_dict())
    tokens = torch.randint(0, 256, (2, 64))
    assert torch.allclose(dense(tokens), sparse(tokens), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name, flavor",
    [("llama3", "debugmodel"), ("llama3", "1B"), ("fork_lm", "tiny"), ("fork_moe", "tiny")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rough_activation_figure_is_as_rough_as_it_says(name, flavor, dtype):
    """The per-layer figure used where nothing better exists, against the trace of titanlite's
    Llamas and the tests' forks (a mixture of experts' included): within ROUGH_RANGE, which the
    start-up line states."""
    import fork_model  # noqa: F401
    import fork_moe  # noqa: F401

    cfg, _ = parse_args(
        [
            "--config",
            "train_configs/debug_model.toml",
            "--model.name",
            name,
            "--model.flavor",
            flavor,
        ]
    )
    meta = build_meta_model(cfg, 2048)
    saved = saved_activations(meta.model, 256, dtype, 0, True)
    rough = 256 * ACTIVATION_FALLBACK * meta.args.dim * dtype.itemsize * len(saved.blocks)
    assert ROUGH_RANGE[0] <= rough / sum(saved.blocks) <= ROUGH_RANGE[1]


def _kept_by_each_block(model: torch.nn.Module, seq: int, loss_chunk: int):
    """(per block, the rest): the bytes a real CPU training forward (its loss terms included)
    keeps for backward, each storage charged to the block running when it was first saved."""
    from titanlite.models.step import StepContext

    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    owner: list[int | None] = [None]
    kept: dict[int, tuple[int | None, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            kept.setdefault(s.data_ptr(), (owner[0], s.nbytes()))
        return t

    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda _m, _a, i=i: owner.__setitem__(0, i))
        block.register_forward_hook(lambda _m, _a, _o: owner.__setitem__(0, None))
    a = model.args
    stats = torch.ones(len(a.moe_layers) * a.experts + 1, dtype=torch.long)
    step = StepContext(None, 1, 0, 1, False, lambda: torch.tensor(seq), lambda: stats)
    tokens = torch.randint(0, a.vocab_size, (1, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels=tokens, loss_chunk=loss_chunk, step=step)
    blocks = [sum(n for who, n in kept.values() if who == i) for i in range(len(model.layers))]
    return blocks, sum(n for who, n in kept.values() if who is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "change",
    [{}, {"dense_layers": (1,), "z_loss_coef": 1e-3, "n_kv_heads": 1, "head_dim": 48, "top_k": 3}],
)
def test_qwen3_moe_gives_what_its_forward_keeps(dtype, change):
    """Qwen3-MoE's routing cannot be traced on fake tensors; its own activation_bytes counts what
    each op keeps (each token's top_k expert rows, the sort's indices, grouped-query attention,
    the router's fp32 probabilities, the loss terms'): a real training forward's saved tensors,
    byte for byte, per block and outside them, dense layers and z-loss included. The estimate
    adds the loss path's fp32 log-probabilities where the whole sequence's logits are made. In
    bf16 the experts run grouped_mm, which traces: the estimate then takes the trace."""
    from dataclasses import replace

    from titanlite.models.qwen3_moe import Qwen3Moe, qwen3_moe_flavors

    seq, vocab = 64, 512
    args = replace(qwen3_moe_flavors["debugmodel"], vocab_size=vocab, max_seq_len=seq, **change)
    model = Qwen3Moe(args)
    model.init_weights(ParamInit(model, 0))
    model = model.to(dtype)
    assert _kept_by_each_block(model, seq, 16) == model.activation_bytes(seq, dtype)
    blocks, rest = _kept_by_each_block(model, seq, 0)
    whole, source = activation_bytes(
        model, seq, dtype, 0, "none", args.dim, args.n_layers, True, vocab
    )
    if dtype == torch.float32:  # the loop's host read: no trace, the model's own figure
        assert source != "traced" and whole == sum(blocks) + rest
    else:  # grouped_mm in bf16 traces on fake tensors: the trace's figure, near the real one
        assert source == "traced" and whole == pytest.approx(sum(blocks) + rest, rel=0.01)
