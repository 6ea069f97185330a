"""Qwen3-MoE's experts run two ways, `loop` (a matmul pair per expert) and `grouped` (torch's
grouped_mm), which must be one model: the same outputs, loss terms and gradients, to float32's
summation order in float32 and to bfloat16's rounding in bfloat16 (parameters in bf16, as FSDP's
policy computes them, and under autocast, as DDP's bf16 runs). Compiled blocks (torch.compile
with fullgraph, as parallelize_blocks compiles them) give the eager block's numbers; grouped
experts compile in bfloat16 only, and are refused at build time where they cannot."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers import BF16_GRAD_TOL

from titanlite.components.loss import LossBalancer, sequence_losses, step_statistics
from titanlite.config import JobConfig
from titanlite.datasets.batch import Microbatch
from titanlite.distributed.param_init import ParamInit
from titanlite.errors import UserError
from titanlite.models.qwen3_moe import Qwen3Moe, qwen3_moe_flavors
from titanlite.models.qwen3_moe.model import Block
from titanlite.models.qwen3_moe.moe import Experts
from titanlite.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from titanlite.models.step import LossPath
from titanlite.ops.cross_entropy import IGNORE_INDEX

TINY = replace(qwen3_moe_flavors["tiny_strong"], vocab_size=64, max_seq_len=16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _model(impl: str, dtype: torch.dtype) -> Qwen3Moe:
    model = Qwen3Moe(replace(TINY, experts_impl=impl))
    model.init_weights(ParamInit(model, 3))
    return model.to(dtype)


def _step(model: Qwen3Moe, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process's training step through the loss path (the statistics pass, then the loss and
    its terms), then backward. Returns each sequence's cross entropy and the terms."""
    g = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 64, (2, 3, 16), generator=g)
    labels[0, 5:] = IGNORE_INDEX
    micro = [Microbatch(tokens, labels)]
    balancer = LossBalancer("global", None, 1, 1)
    path = LossPath(own=True, step=True, statistics=True)
    cast = torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext()
    with cast:
        balancer.begin_step([labels], step_statistics(model, micro, balancer))
        out = sequence_losses(model, micro[0], path, balancer.context(0))
    (out.ce.sum() + sum(t.sum() for t in out.terms.values())).float().backward()
    return out.ce, out.terms


@pytest.mark.parametrize(
    "dtype, autocast, tol",
    [
        (torch.float32, False, 1e-6),
        (torch.bfloat16, False, BF16_GRAD_TOL),  # FSDP's bf16 parameters
        (torch.float32, True, BF16_GRAD_TOL),  # DDP's autocast: the loop's matmuls in bf16
    ],
)
def test_loop_and_grouped_experts_are_one_model(dtype, autocast, tol):
    """The whole tiny model (two MoE layers, one dense), loss, terms and every gradient."""
    loop, grouped = _model("loop", dtype), _model("grouped", dtype)
    (ce_l, terms_l), (ce_g, terms_g) = _step(loop, autocast), _step(grouped, autocast)
    assert _rel(ce_g, ce_l) <= tol and set(terms_l) == set(terms_g) == {"aux", "z"}
    assert all(_rel(terms_g[k], terms_l[k]) <= tol for k in terms_l)
    want = dict(loop.named_parameters())
    errs = {n: _rel(p.grad, want[n].grad) for n, p in grouped.named_parameters()}
    worst = max(errs.values())
    print(f"{dtype} autocast={autocast}: loss {_rel(ce_g, ce_l):.1e}, gradients {worst:.1e}")
    assert worst <= tol and all(p.grad.dtype == dtype for p in grouped.parameters()), errs


def test_an_expert_no_token_chose_gets_a_zero_gradient_both_ways():
    """Expert 3 idle: each way runs it on no rows, its gradient zero (every parameter takes part,
    as DDP's reducer needs), the others' equal."""
    ways = {impl: Experts(replace(TINY, experts_impl=impl)) for impl in ("loop", "grouped")}
    ways["grouped"].load_state_dict(
        {k: torch.randn_like(v) for k, v in ways["loop"].state_dict().items()}
    )
    ways["loop"].load_state_dict(ways["grouped"].state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, TINY.dim, generator=g)
    chosen = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(12)])
    weights = torch.rand(12, 2, generator=g)
    outs = {impl: m(x, chosen, weights) for impl, m in ways.items()}
    for out in outs.values():
        out.square().sum().backward()
    assert _rel(outs["grouped"], outs["loop"]) <= 1e-6
    for name in ("gate_up", "down"):
        loop, grouped = (getattr(ways[i], name).grad for i in ("loop", "grouped"))
        assert not loop[3].any() and not grouped[3].any()
        assert _rel(grouped, loop) <= 1e-6


