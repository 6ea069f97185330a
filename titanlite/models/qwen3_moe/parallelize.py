"""Qwen3-MoE parallelization: each block (attention, router and its experts) is one activation
checkpointing, compile and FSDP unit, so FSDP gathers a layer's experts with the layer and
shards them over the experts' dimension. Compiled, the experts' grouped_mm traces in bfloat16 only
(torch's meta function for it checks the dtype): `grouped` experts under compile need bfloat16
parameters (FSDP's, or DDP's autocast); `auto` and `loop` compile at any dtype."""

from __future__ import annotations

import torch
import torch.nn as nn

from titanlite.config import JobConfig
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.distributed.parallelize import parallelize_blocks
from titanlite.errors import UserError
from titanlite.models.common.tensor_parallel import decoder_split
from titanlite.models.qwen3_moe.moe import grouped_mm_available


def parallelize_qwen3_moe(model: nn.Module, dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    bf16 = dims.param_dtype == torch.bfloat16
    if cfg.training.compile and model.args.experts_impl == "grouped" and not bf16:
        raise UserError(
            f"training.compile cannot trace grouped experts at "
            f"{str(dims.param_dtype).removeprefix('torch.')} parameters (torch compiles grouped_mm "
            "in bfloat16 only): use --training.mixed_precision_param bfloat16, "
            "a flavor with experts_impl 'auto' or 'loop', or --training.compile false"
        )
    args = model.args
    if args.experts_impl == "grouped" and (args.dim % 8 or args.moe_hidden % 8):
        raise UserError(
            f"experts_impl 'grouped' needs dim ({args.dim}) and moe_hidden ({args.moe_hidden}) "
            "to be multiples of 8 (grouped_mm reads rows at 16-byte strides): use 'auto' or 'loop'"
        )
    if args.experts_impl == "grouped" and not grouped_mm_available():
        raise UserError(
            f"experts_impl 'grouped' needs torch.nn.functional.grouped_mm, which torch "
            f"{torch.__version__} lacks: use 'auto' or 'loop'"
        )
    if dims.tensor_mesh is not None:  # the experts stay whole on each tensor-parallel rank
        decoder_split(model, dims.tensor_mesh, ("attention_norm", "mlp_norm"), "mlp")
    return parallelize_blocks(model, model.layers, dims, cfg)
