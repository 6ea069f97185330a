from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import HANG_S, REPO

from titanlite.components.loss import LossBalancer, sequence_losses
from titanlite.config import JobConfig
from titanlite.config.layout import loss_chunk, loss_chunks
from titanlite.datasets.batch import Microbatch
from titanlite.distributed.param_init import ParamInit
from titanlite.errors import TrainingError, UserError
from titanlite.models.llama3 import Llama3, Llama3Args
from titanlite.models.registry import build_meta_model, get_model_spec, register_model
from titanlite.models.step import LossPath
from titanlite.ops.cross_entropy import (
    IGNORE_INDEX,
    chunked_cross_entropy_per_sample,
    count_valid,
    cross_entropy_per_sample,
    cross_entropy_sum,
)


def test_cross_entropy_sum_is_fp32_sum_over_valid_tokens():
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :3] = IGNORE_INDEX
    got = cross_entropy_sum(logits, labels)
    assert got.dtype == torch.float32
    keep = labels != IGNORE_INDEX
    want = F.cross_entropy(logits.float()[keep], labels[keep], reduction="sum")
    torch.testing.assert_close(got, want)
    assert int(count_valid(labels)) == 7


def test_single_process_balancer_normalises_by_the_whole_step():
    """With accumulation, each microbatch is divided by the step's total, not its own count."""
    labels = [
        torch.tensor([[1, 2, IGNORE_INDEX]]),
        torch.tensor([[IGNORE_INDEX] * 3]),
        torch.tensor([[4, 5, 6]]),
    ]
    bal = LossBalancer("global", None, 1, 3)
    bal.begin_step(labels)
    assert int(bal.global_tokens()) == 5
    sums = [torch.tensor(2.0), torch.tensor(0.0), torch.tensor(9.0)]
    total = sum(bal.scale(s, m) for m, s in enumerate(sums))
    torch.testing.assert_close(total, torch.tensor(11.0 / 5))


def test_local_mean_is_the_naive_mean_of_means():
    labels = [torch.tensor([[1, 2, IGNORE_INDEX]]), torch.tensor([[4, 5, 6]])]
    bal = LossBalancer("local_mean", None, 1, 2)
    bal.begin_step(labels)
    total = bal.scale(torch.tensor(2.0), 0) + bal.scale(torch.tensor(9.0), 1)
    torch.testing.assert_close(total, torch.tensor((2.0 / 2 + 9.0 / 3) / 2))


def test_zero_valid_tokens_gives_zero_not_nan():
    labels = [torch.full((2, 4), IGNORE_INDEX)]
    bal = LossBalancer("global", None, 1, 1)
    bal.begin_step(labels)
    logits = torch.randn(2, 4, 7, requires_grad=True)
    loss = bal.scale(cross_entropy_sum(logits, labels[0]), 0)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0
    assert int(bal.global_tokens()) == 0


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-6) -> None:
    """Relative error of the whole tensor (elementwise, entries near 0 only show rounding)."""
    assert (got - want).norm() <= rel * want.norm(), ((got - want).norm() / want.norm()).item()


def _grads(fn, *leaves):
    for x in leaves:
        x.grad = None
    out = fn()
    (out * torch.arange(1, out.numel() + 1)).sum().backward()  # a different weight per sequence
    return out.detach(), [x.grad.clone() for x in leaves]


@pytest.mark.parametrize("chunk", [1, 5, 16, 37])
def test_chunked_loss_is_the_whole_sequence_loss_and_gradient(chunk):
    """Chunks of 1, 5 (not dividing 37), 16 and the whole sequence: per-sequence sums and the
    gradients of the hidden states and the output weight, to 1e-6."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (3, 37), generator=g)
    labels[0, :30] = IGNORE_INDEX
    labels[2] = IGNORE_INDEX  # a sequence without targets sums to 0
    want, want_grads = _grads(
        lambda: cross_entropy_per_sample(F.linear(hidden, weight), labels), hidden, weight
    )
    got, got_grads = _grads(
        lambda: chunked_cross_entropy_per_sample(hidden, weight, labels, chunk), hidden, weight
    )
    _close(got, want)
    assert got[2] == 0
    for a, b in zip(got_grads, want_grads, strict=True):
        _close(a, b)


def test_llama_loss_path_equals_its_logits_path():
    """The model's own chunked loss (labels in, sums out) against cross entropy of its logits:
    values and every parameter's gradient, tied head too."""
    for tied in (False, True):
        _check_llama_loss_path(tied)


