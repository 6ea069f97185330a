from __future__ import annotations

import math

import pytest

from titanlite.components.optimizer import lr_factor
from titanlite.config import parse_args


def _cfg(decay: str, warmup: int = 4, steps: int = 14, min_lr: float = 0.1):
    return parse_args(
        [
            "--lr_scheduler.decay_type",
            decay,
            "--lr_scheduler.warmup_steps",
            str(warmup),
            "--training.steps",
            str(steps),
            "--lr_scheduler.min_lr_factor",
            str(min_lr),
        ]
    )[0]


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_is_linear_up_to_the_peak(decay):
    cfg = _cfg(decay)
    assert [lr_factor(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_decays_reach_their_floor():
    cos, lin, const = _cfg("cosine"), _cfg("linear"), _cfg("constant")
    assert lr_factor(4, cos) == 1.0 and lr_factor(4, lin) == 1.0
    assert math.isclose(lr_factor(14, cos), 0.1) and math.isclose(lr_factor(14, lin), 0.1)
    assert math.isclose(lr_factor(9, lin), 0.1 + 0.9 * 0.5)
    assert math.isclose(lr_factor(9, cos), 0.1 + 0.9 * 0.5)
    assert lr_factor(6, cos) > lr_factor(6, lin) and lr_factor(12, cos) < lr_factor(12, lin)
    assert all(lr_factor(s, const) == 1.0 for s in range(4, 14))


def _resumed(cfg, saved_optimizer: dict, saved_scheduler: dict):
    """A fresh optimizer and schedule loaded from a checkpoint's state, as Trainer._resume does."""
    import torch

    from titanlite.components.optimizer import build_lr_scheduler, build_optimizer

    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg)
    optimizer.load_state_dict(saved_optimizer)
    scheduler.load_state_dict(saved_scheduler)
    return optimizer, scheduler


def test_resume_restores_hparams_unless_told_and_says_which():
    """What `resume_changes` prints is what happens: with restore_hparams the checkpoint's lr and
    betas stay; without, this config's apply at the checkpoint's schedule position."""
    import torch

    from titanlite.components.checkpoint.resume import flat_config, resume_changes
    from titanlite.components.optimizer import (
        build_lr_scheduler,
        build_optimizer,
        continue_schedule,
    )

    old = _cfg("cosine")
    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(model, old)
    scheduler = build_lr_scheduler(optimizer, old)
    for _ in range(6):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    state = {"step": 6, "config": flat_config(old)}
    changed = ["--optimizer.lr", "1e-3", "--optimizer.beta2", "0.99", "--metrics.log_every", "3"]

    kept = parse_args([*changed, *_args(old)])[0]
    lines = resume_changes(state, kept)
    assert [ln.split(" was")[0] for ln in lines] == [
        "resume: optimizer.lr",
        "resume: optimizer.beta2",
        "resume: metrics.log_every",
    ]
    assert (
        "not applied" in lines[0]
        and "not applied" in lines[1]
        and lines[2].endswith(": applied from step 7")
    )
    opt, sched = _resumed(kept, optimizer.state_dict(), scheduler.state_dict())
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and sched.base_lrs == [8e-4, 8e-4]

    applied = parse_args([*changed, "--checkpoint.restore_hparams", "false", *_args(old)])[0]
    assert "applied from step 7" in resume_changes(state, applied)[0]
    opt, sched = _resumed(applied, optimizer.state_dict(), scheduler.state_dict())
    continue_schedule(opt, sched, applied, 6)
    assert opt.param_groups[0]["betas"] == (0.9, 0.99) and sched.base_lrs == [1e-3, 1e-3]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # the bias stays undecayed
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_factor(6, applied))


