"""Run under torchrun at one world size: diagnostics against a single-process reference.

For FSDP and DDP, `exact` and `sketch`, one training step of the tiny Llama on the imbalanced
global batch of exactness.py goes through the real probe, gathers and collect(). Every rank
also computes the reference itself: each rank's local token-mean gradient separately, on an
unsharded copy, and the metrics from those vectors directly. Then the replica check under FSDP,
DDP and HSDP, with one bit flipped on one rank. "layouts": the model check's Llama 3 through the
trainer's hooks at dp=2, as a tensor split of 2 at world 4 (dp=2 x tp=2) and alone at world 2,
whose records must agree; at world 4 once more with one rank's gradient norm perturbed. Writes
JSON (rank 0) to argv[1].
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist
from exactness import ARGS, GLOBAL_BATCH, SEED, build, global_batch, rank_microbatches

from titanlite.analysis.check_cases import check_config
from titanlite.components.loss import LossBalancer, forward_backward
from titanlite.config import JobConfig
from titanlite.config.layout import resolve_layout
from titanlite.datasets.batch import Microbatch
from titanlite.diagnostics.component import Diagnostics
from titanlite.diagnostics.step_record import content_fingerprint
from titanlite.distributed.parallel_dims import ParallelDims, init_distributed
from titanlite.distributed.parallelize import materialize, unwrap
from titanlite.distributed.param_init import ParamInit, canonical_name
from titanlite.distributed.utils import clip_grad_norm_
from titanlite.faults.inject import Faults
from titanlite.faults.switches import FaultSwitches
from titanlite.models.llama3 import Llama3
from titanlite.models.registry import build_meta_model
from titanlite.ops.cross_entropy import IGNORE_INDEX, cross_entropy_sum
from titanlite.tools.hooks import Step


def reference(world: int) -> dict:
    tokens, labels = global_batch()
    per = GLOBAL_BATCH // world
    losses, counts, grads, sample_tokens, sample_loss, sample_content = [], [], [], [], [], []
    for r in range(world):
        model = Llama3(ARGS)
        model.init_weights(ParamInit(model, SEED))
        x, y = tokens[r * per : (r + 1) * per], labels[r * per : (r + 1) * per]
        with torch.no_grad():  # each sequence alone: the per-sample losses alerts carry
            sample_tokens.append([int((row != IGNORE_INDEX).sum()) for row in y])
            sample_content.append(content_fingerprint(x).tolist())
            sums = [
                cross_entropy_sum(model(x[i : i + 1]), y[i : i + 1]).item() for i in range(len(x))
            ]
            sample_loss.append(
                [s / t if t else None for s, t in zip(sums, sample_tokens[-1], strict=True)]
            )
        n = int((y != IGNORE_INDEX).sum())
        s = cross_entropy_sum(model(x), y)
        (s / max(n, 1)).backward()
        losses.append(s.item() / n if n else None)
        counts.append(n)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    total = sum(counts)
    global_grad = sum(g * n for g, n in zip(grads, counts, strict=True)) / total
    live = [r for r in range(world) if counts[r] > 0]
    cos = [
        [
            float(torch.nn.functional.cosine_similarity(grads[i], grads[j], dim=0))
            if i in live and j in live
            else None
            for j in range(world)
        ]
        for i in range(world)
    ]
    norms = [grads[r].norm().item() if r in live else None for r in range(world)]
    live_losses = torch.tensor([losses[r] for r in live], dtype=torch.float64)
    live_norms = torch.tensor([norms[r] for r in live], dtype=torch.float64)
    return {
        "rank_loss": losses,
        "rank_tokens": counts,
        "sample_tokens": sample_tokens,
        "sample_loss": sample_loss,
        "sample_content": sample_content,
        "rank_grad_norm": norms,
        "cos_matrix": cos,
        "rank_cos_to_mean": [
            float(torch.nn.functional.cosine_similarity(grads[r], global_grad, dim=0))
            if r in live
            else None
            for r in range(world)
        ],
        "loss_std": live_losses.std(unbiased=False).item(),
        "grad_norm_std": live_norms.std(unbiased=False).item(),
        "tokens_std": torch.tensor(counts, dtype=torch.float64).std(unbiased=False).item(),
    }


def run_case(
    world: int,
    mode: str,
    method: str,
    k: int,
    sketch_seed: int = 0,
    skip_sync: str = "auto",
    compiled: bool = False,
) -> dict:
    """One measured step with 2 microbatches. Under FSDP the layout reduces every microbatch
    (skip_sync auto), so the sketch is summed per microbatch; skip_sync "on" sketches whole steps.
    `compiled`: the GPU default, the blocks compiled in bf16 with selective checkpointing (the
    exactness worker's compiled case, so the second compile of the suite is a cache hit), the
    probe's hooks around them."""
    cfg = JobConfig()
    cfg.training.compile = compiled
    if compiled:
        cfg.training.activation_checkpoint = "selective"
    cfg.diagnostics.method = method
    cfg.diagnostics.sketch_dim = k
    cfg.training.seed = SEED + sketch_seed
    cfg.parallelism.skip_grad_sync = skip_sync
    layout, dims, model = build(
        cfg, world, mode, accum=2, param="bfloat16" if compiled else "float32"
    )
    diag = Diagnostics(cfg, model, dims, layout)
    micro = rank_microbatches(world, accum=2)
    balancer = LossBalancer("global", dims.dp_group, world, layout.grad_accum)
    s = Step(1, layout.skip_grad_sync, None)
    diag.begin(s)
    diag.ready(s)  # a measured `exact` step reduces its whole gradient at once
    _, sums, _ = forward_backward(model, micro, balancer, dims, skip_grad_sync=s.skip_grad_sync)
    grad_norm = clip_grad_norm_(model.parameters(), 0.0)
    tokens = torch.cat([(y != IGNORE_INDEX).sum(-1) for _, y in micro])
    ids = torch.arange(len(tokens)) + 1000 * dist.get_rank()  # stand-ins for dataset indices
    content = content_fingerprint(torch.cat([x for x, _ in micro]))
    order = torch.tensor(
        [12345.0 + (dist.get_rank() == 0)], dtype=torch.float64
    )  # rank 0's differs
    diag.end_step(
        1,
        grad_norm,
        sequence_loss_sums=sums,
        sequence_tokens=tokens,
        sequence_index=ids,
        sequence_content=content,
        order=order,
    )
    (rec,), _ = diag.collect()
    k = diag.probe.sketch.numel() if method == "sketch" else 0  # the prime actually used
    return {
        "world": world,
        "mode": mode,
        "method": method,
        "k": k,
        "sketch_seed": sketch_seed,
        "skip_sync": skip_sync,
        "compile": compiled,
        "record": rec,
    }


def replica_case(world: int, mode: str, flip_rank: int) -> dict:
    """The replica check after three updates-in-name: replicas equal at step 1; one bit of
    `flip_rank`'s first parameter flipped before step 2; still differing at step 3. Returns the
    alerts collected after each step."""
    cfg = JobConfig()
    cfg.diagnostics.replica_check_every = 1
    layout, dims, model = build(cfg, world, mode, accum=1)
    diag = Diagnostics(cfg, model, dims, layout)
    faults = Faults(
        FaultSwitches(flip_bit_step=2, flip_bit_rank=flip_rank), SEED, dist.get_rank(), world
    )
    faults.model = model
    alerts = []
    for step in (1, 2, 3):
        faults.begin(Step(step, False, None))
        diag.after_update(Step(step, False, None))
        _, raised = diag.collect()
        alerts.append([(a.name, a.step, a.ranks, a.values.get("parameter")) for a in raised])
    faults.close()
    first = canonical_name(next(iter(unwrap(model).named_parameters()))[0])
    return {"world": world, "mode": mode, "flip_rank": flip_rank, "alerts": alerts, "first": first}


class _Sampler:
    """The sampler's two calls the diagnostics make, for a rank's contiguous share."""

    def __init__(self, dp_rank: int, per_rank: int) -> None:
        self.indices = np.arange(dp_rank * per_rank, (dp_rank + 1) * per_rank)

    def rank_share(self, step: int) -> np.ndarray:
        return self.indices

    def order_hash(self, step: int) -> int:
        return 12345


def layout_case(world: int, method: str, mode: str = "fsdp", perturb: int | None = None) -> dict:
    """One measured step of the model check's Llama 3 in `mode` at dp=2 (hsdp: 2 replicas of one
    rank; with a tensor split of the rest of `world`), 2 microbatches per rank, through the trainer's hook calls (begin, ready,
    before_update, after_update) and collect(). `perturb`: the rank whose gradient norm, as the
    diagnostics read it, is 10 times the others'."""
    dp, accum = 2, 2
    cfg = check_config(["--model.name", "llama3", "--model.flavor", "tiny"])
    cfg.parallelism.mode, cfg.parallelism.dp_shard = mode, -1
    cfg.parallelism.dp_replicate = 1 if mode == "fsdp" else dp
    cfg.parallelism.axes = [f"tp={world // dp}"] if world > dp else []
    cfg.training.local_batch_size = GLOBAL_BATCH // (dp * accum)
    cfg.diagnostics.method = method
    layout = resolve_layout(cfg, world)
    dims = ParallelDims.build(layout, torch.device("cpu"), "float32", "float32")
    meta = build_meta_model(cfg, 0)
    model = materialize(meta.spec.parallelize_fn(meta.model, dims, cfg), dims, SEED)
    per_rank, lb = GLOBAL_BATCH // dp, layout.local_batch
    diag = Diagnostics(cfg, model, dims, layout, sampler=_Sampler(dims.dp_rank, per_rank))
    tokens, labels = global_batch()
    start = dims.dp_rank * per_rank
    micro = [
        Microbatch(
            tokens[start + m * lb : start + (m + 1) * lb],
            labels[start + m * lb : start + (m + 1) * lb],
        )
        for m in range(accum)
    ]
    balancer = LossBalancer("global", dims.dp_group, dims.token_ranks, layout.grad_accum)
    s = Step(1, layout.skip_grad_sync, None, micro=micro)
    diag.begin(s)
    diag.ready(s)
    _, s.sample_sums, s.terms = forward_backward(
        model, micro, balancer, dims, skip_grad_sync=s.skip_grad_sync, path=meta.loss_path()
    )
    s.grad_norm = clip_grad_norm_(model.parameters(), 0.0)
    if perturb == dist.get_rank():
        s.grad_norm = s.grad_norm * 10
    s.tokens = balancer.global_tokens()
    s.skip = (s.tokens == 0) | ~torch.isfinite(s.grad_norm)
    diag.before_update(s)
    diag.after_update(s)
    (rec,), alerts = diag.collect()
    return {
        "world": world,
        "method": method,
        "mode": mode,
        "perturb": perturb,
        "record": rec,
        "alerts": [(a.name, a.ranks, a.values, a.message) for a in alerts],
    }


def main() -> None:
    init_distributed(torch.device("cpu"))
    world = dist.get_world_size()
    cases = [run_case(world, mode, "exact", 0) for mode in ("fsdp", "ddp")]
    if world == 2:  # compiling costs ~20 s: one case
        cases.append(run_case(world, "fsdp", "exact", 0, compiled=True))
    cases += [
        run_case(world, mode, "sketch", k, s)
        for mode in ("fsdp", "ddp")
        for k in (256, 4096)
        for s in range(6)
    ]
    cases += [run_case(world, "fsdp", "sketch", k, 0, skip_sync="on") for k in (256, 4096)]
    replicas = [replica_case(world, mode, world - 2) for mode in ("fsdp", "ddp", "hsdp")]
    layouts = [layout_case(world, m) for m in ("exact", "sketch")]
    # where FSDP reduces alone: torch's replicate under ddp with a tensor split; hsdp of 1-rank shards
    layouts.append(layout_case(world, "sketch", "ddp" if world == 4 else "hsdp"))
    if world == 4:
        layouts.append(layout_case(world, "exact", perturb=3))
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            out = {
                "world": world,
                "reference": reference(world),
                "cases": cases,
                "replicas": replicas,
                "layouts": layouts,
            }
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
