r"""Cross entropy and global-token loss balancing: the one place the normaliser lives.

A step has data-parallel ranks r and microbatches m; microbatch (r, m) has n_{r,m} valid tokens
and summed cross entropy S_{r,m}. The objective is the token mean of the global batch,
L = \sum S_{r,m} / N with N = \sum n_{r,m}. N is counted before the first backward (one async
all-reduce, overlapped with the first forward), every microbatch backpropagates S_{r,m} / N, and
gradients are reduced with a plain SUM (titanlite.distributed.parallelize), so the result is
\nabla L exactly for any R, M and token spread; the logged loss is L. "local_mean" (a control)
backpropagates S_{r,m} / (n_{r,m} M R), exact only when every n_{r,m} is equal. A model's loss
terms (per-sequence sums, titanlite.models.step) are divided by the same N. N = 0 divides by 1
(zero gradient) and the trainer skips the update on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from titanlite.datasets.batch import Microbatch
from titanlite.distributed.liveness import phase
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.distributed.parallelize import grad_sync
from titanlite.errors import TrainingError
from titanlite.models.step import LossPath, StepContext
from titanlite.ops.cross_entropy import count_valid, cross_entropy_per_sample


class SequenceLosses(NamedTuple):
    """A microbatch's losses per sequence: the summed cross entropy and each named term the
    model adds (each a per-sequence sum, divided by the step's normaliser like the cross entropy)."""

    ce: torch.Tensor  # [B]
    terms: dict[str, torch.Tensor]  # name -> [B]


RESERVED = ("loss", "total")  # the records' own names for the cross entropy and the sum


def model_losses(out, batch: Microbatch) -> SequenceLosses:
    """A labels path's output, checked against the contract (models/registry.py) from shapes
    alone: a [B] tensor, or ([B] tensor, {name: [B] tensor})."""
    n = batch.labels.shape[0]
    ce, terms = out if isinstance(out, tuple) else (out, {})
    bad = None
    if not isinstance(ce, torch.Tensor) or ce.shape != (n,) or not isinstance(terms, dict):
        bad = f"returned {type(out).__name__}"
    else:
        for name, t in terms.items():
            if not (isinstance(name, str) and name.isidentifier() and name not in RESERVED):
                bad = f"named a term {name!r} (a term is a Python identifier other than {', '.join(RESERVED)})"
            elif not isinstance(t, torch.Tensor) or t.shape != (n,):
                bad = f"returned term {name!r} as {getattr(t, 'shape', type(t).__name__)}"
    if bad:
        raise TrainingError(
            f"the model's labels path {bad}; it returns each sequence's summed cross entropy [{n}], "
            "or that and a dict of named per-sequence terms (titanlite/models/registry.py)"
        )
    return SequenceLosses(ce, terms)


def sequence_losses(
    model: torch.nn.Module, batch: Microbatch, path: LossPath, step: StepContext | None = None
) -> SequenceLosses:
    """Each sequence's summed cross entropy and the model's named terms: training's and eval's
    maths, through the model's labels path whenever it has one (LossPath)."""
    extra = _inputs(batch)
    if step is not None and path.step:
        extra["step"] = step
    if path.own:
        out = model(batch.inputs, labels=batch.labels, loss_chunk=path.chunk, **extra)
        return model_losses(out, batch)
    return SequenceLosses(cross_entropy_per_sample(model(batch.inputs, **extra), batch.labels), {})


def _inputs(batch: Microbatch) -> dict[str, torch.Tensor]:
    """What a forward takes beside the tokens: packed positions, dropout keys."""
    extra = {} if batch.positions is None else {"positions": batch.positions}
    if batch.keys is not None:
        extra["sample_keys"] = batch.keys
    return extra


def step_statistics(
    model: torch.nn.Module, micro: list[Microbatch], balancer: LossBalancer
) -> torch.Tensor:
    """The statistics pass (titanlite.models.step, pattern 2): this rank's sum over its
    microbatches of what the model's counting forward returns, without gradient."""
    total = None
    with torch.no_grad():
        for m, batch in enumerate(micro):
            # the same inputs as the training forward: with dropout keyed by sample, the same masks
            context = balancer.context(m, counting=True)
            out = model(batch.inputs, labels=batch.labels, step=context, **_inputs(batch))
            if not isinstance(out, torch.Tensor) or out.ndim != 1:
                raise TrainingError(
                    f"the model's statistics pass returned {getattr(out, 'shape', type(out).__name__)}; with "
                    "step.counting set its forward returns one 1-D tensor (titanlite/models/step.py)"
                )
            total = out.clone() if total is None else total + out
    return total


class LossBalancer:
    """Turns each microbatch's summed loss into the loss to backpropagate (see module doc)."""

    def __init__(
        self,
        normalization: str,
        dp_group: dist.ProcessGroup | None,
        ranks: int,
        grad_accum: int,
    ) -> None:
        """`dp_group`: the ranks that hold distinct tokens (ParallelDims.dp_group), `ranks` of
        them: the naive mean's divisor."""
        self.normalization = normalization
        self.dp_group = dp_group
        self.ranks = ranks
        self._ranks = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.grad_accum = grad_accum
        self._global_count: torch.Tensor | None = None
        self._statistics: torch.Tensor | None = None
        self._works: list[dist.Work] = []
        self._local_counts: list[torch.Tensor] = []

    def begin_step(
        self, labels: list[torch.Tensor], statistics: torch.Tensor | None = None
    ) -> None:
        """Count this rank's valid tokens of every microbatch and start the global all-reduce;
        `statistics` (the step-statistics pass's sum on this rank) joins it: one collective
        when they are integers, as counts are, else a second one beside it."""
        self._local_counts = [count_valid(y) for y in labels]
        count = torch.stack(self._local_counts).sum()
        joined = statistics is not None and statistics.dtype == count.dtype
        reduce = [torch.cat([count[None], statistics])] if joined else [count[None]]
        if statistics is not None and not joined:
            reduce.append(statistics.clone())
        self._works = []
        if self._ranks > 1:
            self._works = [dist.all_reduce(t, group=self.dp_group, async_op=True) for t in reduce]
        self._global_count = reduce[0][0]
        self._statistics = None if statistics is None else (reduce[0][1:] if joined else reduce[1])

    def _wait(self) -> None:
        for work in self._works:
            work.wait()  # on CUDA this orders the streams; it does not block the host
        self._works = []

    def global_tokens(self) -> torch.Tensor:
        """N: valid tokens of the whole step over all ranks (device int64). Never read on host."""
        self._wait()
        return self._global_count

    def statistics(self) -> torch.Tensor | None:
        """The step statistics summed over microbatches and ranks (None: the model has none)."""
        self._wait()
        return self._statistics

    def context(self, micro: int, counting: bool = False) -> StepContext:
        """Microbatch `micro`'s view of the step (titanlite.models.step)."""
        return StepContext(
            self.dp_group,
            self._ranks,
            micro,
            self.grad_accum,
            counting,
            self.global_tokens,
            self.statistics,
        )

    def scale(self, loss_sum: torch.Tensor, micro: int) -> torch.Tensor:
        """The loss to backpropagate for microbatch `micro`, given its summed loss."""
        if self.normalization == "global":
            return loss_sum / self.global_tokens().clamp(min=1)
        local = self._local_counts[micro].clamp(min=1)
        return loss_sum / (local * (self.grad_accum * self.ranks))


def forward_backward(
    model: nn.Module,
    micro: list[Microbatch] | list[tuple[torch.Tensor, torch.Tensor]],
    balancer: LossBalancer,
    dims: ParallelDims,
    *,
    skip_grad_sync: bool,
    path: LossPath | None = None,
    losses=sequence_losses,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Accumulate this rank's gradients for one step (module doc). `path`: the model's loss path
    (None: logits, then the cross entropy here); `losses`: sequence_losses or a wrapper of it.
    Returns this rank's share of the logged loss, its per-sequence summed cross entropy in
    microbatch order (for the diagnostics) and its share of each term (shares sum over ranks)."""
    path = path or LossPath()
    micro = [Microbatch(*batch) for batch in micro]
    statistics = None
    if path.statistics:
        with dims.autocast(), phase("forward"):
            statistics = step_statistics(model, micro, balancer)
    balancer.begin_step([batch.labels for batch in micro], statistics)
    loss_total = torch.zeros((), device=dims.device)
    terms: dict[str, torch.Tensor] = {}
    sample_sums = []
    for m, batch in enumerate(micro):
        sync = m == len(micro) - 1 or not skip_grad_sync
        with grad_sync(model, sync):
            with dims.autocast(), phase("forward"):
                out = losses(model, batch, path, balancer.context(m))
            loss = balancer.scale(out.ce.sum(), m)
            scaled = {name: balancer.scale(t.sum(), m) for name, t in out.terms.items()}
            with phase("backward"):
                (loss + sum(scaled.values()) if scaled else loss).backward()
        loss_total += loss.detach()
        for name, t in scaled.items():
            terms[name] = terms[name] + t.detach() if name in terms else t.detach()
        sample_sums.append(out.ce.detach())
    return loss_total, torch.cat(sample_sums), terms
