"""Held-out evaluation: the exact token-mean loss of the whole eval set, and its perplexity.

The maths is training's (titanlite.components.loss.sequence_losses: summed cross entropy over valid
tokens), summed in float64 and all-reduced with the valid-token count over the data-parallel
ranks, so the result does not depend on dp or the eval batch. Rank r of dp reads the items
r*B .. r*B + B-1 of every round of dp*B, a fixed order independent of the training data's;
every rank runs the same number of forwards (FSDP gathers in each), the last round padded with
label-less copies. Nothing here draws a random number (eval mode: no dropout), so training
after an eval is bitwise what it would have been without it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from titanlite.components.loss import IGNORE_INDEX, sequence_losses
from titanlite.datasets.build import Microbatch, collate
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.tools.readback import readback


class Evaluator:
    """Evaluates a model on a dataset (an indexable of (inputs, labels[, positions]) items)."""

    def __init__(self, dataset, dims: ParallelDims, batch_size: int, loss_chunk: int) -> None:
        self.dataset = dataset
        self.dims = dims
        self.batch_size = batch_size
        self.loss_chunk = loss_chunk  # see sequence_losses

    def _batch(self, round_: int) -> Microbatch:
        """This rank's microbatch of one round; past the end, copies of item 0 without labels."""
        per_round = self.batch_size * self.dims.dp_size
        first = round_ * per_round + self.dims.dp_rank * self.batch_size
        items = []
        for i in range(first, first + self.batch_size):
            if i < len(self.dataset):
                items.append(self.dataset[i])
            else:
                inputs, labels, *rest = self.dataset[0]
                items.append((inputs, np.full_like(labels, IGNORE_INDEX), *rest))
        return collate(items).to(self.dims.device)

    @torch.no_grad()
    def run(self, model: nn.Module) -> dict[str, float]:
        """{"loss", "perplexity", "tokens", "sequences"}; every rank calls it."""
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.dims.device)  # loss sum, valid tokens
        rounds = math.ceil(len(self.dataset) / (self.batch_size * self.dims.dp_size))
        try:
            for r in range(rounds):
                batch = self._batch(r)
                with self.dims.autocast():
                    per_sequence = sequence_losses(model, batch, self.loss_chunk)
                totals[0] += per_sequence.double().sum()
                totals[1] += (batch.labels != IGNORE_INDEX).sum()
        finally:
            model.train(was_training)
        if self.dims.dp_size > 1:
            dist.all_reduce(totals, group=self.dims.dp_group)
        ((loss_sum, tokens),) = readback([totals])  # the eval's one read on the host
        loss = loss_sum / tokens if tokens else float("nan")
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)) if tokens else float("nan"),
            "tokens": int(tokens),
            "sequences": len(self.dataset),
        }
