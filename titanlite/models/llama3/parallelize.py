"""Llama 3 parallelization: the tensor-parallel plan of its shared blocks over a tensor-splitting
axis (titanlite.models.common.tensor_parallel), then each TransformerBlock one AC / compile / FSDP
unit."""

from __future__ import annotations

import torch.nn as nn

from titanlite.config import JobConfig
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.distributed.parallelize import parallelize_blocks
from titanlite.models.common.tensor_parallel import decoder_split


def parallelize_llama(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    if dims.tensor_mesh is not None:
        decoder_split(model, dims.tensor_mesh, ("attention_norm", "ffn_norm"), "feed_forward")
    return parallelize_blocks(model, model.layers, dims, cfg)
