"""The tensor-parallel plan of each shared block (Megatron-LM's layout, Shoeybi et al., arXiv
1909.08053, with sequence parallelism, Korthikanti et al., arXiv 2205.05198), on torch's DTensor
styles over the mesh of the tensor-splitting axis (ParallelDims.tensor_mesh).

Between blocks the residual stream is split by sequence positions: each tensor-parallel rank holds
a piece of every sequence, so the norms (whose weights stay whole on each rank, and whose
gradients DTensor sums over the axis) run on 1/tp of the positions. Attention and the SwiGLU
gather the whole sequence, split their heads and hidden units over the axis (q, k, v, gate and
up by their outputs; the output and down projections by their inputs) and reduce-scatter their
outputs back to the pieces. The embedding and the head split the vocabulary; the head's loss is
the vocab-parallel cross entropy (titanlite.ops.vocab_parallel), so the logits are never gathered.
Every parameter is a DTensor on the axis's mesh, so initial weights drawn in full per name
(ParamInit), checkpoints and the gradient norm are those of the unsplit model."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titanlite.errors import UserError
from titanlite.models.common.attention import Attention
from titanlite.models.common.feed_forward import SwiGLU
from titanlite.ops.vocab_parallel import chunked_vocab_parallel_cross_entropy, vocab_slice


def _whole_sequence(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: the block's input (the residual stream's pieces, a DTensor split by
    positions) gathered whole on every rank; its backward reduce-scatters the gradient."""
    x = args[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, module.tp_mesh, [Shard(1)], run_check=False)
    return (x.redistribute(module.tp_mesh, [Replicate()]), *args[1:])


def _gathers_sequence(module: nn.Module, mesh: DeviceMesh) -> None:
    module.tp_mesh = mesh
    module.register_forward_pre_hook(_whole_sequence)


