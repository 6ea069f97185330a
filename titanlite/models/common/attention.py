"""Grouped-query attention (Ainslie et al., arXiv 2305.13245) with rotary embeddings, optional
RMSNorm on each q and k head (Qwen3's), and a KV cache for generation.

wq, wk and wv map the residual stream to the heads and wo maps them back, each a plain
nn.Linear, and the forward reads its head counts from the projections' outputs, never from the
model's args: a tensor-parallel plan that splits wq, wk and wv by their outputs and wo by its
inputs leaves each rank a whole number of heads, which this block then runs unchanged."""

from __future__ import annotations

import torch
import torch.nn as nn

from titanlite.distributed.param_init import ParamInit
from titanlite.models.common.document_attention import DocumentMask, attend
from titanlite.models.common.kv_cache import KVCache
from titanlite.models.common.rmsnorm import RMSNorm
from titanlite.models.common.rope import RopeLayout, rotate


class Attention(nn.Module):
    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope_layout: RopeLayout,
        qk_norm_eps: float | None = None,
    ) -> None:
        """`qk_norm_eps`: RMSNorm each q and k head with this epsilon before RoPE (None: no norm)."""
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError("n_heads must divide by n_kv_heads")
        if rope_layout not in ("pairs", "halves"):
            raise ValueError(f"rope_layout {rope_layout!r}: 'pairs' or 'halves'")
        self.head_dim, self.rope_layout = head_dim, rope_layout
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps)
        self.k_norm = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: DocumentMask = None,
        cache: tuple[KVCache, int] | None = None,
    ) -> torch.Tensor:
        """x [B, S, dim]; cos, sin from rope_lookup; `cache`: a generation's KVCache and this
        layer's index in it."""
        b, s, _ = x.shape
        # -1: the heads this rank's projections give (all of them unless split by a plan)
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin, self.rope_layout), rotate(k, cos, sin, self.rope_layout)
        if cache is not None:
            k, v = cache[0].extend(cache[1], k, v)
        rep = q.shape[2] // k.shape[2]
        if rep > 1:  # grouped-query attention: each k/v head serves `rep` query heads
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def init_weights(self, init: ParamInit, out_std: float) -> None:
        """wq, wk, wv at std 0.02, wo at `out_std` (the block's depth-scaled std), norms at 1."""
        for lin in (self.wq, self.wk, self.wv):
            init.trunc_normal_(lin.weight, 0.02)
        init.trunc_normal_(self.wo.weight, out_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                init.constant_(norm.weight, 1.0)