@pytest.mark.parametrize(
    "impl, dtype, autocast",
    [
        ("grouped", torch.bfloat16, False),  # FSDP's bf16 parameters (its GPU default)
        ("grouped", torch.float32, True),  # DDP's bf16 autocast, cast by hand for grouped_mm
        ("loop", torch.float32, False),
    ],
)
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.long)])
def test_a_compiled_block_gives_the_eager_blocks_numbers(backend, impl, dtype, autocast):
    """A MoE block compiled whole, as parallelize_blocks compiles it: grouped experts in bf16
    and the loop with its host read of the run lengths (fullgraph takes them as data-dependent
    sizes), output and every gradient as the eager block's. aot_eager traces forward and
    backward as inductor does (where a graph breaks or a dtype is refused) without generating
    code, which costs ~40 s cold: inductor itself with --long."""
    block = Block(0, replace(TINY, experts_impl=impl))
    block.init_weights(ParamInit(block, 5))
    block = block.to(dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 16, TINY.dim, generator=g).to(dtype)
    angles = torch.rand(1, 16, 1, TINY.head_dim // 2, generator=g)
    cast = torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext()
    ours = {}
    for name, run in (
        ("eager", block),
        ("compiled", torch.compile(block, fullgraph=True, backend=backend)),
    ):
        h = x.clone().requires_grad_()
        with cast:
            out, logits = run(h, angles.cos(), angles.sin(), None)
        (out.float().square().sum() + logits.float().logsumexp(-1).sum()).backward()
        ours[name] = [out, h.grad, *(p.grad.clone() for p in block.parameters())]
        block.zero_grad(set_to_none=True)
    tol = 1e-5 if dtype == torch.float32 and not autocast else BF16_GRAD_TOL
    errs = [_rel(c, e) for c, e in zip(ours["compiled"], ours["eager"], strict=True)]
    print(f"compiled ({backend}) {impl} {dtype}: largest relative difference {max(errs):.1e}")
    assert max(errs) <= tol, errs


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
@pytest.mark.parametrize("param", [torch.float32, torch.float16])
def test_grouped_experts_that_cannot_compile_are_refused_at_build_time(mode, param):
    """torch traces grouped_mm in bf16 only: other parameter dtypes (FSDP's policy or DDP's
    autocast) are refused in one line before anything is built."""
    cfg = JobConfig()
    cfg.training.compile = True
    with torch.device("meta"):
        model = Qwen3Moe(replace(TINY, experts_impl="grouped"))
    dims = SimpleNamespace(param_dtype=param, mode=mode)
    with pytest.raises(UserError, match="cannot trace grouped experts") as e:
        parallelize_qwen3_moe(model, dims, cfg)
    assert "\n" not in str(e.value)


def test_auto_takes_grouped_where_the_experts_compute_in_bf16_at_aligned_widths():
    """`auto` reads the parameters' dtype, or autocast's (DDP's bf16), so bf16 experts run
    without the loop's host read on any device (a CPU rehearsal runs a GPU's path); float32,
    and widths grouped_mm's 16-byte strides cannot read, run the loop."""
    x = torch.zeros(2, TINY.dim)
    auto = Experts(TINY)
    assert Experts.compute_dtype(x) == torch.float32 and not auto.grouped(x)
    with torch.autocast("cpu", torch.bfloat16):
        assert Experts.compute_dtype(x) == torch.bfloat16 and auto.grouped(x)
    assert Experts.compute_dtype(x.bfloat16()) == torch.bfloat16 and auto.grouped(x.bfloat16())
    odd = Experts(replace(TINY, moe_hidden=12))
    assert not odd.grouped(x.bfloat16())


@pytest.mark.parametrize("change", [{"moe_hidden": 12}, {"dim": 36, "head_dim": 9}])
def test_grouped_experts_at_widths_grouped_mm_cannot_read_are_refused(change):
    with torch.device("meta"):
        model = Qwen3Moe(replace(TINY, experts_impl="grouped", **change))
    dims = SimpleNamespace(param_dtype=torch.float32, mode="fsdp")
    with pytest.raises(UserError, match="multiples of 8") as e:
        parallelize_qwen3_moe(model, dims, JobConfig())
    assert "\n" not in str(e.value)