def _args(cfg) -> list[str]:
    s = cfg.lr_scheduler
    return [
        "--lr_scheduler.decay_type", s.decay_type, "--lr_scheduler.warmup_steps", str(s.warmup_steps),
        "--training.steps", str(cfg.training.steps), "--lr_scheduler.min_lr_factor", str(s.min_lr_factor),
    ]  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_weight_decay_spares_norms_biases_and_embeddings_unless_asked(tied):
    """Matrices decay; norm gains, biases and embedding tables (a tied head with them) do not,
    unless optimizer.weight_decay_embeddings. Checked on the update itself: with zero gradients
    AdamW moves only what decays, by lr x weight_decay."""
    import torch

    from titanlite.components.optimizer import build_optimizer
    from titanlite.distributed.param_init import ParamInit
    from titanlite.models.llama3 import Llama3, Llama3Args

    args = Llama3Args(
        dim=16,
        n_layers=1,
        n_heads=2,
        vocab_size=32,
        multiple_of=16,
        max_seq_len=8,
        tie_embeddings=tied,
    )
    model = Llama3(args)
    model.add_module(
        "extra", torch.nn.Linear(16, 16)
    )  # a bias, which titanlite's Llama has none of
    model.init_weights(ParamInit(model, 0))
    for embeddings_too in (False, True):
        cfg = parse_args(["--optimizer.weight_decay_embeddings", str(embeddings_too).lower()])[0]
        optimizer = build_optimizer(model, cfg)
        decayed = {
            name
            for name, p in model.named_parameters()
            for g in optimizer.param_groups
            if g["weight_decay"] > 0 and any(p is q for q in g["params"])
        }
        matrices = {
            n for n, p in model.named_parameters() if p.ndim == 2 and "tok_embeddings" not in n
        }
        if tied:  # the head is the embedding: named once, as tok_embeddings.weight
            matrices.discard("output.weight")
        want = matrices | ({"tok_embeddings.weight"} if embeddings_too else set())
        if not tied and not embeddings_too:
            assert "output.weight" in decayed  # an untied head is a matrix like any other
        assert decayed == want, decayed ^ want
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for n, p in model.named_parameters():
            shrink = 1 - cfg.optimizer.lr * cfg.optimizer.weight_decay if n in decayed else 1.0
            torch.testing.assert_close(p.detach(), before[n] * shrink, msg=n)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(before[n])


def test_the_seed_rule_gives_every_rank_one_stream_unless_a_fault_says_otherwise():
    """titanlite.tools.seeds: training.seed on every rank; the S1-2/S1-3 faults differ per rank."""
    from titanlite.tools.seeds import rank_seed, reshard_seed

    assert {rank_seed(7, r) for r in range(16)} == {7}
    assert len({rank_seed(7, r, "per_rank") for r in range(16)}) == 16
    assert [rank_seed(7, r, "rank0_differs") != 7 for r in range(3)] == [True, False, False]
    streams = {reshard_seed(7, step, r, s) for step in (3, 4) for r in range(8) for s in range(3)}
    assert len(streams) == 2 * 8 * 3  # resharded per-rank streams never share a seed


def test_a_resume_with_a_longer_schedule_moves_the_lr_of_its_first_step():
    """The step after the checkpoint already runs the new schedule (its lr, not the old one's,
    and the resume line gives both); an unchanged schedule keeps the lr bit for bit."""
    import torch

    from titanlite.components.checkpoint.resume import flat_config, resume_changes
    from titanlite.components.optimizer import build_lr_scheduler, build_optimizer, realign_schedule

    old = _cfg("cosine", steps=10)
    optimizer = build_optimizer(torch.nn.Linear(4, 4), old)
    scheduler = build_lr_scheduler(optimizer, old)
    for _ in range(6):
        optimizer.step()
        scheduler.step()
    saved = optimizer.state_dict(), scheduler.state_dict()
    same = realign_schedule(*_resumed(old, *saved), old, 6)
    assert same[0] == same[1] == 8e-4 * lr_factor(6, old)
    longer = _cfg("cosine", steps=40)
    opt, sched = _resumed(longer, *saved)
    before, after = realign_schedule(opt, sched, longer, 6)
    assert before == 8e-4 * lr_factor(6, old) and after == 8e-4 * lr_factor(6, longer) > before
    assert all(g["lr"] == after for g in opt.param_groups) and sched.get_last_lr() == [after] * 2
    (line,) = resume_changes({"step": 6, "config": flat_config(old)}, longer, (before, after))
    assert (
        line.startswith("resume: training.steps was 10, now 40: applied from step 7")
        and f"{after:.3g}" in line
    )
