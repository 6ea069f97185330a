"""What one sequence's Qwen3-MoE forward keeps for backward, counted from the model's own ops:
the memory estimate's figure (titanlite/tools/activations.py) where the routing cannot be traced
on fake tensors (the experts' loop reads its run lengths on the host; grouped_mm traces). Each
term is what an op saves, per token; tests/test_memory.py holds the sum to a real forward's
saved tensors, byte for byte, and tests/test_rehearsal.py to the tensor tracker's activations
at a rehearsed step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from titanlite.models.qwen3_moe.moe import runs_grouped

if TYPE_CHECKING:
    from titanlite.models.qwen3_moe.args import Qwen3MoeArgs

FP32, INDEX, FLAG, OFFSET = 4, 8, 1, 4  # the bytes of an fp32, an int64 index, a bool, an int32


def _norm(n: int, b: int) -> int:
    """An RMSNorm over n features: its fp32 input, the inverse RMS, the normalised values cast
    back (the weight's multiply keeps them)."""
    return FP32 * n + FP32 + b * n


def attention_per_token(a: Qwen3MoeArgs, b: int) -> int:
    """The norm and its output (read by q, k and v), q and k's head norms, and attention's q with
    k and v repeated to every query head (grouped-query attention repeats them before the kernel),
    its output (read by the output projection) and log-sum-exp per head."""
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    head_norms = (FP32 + b) * (q + kv) + FP32 * (a.n_heads + a.n_kv_heads)
    return _norm(a.dim, b) + b * a.dim + head_norms + 4 * b * q + FP32 * a.n_heads


def moe_per_token(a: Qwen3MoeArgs, b: int) -> int:
    """The norm and its output (read by the router and the experts' gather); the router's fp32
    probabilities over every expert, the top-k indices, the chosen probabilities and their sum;
    the sort's three int64 indices per routing slot (gather, weights, scatter); and for each of a
    token's top_k slots: its gathered row, the expert's gate and up, silu(gate), their product, the
    expert's output, its routing weight and the weighted output (the scatter-add keeps it)."""
    k = a.top_k
    router = FP32 * a.experts + (INDEX + FP32) * k + FP32 + 3 * INDEX * k
    slot = b * (3 * a.dim + 4 * a.moe_hidden + 1)
    return _norm(a.dim, b) + b * a.dim + router + k * slot


def dense_mlp_per_token(a: Qwen3MoeArgs, b: int) -> int:
    """A dense layer's SwiGLU: the norm and its output, gate, up, silu(gate) and their product."""
    return _norm(a.dim, b) + b * a.dim + 4 * b * a.dense_hidden


def rest_per_token(a: Qwen3MoeArgs, b: int) -> int:
    """Outside the blocks: the token ids, the final norm and its output (the output projection
    reads it), and the loss terms' own: per MoE layer the fp32 softmax of the router logits
    (load-balancing loss), their fp32 logits and log-sum-exp (z-loss), and each term's token
    mask. The loss's logits are the loss path's (titanlite/tools/activations.py adds them)."""
    aux, z = bool(a.aux_loss_coef), bool(a.z_loss_coef)
    per_layer = FP32 * a.experts * aux + (FP32 * a.experts + FP32) * z
    return INDEX + _norm(a.dim, b) + b * a.dim + len(a.moe_layers) * per_layer + FLAG * (aux + z)


def saved_bytes(a: Qwen3MoeArgs, seq_len: int, dtype: torch.dtype) -> tuple[list[int], int]:
    """(bytes per block, the rest) that one sequence of seq_len tokens keeps for backward."""
    b = dtype.itemsize
    attention = attention_per_token(a, b)
    offsets = OFFSET * a.experts * runs_grouped(a, dtype)  # grouped_mm's run ends, per layer
    blocks = [
        seq_len * (attention + dense_mlp_per_token(a, b))
        if i in a.dense_layers
        else seq_len * (attention + moe_per_token(a, b)) + offsets
        for i in range(a.n_layers)
    ]
    balance = (FP32 * a.experts + FP32) * bool(a.aux_loss_coef)  # the step's f and scale, once
    return blocks, seq_len * rest_per_token(a, b) + balance
