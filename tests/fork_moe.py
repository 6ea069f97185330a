"""A mixture-of-experts model written only from the fork contract (titanlite/models/registry.py
and titanlite/models/step.py), registered from outside the package: Qwen3-MoE's routing (softmax
over the experts, top-k, the chosen weights renormalised; the router reads the tokens flattened
to [B*S, dim], as transformers' does) with SwiGLU experts, and the loss terms such a model adds:

- fork_moe: the Switch load-balancing loss (Fedus et al., arXiv 2101.03961; transformers'
  load_balancing_loss_func: the layers' routing rows taken together) over the whole step, from
  the step-statistics pass (pattern 2), and a router z-loss (Zoph et al., ST-MoE, arXiv
  2202.08906) over the valid tokens (pattern 1). Flavors: tiny (coefficient 0.001, transformers'
  default) and strong (0.1).
- fork_moe_z: the z-loss alone (pattern 1: nothing from the step but its normaliser).
- fork_moe_local: the load-balancing loss by transformers' formula on each microbatch, the
  microbatches' losses averaged: the control, whose gradient depends on how the batch is cut.
- fork_moe_sparse: fork_moe with its experts dispatched on the tokens that chose them, as
  transformers does: its forward cannot be traced on fake tensors, so it gives the memory
  estimate its own activation_bytes.

The experts run densely (every expert on every token, weighted by its routing weight, zero
where not chosen): the same sums as a sparse dispatch, and every parameter gets a gradient at
every step, as DDP needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from fork_model import parallelize_fork

from titanlite.models.registry import ModelSpec, register_model
from titanlite.models.step import StepContext
from titanlite.ops.cross_entropy import IGNORE_INDEX, chunked_cross_entropy_per_sample


@dataclass(frozen=True)
class MoEArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    experts: int = 4
    top_k: int = 2
    hidden: int = 48  # each expert's SwiGLU width
    balance_coef: float = 0.001  # load-balancing loss (0: none)
    z_coef: float = 0.001  # router z-loss (0: none)
    vocab_size: int = -1  # filled in by the trainer
    max_seq_len: int = -1  # filled in by the trainer


class Experts(nn.Module):
    """SwiGLU experts, their weights stacked: [experts, hidden, dim] and [experts, dim, hidden]."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(args.experts, args.hidden, args.dim))
        self.up_proj = nn.Parameter(torch.empty(args.experts, args.hidden, args.dim))
        self.down_proj = nn.Parameter(torch.empty(args.experts, args.dim, args.hidden))

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, dim], weights [T, experts] (zero where an expert is not chosen) -> [T, dim]."""
        gate = torch.einsum("td,ehd->teh", x, self.gate_proj)
        up = torch.einsum("td,ehd->teh", x, self.up_proj)
        out = torch.einsum("teh,edh->ted", F.silu(gate) * up, self.down_proj)
        return (weights[..., None] * out).sum(1)


class MoEBlock(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.attn_norm = nn.LayerNorm(args.dim)
        self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.proj = nn.Linear(args.dim, args.dim, bias=False)
        self.mlp_norm = nn.LayerNorm(args.dim)
        self.router = nn.Linear(args.dim, args.experts, bias=False)
        self.experts = Experts(args)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output and its router logits [B*S, experts]."""
        b, s, d = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(b, s, 3, self.args.n_heads, d // self.args.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        flat = self.mlp_norm(x).view(b * s, d)
        logits = self.router(flat)
        probs = logits.float().softmax(-1)
        top, chosen = probs.topk(self.args.top_k, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, chosen, top / top.sum(-1, keepdim=True))
        return x + self.experts(flat, weights.to(x.dtype)).view(b, s, d), logits


class MoELM(nn.Module):
    """Token embedding, MoE blocks, final norm, head. The load-balancing loss: step statistics
    (pattern 2 of titanlite/models/step.py)."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(MoEBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_chunk: int = 0,
        step: StepContext | None = None,
    ):
        """Logits; with `labels`, each sequence's summed cross entropy, and in training (`step`)
        the named terms beside it; in the statistics pass (`step.counting`), this microbatch's
        expert counts and routing rows."""
        h = self.tokens(tokens)
        router_logits = []
        for layer in self.layers:
            h, logits = layer(h)
            router_logits.append(logits.view(*tokens.shape, -1))
        logits = torch.stack(router_logits, 2)  # [B, S, layers, experts]
        if step is not None and step.counting:
            return self.routing_counts(logits)
        h = self.norm(h)
        if labels is None:
            return self.head(h)
        ce = chunked_cross_entropy_per_sample(h, self.head.weight, labels, loss_chunk)
        if step is None:  # eval: the cross entropy is all it reads
            return ce
        terms = {}
        if self.args.balance_coef:
            terms["aux"] = self.balance_loss(logits, step)
        if self.args.z_coef:  # pattern 1: a per-token sum over the valid tokens, exact as it is
            valid = (labels != IGNORE_INDEX)[:, :, None]
            z = logits.float().logsumexp(-1) ** 2 * valid
            terms["z"] = self.args.z_coef * z.sum((1, 2))
        return ce, terms

    def routing_counts(self, logits: torch.Tensor) -> torch.Tensor:
        """[expert counts of each layer (layers x experts)..., routing rows]: how many of the
        microbatch's routing slots chose each expert in each layer, and its rows (tokens x
        layers), as int64, which the normaliser's all-reduce sums."""
        chosen = logits.float().softmax(-1).topk(self.args.top_k, dim=-1).indices
        layer = torch.arange(self.args.n_layers, device=logits.device)[:, None]
        # [B, S, layers, k]: one bin per layer and expert
        slots = chosen + layer * self.args.experts
        counts = torch.bincount(slots.flatten(), minlength=self.args.n_layers * self.args.experts)
        rows = torch.tensor([logits[..., 0].numel()], device=logits.device)
        return torch.cat([counts, rows])

    def expert_load(self, statistics: torch.Tensor) -> dict[str, torch.Tensor]:
        """The contract's optional expert load: each layer's share of its routing slots per
        expert, from statistics summed over steps, on the device."""
        counts = statistics[:-1].view(self.args.n_layers, self.args.experts).double()
        shares = counts / counts.sum(-1, keepdim=True)
        return {str(i): row for i, row in enumerate(shares)}

    def balance_loss(self, logits: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Each sequence's share of coef * E * sum_e f_e P_e over the step (pattern 2): f from
        the step's statistics (the layers' counts together), the per-token sum scaled by N / T so
        that the trainer's division by N leaves the mean over the step's T routing rows."""
        counts = step.statistics[:-1].view(self.args.n_layers, -1).sum(0)
        rows = step.statistics[-1]
        f = counts.float() / rows
        probs = logits.float().softmax(-1)
        per_token = self.args.experts * (probs * f).sum(-1)  # [B, S, layers]
        return self.args.balance_coef * per_token.sum((1, 2)) * (step.tokens / rows)

    def init_weights(self, init) -> None:
        init.normal_(self.tokens.weight, 1.0)
        for norm in [self.norm] + [
            m for layer in self.layers for m in (layer.attn_norm, layer.mlp_norm)
        ]:
            init.constant_(norm.weight, 1.0)
            init.constant_(norm.bias, 0.0)
        for layer in self.layers:
            for weight in (layer.qkv.weight, layer.proj.weight, layer.router.weight):
                init.trunc_normal_(weight, 0.02)
            for weight in (layer.experts.gate_proj, layer.experts.up_proj, layer.experts.down_proj):
                init.trunc_normal_(weight, 0.02)
        init.trunc_normal_(self.head.weight, 0.02)


class LocalBalanceLM(MoELM):
    """The control: transformers' load-balancing formula on what one microbatch holds (f and P
    of its own tokens), averaged over the step's microbatches and ranks. Equal to fork_moe at one
    microbatch in one process; its gradient changes with how the batch is cut."""

    def balance_loss(self, logits: torch.Tensor, step: StepContext) -> torch.Tensor:
        probs = logits.float().softmax(-1).flatten(0, 2)  # [rows, experts]
        chosen = probs.topk(self.args.top_k, dim=-1).indices
        f = torch.bincount(chosen.flatten(), minlength=self.args.experts).float() / len(probs)
        aux = self.args.balance_coef * self.args.experts * (f * probs.mean(0)).sum()
        share = step.tokens / (len(logits) * step.accum * step.ranks)  # the mean over microbatches
        return aux * share * torch.ones(len(logits), device=logits.device)


class SparseExperts(Experts):
    """The same experts dispatched as transformers does: each expert on the tokens that chose it
    (torch.nonzero: shapes that depend on the data, which fake tensors cannot trace)."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.gate_proj.shape[0]):
            tokens = weights[:, e].nonzero().squeeze(-1)
            h = x[tokens]
            y = (F.silu(h @ self.gate_proj[e].T) * (h @ self.up_proj[e].T)) @ self.down_proj[e].T
            out = out.index_add(0, tokens, weights[tokens, e, None] * y)
        return out


