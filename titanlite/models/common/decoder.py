"""The decoder shell a family's model is built in: token embedding, the family's blocks, final
RMSNorm and output head, and the RoPE tables, with what every forward does around the blocks.

A family subclasses Decoder, giving its args (the fields below), a block per layer index and its
RoPE frequencies, and writes the forward over its own blocks from three calls: `prepare` (cos,
sin and the attention mask from positions or a KV cache), the embedding, and `head` (the logits,
or with labels each sequence's summed cross entropy). The head and its loss run in the root's
forward, where FSDP has the embedding, norm and head gathered (the registry's root rule). A
tied head is one Parameter under the embedding's name (the registry's tied-head rule)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from titanlite.distributed.param_init import ParamInit
from titanlite.models.common.document_attention import DocumentMask, document_mask
from titanlite.models.common.kv_cache import KVCache
from titanlite.models.common.rmsnorm import RMSNorm
from titanlite.models.common.rope import rope_lookup, rope_tables
from titanlite.models.common.tensor_parallel import vocab_parallel_head
from titanlite.ops.cross_entropy import chunked_cross_entropy_per_sample


class DecoderArgs(Protocol):
    """The args fields the shell reads (a family's frozen dataclass has them)."""

    dim: int
    n_layers: int
    vocab_size: int
    norm_eps: float
    max_seq_len: int
    tie_embeddings: bool


def depth_std(layer_id: int) -> float:
    """The std of a block's output projections (those that write the residual stream), scaled
    down with depth so that the stream does not grow with the layers."""
    return 0.02 / math.sqrt(2 * (layer_id + 1))


class Decoder(nn.Module):
    def __init__(self, args: DecoderArgs, block: Callable[[int], nn.Module]) -> None:
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError(
                f"{type(args).__name__}.vocab_size must be set (it comes from the tokenizer)"
            )
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(block(i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # the tensor-splitting axis's mesh once tensor_parallel.decoder_plan splits the vocabulary
        self.vocab_mesh: DeviceMesh | None = None
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self._init_rope()

    def rope_frequencies(self) -> torch.Tensor:
        """[head_dim / 2] the family's RoPE frequencies (titanlite.models.common.rope)."""
        raise NotImplementedError

    def _init_rope(self) -> None:
        freqs = self.rope_frequencies().to(self.tok_embeddings.weight.device)
        self.rope_cos, self.rope_sin = rope_tables(freqs, self.args.max_seq_len)

    def init_weights(self, init: ParamInit) -> None:
        """The RoPE tables recomputed; the embedding, the head (when not tied) and the final
        norm drawn here, each block's parameters by its own init_weights(init)."""
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

    def prepare(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DocumentMask]:
        """cos, sin and the attention mask of a forward over `tokens` [B, S]: one causal
        sequence per row; with `positions` [B, S] (each token's position in its document, 0
        starting one) each document attending to itself at its own positions; with a `cache`
        the prompts, then one token per row (KVCache.open)."""
        seqlen = tokens.shape[1]
        columns = seqlen if cache is None else cache.columns(seqlen)
        if columns > self.args.max_seq_len:
            raise ValueError(
                f"sequence of {columns} tokens exceeds max_seq_len {self.args.max_seq_len}"
            )
        if cache is not None:
            if positions is not None:
                raise ValueError(
                    "a KV cache is for generation: tokens only, no positions or labels"
                )
            at, mask = cache.open(seqlen, tokens.device)
            return *rope_lookup(self.rope_cos, self.rope_sin, seqlen, at), mask
        mask = None if positions is None else document_mask(positions)
        return *rope_lookup(self.rope_cos, self.rope_sin, seqlen, positions), mask

    def head(
        self, h: torch.Tensor, labels: torch.Tensor | None = None, loss_chunk: int = 0
    ) -> torch.Tensor:
        """The final norm and the output head over the last block's output: logits, or with
        `labels` each sequence's summed cross entropy [B], the head run `loss_chunk` positions
        at a time inside the loss (0: all at once;
        titanlite.ops.cross_entropy.chunked_cross_entropy_per_sample)."""
        h = self.norm(h)
        if self.vocab_mesh is not None:
            return vocab_parallel_head(h, self.output.weight, labels, loss_chunk)
        if labels is None:
            return self.output(h)
        return chunked_cross_entropy_per_sample(h, self.output.weight, labels, loss_chunk)
