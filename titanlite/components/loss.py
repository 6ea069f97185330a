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

A step with N = 0 (every label ignored) has S_{r,m} = 0 everywhere; dividing by max(N, 1) keeps
it finite (zero gradient) and the trainer skips its optimizer update on the device.

The loss path, in the order a step runs it
------------------------------------------
1. titanlite.datasets.batch: the step's microbatches (tokens, labels with IGNORE_INDEX).
2. here, LossBalancer.begin_step: n_{r,m} counted (titanlite.ops.cross_entropy.count_valid) and
   N all-reduced, asynchronously, before the first forward ends.
3. the model's forward (titanlite.models, e.g. llama3/model.py): the head and the loss in the
   root module's forward, S_{r,m} per sequence (titanlite.ops.cross_entropy, in chunks of
   loss_chunk positions at a large vocabulary).
4. here, forward_backward: S_{r,m} / N backpropagated per microbatch.
5. titanlite.distributed.parallelize: the gradients reduced with a plain SUM (FSDP's and DDP's
   division switched off); on a measured step the diagnostics' probe sees each rank's local
   gradient there first (titanlite.diagnostics.probe).
6. titanlite.train: the optimizer step (components/optimizer.py), skipped on the device when N = 0,
   the norm is not finite or the spike guard judges it a spike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from titanlite.datasets.batch import Microbatch
from titanlite.distributed.liveness import phase
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.distributed.parallelize import grad_sync
from titanlite.ops.cross_entropy import count_valid, cross_entropy_per_sample


def sequence_losses(model: torch.nn.Module, batch, loss_chunk: int = 0) -> torch.Tensor:
    """Each sequence's summed cross entropy over its valid tokens, for a Microbatch
    (titanlite.datasets.build): training's and eval's maths. `loss_chunk`: sequence positions per
    chunk of the model's own loss path (0, or the whole sequence: the model returns logits and
    the loss follows)."""
    extra = {} if batch.positions is None else {"positions": batch.positions}
    if batch.keys is not None:
        extra["sample_keys"] = batch.keys
    if 0 < loss_chunk < batch.labels.shape[1]:
        return model(batch.inputs, labels=batch.labels, loss_chunk=loss_chunk, **extra)
    return cross_entropy_per_sample(model(batch.inputs, **extra), batch.labels)


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
        self._work: dist.Work | None = None
        self._local_counts: list[torch.Tensor] = []

    def begin_step(self, labels: list[torch.Tensor]) -> None:
        """Count this rank's valid tokens of every microbatch and start the global all-reduce."""
        if len(labels) != self.grad_accum:
            raise ValueError(f"expected {self.grad_accum} microbatches, got {len(labels)}")
        self._local_counts = [count_valid(y) for y in labels]
        self._global_count = torch.stack(self._local_counts).sum()
        self._work = None
        if self._ranks > 1:
            self._work = dist.all_reduce(self._global_count, group=self.dp_group, async_op=True)

    def global_tokens(self) -> torch.Tensor:
        """N: valid tokens of the whole step over all ranks (device int64). Never read on host."""
        if self._global_count is None:
            raise RuntimeError("begin_step() must run first")
        if self._work is not None:
            self._work.wait()  # on CUDA this orders the streams; it does not block the host
            self._work = None
        return self._global_count

    def scale(self, loss_sum: torch.Tensor, micro: int) -> torch.Tensor:
        """The loss to backpropagate for microbatch `micro`, given its summed cross entropy."""
        if self.normalization == "global":
            return loss_sum / self.global_tokens().clamp(min=1)
        local = self._local_counts[micro].clamp(min=1)
        return loss_sum / (local * (self.grad_accum * self.dp_size))


def forward_backward(
    model: nn.Module,
    micro: list[Microbatch] | list[tuple[torch.Tensor, torch.Tensor]],
    balancer: LossBalancer,
    dims: ParallelDims,
    *,
    skip_grad_sync: bool,
    loss_chunk: int = 0,
    losses=sequence_losses,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate this rank's gradients for one step.

    Returns (this rank's share of the step's loss, its summed cross entropy per sequence, in
    microbatch order). The shares of all ranks sum to the logged loss (see
    module doc); the per-sequence sums feed the diagnostics. `loss_chunk`: see
    sequence_losses; `losses`: the per-sequence loss function (sequence_losses' signature).
    """
    micro = [Microbatch(*batch) for batch in micro]
    balancer.begin_step([batch.labels for batch in micro])
    loss_total = torch.zeros((), device=dims.device)
    sample_sums = []
    for m, batch in enumerate(micro):
        sync = m == len(micro) - 1 or not skip_grad_sync
        with grad_sync(model, sync):
            with dims.autocast(), phase("forward"):
                per_sample = losses(model, batch, loss_chunk)
            loss = balancer.scale(per_sample.sum(), m)
            with phase("backward"):
                loss.backward()
        loss_total += loss.detach()
        sample_sums.append(per_sample.detach())
    return loss_total, torch.cat(sample_sums)
