r"""Cross entropy and global-token loss balancing: the one place the normaliser lives.

The maths
---------
A step has data-parallel ranks r = 1..R and gradient-accumulation microbatches m = 1..M per
rank. Microbatch (r, m) has n_{r,m} valid tokens (labels != IGNORE_INDEX) and the summed
cross entropy S_{r,m} = \sum_{j valid} \ell_{r,m,j}. The step's true objective is the token
mean over the whole global batch

    L = (\sum_{r,m} S_{r,m}) / N,        N = \sum_{r,m} n_{r,m},

so its gradient is  \nabla L = (1/N) \sum_{r,m} \nabla S_{r,m}.

titanlite computes N before the first backward of the step (all labels of the step are on hand:
count locally, one async all-reduce of a device integer over the data-parallel group, overlapped
with the first forward), backpropagates S_{r,m} / N for every microbatch, accumulates the
gradients locally, and reduces them across ranks with a plain SUM (FSDP's and DDP's division by
the world size is disabled, see titanlite.distributed.parallelize). The reduced gradient is then

    \sum_r \sum_m \nabla S_{r,m} / N = \nabla L

exactly, whatever R and M are and however the valid tokens are spread over them. The logged
loss is the sum over ranks of the backpropagated losses, i.e. L itself.

The naive alternative ("local_mean", kept as a control) backpropagates S_{r,m} / (n_{r,m} M R):
the mean over ranks and microbatches of per-microbatch token means. It weights a token on a
microbatch with few valid tokens more than one on a full microbatch, so it equals \nabla L only
when every n_{r,m} is the same.

A loss term a model adds (a router's load-balancing or z-loss) is a per-sequence sum A_{r,m}
like S_{r,m}, and is divided by the same N: the step minimises (\sum S + \sum_k \sum A^k) / N.
Each term is then exact when \sum_{r,m} A^k_{r,m} / N is the term of the whole global batch;
titanlite.models.step says how a model makes it so (statistics of the whole step included).
The logged loss stays the cross entropy; each term and the total are logged beside it.

A step with N = 0 (every label ignored) has S_{r,m} = 0 everywhere; dividing by max(N, 1) keeps
it finite (zero gradient) and the trainer skips its optimizer update on the device.

The loss path, in the order a step runs it
------------------------------------------
1. titanlite.datasets.batch: the step's microbatches (tokens, labels with IGNORE_INDEX).
2. here, LossBalancer.begin_step: n_{r,m} counted (titanlite.ops.cross_entropy.count_valid) and
   N all-reduced, asynchronously, before the first forward ends; a model that asks for step
   statistics has its no-grad counting pass first, whose sums join that all-reduce.
3. the model's forward (titanlite.models, e.g. llama3/model.py), through its labels path when it
   has one (LossPath): the head and the loss in the root module's forward, S_{r,m} per sequence
   (titanlite.ops.cross_entropy, in chunks of loss_chunk positions at a large vocabulary) and
   the model's named terms.
4. here, forward_backward: (S_{r,m} + \sum_k A^k_{r,m}) / N backpropagated per microbatch.
5. titanlite.distributed.parallelize: the gradients reduced with a plain SUM (FSDP's and DDP's
   division switched off); on a measured step the diagnostics' probe sees each rank's local
   gradient there first (titanlite.diagnostics.probe).
6. titanlite.train: the optimizer step (components/optimizer.py), skipped on the device when N = 0,
   the norm is not finite or the spike guard judges it a spike.
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
    ce, terms = (
        (out, {})
        if isinstance(out, torch.Tensor)
        else (out if isinstance(out, tuple) else (None, None))
    )
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
    """Each sequence's summed cross entropy over its valid tokens and the model's named terms,
    for a Microbatch (titanlite.datasets.build): training's and eval's maths, through the model's
    labels path whenever it has one (LossPath). `step`: the training step's context, for a model
    that takes it."""
    extra = _inputs(batch)
    if step is not None and path.step:
        extra["step"] = step
    if path.own:
        return model_losses(
            model(batch.inputs, labels=batch.labels, loss_chunk=path.chunk, **extra), batch
        )
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
            out = model(batch.inputs, step=balancer.context(m, counting=True), **_inputs(batch))
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
        dp_size: int,
        grad_accum: int,
    ) -> None:
        if normalization not in ("global", "local_mean"):
            raise ValueError(f"unknown loss normalization {normalization!r}")
        self.normalization = normalization
        self.dp_group = dp_group
        self.dp_size = dp_size
        # every rank of the group holds distinct tokens (with sequences split: more than dp_size)
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
        if len(labels) != self.grad_accum:
            raise ValueError(f"expected {self.grad_accum} microbatches, got {len(labels)}")
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
        if self._global_count is None:
            raise RuntimeError("begin_step() must run first")
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
        return loss_sum / (local * (self.grad_accum * self.dp_size))


class StepLosses(NamedTuple):
    """What one rank's step leaves: its shares of the step's losses (each rank's sum to the
    logged values) and its per-sequence cross entropy, in microbatch order, for the diagnostics."""

    ce: torch.Tensor  # this rank's share of the logged loss (the cross entropy)
    sample_sums: torch.Tensor  # [sequences] summed cross entropy
    terms: dict[str, torch.Tensor]  # name -> this rank's share of the term


def forward_backward(
    model: nn.Module,
    micro: list[Microbatch] | list[tuple[torch.Tensor, torch.Tensor]],
    balancer: LossBalancer,
    dims: ParallelDims,
    *,
    skip_grad_sync: bool,
    path: LossPath | None = None,
    losses=sequence_losses,
) -> StepLosses:
    """Accumulate this rank's gradients for one step: every microbatch's cross entropy and named
    terms divided by the step's normaliser, their total backpropagated (see module doc).
    `path`: how the model computes its loss (None: logits, then the cross entropy here);
    `losses`: the per-sequence loss function (sequence_losses' signature; the faults and the
    fingerprints wrap it).
    """
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
    return StepLosses(loss_total, torch.cat(sample_sums), terms)
