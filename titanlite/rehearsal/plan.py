"""What a rehearsal knows before any step, and how much of the model its steps run.

The figures that need no step: the whole model's parameters, its memory estimate per rank
(titanlite.tools.memory), the fits verdict by that estimate, and FSDP's traffic per step from
the parameters' shapes and the layout (`fsdp_traffic`). A model whose step is too slow for the
device here (a CPU) is measured on its first blocks (`rehearsal.blocks`) and the rest derived:
the estimate's and the plan's terms for the blocks not run, added to what the run measured."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from titanlite.config import JobConfig
from titanlite.config.layout import AXIS_KINDS, Layout, loss_chunk, resolve_layout
from titanlite.datasets.build import build_tokenizer
from titanlite.distributed.parallel_dims import resolve_device
from titanlite.models.common.tensor_parallel import exchanges
from titanlite.models.registry import MetaModel, build_meta_model
from titanlite.tools.memory import (
    MemoryEstimate,
    available_bytes,
    job_estimate,
    keeps_gathered_params,
    shard_numel,
)

if TYPE_CHECKING:
    from titanlite.train import Trainer


# A step above this many FLOPs (the model's own count per token x the tokens a rank computes) runs
# on part of the model on a CPU, where it takes a minute and a half or more.
CPU_STEP_FLOPS = 1e13
CPU_FLOPS = 1e11  # a few cores' float32 matmuls (10^11 FLOP/s), for the time a whole step takes
AUTO_BLOCKS = 2  # the blocks a partial step runs: the one computing and the next, gathered ahead


def param_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    """training.mixed_precision_param with 'auto' resolved, as ParallelDims.build resolves it."""
    name = cfg.training.mixed_precision_param
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return getattr(torch, name)


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(getattr(model, "layers", None) or ())


def fsdp_traffic(
    model: torch.nn.Module, layout: Layout, cfg: JobConfig, keep: bool, blocks: int = 0
) -> dict[str, float]:
    """Bytes one rank sends per step on each group for FSDP's all-gathers and reductions, from
    the parameters' shapes (titanlite.distributed.parallelize: a unit per block, then the root;
    every block but the last resharded after forward unless params are kept gathered), or {} for
    a layout this does not model (DDP, a sequence split). Each all-gather gathers a unit's params padded
    to a multiple of the shard degree per microbatch (twice for a resharded block: forward and
    backward); each synced microbatch reduce-scatters its gradients, and HSDP all-reduces the
    shards over the replicas. The step's few-byte all-reduces (the token count) are not in it.
    `keep`: params kept gathered from forward to backward; `blocks`: the model's first this many
    blocks alone (0: all)."""
    if layout.mode not in ("fsdp", "hsdp") or layout.seq_split > 1:
        return {}
    shard, replicas, tp = layout.dp_shard, layout.dp_replicate, layout.model_split
    itemsize = param_dtype(cfg, resolve_device(cfg.training.device)).itemsize
    reduce_size = getattr(torch, cfg.training.mixed_precision_reduce).itemsize

    def padded(params) -> float:  # a tensor split's rank holds 1/tp of each matrix
        return sum(shard_numel(p.shape, shard) * shard / (tp if p.ndim > 1 else 1) for p in params)

    every = blocks_of(model)
    in_blocks = {id(p) for b in every for p in b.parameters()}
    root = padded(p for p in model.parameters() if id(p) not in in_blocks)
    each = [padded(b.parameters()) for b in every[: blocks or len(every)]]
    gathers = root + sum(n * (1 if keep or i == len(each) - 1 else 2) for i, n in enumerate(each))
    micro = layout.grad_accum
    syncs = 1 if layout.skip_grad_sync and micro > 1 else micro
    share = (shard - 1) / shard
    total = root + sum(each)
    out = {"dp_shard": share * (micro * gathers * itemsize + syncs * total * reduce_size)}
    if layout.mode == "hsdp":
        out["dp_replicate"] = syncs * total / shard * reduce_size * 2 * (replicas - 1) / replicas
    return out


def tensor_traffic(
    model: torch.nn.Module, layout: Layout, cfg: JobConfig, blocks: int = 0
) -> dict[str, float]:
    """Bytes one rank sends per step over a tensor split's group, for titanlite's shared blocks'
    plans (titanlite.models.common.tensor_parallel.exchanges: the residual stream gathered or
    reduce-scattered around each split block, (tp-1)/tp of it sent each time) and the
    vocab-parallel loss's three all-reduces of [B, S] floats (again in the backward where the
    loss runs in chunks); {} without a tensor split. `blocks`: the first this many blocks alone."""
    split = [(n, d) for n, d in layout.axes if not AXIS_KINDS[n].distinct_tokens]
    if not split:
        return {}
    (name, tp), t, args = split[0], cfg.training, model.args
    if blocks:
        model = copy.copy(model)  # the same modules, its layers cut to the first `blocks`
        model.layers = model.layers[:blocks]
    itemsize = param_dtype(cfg, resolve_device(t.device)).itemsize
    tokens, share = t.local_batch_size * t.seq_len, (tp - 1) / tp
    stream = exchanges(model, t.activation_checkpoint != "none") * tokens * args.dim * itemsize
    chunk = loss_chunk(cfg.loss.chunk_logits_mib, t.local_batch_size, t.seq_len, args.vocab_size)
    loss = 3 * tokens * 4 * 2 * (2 if chunk else 1)  # an all-reduce sends its payload twice
    return {name: layout.grad_accum * (stream + loss) * share}


@dataclass
class Plan:
    """The whole model's figures before any step, and the blocks the steps run (0: all)."""

    model: str
    params: int
    n_blocks: int
    blocks: int  # the blocks the steps run; 0: the whole model
    estimate: MemoryEstimate  # the whole model's, per rank
    traffic: dict[str, float]  # FSDP's bytes per step per group, from the shapes ({}: not modelled)
    part_traffic: dict[str, float]  # the same for the blocks the steps run
    flops_per_token: int  # the whole model's (0: the model does not say)
    why: str  # why the blocks are what they are

    def report(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "n_blocks": self.n_blocks,
            "blocks": self.blocks,
            "estimate_bytes": self.estimate.total_bytes,
            "estimate": self.estimate.summary(),
            "traffic_bytes": self.traffic,
            "flops_per_token": self.flops_per_token,
            "why": self.why,
        }


