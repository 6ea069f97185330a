"""Memory per rank: estimated on the meta model before anything is allocated (a model that cannot
fit stops with a message instead of being OOM-killed), and the peak reached, for the log. The
estimate adds terms that peak at different moments of a step (MemoryEstimate's), so it stays a
little above the peak (titanlite.rehearsal measures both)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from titanlite.config import JobConfig
from titanlite.config.layout import Layout, holds_unsharded_grads, mesh_text
from titanlite.errors import UserError
from titanlite.tools.activations import activation_bytes

GiB = 1024**3
logger = logging.getLogger("titanlite")


@dataclass
class MemoryEstimate:
    params: int
    states_bytes: float  # fp32 params, grads and AdamW moments: 16 bytes a param, sharded
    gathered_bytes: float  # FSDP's largest unit gathered at once, with its gradient
    activation_bytes: float  # what autograd keeps for backward (tools/activations.py)
    logits_bytes: float  # the loss's logits beyond what the activations' trace saw
    unit_params: int = 0  # the largest unit's params: a block, or the root's own under FSDP
    held_grads_bytes: float = 0.0  # unsharded gradients kept across microbatches
    diagnostics_bytes: float = 0.0  # what a measured step adds besides held gradients
    diagnostics_after_backward: bool = False  # exact's buffers peak once a unit's backward is done
    activations_from: str = "traced"  # how the activations were estimated (tools/activations.py)

    @property
    def total_bytes(self) -> float:
        compute = self.gathered_bytes + self.activation_bytes + self.logits_bytes
        if self.diagnostics_after_backward:  # the activations are gone by the probe's peak
            peak = max(compute, self.diagnostics_bytes)
        else:
            peak = compute + self.diagnostics_bytes
        return self.states_bytes + self.held_grads_bytes + peak

    def summary(self) -> str:
        return (
            f"{self.total_bytes / GiB:.2f} GiB (params+grads+AdamW {self.states_bytes / GiB:.2f}, "
            f"gathered {self.gathered_bytes / GiB:.2f}, activations {self.activation_bytes / GiB:.2f} "
            f"({self.activations_from}), "
            f"logits {self.logits_bytes / GiB:.2f}, held unsharded grads {self.held_grads_bytes / GiB:.2f}, "
            f"diagnostics {self.diagnostics_bytes / GiB:.2f}"
            + (", once backward is done)" if self.diagnostics_after_backward else ")")
        )


def measured_step_bytes(
    cfg: JobConfig, layout: Layout, params: int, unit_params: int
) -> tuple[float, float]:
    """(held unsharded gradient bytes, diagnostics buffer bytes) at the heaviest step. exact's probe
    holds the largest unit's fp32 gradient, its all-to-all copy and the buffer received; both
    methods hold the dp x dp Gram, which at tens of thousands of ranks is the most."""
    held = 4.0 * params if holds_unsharded_grads(layout) else 0.0
    d = cfg.diagnostics
    if not d.enable or layout.dp < 2:
        return held, 0.0
    gram = 8.0 * layout.dp**2  # either method's float64 Gram of the ranks' gradients
    if layout.diagnostics_method == "sketch":
        return held, gram + 4.0 * (2 * 2**20 + 2 * layout.dp * d.sketch_dim)
    if holds_unsharded_grads(dataclasses.replace(layout, skip_grad_sync=True)):
        held = 4.0 * params  # a measured exact step reduces on its last microbatch only
    return held, gram + 3 * 4.0 * unit_params


KEEP_GATHERED_SHARE = 0.05  # reshard_after_forward = auto keeps params gathered up to this share


def keeps_gathered_params(cfg: JobConfig, params: int, param_bytes: int, available: float) -> bool:
    """Whether FSDP keeps each block's gathered params from forward to backward
    (parallelism.reshard_after_forward): one in three of FSDP's collectives saved, the whole
    model's params held; auto keeps them where that costs <= 5% of `available` bytes."""
    policy = cfg.parallelism.reshard_after_forward
    if policy == "auto":
        return params * param_bytes <= KEEP_GATHERED_SHARE * available
    return policy == "never"


