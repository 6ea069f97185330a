"""Llama 3 parallelization: each TransformerBlock is one AC / compile / FSDP unit."""

from __future__ import annotations

import torch.nn as nn

from titanlite.config import JobConfig
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.distributed.parallelize import parallelize_blocks


def parallelize_llama(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    return parallelize_blocks(model, model.layers, dims, cfg)
