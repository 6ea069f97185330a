"""Llama 3 on titanlite.models.common's blocks: RMSNorm, RoPE on consecutive pairs (with Llama
3.1's frequency scaling), grouped-query attention and SwiGLU; what is Llama's own is here: its
args and feed-forward width rule, dropout, the KV cache's generation and the FLOP count.

Given `positions` (packed SFT, data.document_mask), each document attends only to itself and
its RoPE positions restart at 0. Given a `KVCache` (generation), a forward extends the
sequences the cache holds: the keys and values of earlier positions are kept, so decoding a
token costs one position's forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.distributed.param_init import ParamInit
from titanlite.models.common.attention import Attention
from titanlite.models.common.decoder import Decoder, depth_std
from titanlite.models.common.document_attention import DocumentMask
from titanlite.models.common.feed_forward import SwiGLU
from titanlite.models.common.kv_cache import KVCache
from titanlite.models.common.rmsnorm import RMSNorm
from titanlite.models.common.rope import Llama31Scaling
from titanlite.models.common.rope import rope_frequencies as frequencies
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
    """Llama 3's RoPE frequencies: plain, or with Llama 3.1's scaling when its factor is set."""
    scaling = None
    if args.rope_scaling_factor is not None:
        scaling = Llama31Scaling(
            args.rope_scaling_factor,
            args.rope_low_freq_factor,
            args.rope_high_freq_factor,
            args.rope_original_max_len,
        )
    return frequencies(args.dim // args.n_heads, args.rope_theta, scaling)


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
        if args.dim % args.n_heads:
            raise ValueError("dim must divide by n_heads")
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(
            args.dim,
            args.n_heads,
            args.n_kv_heads or args.n_heads,
            args.dim // args.n_heads,
            rope_layout="pairs",
        )
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = SwiGLU(args.dim, ffn_hidden_dim(args))
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
        out_std = depth_std(self.layer_id)
        self.attention.init_weights(init, out_std)
        self.feed_forward.init_weights(init, out_std, up_std=out_std)
        init.constant_(self.attention_norm.weight, 1.0)
        init.constant_(self.ffn_norm.weight, 1.0)


class Llama3(Decoder):
    def __init__(self, args: Llama3Args) -> None:
        super().__init__(args, lambda i: TransformerBlock(i, args))

    def rope_frequencies(self) -> torch.Tensor:
        return rope_frequencies(self.args)

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
        projection run `loss_chunk` positions at a time inside the loss (Decoder.head).
        `positions` [B, S]: each token's position in its document (0 starts one); None: one
        causal sequence. `sample_keys` [B]: dropout masks keyed by sequence (titanlite.ops.dropout);
        None: torch's RNG. `cache` (from `kv_cache`): generation's logits, the prompts first,
        then one token per row at a time (see KVCache)."""
        if cache is not None and labels is not None:
            raise ValueError("a KV cache is for generation: tokens only, no positions or labels")
        cos, sin, mask = self.prepare(tokens, positions, cache)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, sample_keys, cache=cache)
        return self.head(h, labels, loss_chunk)

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