class SparseMoELM(MoELM):
    """fork_moe with its experts dispatched sparsely; its memory estimate is its own."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__(args)
        for layer in self.layers:
            layer.experts = SparseExperts(args)

    def activation_bytes(self, seq_len: int, dtype: torch.dtype) -> tuple[list[int], int]:
        """What one sequence's forward keeps for backward: per block, attention (its norm, q, k,
        v, output and projection: 8 x dim a token), the router (its norm, logits, probabilities)
        and each chosen expert's gate, up, their product and output; the rest, the final norm."""
        a = self.args
        per_token = 8 * a.dim + 2 * a.dim + 2 * a.experts + a.top_k * (3 * a.hidden + a.dim)
        return [
            seq_len * per_token * dtype.itemsize
        ] * a.n_layers, 2 * seq_len * a.dim * dtype.itemsize


FLAVORS = {"tiny": MoEArgs(), "strong": MoEArgs(balance_coef=0.1)}
register_model(ModelSpec("fork_moe", MoELM, FLAVORS, parallelize_fork, step_statistics=True))
register_model(
    ModelSpec("fork_moe_z", MoELM, {"tiny": MoEArgs(balance_coef=0.0)}, parallelize_fork)
)
register_model(ModelSpec("fork_moe_local", LocalBalanceLM, FLAVORS, parallelize_fork))
register_model(
    ModelSpec("fork_moe_sparse", SparseMoELM, FLAVORS, parallelize_fork, step_statistics=True)
)
