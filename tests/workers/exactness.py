"""Run under torchrun at one world size; loops over every case inside one process group.

For each (mode, grad accumulation, normalization, grad-sync skipping) case: build the tiny
Llama through the production path (parallelize_blocks + materialize), run the production
forward_backward on this rank's slice of a fixed global batch with deliberately imbalanced
labels, and compare the full reduced gradient with a single-process reference on the whole
global batch. Also records a hash of the full initial weights per mode.
"tied_cases": the same with the output head tied to the embedding (Llama 3.2's layout), in
every mode. "packed_cases": a global batch of packed sequences (2-3 records each, positions
restarting per record) against the reference of every record run as a sequence of its own.
"grad_norm_cases": the logged gradient norm of a known gradient of a million values a
tensor, sharded as each mode shards it, against its float64 norm. "eval_cases": the Evaluator's loss of a fixed eval set at eval batch 1 and 3 (a padded last
round), against the single-process token mean. "generate": greedy and top-p decoding under FSDP,
every rank's tokens gathered, against the unsharded model's greedy decoding. "fork_check": the
model of tests/fork_model.py, written only from the fork contract, through scripts/check_model.py's
cases (titanlite.analysis.model_check); "moe_checks": tests/fork_moe.py's loss terms the same way,
and titanlite's Qwen3-MoE's; "tensor_checks": titanlite's Llama 3 with its tensor split, and the
planted tensor-parallel defects of tests/fork_tp_controls.py.
"golden_elsewhere" (world 4): scripts/golden_losses.py's first case run here, without its numerics
pins, as another CPU runs it (tests/test_golden.py).
"dropout_cases": dropout 0.3 with masks keyed by sample in every mode (against one process's
keyed masks), and with torch's RNG cut over ranks and microbatches (the control). Cases
with "loss_chunk" > 0 run the loss inside the model, chunk by chunk. "reduce_cases": FSDP and
DDP reducing in bfloat16 (training.mixed_precision_reduce), and whether every reduced gradient
value is a bfloat16 number, as only a bf16 reduction makes it.
Writes JSON results (rank 0) to argv[1].
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fork_tp_controls import TP_CONTROLS
from helpers import load_script
from torch.distributed.tensor import DTensor, distribute_tensor

from titanlite.analysis.model_check import check, documents, packed_batch, unequal_batch
from titanlite.components.evaluate import Evaluator
from titanlite.components.generate import generate
from titanlite.components.loss import LossBalancer, forward_backward
from titanlite.config import JobConfig
from titanlite.config.layout import resolve_layout
from titanlite.datasets.batch import Microbatch
from titanlite.distributed.parallel_dims import ParallelDims, init_distributed
from titanlite.distributed.parallelize import materialize, parallelize_blocks, unwrap
from titanlite.distributed.param_init import ParamInit, canonical_name
from titanlite.distributed.utils import clip_grad_norm_
from titanlite.models.llama3 import Llama3, Llama3Args
from titanlite.models.step import LossPath
from titanlite.ops.cross_entropy import IGNORE_INDEX, cross_entropy_sum
from titanlite.ops.dropout import sample_keys

ARGS = Llama3Args(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16
)
TIED = dataclasses.replace(ARGS, tie_embeddings=True)
GLOBAL_BATCH, SEQ, SEED = 16, 16, 7


# The batches are the model check's (titanlite.analysis.model_check), so the suite and
# scripts/check_model.py exercise one implementation.
global_batch, records, packed_global_batch = unequal_batch, documents, packed_batch


def build(
    cfg: JobConfig,
    world: int,
    mode: str,
    accum: int,
    args: Llama3Args = ARGS,
    param: str = "float32",
):
    """The tiny Llama through the production path, for `mode` at
    `world` ranks, `accum` microbatches per rank, parameters computed in `param`. Returns
    (layout, dims, model)."""
    cfg.parallelism.mode = mode
    cfg.parallelism.dp_replicate = {"fsdp": 1, "ddp": world, "hsdp": 2 if world >= 2 else 1}[mode]
    cfg.parallelism.dp_shard = -1
    cfg.training.global_batch_size = GLOBAL_BATCH
    cfg.training.local_batch_size = GLOBAL_BATCH // (world * accum)
    layout = resolve_layout(cfg, world)
    dims = ParallelDims.build(
        layout, torch.device("cpu"), param, cfg.training.mixed_precision_reduce
    )
    with torch.device("meta"):
        model = Llama3(args)
    return layout, dims, materialize(parallelize_blocks(model, model.layers, dims, cfg), dims, SEED)


def rank_microbatches(
    world: int, accum: int, batch: tuple[torch.Tensor, ...] | None = None
) -> list[tuple]:
    """This rank's contiguous share of the global batch (default: global_batch()), cut into
    `accum` microbatches."""
    batch = batch or global_batch()
    per_rank, lb = GLOBAL_BATCH // world, GLOBAL_BATCH // (world * accum)
    start = dist.get_rank() * per_rank
    return [tuple(t[start + m * lb : start + (m + 1) * lb] for t in batch) for m in range(accum)]


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in unwrap(model).named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[canonical_name(name)] = g.detach().clone()
    return out


def full_weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    named = sorted((canonical_name(n), p) for n, p in unwrap(model).named_parameters())
    for name, p in named:
        w = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(w.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def reference(args: Llama3Args = ARGS, keyed: bool = False) -> dict[str, torch.Tensor]:
    """The gradient of the whole global batch in one process; with dropout (args.dropout),
    masks keyed by sample (`keyed`) or drawn from torch's RNG seeded with SEED."""
    model = Llama3(args)
    model.init_weights(ParamInit(model, SEED))
    tokens, labels = global_batch()
    keys = sample_keys(SEED, 0, GLOBAL_BATCH, torch.device("cpu")) if keyed else None
    torch.manual_seed(SEED)
    loss = (
        cross_entropy_sum(model(tokens, sample_keys=keys), labels) / (labels != IGNORE_INDEX).sum()
    )
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def records_reference(
    model: torch.nn.Module | None = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """Gradient and token-mean loss of the records, each run as a sequence of its own, by the
    tiny Llama or `model`, unsharded."""
    model = model or Llama3(ARGS)
    model.init_weights(ParamInit(model, SEED))
    recs = records()
    total = sum(int((y != IGNORE_INDEX).sum()) for _, y in recs)
    loss = sum(cross_entropy_sum(model(x[None]), y[None]) for x, y in recs) / total
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, loss.item()


def generate_case(world: int) -> dict:
    """Greedy and top-p continuations of two prompts under FSDP: each rank's, and one process's."""
    _, _, model = build(JobConfig(), world, "fsdp", 1)
    prompts = [[1, 5, 9], [3, 3, 7, 2, 11, 4]]
    greedy = generate(model, prompts, 8, eos_id=None)
    sampled = generate(model, prompts, 8, eos_id=None, temperature=1.0, top_p=0.9,
                       generator=torch.Generator().manual_seed(dist.get_rank()))  # fmt: skip
    every = [None] * world
    dist.all_gather_object(every, (greedy, sampled))
    alone = Llama3(ARGS)
    alone.init_weights(ParamInit(alone, SEED))
    return {"every_rank": every, "unsharded": generate(alone, prompts, 8, eos_id=None)}


def eval_case(world: int, batch_size: int) -> dict:
    """The Evaluator's loss of the packed sequences as an eval set, under FSDP at `world`."""
    cfg = JobConfig()
    _, dims, model = build(cfg, world, "fsdp", 1)
    tokens, labels, positions = packed_global_batch()
    items = [
        (tokens[i].numpy(), labels[i].numpy(), positions[i].numpy())
        for i in range(GLOBAL_BATCH - 3)
    ]
    result = Evaluator(items, dims, batch_size, LossPath(own=True)).loss(model)
    return {"world": world, "batch": batch_size, **result, "training": model.training}


def run_case(
    world: int,
    mode: str,
    accum: int,
    norm: str,
    skip_sync: str,
    ref: dict,
    ac: str = "none",
    args: Llama3Args = ARGS,
    reduce: str = "float32",
    loss_chunk: int = 0,
    batch: tuple[torch.Tensor, ...] | None = None,
    param: str = "float32",
    compiled: bool = False,
    keyed: bool = False,
) -> dict:
    cfg = JobConfig()
    cfg.training.activation_checkpoint = ac
    cfg.training.compile = compiled
    cfg.training.mixed_precision_reduce = reduce
    cfg.parallelism.skip_grad_sync = skip_sync
    cfg.loss.normalization = norm
    layout, dims, model = build(cfg, world, mode, accum, args, param)
    init_hash = full_weights_hash(model)
    micro = rank_microbatches(world, accum, batch)
    if (
        keyed
    ):  # each sequence's dropout key from its place in the global batch, as the sampler gives it
        lb, first = GLOBAL_BATCH // (world * accum), dist.get_rank() * GLOBAL_BATCH // world
        micro = [
            (*b, None, sample_keys(SEED, first + m * lb, lb, torch.device("cpu")))
            for m, b in enumerate(micro)
        ]
    balancer = LossBalancer(norm, dims.dp_group, dims.token_ranks, layout.grad_accum)
    torch.manual_seed(SEED)  # dropout from torch's RNG: every rank draws one stream (the seed rule)
    path = LossPath(own=True, chunk=loss_chunk)  # Llama's labels path, whole or in chunks
    share, *_ = forward_backward(
        model, micro, balancer, dims, skip_grad_sync=layout.skip_grad_sync, path=path
    )
    dist.all_reduce(share)
    grads = full_grads(model)
    rel = max(((grads[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref)
    bf16 = all(torch.equal(g, g.bfloat16().float()) for g in grads.values())
    local_tokens = sum(int((Microbatch(*b).labels != IGNORE_INDEX).sum()) for b in micro)
    min_micro = min(int((Microbatch(*b).labels != IGNORE_INDEX).sum()) for b in micro)
    counts = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor(local_tokens))
    mins = [torch.zeros((), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(mins, torch.tensor(min_micro))
    return {
        "world": world,
        "mode": mode,
        "layout": f"{layout.dp_replicate}x{layout.dp_shard}",
        "accum": accum,
        "norm": norm,
        "skip_grad_sync": layout.skip_grad_sync,
        "activation_checkpoint": ac,
        "dropout": getattr(args, "dropout", 0.0),
        "keyed": keyed,
        "loss_chunk": loss_chunk,
        "max_rel_err": rel,
        "reduce_dtype": reduce,
        "param_dtype": param,
        "compile": compiled,
        "packed": batch is not None,
        "bf16_values": bf16,
        "tied": unwrap(model).output.weight is unwrap(model).tok_embeddings.weight,
        "model": cfg.model.name,
        "logged_loss": share.item(),
        "init_hash": init_hash,
        "rank_tokens": [int(c) for c in counts],
        "min_micro_tokens": min(int(c) for c in mins),
    }


def golden_elsewhere(folder: Path) -> dict | None:
    """The golden files' first case, trained in this worker under MKL's and PyTorch's own kernel
    choice (no MKL_CBWR, no ATEN_CPU_CAPABILITY): another GEMM branch than the files' on any x86-64
    CPU, as another CPU runs it. Rank 0's identity and curve; None elsewhere."""
    golden = load_script("golden_losses")
    name = next(iter(golden.CASES))
    curve = golden.run_cases(str(folder), {name: golden.CASES[name]})
    return {"identity": golden.identity(), "name": name, "curve": curve[name]} if curve else None


# A vocabulary whose embedding and head hold about a million values each, the size at which a
# float32 norm on a CPU drifts about 1e-5 (grad_norm_case).
NORM_ARGS = dataclasses.replace(ARGS, vocab_size=32768)


def grad_norm_case(world: int, mode: str) -> dict:
    """The logged gradient norm (clip_grad_norm_) of a known gradient, placed on the model's
    parameters as `mode` shards them at `world` ranks, against its float64 norm taken whole."""
    layout, dims, model = build(JobConfig(), world, mode, 1, NORM_ARGS)
    whole = []
    for i, (_, p) in enumerate(sorted(unwrap(model).named_parameters())):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 1e-3
        whole.append(g)
        if isinstance(p, DTensor):
            g = distribute_tensor(g, p.device_mesh, p.placements)
        p.grad = g
    exact = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in whole]))
    logged = clip_grad_norm_(model.parameters(), max_norm=0.0)
    return {
        "mode": mode,
        "logged": float(logged),
        "reference": float(exact),
        "largest": max(g.numel() for g in whole),
    }


def main() -> None:
    init_distributed(torch.device("cpu"))
    world = dist.get_world_size()
    ref = reference()
    tokens, labels = global_batch()
    ref_loss = None
    model = Llama3(ARGS)
    model.init_weights(ParamInit(model, SEED))
    with torch.no_grad():
        ref_loss = (
            cross_entropy_sum(model(tokens), labels) / (labels != IGNORE_INDEX).sum()
        ).item()
    cases = []
    for mode in ("fsdp", "ddp", "hsdp"):
        for accum in (1, 2, 4):
            cases.append((mode, accum, "global", "auto"))
    cases += [("fsdp", 2, "global", "on"), ("ddp", 2, "global", "on"), ("hsdp", 2, "global", "on")]
    cases += [("fsdp", 2, "local_mean", "auto"), ("ddp", 2, "local_mean", "auto")]
    results = [run_case(world, *c, ref) for c in cases]
    for ac in ("full", "selective"):
        results += [
            run_case(world, mode, 2, "global", "auto", ref, ac=ac) for mode in ("fsdp", "ddp")
        ]
    # The loss inside the model, 5 positions at a time (16 per sequence: 4 chunks, the last short)
    results += [
        run_case(world, m, 2, "global", "auto", ref, loss_chunk=5) for m in ("fsdp", "ddp", "hsdp")
    ]
    tied_ref = reference(TIED)
    tied = [
        run_case(world, m, 2, "global", "auto", tied_ref, args=TIED)
        for m in ("fsdp", "ddp", "hsdp")
    ]
    tied.append(run_case(world, "fsdp", 2, "global", "auto", tied_ref, args=TIED, loss_chunk=5))
    # Sync skipping on: one reduction per step, whose result the gradient then is (FSDP would
    # otherwise add two reduced microbatches up in float32).
    reduce = [
        run_case(world, m, 2, "global", "on", ref, reduce="bfloat16") for m in ("fsdp", "ddp")
    ]
    packed_ref, packed_loss = records_reference()
    packed = [
        {
            **run_case(world, m, a, "global", "auto", packed_ref, batch=packed_global_batch()),
            "ref_loss": packed_loss,
        }
        for m, a in (("fsdp", 2), ("ddp", 1), ("hsdp", 2))
    ]
    # A fork's model, registered from outside the package: scripts/check_model.py's cases
    forked = check(
        ["--model.name", "fork_lm", "--model.import_module", "fork_model", "--model.flavor", "tiny"]
    )
    # ... and tests/fork_cp.py's context parallelism, which adds the cp axis's cases
    context = check(
        ["--model.name", "fork_cp", "--model.import_module", "fork_cp", "--model.flavor", "tiny"]
    )
    # ... and tests/fork_moe.py's loss terms: the load-balancing loss over the whole step (at
    # transformers' coefficient and at 0.1) with a z-loss, and the per-microbatch formula (the control)
    moe = {
        f"{name}/{flavor}": check(
            ["--model.name", name, "--model.import_module", "fork_moe", "--model.flavor", flavor]
        )
        for name, flavor in (
            ("fork_moe", "tiny"),
            ("fork_moe", "strong"),
            ("fork_moe_local", "tiny"),
        )
    }
    # ... and the package's Qwen3-MoE at the model check's size, at both coefficients (~16 s in all)
    moe |= {
        f"qwen3_moe/{flavor}": check(["--model.name", "qwen3_moe", "--model.flavor", flavor])
        for flavor in ("tiny", "tiny_strong")
    }
    # ... and titanlite's Llama 3 at the model check's size, whose tensor split (tp=2 at an even
    # world) runs in every mode, and the field's tensor-parallel defects planted in it
    tensor = {
        f"llama3/{flavor}": check(["--model.name", "llama3", "--model.flavor", flavor])
        for flavor in ("tiny", "tiny_tied")
    }
    tensor |= {
        f"{name}/tiny": check(
            [
                "--model.name",
                name,
                "--model.import_module",
                "fork_tp_controls",
                "--model.flavor",
                "tiny",
            ]
        )
        for name in TP_CONTROLS
    }
    # Dropout: masks keyed by sample equal one process's in every mode, accumulation and
    # checkpointing; masks from torch's RNG do not once the batch is cut (the control).
    drop = dataclasses.replace(ARGS, dropout=0.3)
    keyed_ref, stream_ref = reference(drop, keyed=True), reference(drop)
    dropout = [
        run_case(world, m, a, "global", "auto", keyed_ref, args=drop, keyed=True, ac=ac)
        for m, a, ac in (
            ("fsdp", 2, "none"),
            ("ddp", 1, "none"),
            ("hsdp", 2, "none"),
            ("fsdp", 2, "full"),
        )
    ]
    dropout += [run_case(world, "fsdp", 2, "global", "auto", stream_ref, args=drop)]
    # The GPU's defaults on the CPU: bf16 parameters (FSDP's policy; DDP under autocast), fp32 or
    # bf16 reduction, checkpointing, the chunked loss, packing; compiled blocks in one case at
    # world 2 (compiling costs ~20 s here). Each against the fp32 reference, to a bound on bf16
    # rounding (tests/test_distributed.py).
    bf16 = dict(param="bfloat16")
    low = [run_case(world, m, 2, "global", "auto", ref, **bf16) for m in ("fsdp", "ddp", "hsdp")]
    low += [
        run_case(world, m, 2, "global", "on", ref, reduce="bfloat16", **bf16)
        for m in ("fsdp", "ddp", "hsdp")
    ]
    low += [run_case(world, m, 2, "global", "auto", ref, ac=ac, **bf16) for m, ac in
            (("fsdp", "selective"), ("ddp", "selective"), ("fsdp", "full"), ("hsdp", "full"))]  # fmt: skip
    low += [
        run_case(world, m, 2, "global", "auto", ref, loss_chunk=5, **bf16)
        for m in ("fsdp", "ddp", "hsdp")
    ]
    low += [
        {**run_case(world, m, a, "global", "auto", packed_ref, batch=packed_global_batch(), **bf16),
         "ref_loss": packed_loss}
        for m, a in (("fsdp", 2), ("ddp", 1), ("hsdp", 2))
    ]  # fmt: skip
    if world == 2:  # the GPU default, compiled
        low.append(
            run_case(world, "fsdp", 2, "global", "auto", ref, ac="selective", compiled=True, **bf16)
        )
    evals = [eval_case(world, b) for b in (1, 3)]
    norms = [grad_norm_case(world, m) for m in ("fsdp", "ddp", "hsdp")]
    elsewhere = golden_elsewhere(Path(sys.argv[1]).parent / "golden") if world == 4 else None
    decoded = generate_case(world)
    tied_model = Llama3(TIED)
    tied_model.init_weights(ParamInit(tied_model, SEED))
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(
                {
                    "world": world,
                    "ref_loss": ref_loss,
                    "ref_hash": full_weights_hash(model),
                    "cases": results,
                    "tied_ref_hash": full_weights_hash(tied_model),
                    "tied_cases": tied,
                    "reduce_cases": reduce,
                    "packed_cases": packed,
                    "fork_check": forked,
                    "context_check": context,
                    "moe_checks": moe,
                    "tensor_checks": tensor,
                    "dropout_cases": dropout,
                    "bf16_cases": low,
                    "eval_cases": evals,
                    "grad_norm_cases": norms,
                    "generate": decoded,
                    "golden_elsewhere": elsewhere,
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
