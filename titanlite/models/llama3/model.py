"""Llama 3: RMSNorm, RoPE (with Llama 3.1 frequency scaling), GQA, SwiGLU, SDPA attention.

Given `positions` (packed SFT, data.document_mask), each document attends only to itself and
its RoPE positions restart at 0: titanlite.models.attention builds the mask from them. Given a
`KVCache` (generation), a forward extends the sequences the cache holds: the keys and values of
earlier positions are kept, so decoding a token costs one position's forward."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.distributed.param_init import ParamInit
from titanlite.models.attention import DocumentMask, attend, document_mask
from titanlite.ops.cross_entropy import chunked_cross_entropy_per_sample
from titanlite.ops.dropout import keyed_dropout


@dataclass(frozen=True)
class Llama3Args:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: same as n_heads (no GQA)
    vocab_size: int = -1  # filled in from the tokenizer
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    hidden_dim: int | None = (
        None  # SwiGLU hidden size given outright (HF's intermediate_size); wins
    )
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling_factor: float | None = None  # Llama 3.1/3.2 long-context frequency scaling
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    max_seq_len: int = 2048  # filled in from training.seq_len
    tie_embeddings: bool = False
    dropout: float = 0.0  # on the attention and feed-forward outputs


def rope_frequencies(args: Llama3Args) -> torch.Tensor:
    head_dim = args.dim // args.n_heads
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    if args.rope_scaling_factor is None:
        return freqs
    # Llama 3.1: keep high frequencies, divide low ones by the factor, blend in between.
    low_wavelen = args.rope_original_max_len / args.rope_low_freq_factor
    high_wavelen = args.rope_original_max_len / args.rope_high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (args.rope_original_max_len / wavelen - args.rope_low_freq_factor) / (
        args.rope_high_freq_factor - args.rope_low_freq_factor
    )
    blended = (1 - smooth) * freqs / args.rope_scaling_factor + smooth * freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / args.rope_scaling_factor, freqs)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, blended, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x0, x1), (x2, x3), ... as Meta's complex-number RoPE does.
    x: [B, S, heads, head_dim]; cos, sin: [1 or B, S, 1, head_dim / 2]."""
    xf = x.float().unflatten(-1, (-1, 2))
    real, imag = xf[..., 0], xf[..., 1]
    out = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class KVCache:
    """Each layer's keys and values [B, S, kv_heads, head_dim] (after RoPE) of the positions a
    generation has run. The first forward given it runs the prompts, right-padded (`lengths`:
    each row's real tokens), under causal attention, so no real position reads a padded one;
    each later forward adds one token per row at that row's own next position, attending only
    to the row's real columns (`valid`)."""

    def __init__(self, n_layers: int, lengths: torch.Tensor) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.lengths = lengths  # [B] each row's positions so far: its next token's RoPE position
        self.valid: torch.Tensor | None = (
            None  # [B, columns] bool: the columns that hold real tokens
        )

    def extend(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=1)
            v = torch.cat([self.values[layer], v], dim=1)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows go on (the others finished)."""
        self.keys = [t.index_select(0, rows) for t in self.keys]
        self.values = [t.index_select(0, rows) for t in self.values]
        self.lengths, self.valid = (
            self.lengths.index_select(0, rows),
            self.valid.index_select(0, rows),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        if args.dim % args.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError("dim must divide by n_heads and n_heads by n_kv_heads")
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: DocumentMask = None,
        cache: tuple[KVCache, int] | None = None,
    ) -> torch.Tensor:
        """`cache`: the generation's KVCache and this layer's index in it."""
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, self.n_heads, self.head_dim)
        k = self.wk(x).view(bs, seqlen, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bs, seqlen, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache[0].extend(cache[1], k, v)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:  # grouped-query attention: share each k/v head among `rep` query heads
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        hidden = ffn_hidden_dim(args)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def ffn_hidden_dim(args: Llama3Args) -> int:
    if args.hidden_dim is not None:
        return args.hidden_dim
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Llama3Args) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)
        self.dropout = args.dropout

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: DocumentMask = None,
        keys: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        at = None if cache is None else (cache, self.layer_id)
        h = x + self._dropout(self.attention(self.attention_norm(x), cos, sin, mask, at), keys, 0)
        return h + self._dropout(self.feed_forward(self.ffn_norm(h)), keys, 1)

    def _dropout(self, y: torch.Tensor, keys: torch.Tensor | None, branch: int) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if keys is None:
            return F.dropout(y, p)
        return keyed_dropout(y, p, keys, 2 * self.layer_id + branch)

    def init_weights(self, init: ParamInit) -> None:
        # Output projections get a depth-scaled std so the residual stream does not grow with depth.
        out_std = 0.02 / math.sqrt(2 * (self.layer_id + 1))
        for lin in (self.attention.wq, self.attention.wk, self.attention.wv, self.feed_forward.w1):
            init.trunc_normal_(lin.weight, 0.02)
        for lin in (self.attention.wo, self.feed_forward.w2, self.feed_forward.w3):
            init.trunc_normal_(lin.weight, out_std)
        init.constant_(self.attention_norm.weight, 1.0)
        init.constant_(self.ffn_norm.weight, 1.0)


class Llama3(nn.Module):
    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("Llama3Args.vocab_size must be set (it comes from the tokenizer)")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self._init_rope()

    def _init_rope(self) -> None:
        device = self.tok_embeddings.weight.device
        freqs = rope_frequencies(self.args).to(device)
        angles = torch.outer(torch.arange(self.args.max_seq_len, device=device).float(), freqs)
        self.rope_cos, self.rope_sin = angles.cos(), angles.sin()

    def init_weights(self, init: ParamInit) -> None:
        self._init_rope()
        out_std = self.args.dim**-0.5
        if self.args.tie_embeddings:
            init.trunc_normal_(self.tok_embeddings.weight, out_std)
        else:
            init.normal_(self.tok_embeddings.weight, 1.0)
            init.trunc_normal_(self.output.weight, out_std)
        for layer in self.layers:
            layer.init_weights(init)
        init.constant_(self.norm.weight, 1.0)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_chunk: int = 0,
        positions: torch.Tensor | None = None,
        sample_keys: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits; with `labels`, each sequence's summed cross entropy instead, the output
        projection run `loss_chunk` positions at a time inside the loss (0: all at once; the
        trainer's path at a large vocabulary: titanlite.ops.cross_entropy.chunked_cross_entropy_per_sample).
        It happens here, in the root's forward, where FSDP has the output weight unsharded.
        `positions` [B, S]: each token's position in its document (0 starts one); None: one
        causal sequence. `sample_keys` [B]: dropout masks keyed by sequence (titanlite.ops.dropout);
        None: torch's RNG. `cache` (from `kv_cache`): generation's logits, the prompts first,
        then one token per row at a time (see KVCache)."""
        seqlen = tokens.shape[1]
        decoding = cache is not None and cache.valid is not None  # the prompts ran already
        columns = cache.valid.shape[1] + seqlen if decoding else seqlen
        if columns > self.args.max_seq_len:
            raise ValueError(
                f"sequence of {columns} tokens exceeds max_seq_len {self.args.max_seq_len}"
            )
        if cache is not None and (positions is not None or labels is not None):
            raise ValueError("a KV cache is for generation: tokens only, no positions or labels")
        if decoding:  # one more token per row, at the row's own position
            if seqlen != 1:
                raise ValueError("after the prompts, a KV cache takes one token per row at a time")
            at = cache.lengths[:, None]
            cos, sin = self.rope_cos[at][:, :, None], self.rope_sin[at][:, :, None]
            cache.valid = torch.cat([cache.valid, torch.ones_like(cache.valid[:, :1])], dim=1)
            mask = cache.valid[:, None, None, :]
        elif positions is None:
            cos, sin, mask = (
                self.rope_cos[None, :seqlen, None],
                self.rope_sin[None, :seqlen, None],
                None,
            )
            if cache is not None:  # the prompts, right-padded
                cache.valid = (
                    torch.arange(seqlen, device=tokens.device)[None] < cache.lengths[:, None]
                )
        else:
            cos, sin = self.rope_cos[positions][:, :, None], self.rope_sin[positions][:, :, None]
            mask = document_mask(positions)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, sample_keys, cache=cache)
        if decoding:
            cache.lengths = cache.lengths + 1
        if labels is not None:
            return chunked_cross_entropy_per_sample(
                self.norm(h), self.output.weight, labels, loss_chunk
            )
        return self.output(self.norm(h))

    def kv_cache(self, lengths: torch.Tensor) -> KVCache:
        """An empty cache for one generation of prompts of these lengths [B] (titanlite.components.generate
        uses it when the model has this method)."""
        return KVCache(self.args.n_layers, lengths)

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per non-embedding parameter (2 forward, 4 backward) plus
        attention's 12 x L x d x S. The embedding is a lookup; the output head is a matmul and
        counts whether or not it shares the embedding's weight."""
        params = sum(p.numel() for p in self.layers.parameters()) + self.norm.weight.numel()
        params += self.output.weight.numel()
        return 6 * params + 12 * self.args.n_layers * self.args.dim * seq_len
