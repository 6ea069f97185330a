"""Qwen3-MoE parallelization: each block (attention, router and its experts) is one activation
checkpointing, compile and FSDP unit, so FSDP gathers a layer's experts with the layer and
shards them over the experts' dimension."""

from __future__ import annotations

import torch.nn as nn

from titanlite.config import JobConfig
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.distributed.parallelize import parallelize_blocks


def parallelize_qwen3_moe(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    return parallelize_blocks(model, model.layers, dims, cfg)
