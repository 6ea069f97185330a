r"""What a model's forward may know about the training step it runs in: the step context.

A model whose forward takes `step` gets a StepContext on every training forward (None in eval,
generation and a plain `model(tokens)`). It is how a loss term the model adds stays exact at any
layout. The trainer divides every term the model returns by the step's normaliser N, the valid
tokens over all data-parallel ranks and microbatches (titanlite.components.loss), as it divides
the cross entropy; a term is exact when its per-sequence values, summed over the step and divided
by N, are the term of the whole global batch. Three patterns, each with a worked example in
tests/fork_moe.py:

1. Per-token sums (a router z-loss, `coef * sum_t logsumexp(router logits_t)^2`; a
   sequence-wise auxiliary loss): return each sequence's sum; divided by N it is the token
   mean over the step, exact everywhere as it is. Needs nothing from the context.
2. Statistics of the whole step (the Switch load-balancing loss, Fedus et al., arXiv
   2101.03961: `coef * E * sum_e f_e P_e`, f_e the share of routing slots that chose expert e
   and P_e the mean router probability of e, both over the step's T routed tokens). f has no
   gradient, so the term is linear in the probabilities once f is known:
       coef * E * sum_e f_e P_e = (1/N) sum_t [ (N/T) coef * E * sum_e f_e p_{t,e} ],
   a per-token sum the trainer's division makes exact, given the step's f and T. A rank cannot
   see its later microbatches' routing before its first backward, so the model opts in
   (`ModelSpec.step_statistics = True`) to a no-grad pass over all of the step's microbatches
   before the first training forward: each call has `step.counting` set (and the labels and
   positions of a training forward, so it can say which tokens count) and returns this
   microbatch's statistics (a 1-D tensor: the expert counts and T), which the trainer sums over
   the microbatches and the data-parallel ranks in the normaliser's all-reduce and hands to
   every training forward as `step.statistics`. Exact at any dp, accumulation and mode; it
   costs one more forward without gradient per microbatch (scripts/README.md, "Step
   statistics", has the measured cost). A model that gathers its statistics inside the training
   forward with `step.all_reduce` is exact only at one microbatch per rank. The same counts are
   the expert load a log step reports: a model with `expert_load(statistics)` (the contract in
   models/registry.py) gets their sum over the steps since the last log step and returns each
   MoE layer's expert shares (titanlite.components.expert_load), so nothing more is gathered.
3. The previous step's statistics (f from step t-1, kept in a buffer): invariant, since every
   rank sees the same previous step, and no extra forward, but not transformers' objective (its
   f is the current batch's), so its curve is not transformers' curve; say so where you use it.
   In the training forward, with `pending` and `previous` persistent buffers (a checkpoint
   keeps them; `previous` starts uniform):
       f = self.previous[:-1] / self.previous[-1]  # the step before's shares, then as in 2
       self.pending += counts                      # this microbatch's expert counts and rows
       if step.micro == step.accum - 1:            # every rank, once per step: one all-reduce
           self.previous.copy_(step.all_reduce(self.pending)); self.pending.zero_()

What the formula of one microbatch gives (transformers' load_balancing_loss_func applied to what
a rank holds): a product of two microbatch means, whose mean over microbatches is not the product
of the step's means: its gradient depends on how the batch is cut (tests/fork_moe.py's
fork_moe_local, the control that scripts/check_model.py and scripts/invariance.py fail).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class StepContext:
    """One microbatch's view of its step. Every field is known without reading the device."""

    group: dist.ProcessGroup | None  # the normaliser's group: every rank holding distinct tokens
    ranks: int  # its size (1: one process)
    micro: int  # this microbatch's index in the rank's step, 0 .. accum - 1
    accum: int  # microbatches per rank in the step
    counting: bool  # the statistics pass (pattern 2): return this microbatch's statistics
    _tokens: Callable[[], torch.Tensor]
    _statistics: Callable[[], torch.Tensor | None]

    @property
    def tokens(self) -> torch.Tensor:
        """N, the step's valid tokens over every rank and microbatch: a device int64 (on CUDA the
        wait on its all-reduce orders the streams and never blocks the host)."""
        return self._tokens()

    @property
    def statistics(self) -> torch.Tensor | None:
        """The sum over the step's microbatches and ranks of what the counting pass returned
        (None without ModelSpec.step_statistics, and during the counting pass itself)."""
        return None if self.counting else self._statistics()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the normaliser's group, in place and returned. A collective: every rank
        of the group calls it the same number of times in a step (titanlite.tools.instrument counts
        it, and the rehearsal prices it)."""
        if self.ranks > 1:
            dist.all_reduce(t, group=self.group)
        return t


@dataclass(frozen=True)
class LossPath:
    """How a model's loss is computed (MetaModel.loss_path in models/registry.py): one path per model.

    A model with a labels path (its forward takes `labels` and `loss_chunk`) always computes its
    own loss, and with it every term it adds; `chunk` only says how many positions its output
    projection runs at a time (0: the whole sequence, one chunk). A model without one returns
    logits and the cross entropy follows in titanlite.components.loss."""

    own: bool = False  # the model's forward takes labels (and loss_chunk) and returns the loss
    chunk: int = 0  # positions per chunk of that path (0: the whole sequence)
    step: bool = False  # its forward takes the step context (titanlite.models.step)
    statistics: bool = False  # it asks for the step-statistics pass (ModelSpec.step_statistics)