def whole_model(cfg: JobConfig) -> MetaModel:
    """The configured model on the meta device, every block of it."""
    whole = copy.deepcopy(cfg)
    whole.rehearsal.blocks = 0
    tokenizer = build_tokenizer(whole)
    return build_meta_model(whole, tokenizer.vocab_size if tokenizer else 0)


def make_plan(cfg: JobConfig) -> Plan:
    """Resolve what the rehearsal runs and what it knows before a step. Sets, in `cfg` (so
    config.toml records what ran): rehearsal.blocks to the blocks run (0: all), and, where the
    steps run part of the model, parallelism.reshard_after_forward as 'auto' decides it for the
    whole model (a part is smaller and could be kept gathered where the whole is not). Under DDP
    `keep` means nothing: fsdp_traffic returns {} for it."""
    meta = whole_model(cfg)
    layout = resolve_layout(cfg, cfg.rehearsal.world)
    device = resolve_device(cfg.training.device)
    dtype = param_dtype(cfg, device)
    available, _ = available_bytes(device)
    params = sum(p.numel() for p in meta.model.parameters())
    keep = keeps_gathered_params(cfg, params, dtype.itemsize, available)
    n_blocks = len(blocks_of(meta.model))
    step_flops = meta.flops_per_token * layout.tokens_per_rank_step
    traffic = fsdp_traffic(meta.model, layout, cfg, keep) | tensor_traffic(meta.model, layout, cfg)
    asked = cfg.rehearsal.blocks
    if asked == -1:
        slow = device.type == "cpu" and step_flops > CPU_STEP_FLOPS
        asked = AUTO_BLOCKS if slow else 0
        why = (
            f"a step of the whole model is {step_flops:.1e} FLOPs: about {step_flops / CPU_FLOPS / 60:,.0f} min "
            "on a CPU at 10^11 FLOP/s"
            if slow
            else "the whole model"
        )
    else:
        why = "rehearsal.blocks" if asked else "the whole model (rehearsal.blocks = 0)"
    if asked and not (hasattr(meta.args, "n_layers") and traffic):
        why = (
            f"the whole model: a part cannot be derived for {cfg.model.name} at this layout "
            "(its args have no n_layers, or the traffic of DDP or extra axes is not modelled)"
        )
        asked = 0
    if asked >= n_blocks:
        asked = 0
    cfg.rehearsal.blocks = asked
    if asked and cfg.parallelism.reshard_after_forward == "auto":
        cfg.parallelism.reshard_after_forward = "never" if keep else "always"
    estimate = job_estimate(meta, cfg, layout, dtype, available)
    part = fsdp_traffic(meta.model, layout, cfg, keep, asked) | tensor_traffic(
        meta.model, layout, cfg, asked
    )
    name = f"{cfg.model.name}/{cfg.model.flavor}"
    flops = meta.flops_per_token
    return Plan(name, params, n_blocks, asked, estimate, traffic, part, flops, why)


def derive(plan: Plan, trainer: Trainer, measured: dict[str, Any]) -> dict[str, Any]:
    """The whole model's figures from those measured on its first plan.blocks: memory plus the
    estimate's terms for the other blocks, traffic plus the plan's, compute times the FLOPs."""
    part = trainer.memory_estimate.total_bytes
    extra = {g: plan.traffic[g] - plan.part_traffic.get(g, 0.0) for g in plan.traffic}
    traffic = dict(measured["traffic_bytes"])
    for group, b in extra.items():
        traffic[group] = traffic.get(group, 0.0) + b
    compute = measured["compute_s"]
    part_flops = trainer.meta.flops_per_token  # the model the steps ran
    ratio = plan.flops_per_token / part_flops if part_flops else None
    if ratio is None:  # the model does not count its FLOPs: the parameters instead
        ratio = plan.params / sum(p.numel() for p in trainer.meta.model.parameters())
    return {
        "peak_bytes": measured["peak_bytes"] + plan.estimate.total_bytes - part,
        "traffic_bytes": traffic,
        "compute_s": None if compute is None else compute * ratio,
        "compute_ratio": ratio,
    }