def _check_llama_loss_path(tied: bool) -> None:
    args = Llama3Args(
        dim=32,
        n_layers=2,
        n_heads=4,
        vocab_size=96,
        multiple_of=16,
        max_seq_len=24,
        tie_embeddings=tied,
    )
    model = Llama3(args)
    model.init_weights(ParamInit(model, 5))
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(-1, dims=1)
    labels[1, :7] = IGNORE_INDEX
    params = list(model.parameters())
    want, want_grads = _grads(lambda: cross_entropy_per_sample(model(tokens), labels), *params)
    got, got_grads = _grads(lambda: model(tokens, labels=labels, loss_chunk=7), *params)
    _close(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        _close(a, b)


def test_chunk_size_follows_the_logits_budget_and_a_logits_only_model_is_refused():
    # 4 sequences x 128,256 vocab x 4 bytes = 2 MB of fp32 logits per position
    assert loss_chunk(256, 4, 2048, 128256) == 130
    assert loss_chunk(256, 4, 512, 2048) == 0  # the debug model: all fit, no chunks
    assert loss_chunk(0, 4, 2048, 128256) == 0
    assert loss_chunk(0.001, 4, 2048, 128256) == 1
    cfg = JobConfig()
    cfg.training.seq_len, cfg.training.local_batch_size = 2048, 4
    assert loss_chunks(cfg, 128256) == (130, 130)
    meta = build_meta_model(cfg, 128256)  # llama3 takes chunks; the plan's chunks ride on the model
    assert (meta.args.vocab_size, meta.loss_chunk, meta.eval_loss_chunk) == (128256, 130, 130)
    cfg.model.name, cfg.model.import_module, cfg.model.flavor = "toy_mlp", "toy_model", "tiny"
    with pytest.raises(UserError, match=r"model 'toy_mlp' returns logits only .* set it to 0"):
        build_meta_model(cfg, 128256)
    # the eval's batch is checked too: at 1 GiB, training's 1 sequence fits, eval's 8 need chunks
    cfg.training.local_batch_size, cfg.eval.local_batch_size = 1, 8
    cfg.loss.chunk_logits_mib = 1024
    assert loss_chunks(cfg, 128256) == (0, 261)
    with pytest.raises(UserError, match="returns logits only"):
        build_meta_model(cfg, 128256)
    cfg.loss.chunk_logits_mib = 0
    assert loss_chunks(cfg, 128256) == (0, 0)
    build_meta_model(cfg, 128256)


def test_loss_memory_benchmark_shows_the_saving(tmp_path):
    """scripts/loss_memory.py at a small size: the whole sequence's fp32 logits are 64 MiB (the
    estimate's logits term counts their gradients, 128: the forward's own are among the traced
    activations); 64-position chunks hold 8 MiB of them (24 counted: output, fp32 copy, gradient,
    recomputed in backward)."""
    out = tmp_path / "mem.json"
    cmd = [
        sys.executable,
        "scripts/loss_memory.py",
        "--seq",
        "512",
        "--batch",
        "1",
        "--budgets",
        "0",
        "8",
    ]
    proc = subprocess.run(
        [*cmd, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=HANG_S
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    whole, chunked = json.loads(out.read_text())
    assert (whole["chunk_positions"], chunked["chunk_positions"]) == (512, 64)
    assert whole["loss"] == pytest.approx(chunked["loss"], rel=1e-6)
    assert whole["estimated_logits_mib"] == 128 and chunked["estimated_logits_mib"] == 24
    assert (
        whole["estimated_activations_mib"] - chunked["estimated_activations_mib"] >= 64
    )  # traced logits
    assert whole["peak_mib"] - chunked["peak_mib"] > 48, (whole, chunked)


class _Returns(torch.nn.Module):
    """A labels path that returns `out` as it is: the contract's shapes, checked."""

    def __init__(self, out) -> None:
        super().__init__()
        self.out = out

    def forward(self, tokens, labels=None, loss_chunk=0):
        return self.out


B = 3
GOOD_CE = torch.ones(B)


@pytest.mark.parametrize(
    "out, says",
    [
        (torch.ones(B, 5), "returned Tensor"),
        (torch.ones(()), "returned Tensor"),
        ([GOOD_CE], "returned list"),
        ((GOOD_CE, [torch.ones(B)]), "returned tuple"),
        ((GOOD_CE, {"aux": torch.ones(B, 1)}), "returned term 'aux' as torch.Size([3, 1])"),
        ((GOOD_CE, {"aux": 0.5}), "returned term 'aux' as float"),
        ((GOOD_CE, {"loss": torch.ones(B)}), "named a term 'loss'"),
        ((GOOD_CE, {"total": torch.ones(B)}), "named a term 'total'"),
        ((GOOD_CE, {"z loss": torch.ones(B)}), "named a term 'z loss'"),
    ],
)
def test_a_labels_path_returning_anything_else_is_one_line(out, says):
    """What a model's labels path returns is checked from its shapes (no host read): each
    sequence's cross entropy [B], or that and a dict of named [B] terms; anything else is one
    line naming what came back and what the contract wants."""
    batch = Microbatch(torch.zeros(B, 4, dtype=torch.long), torch.zeros(B, 4, dtype=torch.long))
    with pytest.raises(TrainingError, match="the model's labels path ") as e:
        sequence_losses(_Returns(out), batch, LossPath(own=True))
    assert says in str(e.value) and "\n" not in str(e.value)
    got = sequence_losses(_Returns((GOOD_CE, {"aux": torch.ones(B)})), batch, LossPath(own=True))
    assert got.ce is GOOD_CE and list(got.terms) == ["aux"]


def test_a_model_with_a_labels_path_always_computes_its_own_loss():
    """One loss path: chunk 0 (the whole sequence) goes through the model's labels path as a
    chunked loss does, so the terms it adds are never dropped; a model without one gets logits,
    then the cross entropy."""
    calls = []

    class Spy(torch.nn.Module):
        def forward(self, tokens, labels=None, loss_chunk=0):
            calls.append((labels is not None, loss_chunk))
            return (
                (torch.zeros(len(tokens)), {"aux": torch.ones(len(tokens))})
                if labels is not None
                else None
            )

    batch = Microbatch(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    for chunk in (0, 3):
        assert sequence_losses(Spy(), batch, LossPath(own=True, chunk=chunk)).terms.keys() == {
            "aux"
        }
    assert calls == [(True, 0), (True, 3)]
    logits = torch.randn(2, 8, 5)
    plain = sequence_losses(lambda tokens: logits, batch, LossPath())
    assert (
        torch.equal(plain.ce, cross_entropy_per_sample(logits, batch.labels)) and plain.terms == {}
    )


def test_step_statistics_need_a_forward_that_takes_the_step():
    import fork_moe  # noqa: F401  (registers the forks)

    cfg = JobConfig()
    cfg.model.name, cfg.model.flavor = "fork_moe", "tiny"
    assert build_meta_model(cfg, 64).loss_path() == LossPath(
        own=True, chunk=0, step=True, statistics=True
    )
    assert build_meta_model(cfg, 64).loss_path(evaluating=True) == LossPath(own=True)
    spec = get_model_spec("fork_moe")
    register_model(replace(spec, name="fork_moe_stepless", model_cls=_Returns))
    cfg.model.name = "fork_moe_stepless"
    with pytest.raises(
        UserError, match="asks for step statistics .* but its forward takes no step"
    ):
        build_meta_model(cfg, 64)


def test_the_step_contexts_all_reduce_is_a_counted_collective_on_the_normalisers_group():
    """StepContext.all_reduce is a SUM over the normaliser's group that the instrument (and so the
    rehearsal's meter) counts; with one rank it is no collective. On torch's fake group of 4."""
    from titanlite.distributed.groups import FAKE, fake_store
    from titanlite.tools.instrument import CollectiveCounter

    dist.init_process_group(FAKE, store=fake_store(), rank=0, world_size=4)
    try:
        balancer = LossBalancer("global", dist.group.WORLD, 4, 2)
        balancer.begin_step([torch.zeros(1, 3, dtype=torch.long)] * 2)
        step = balancer.context(1)
        assert (step.ranks, step.micro, step.accum, step.counting, step.statistics) == (
            4,
            1,
            2,
            False,
            None,
        )
        with CollectiveCounter() as counted:
            step.all_reduce(torch.ones(3))
        assert sum(n for (_, op), n in counted.counts.items() if op == "allreduce") == 1
        # step statistics ride the token count's all-reduce when they are integers (counts), and
        # take a second one beside it otherwise
        for stats, reductions in ((torch.ones(3, dtype=torch.long), 1), (torch.ones(3), 2)):
            with CollectiveCounter() as counted:
                balancer.begin_step([torch.zeros(1, 3, dtype=torch.long)] * 2, stats)
            assert (
                sum(n for (_, op), n in counted.counts.items() if op == "allreduce") == reductions
            )
            assert balancer.statistics().shape == (3,) and balancer.global_tokens().shape == ()
        alone = LossBalancer("global", None, 1, 1)
        alone.begin_step([torch.zeros(1, 3, dtype=torch.long)])
        with CollectiveCounter() as counted:
            assert torch.equal(alone.context(0).all_reduce(torch.ones(3)), torch.ones(3))
        assert not counted.counts
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes", [(1,), (1000, 7), (2**20, 3), (2**22, 2**20, 5)])
@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_the_logged_gradient_norm_is_its_float64_norm_and_clips_to_max_norm(sizes, max_norm):
    """clip_grad_norm_ of gradients up to four million values a tensor (where a float32 norm on
    a CPU drifts 1e-5 to 1e-4) returns their float64 norm as a device tensor; clipped (max_norm
    below it), the gradients' norm is max_norm. Sharded layouts: tests/test_distributed.py."""
    from titanlite.distributed.utils import clip_grad_norm_

    params = []
    for i, n in enumerate(sizes):
        p = torch.nn.Parameter(torch.zeros(n))
        p.grad = torch.randn(n, generator=torch.Generator().manual_seed(i)) * 1e-3
        params.append(p)
    exact = torch.stack([p.grad.double().norm() for p in params]).norm()
    logged = clip_grad_norm_(params, max_norm)
    assert logged.dtype == torch.float64 and logged.shape == ()
    assert logged.item() == pytest.approx(exact.item(), rel=1e-12, abs=0)
    after = torch.stack([p.grad.double().norm() for p in params]).norm().item()
    clipped = max_norm if 0 < max_norm < exact.item() else exact.item()
    assert after == pytest.approx(clipped, rel=1e-6)