def attention_plan(attention: Attention, mesh: DeviceMesh) -> None:
    """Heads split over the axis: q, k, v column-parallel, wo row-parallel back to the pieces;
    per-head q/k norms (Qwen3's) see their rank's heads, their weights whole on every rank."""
    plan = {
        "wq": ColwiseParallel(),
        "wk": ColwiseParallel(),
        "wv": ColwiseParallel(),
        "wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if attention.q_norm is not None:
        # [B, S, heads, head_dim] split by heads: a norm over head_dim, sharded on dim 2
        plan["q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    parallelize_module(attention, mesh, plan)
    _gathers_sequence(attention, mesh)


def swiglu_plan(mlp: SwiGLU, mesh: DeviceMesh) -> None:
    """Hidden units split over the axis: gate and up column-parallel, down row-parallel back to
    the pieces."""
    parallelize_module(
        mlp,
        mesh,
        {
            "w1": ColwiseParallel(),
            "w3": ColwiseParallel(),
            "w2": RowwiseParallel(output_layouts=Shard(1)),
        },
    )
    _gathers_sequence(mlp, mesh)


def _whole_input(module: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook of a block run whole: the sequence gathered, as a plain tensor every
    rank holds alike (its gradient too: the backward keeps this rank's piece of it)."""
    whole = _whole_sequence(module, args)
    return (whole[0].to_local(), *whole[1:])


def _own_piece(module: nn.Module, args: tuple, out):
    """Forward hook of a block run whole: its first output cut back to this rank's piece; the
    backward gathers the pieces' gradients, so every rank's gradient of the block is whole."""
    first = out[0] if isinstance(out, tuple) else out
    piece = DTensor.from_local(first, module.tp_mesh, [Replicate()], run_check=False)
    piece = piece.redistribute(module.tp_mesh, [Shard(1)]).to_local()
    return (piece, *out[1:]) if isinstance(out, tuple) else piece


def whole_plan(block: nn.Module, mesh: DeviceMesh) -> None:
    """A block every rank of the axis runs whole on the whole sequence (a mixture's experts, until
    an expert axis splits them): its parameters plain and alike on every rank, its gradients
    complete on each (nothing to sum over the axis), its statistics those of the unsplit model."""
    block.tp_mesh = mesh
    block.register_forward_pre_hook(_whole_input)
    block.register_forward_hook(_own_piece)


def norm_plan(norm: nn.Module, mesh: DeviceMesh) -> None:
    """An RMSNorm on the residual stream's pieces (sequence parallelism), its weight whole."""
    parallelize_module(norm, mesh, SequenceParallel())


def decoder_plan(model: nn.Module, mesh: DeviceMesh) -> None:
    """The shell's own parameters (titanlite.models.common.decoder): the embedding split by
    vocabulary rows and reduce-scattered into the pieces, the final norm on the pieces, the head's
    rows split by vocabulary (a tied head is the embedding's one Parameter, split alike)."""
    parallelize_module(
        model.tok_embeddings,
        mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    )
    norm_plan(model.norm, mesh)
    if model.args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    else:
        weight = distribute_tensor(model.output.weight.data, mesh, [Shard(0)])
        model.output.weight = nn.Parameter(weight)
    model.vocab_mesh = mesh


def decoder_split(model: nn.Module, mesh: DeviceMesh, norms: tuple[str, ...], mlp: str) -> None:
    """The whole plan of a Decoder (titanlite.models.common.decoder) over `mesh`: in each block
    its attention, the norms named `norms` and the feed-forward named `mlp`, split when it is a
    SwiGLU and otherwise (a mixture's experts) run whole; then the shell's own parameters."""
    for block in model.layers:
        attention_plan(block.attention, mesh)
        for name in norms:
            norm_plan(getattr(block, name), mesh)
        feed_forward = getattr(block, mlp)
        if isinstance(feed_forward, SwiGLU):
            swiglu_plan(feed_forward, mesh)
        else:
            whole_plan(feed_forward, mesh)
    decoder_plan(model, mesh)


def vocab_parallel_head(
    h: torch.Tensor, weight: DTensor, labels: torch.Tensor | None, loss_chunk: int
) -> torch.Tensor:
    """The head over the last norm's output (the residual stream's pieces): each sequence's summed
    cross entropy [B] with `labels`, else the logits gathered whole [B, S, vocab]."""
    mesh = weight.device_mesh
    if not isinstance(h, DTensor):
        h = DTensor.from_local(h, mesh, [Shard(1)], run_check=False)
    # Gathered whole for the head; each rank's gradient of it covers its vocabulary rows only,
    # a partial sum that the backward reduce-scatters into the pieces.
    h = h.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    local = weight.to_local()
    if labels is None:
        # every rank then computes the same from the whole logits: their gradient is replicated
        logits = DTensor.from_local(F.linear(h, local), mesh, [Shard(-1)], run_check=False)
        return logits.redistribute(mesh, [Replicate()]).to_local()
    lo, _ = vocab_slice(weight.shape[0], mesh.size(), mesh.get_local_rank())
    return chunked_vocab_parallel_cross_entropy(h, local, labels, loss_chunk, lo, mesh.get_group())


def exchanges(model: nn.Module, recompute: bool) -> int:
    """How many times one microbatch's residual stream ([B, S, dim], whole) crosses the axis in a
    forward and backward under these plans, each an all-gather or a reduce-scatter. In a block's
    forward, attention gathers its input and reduce-scatters its output (2), a split SwiGLU
    likewise (2), a block run whole (whole_plan) gathers its input (1); the backward mirrors each
    one; activation checkpointing (`recompute`) runs the forward's again in the backward, but for
    a split SwiGLU's closing reduce-scatter, whose output no backward reads. The embedding's
    reduce-scatter and the head's gather, with their backward: 4."""
    total = 4
    for block in getattr(model, "layers", None) or ():
        split = any(isinstance(m, SwiGLU) for m in block.modules())
        forward = 2 * sum(isinstance(m, Attention) for m in block.modules()) + (2 if split else 1)
        total += 2 * forward + (forward - split if recompute else 0)
    return total


def check_tensor_split(model: nn.Module, degree: int) -> None:
    """One UserError, before any worker starts, where a shared block cannot be split `degree`
    ways: each rank holds whole heads (query and key-value) and an equal share of the SwiGLU's
    hidden units."""
    for name, module in model.named_modules():
        counts = {}
        if isinstance(module, Attention):
            counts = {
                "attention heads": module.wq.out_features // module.head_dim,
                "key-value heads": module.wk.out_features // module.head_dim,
            }
        elif isinstance(module, SwiGLU):
            counts = {"feed-forward hidden units": module.w1.out_features}
        for what, n in counts.items():
            if n % degree:
                fits = [d for d in range(1, n + 1) if n % d == 0 and d <= 64]
                raise UserError(
                    f"parallelism.axes tp={degree}: {name} has {n} {what}, which {degree} ranks cannot "
                    f"split evenly; use a tensor-parallel degree that divides {n} ({', '.join(map(str, fits))})"
                )
