"""Data-parallel wrapping of a model of repeated blocks (AC, compile, FSDP/DDP/HSDP), and
`materialize`, which gives the wrapped meta-device model its initialized weights.

Every mode reduces gradients with a plain SUM (the loss is already divided by the global token
count: titanlite.components.loss), in training.mixed_precision_reduce.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.config import JobConfig
from titanlite.distributed.parallel_dims import ParallelDims
from titanlite.distributed.param_init import ParamInit
from titanlite.tools.memory import available_bytes, keeps_gathered_params


def parallelize_blocks(
    model: nn.Module, blocks: nn.ModuleList, dims: ParallelDims, cfg: JobConfig
) -> nn.Module:
    """Wrap each block (AC, compile, FSDP unit), then the root, of a meta-device model."""
    for i, block in enumerate(blocks):
        block = checkpoint_block(block, cfg.training.activation_checkpoint)
        if cfg.training.compile:
            block = torch.compile(block, fullgraph=True)
        blocks[i] = block
    if dims.mode == "ddp" and dims.tensor_mesh is None:
        return model  # DDP wraps the materialized model: see wrap_ddp
    mp = MixedPrecisionPolicy(param_dtype=dims.param_dtype, reduce_dtype=dims.reduce_dtype)
    if dims.mode == "ddp":
        # A tensor split's parameters are DTensors, which torch's DDP does not take: the same
        # all-reduce on FSDP's machinery (torch's replicate), block by block as FSDP's units.
        for block in blocks:
            replicate(block, mesh=dims.replicate_mesh, mp_policy=mp)
        replicate(model, mesh=dims.replicate_mesh, mp_policy=mp)
    else:
        mesh = dims.shard_mesh
        params = sum(p.numel() for p in model.parameters())
        keep = keeps_gathered_params(
            cfg, params, dims.param_dtype.itemsize, available_bytes(dims.device)[0]
        )
        for i, block in enumerate(blocks):
            # The last block's params are needed again at once by backward: keep them unsharded.
            last = i == len(blocks) - 1
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep and not last)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    disable_fsdp_grad_division(model)
    use_fast_reduce_scatter(model)
    return model


# Ops whose outputs selective checkpointing keeps: the FLOPs of a block. Everything else (norms,
# RoPE, SwiGLU's activation and product, residual adds) is recomputed in backward: about half a
# block's activation memory for a few percent more time.
_KEPT_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._grouped_mm.default,  # a mixture's experts (models/qwen3_moe/moe.py)
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,  # per-document attention on CUDA (models/common/document_attention.py)
}


def _keep_matmuls() -> tuple:
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_block(block: nn.Module, kind: str) -> nn.Module:
    """training.activation_checkpoint on one block: none, full, or selective (_KEPT_OPS)."""
    if kind == "full":
        return checkpoint_wrapper(block, preserve_rng_state=True)
    if kind == "selective":
        return checkpoint_wrapper(block, preserve_rng_state=True, context_fn=_keep_matmuls)
    return block


def disable_fsdp_grad_division(model: nn.Module) -> None:
    """Reduce as plain SUM on every FSDP unit (each setter acts on one unit's own group); on
    gloo the divide factor alone fails (PREMUL_SUM is NCCL-only), hence force-sum as well."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    op: dist.ReduceOp,
    async_op: bool = False,
) -> dist.Work | None:
    """FSDP2's gradient reduce-scatter. gloo runs its own as an all-reduce of the whole input;
    an all-to-all of the shards, summed here, is faster (scripts/bench.py's reduce-scatter group).
    Other backends keep their native reduce-scatter."""
    if dist.get_backend(group) != "gloo" or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    world = group.size()
    received = torch.empty_like(input)
    dist.all_to_all_single(received, input, group=group)
    torch.sum(received.view(world, -1), dim=0, out=output.view(-1))
    if op == dist.ReduceOp.AVG:
        output.div_(world)
    return None


class ReduceScatterComm:
    """FSDP2 custom reduce-scatter (FSDPModule.set_custom_reduce_scatter) calling reduce_scatter."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return reduce_scatter(output_tensor, input_tensor, group, op, async_op)


def use_fast_reduce_scatter(model: nn.Module) -> None:
    """On gloo, every FSDP unit reduces through reduce_scatter (the diagnostics probe replaces
    this with its own, which calls reduce_scatter too)."""
    if dist.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(ReduceScatterComm())


class SumHookState:
    """State of titanlite's DDP comm hook. `interceptor(tensor, bucket_index, group)` may take
    over a bucket's reduction (the diagnostics probe does on measured steps): it reduces
    `tensor` (the bucket in the reduce dtype) in place and returns it, or returns None."""

    def __init__(self, group: dist.ProcessGroup, reduce_dtype: torch.dtype) -> None:
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.interceptor = None


def _sum_allreduce_hook(state, bucket):  # DDP checks the real annotations; strings fail it
    """DDP comm hook: all-reduce SUM in the reduce dtype, without the default hook's division by
    the world size. A bf16 reduce sends half the bytes; the result is cast back into the bucket."""
    buf = bucket.buffer()
    comm = buf if buf.dtype == state.reduce_dtype else buf.to(state.reduce_dtype)

    def into_bucket(reduced: torch.Tensor) -> torch.Tensor:
        return reduced if reduced is buf else buf.copy_(reduced)

    if state.interceptor is not None:
        reduced = state.interceptor(comm, bucket.index(), state.group)
        if reduced is not None:
            fut = torch.futures.Future()
            fut.set_result(into_bucket(reduced))
            return fut
    fut = dist.all_reduce(comm, group=state.group, async_op=True).get_future()
    return fut.then(lambda f: into_bucket(f.value()[0]))


def wrap_ddp(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """DDP on an initialized model; buffers are the same on every rank: no per-forward sync."""
    device_ids = [dims.device.index] if dims.device.type == "cuda" else None
    group = dims.replicate_group
    ddp = DistributedDataParallel(
        model, device_ids=device_ids, process_group=group, forward_sync_buffers=False
    )
    ddp.titanlite_hook_state = SumHookState(group, dims.reduce_dtype)
    ddp.register_comm_hook(ddp.titanlite_hook_state, _sum_allreduce_hook)
    return ddp


def to_empty_tied(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device)` with its tied weights (e.g. Llama 3.2's head and embedding) still
    tied: on an unsharded model to_empty makes a Parameter per module (FSDP keeps one sharded)."""
    first: dict[int, tuple[nn.Module, str]] = {}
    tied = []  # (module, name, owner, owner_name): a slot holding a parameter another holds first
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                tied.append((module, name, *first[id(p)]))
            else:
                first[id(p)] = (module, name)
    model.to_empty(device=device)
    for module, name, owner, owner_name in tied:
        setattr(module, name, getattr(owner, owner_name))


def materialize(
    model: nn.Module, dims: ParallelDims, seed: int, rehearsal: bool = False
) -> nn.Module:
    """Parallelized meta-device model -> initialized model on the device (ParamInit: the same
    weights for every dp degree and mode; a rehearsal's drawn per shard, as it never reads them);
    DDP wraps it only now, as it needs real tensors."""
    to_empty_tied(model, dims.device)
    with torch.no_grad():
        model.init_weights(ParamInit(model, seed, per_shard=rehearsal))
    return wrap_ddp(model, dims) if dims.mode == "ddp" and dims.tensor_mesh is None else model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def grad_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Context for one microbatch's forward+backward: reduce gradients only if `enabled`."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()
