"""Context parallelism added from outside the package, written only from the registry's contract
(its axis rules for a sequence split) as a fork would: tests/fork_model.py's transformer with Ulysses-style
attention (DeepSpeed-Ulysses, arXiv 2309.14509). Each rank of the `cp` axis holds one piece of
every sequence's positions; before attention an all-to-all trades pieces of the sequence for
groups of heads, so each rank attends over whole sequences with n_heads / cp heads, and a
second all-to-all trades them back. Position embeddings and document boundaries come from the
global positions (the piece's offset, or the packed positions gathered over the axis).

Selected with `--model.name fork_cp --model.import_module fork_cp --model.flavor tiny
--parallelism.axes '["cp=2"]'` (n_heads must divide by cp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from fork_model import Block, ForkArgs, ForkLM

from titanlite.distributed.parallelize import parallelize_blocks
from titanlite.models.registry import ModelSpec, register_model
from titanlite.ops.cross_entropy import chunked_cross_entropy_per_sample


def _trade(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """all-to-all along dim 0 of x [cp, ...] (chunk j to rank j), with its gradient."""
    x = x.contiguous()  # first: an empty_like of a strided view would be strided too
    return dist_fn.all_to_all_single(torch.empty_like(x), x, group=group)


def pieces_to_heads(x: torch.Tensor, cp: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, s, ..., heads, d] (this piece, every head) -> [b, cp*s, ..., heads/cp, d] (the whole
    sequence, this rank's heads)."""
    b, s, *mid, h, d = x.shape
    x = x.view(b, s, *mid, cp, h // cp, d).movedim(-3, 0)  # [cp (head group), b, s, ..., h/cp, d]
    x = _trade(x, group)  # chunk j: piece j of the sequence, this rank's heads
    return x.movedim(0, 1).reshape(b, cp * s, *mid, h // cp, d)


def heads_to_pieces(x: torch.Tensor, cp: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse: [b, cp*s, heads/cp, d] -> [b, s, heads, d]."""
    b, full, hc, d = x.shape
    x = x.view(b, cp, full // cp, hc, d).movedim(1, 0)  # [cp (piece), b, s, h/cp, d]
    x = _trade(x, group)  # chunk j: this piece, head group j
    return x.movedim(0, 2).reshape(b, full // cp, cp * hc, d)


class UlyssesBlock(Block):
    """fork_model's Block (the same weights) attending over whole sequences across the cp axis."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cp: int = 1, group=None) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads)
        if cp > 1:
            qkv = pieces_to_heads(qkv, cp, group)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
        if cp > 1:
            att = heads_to_pieces(att, cp, group)
        x = x + self.proj(att.reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class ContextParallelLM(ForkLM):
    def __init__(self, args: ForkArgs) -> None:
        super().__init__(args)
        self.layers = nn.ModuleList(UlyssesBlock(args) for _ in range(args.n_layers))
        self.cp, self.cp_rank, self.cp_group = 1, 0, None  # set by parallelize_cp

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_chunk: int = 0,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This piece's logits [B, s, vocab]; with `labels`, its summed cross entropy per sequence [B]."""
        b, s = tokens.shape
        if positions is None:  # unpacked: the piece's global positions
            positions = (self.cp_rank * s + torch.arange(s, device=tokens.device)).expand(b, s)
        whole = positions
        if self.cp > 1:  # every piece's positions, in order: the whole sequences' documents
            parts = [torch.empty_like(positions) for _ in range(self.cp)]
            dist.all_gather(parts, positions.contiguous(), group=self.cp_group)
            whole = torch.cat(parts, dim=1)
        docs = (whole == 0).cumsum(-1)
        full = whole.shape[1]
        causal = torch.ones(full, full, dtype=torch.bool, device=tokens.device).tril()
        mask = ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]
        h = self.tokens(tokens) + self.positions(positions)
        for layer in self.layers:
            h = layer(h, mask, self.cp, self.cp_group)
        h = self.norm(h)
        if labels is None:
            return self.head(h)
        return chunked_cross_entropy_per_sample(h, self.head.weight, labels, loss_chunk)


def parallelize_cp(model: ContextParallelLM, dims, cfg) -> nn.Module:
    axes = dict(dims.layout.axes)
    if axes.get("cp", 1) > 1:
        model.cp, model.cp_rank, model.cp_group = axes["cp"], dims.seq_rank, dims.axis_group("cp")
    return parallelize_blocks(model, model.layers, dims, cfg)


FLAVORS = {"tiny": ForkArgs(), "tiny4": ForkArgs(n_heads=4)}  # tiny4: cp up to 4
register_model(ModelSpec("fork_cp", ContextParallelLM, FLAVORS, parallelize_cp, axes=("cp",)))
