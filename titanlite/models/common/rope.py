"""Rotary position embeddings (Su et al., RoFormer, arXiv 2104.09864): each head's features are
rotated in pairs by angles position x frequency.

- the frequencies: theta^(-2i / head_dim), optionally with Llama 3.1's long-context scaling;
- the tables: cos and sin of every position up to max_seq_len, [max_seq_len, head_dim / 2], the
  decoder's buffers;
- the lookup for one forward: the first S rows (one causal sequence per row), or each token's own
  row (`positions`: packed documents restart at 0; decoding: each row's next position);
- the rotation, in one of two layouts of the same maths: `pairs` rotates consecutive features
  (x0, x1), (x2, x3), ... as Meta's complex-number code does (Llama); `halves` rotates the
  first half of a head against its second, as transformers' rotate_half does (Qwen3). A
  checkpoint moves between them by permuting each head's q and k rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

RopeLayout = Literal["pairs", "halves"]


@dataclass(frozen=True)
class Llama31Scaling:
    """Llama 3.1's frequency scaling (transformers' rope_type "llama3")."""

    factor: float
    """low frequencies are divided by it"""
    low_freq_factor: float
    """wavelengths above original_max_len / low_freq_factor are scaled whole"""
    high_freq_factor: float
    """wavelengths below original_max_len / high_freq_factor are kept"""
    original_max_len: int
    """the context length the model was pretrained at"""


def rope_frequencies(
    head_dim: int, theta: float, scaling: Llama31Scaling | None = None
) -> torch.Tensor:
    """[head_dim / 2] the rotation frequencies, on the default device."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    if scaling is None:
        return freqs
    # Llama 3.1: keep high frequencies, divide low ones by the factor, blend in between.
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    low_wavelen = scaling.original_max_len / low
    high_wavelen = scaling.original_max_len / high
    wavelen = 2 * math.pi / freqs
    smooth = (scaling.original_max_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / scaling.factor, freqs)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, blended, scaled)


def rope_tables(freqs: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, head_dim / 2] of every position's angles, on freqs' device."""
    angles = torch.outer(torch.arange(max_seq_len, device=freqs.device).float(), freqs)
    return angles.cos(), angles.sin()


def rope_lookup(
    cos: torch.Tensor, sin: torch.Tensor, seqlen: int, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward's cos and sin from the tables, shaped to broadcast over the heads:
    [1, S, 1, head_dim / 2] for the first `seqlen` positions, or [B, S, 1, head_dim / 2] at each
    token's own `positions` [B, S]."""
    if positions is None:
        return cos[None, :seqlen, None], sin[None, :seqlen, None]
    return cos[positions][:, :, None], sin[positions][:, :, None]


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: RopeLayout
) -> torch.Tensor:
    """x [B, S, heads, head_dim] rotated in fp32 and cast back; cos, sin from rope_lookup."""
    xf = x.float()
    if layout == "pairs":
        xf = xf.unflatten(-1, (-1, 2))
        real, imag = xf[..., 0], xf[..., 1]
        out = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
        return out.flatten(-2).type_as(x)
    if layout == "halves":
        a, b = xf.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).type_as(x)
    raise ValueError(f"RoPE layout {layout!r}: 'pairs' or 'halves'")
