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
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titanlite.errors import UserError

IGNORE_INDEX = -100
"""Label value that marks a position without a target (prompt, padding)."""


def cross_entropy_per_sample(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed token cross entropy over its valid positions ([batch], fp32 whatever
    the logits' dtype): what the loss path sums, kept per sample for the diagnostics' alerts."""
    per_token = F.cross_entropy(
        logits.flatten(0, -2).float(),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )
    return per_token.view(labels.shape).sum(-1)


def chunked_cross_entropy_per_sample(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int
) -> torch.Tensor:
    """cross_entropy_per_sample(hidden @ weight.T, labels) with the logits of `chunk` sequence
    positions alive at a time, forward and backward: each chunk's projection and cross entropy
    run under activation checkpointing, so backward recomputes that chunk's logits (one extra
    output matmul) instead of keeping [batch, seq, vocab] of them, and of their gradient.
    At vocab 128,256 a 2,048-token sequence's fp32 logits alone take 1 GB. The sums are the
    same per chunk, added in another order (exact to float rounding). `chunk` <= 0: the whole
    sequence at once, nothing recomputed."""
    if chunk <= 0:
        return _projected_ce(hidden, weight, labels)
    # split, not slices: backward gathers the chunks' gradients once, where each slice's would
    # be a zero-padded full-size tensor
    sums = [
        checkpoint(_projected_ce, h, weight, y, use_reentrant=False)
        for h, y in zip(hidden.split(chunk, dim=1), labels.split(chunk, dim=1), strict=True)
    ]
    return torch.stack(sums).sum(0)


def _projected_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return cross_entropy_per_sample(F.linear(hidden, weight), labels)


def chunk_positions(budget_mib: float, local_batch: int, seq_len: int, vocab: int) -> int:
    """Sequence positions per loss chunk so that one chunk's fp32 logits fit in `budget_mib`
    (loss.chunk_logits_mib); seq_len (no chunking) when they all fit, or when the budget is 0."""
    if budget_mib <= 0:
        return seq_len
    per_position = local_batch * vocab * 4
    return max(1, min(seq_len, int(budget_mib * 2**20 // per_position)))


def loss_chunk(cfg, meta, local_batch: int = 0) -> int:
    """The trainer's loss chunk (positions; 0: logits then loss) for a config and its meta model
    (titanlite.models.registry.MetaModel), at `local_batch` sequences (0: training's). A model
    whose forward takes no `labels` computes logits only: chunking it is refused in one line."""
    t = cfg.training
    batch = local_batch or t.local_batch_size
    chunk = chunk_positions(cfg.loss.chunk_logits_mib, batch, t.seq_len, meta.args.vocab_size)
    if chunk >= t.seq_len:
        return 0
    if "labels" not in inspect.signature(meta.spec.model_cls.forward).parameters:
        raise UserError(
            f"model '{meta.spec.name}' returns logits only (its forward takes no labels), and "
            f"loss.chunk_logits_mib = {cfg.loss.chunk_logits_mib:g} asks for the loss in chunks; set it to 0, or "
            "give the model forward(tokens, labels, loss_chunk) (see models/llama3/model.py)"
        )
    return chunk


def sequence_losses(model: torch.nn.Module, batch, loss_chunk: int = 0) -> torch.Tensor:
    """Each sequence's summed cross entropy over its valid tokens, for a Microbatch
    (titanlite.datasets.build): training's and eval's maths. `loss_chunk`: sequence positions per
    chunk of the model's own loss path (0, or the whole sequence: the model returns logits and
    the loss follows)."""
    extra = {} if batch.positions is None else {"positions": batch.positions}
    if 0 < loss_chunk < batch.labels.shape[1]:
        return model(batch.inputs, labels=batch.labels, loss_chunk=loss_chunk, **extra)
    return cross_entropy_per_sample(model(batch.inputs, **extra), batch.labels)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross entropy over valid positions (the per-sample sums, added)."""
    return cross_entropy_per_sample(logits, labels).sum()


def count_valid(labels: torch.Tensor) -> torch.Tensor:
    """Number of positions that carry a target, as a device int64 scalar."""
    return (labels != IGNORE_INDEX).sum()


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
        if self.dp_group is not None and self.dp_size > 1:
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
