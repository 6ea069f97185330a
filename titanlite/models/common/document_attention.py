"""Causal attention over packed documents: a token attends to the earlier tokens of its own
document only.

Documents are given by `positions` [B, S], each token's position within its document: a 0
starts a new one, so document ids are the running count of zeros. Padding at the end of a
packed sequence restarts at 0 too and forms a document of its own, which no real token sees.
Every query sees at least itself, so no row of the mask is empty (no NaN from the softmax).

The mask takes one of two forms, chosen by device:
- CPU: a dense boolean [B, 1, S, S] mask through scaled_dot_product_attention (B x S^2 bytes:
  16 MiB at B = 4, S = 2,048);
- CUDA: a FlexAttention BlockMask (Dong et al., "Flex Attention: A Programming Model for
  Generating Optimized Attention Kernels", arXiv:2412.05496) with a compiled flex_attention,
  which skips the blocks that cross documents instead of computing and masking them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

DocumentMask = torch.Tensor | BlockMask | None  # None: plain causal attention


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[B, S] document index of each token: the number of document starts up to it."""
    return (positions == 0).cumsum(-1)


def dense_document_mask(positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: query i may see key j iff j <= i and both are in one document."""
    docs = document_ids(positions)
    seq = positions.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    return ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]


def block_document_mask(positions: torch.Tensor) -> BlockMask:
    """The same mask as FlexAttention's BlockMask (128 x 128 blocks)."""
    docs = document_ids(positions)
    batch, seq = docs.shape

    def same_document_causal(b, h, q, kv):
        return (docs[b, q] == docs[b, kv]) & (kv <= q)

    return create_block_mask(same_document_causal, batch, None, seq, seq, device=positions.device)


def document_mask(positions: torch.Tensor) -> torch.Tensor | BlockMask:
    """The mask for this device: a BlockMask on CUDA, a dense one elsewhere."""
    return block_document_mask(positions) if positions.is_cuda else dense_document_mask(positions)


@functools.cache
def _compiled_flex():
    # flex_attention is fast only compiled (eager runs a reference that materializes the scores).
    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask) -> torch.Tensor:
    """Attention of q, k, v [B, heads, S, head_dim] under `mask` (None: causal)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if isinstance(mask, BlockMask):
        flex = _compiled_flex() if q.is_cuda else flex_attention
        return flex(q, k, v, block_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
