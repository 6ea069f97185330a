"""Llama 3 parallelization: the tensor-parallel plan of its shared blocks over a tensor-splitting
axis (titanlite.models.common.tensor_parallel), then each TransformerBlock one AC / compile / FSDP
unit."""

from __future__ import annotations

import torch.nn as nn

from titanlite.config import JobConfig
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.distributed.parallelize import parallelize_blocks
from titanlite.models.common.tensor_parallel import (
    attention_plan,
    decoder_plan,
    norm_plan,
    swiglu_plan,
)


def parallelize_llama(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    mesh = dims.tensor_mesh
    if mesh is not None:
        for block in model.layers:
            attention_plan(block.attention, mesh)
            swiglu_plan(block.feed_forward, mesh)
            norm_plan(block.attention_norm, mesh)
            norm_plan(block.ffn_norm, mesh)
        decoder_plan(model, mesh)
    return parallelize_blocks(model, model.layers, dims, cfg)
