"""A model written only from the fork contract in titanlite/models/registry.py's docstring, and
registered from outside the package, as a fork would do it: a pre-norm transformer with learned
position embeddings, per-document attention from `positions` and the loss in chunks.

Selected with `--model.name fork_lm --model.import_module fork_model --model.flavor tiny`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.distributed.parallelize import parallelize_blocks
from titanlite.models.registry import ModelSpec, register_model
from titanlite.ops.cross_entropy import chunked_cross_entropy_per_sample


@dataclass(frozen=True)
class ForkArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    vocab_size: int = -1  # filled in by the trainer
    max_seq_len: int = -1  # filled in by the trainer


class Block(nn.Module):
    def __init__(self, args: ForkArgs) -> None:
        super().__init__()
        self.heads = args.n_heads
        self.attn_norm = nn.LayerNorm(args.dim)
        self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.proj = nn.Linear(args.dim, args.dim, bias=False)
        self.mlp_norm = nn.LayerNorm(args.dim)
        self.up = nn.Linear(args.dim, 4 * args.dim)
        self.down = nn.Linear(4 * args.dim, args.dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class ForkLM(nn.Module):
    def __init__(self, args: ForkArgs) -> None:
        super().__init__()
        self.args = args
        self.tokens = nn.Embedding(args.vocab_size, args.dim)
        self.positions = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_chunk: int = 0,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, vocab]; with `labels`, each sequence's summed cross entropy [B]."""
        b, s = tokens.shape
        if positions is None:
            positions = torch.arange(s, device=tokens.device).expand(b, s)
        # A 0 in positions starts a document: a token sees the earlier tokens of its own only.
        docs = (positions == 0).cumsum(-1)
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
        mask = ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]
        h = self.tokens(tokens) + self.positions(positions)
        for layer in self.layers:
            h = layer(h, mask)
        h = self.norm(h)
        if labels is None:
            return self.head(h)
        return chunked_cross_entropy_per_sample(h, self.head.weight, labels, loss_chunk)

    def init_weights(self, init) -> None:
        init.normal_(self.tokens.weight, 1.0)
        init.normal_(self.positions.weight, 0.1)
        for norm in [self.norm] + [
            m for layer in self.layers for m in (layer.attn_norm, layer.mlp_norm)
        ]:
            init.constant_(norm.weight, 1.0)
            init.constant_(norm.bias, 0.0)
        for layer in self.layers:
            for linear in (layer.qkv, layer.proj, layer.up, layer.down):
                init.trunc_normal_(linear.weight, 0.02)
            init.constant_(layer.up.bias, 0.0)
            init.constant_(layer.down.bias, 0.0)
        init.trunc_normal_(self.head.weight, 0.02)

    def num_flops_per_token(self, seq_len: int) -> int:
        """6 x the matmuls' parameters (forward and backward) + the attention scores (Kaplan et
        al., "Scaling Laws for Neural Language Models", arXiv 2001.08361); lookups are free."""
        tables = self.tokens.weight.numel() + self.positions.weight.numel()
        params = sum(p.numel() for p in self.parameters()) - tables
        return 6 * params + 12 * self.args.n_layers * self.args.dim * seq_len


def parallelize_fork(model: ForkLM, dims, cfg) -> nn.Module:
    return parallelize_blocks(model, model.layers, dims, cfg)


register_model(ModelSpec("fork_lm", ForkLM, {"tiny": ForkArgs()}, parallelize_fork))