def shard_numel(shape: torch.Size, shard: int) -> int:
    """Elements of one rank's shard of a parameter: FSDP2 cuts dim 0 into `shard` equal, padded
    chunks (FSDPParam), so 256 rows over 1,024 ranks hold 1 row a rank, four times its share."""
    rows = shape[0] if len(shape) else 1
    return -(-rows // shard) * (math.prod(shape[1:]) if len(shape) > 1 else 1)


def estimate_memory(
    model: nn.Module,
    args: Any,
    *,
    local_batch: int,
    seq_len: int,
    param_dtype: torch.dtype,
    activation_checkpoint: str,
    shard: int = 1,
    mode: str = "fsdp",
    loss_chunk: int = 0,
    keep_gathered: bool = False,
    labels_path: bool = False,
    reduce_dtype: torch.dtype | None = None,
    tensor_split: int = 1,
) -> MemoryEstimate:
    """The estimate for `model` (blocks in `model.layers`; `args`: its vocab_size, dim, n_layers)
    before the measured step's terms (job_estimate adds them). `tensor_split`: the ranks a tensor
    split (titanlite.models.common.tensor_parallel) divides each matrix among, the whole sequence
    on each: a rank holds 1/tp of every matrix (the norms' vectors whole), of the activations
    (the residual stream in pieces between blocks, heads and hidden units split inside them) and
    of the logits (its vocabulary rows)."""
    blocks = list(getattr(model, "layers", None) or ())
    # blocks differ where some layers are dense and others hold experts: the largest is gathered
    each = [sum(p.numel() for p in block.parameters()) for block in blocks]
    block_params = max(each, default=0)
    n_layers = getattr(args, "n_layers", 0)
    weights = list(model.parameters())
    params = sum(p.numel() for p in weights)
    root = params - sum(each)
    param_bytes = param_dtype.itemsize
    sharded_mode = mode in ("fsdp", "hsdp")
    divisor = shard if sharded_mode else 1
    tp = tensor_split
    sharded = sum(shard_numel(p.shape, divisor) / (tp if p.ndim > 1 else 1) for p in weights)
    gathered = 0.0
    if sharded_mode:
        # The root's own params (embedding, head) stay gathered through the step (FSDP2 keeps
        # the root unsharded after forward); on top of them the block computing and the next,
        # whose all-gather FSDP issues ahead (its implicit prefetch). Gradients: the root's (a
        # head tied to the embedding has two, and their sum alive at the root's backward) and
        # one block's, with its copy in the reduce dtype where that differs (the
        # reduce-scatter's input). Each term shows in Qwen3-30B-A3B rehearsed at 64 ranks, where
        # a block (its 128 experts) is as large as the root.
        tied = len(list(model.named_parameters(remove_duplicate=False))) > len(weights)
        unit = root + min(2, len(blocks)) * block_params
        grads = (root * (3 if tied else 1) + block_params) * param_bytes
        if reduce_dtype is not None and reduce_dtype != param_dtype:
            grads += block_params * reduce_dtype.itemsize
        # what the shards' padding adds to a gather
        padding = sum(shard_numel(p.shape, divisor) for p in weights) * divisor / max(params, 1)
        gathered = ((params if keep_gathered else unit) * param_bytes + grads) * padding / tp
    chunk = loss_chunk if 0 < loss_chunk < seq_len else 0
    dim = getattr(args, "dim", 0)
    one, source = activation_bytes(
        model,
        seq_len,
        param_dtype,
        chunk,
        activation_checkpoint,
        dim,
        n_layers,
        labels_path,
        args.vocab_size,
    )
    # The loss's logits beyond what the trace saw: a chunk's, recomputed in backward (its output,
    # fp32 copy and gradient), or the whole sequence's gradients (forward's own are traced).
    positions = chunk or seq_len
    logits = local_batch * positions * args.vocab_size * (param_bytes + (8 if chunk else 4))
    activations = local_batch * one / tp
    if tp > 1 and activation_checkpoint == "none":
        # attention's and the SwiGLU's inputs, gathered whole for their column-parallel
        # matmuls, are kept whole on every rank for those matmuls' backward
        activations += 2 * n_layers * local_batch * seq_len * dim * param_bytes * (1 - 1 / tp)
    return MemoryEstimate(
        params,
        16 * sharded,
        gathered,
        activations,
        logits / tp,
        unit_params=max(block_params, root) if sharded_mode else block_params,
        activations_from=source,
    )


def available_bytes(device: torch.device) -> tuple[float, str]:
    """Memory this rank may use: its GPU's free memory, or a share of the host's."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"free on {torch.cuda.get_device_name(device)}"
    avail = math.inf
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            avail = float(line.split()[1]) * 1024
    cgroup = Path("/sys/fs/cgroup/memory.max")  # this container's limit, where it sets one
    raw = cgroup.read_text().strip() if cgroup.exists() else ""
    avail = min(avail, float(raw) if raw.isdigit() else math.inf)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return avail / ranks, f"host memory available / {ranks} local rank(s)"


def job_estimate(
    meta: Any, cfg: JobConfig, layout: Layout, param_dtype: torch.dtype, available: float
) -> MemoryEstimate:
    """The estimate for `meta` (a registry.MetaModel) under cfg and its layout, measured step
    included, on a rank with `available` bytes (by which reshard_after_forward = auto decides)."""
    t, model = cfg.training, meta.model
    params = sum(p.numel() for p in model.parameters())
    est = estimate_memory(
        model,
        meta.args,
        local_batch=t.local_batch_size,
        seq_len=t.seq_len // layout.seq_split,  # a rank that splits sequences holds one piece each
        param_dtype=param_dtype,
        activation_checkpoint=t.activation_checkpoint,
        shard=layout.shard_ranks,
        mode=layout.mode,
        loss_chunk=meta.loss_chunk,
        keep_gathered=keeps_gathered_params(cfg, params, param_dtype.itemsize, available),
        labels_path=meta.loss_path().own,
        reduce_dtype=getattr(torch, t.mixed_precision_reduce),
        tensor_split=layout.model_split,
    )
    measured = measured_step_bytes(cfg, layout, params, est.unit_params)
    est.held_grads_bytes, est.diagnostics_bytes = measured
    est.diagnostics_after_backward = layout.diagnostics_method == "exact"
    return est


def check_memory(
    meta: Any, cfg: JobConfig, layout: Layout, device: torch.device, param_dtype: torch.dtype
) -> MemoryEstimate:
    """Log the estimate (before the model is parallelized: the activations' trace needs that) and
    refuse, in one line, a job that cannot fit on this rank (unless debug.skip_memory_check)."""
    avail, what = available_bytes(device)
    est = job_estimate(meta, cfg, layout, param_dtype, avail)
    model = f"{cfg.model.name}/{cfg.model.flavor}"
    if cfg.model.hf_assets_path:
        model = f"{cfg.model.name} from {cfg.model.hf_assets_path}"
    # titanlite.rehearsal.plan: a part runs (the meta model was cut to it: a count at or above the
    # model's blocks cuts nothing and runs the whole)
    blocks = cfg.rehearsal.blocks
    if cfg.rehearsal.world and blocks > 0 and getattr(meta.args, "n_layers", 0) == blocks:
        model += f" (its first {cfg.rehearsal.blocks} blocks, which the rehearsal's steps run)"
    logger.info(
        f"model {model}: {est.params:,} params, vocab {meta.args.vocab_size}; "
        f"{mesh_text(layout.mode, layout.dp_replicate, layout.dp_shard, dict(layout.axes))}, grad accum {layout.grad_accum}; "
        f"est. memory per rank {est.summary()}; {avail / GiB:.1f} GiB {what}"
    )
    if est.total_bytes > avail and not cfg.debug.skip_memory_check:
        fixes = "use more ranks or GPUs, a smaller local_batch_size or seq_len, or training.activation_checkpoint = 'selective' or 'full'"
        if est.held_grads_bytes:
            why = "diagnostics.method = 'exact'"
            if layout.skip_grad_sync:
                why = "parallelism.skip_grad_sync"
            fixes = (
                f"{why} keeps {est.held_grads_bytes / GiB:.2f} GiB of unsharded gradients across "
                f"microbatches: set it to 'auto', or {fixes}"
            )
        raise UserError(
            f"model {model} needs about {est.total_bytes / GiB:.1f} GiB per rank "
            f"but {avail / GiB:.1f} GiB is available ({what}); {fixes}"
        )
    return est


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far: allocated on the GPU, or this process's resident set on the host."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
