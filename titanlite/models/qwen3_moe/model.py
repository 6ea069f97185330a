"""Qwen3-MoE: RMSNorm, grouped-query attention with an explicit head_dim and RMSNorm on each q
and k head, RoPE on the two halves of a head (transformers' layout, so its weights need no
permutation), and in each MLP a top-k router over SwiGLU experts (Qwen3 Technical Report,
arXiv 2505.09388; transformers' Qwen3MoeForCausalLM is the reference the tests hold it to).

The loss terms, both exact at any layout (titanlite/models/step.py):
- `aux`: the Switch load-balancing loss (Fedus et al., arXiv 2101.03961) as transformers'
  load_balancing_loss_func computes it, coef * E * sum_e f_e P_e with the routing rows of every
  MoE layer taken together, but over the whole step: f comes from the step-statistics pass
  (pattern 2), so the term is the global batch's at any dp, accumulation and mode;
- `z`: the router z-loss (Zoph et al., ST-MoE, arXiv 2202.08906), coef * logsumexp(logits)^2
  summed over the MoE layers, a per-token sum over the valid tokens (pattern 1). Off by default:
  Qwen3 was not trained with it.

The statistics pass returns each MoE layer's expert counts and the routed tokens; the trainer sums
them over the step and every rank, so they are also the expert load a log step reports
(`expert_load`), with no collective of their own.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from titanlite.distributed.param_init import ParamInit
from titanlite.models.attention import DocumentMask, attend, document_ids, document_mask
from titanlite.models.llama3.model import RMSNorm
from titanlite.models.qwen3_moe.activations import saved_bytes
from titanlite.models.qwen3_moe.args import Qwen3MoeArgs
from titanlite.models.qwen3_moe.moe import DenseMLP, MoE
from titanlite.models.step import StepContext
from titanlite.ops.cross_entropy import IGNORE_INDEX, chunked_cross_entropy_per_sample


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with the head's first half rotated against its second (transformers' rotate_half).
    x: [B, S, heads, head_dim]; cos, sin: [1 or B, S, 1, head_dim / 2]."""
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        if args.n_heads % args.n_kv_heads:
            raise ValueError("n_heads must divide by n_kv_heads")
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: DocumentMask
    ) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.wq(x).view(b, s, self.n_heads, self.head_dim))
        k = self.k_norm(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim))
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:  # grouped-query attention: each k/v head serves `rep` query heads
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        dense = layer_id in args.dense_layers
        self.mlp = DenseMLP(args.dim, args.dense_hidden) if dense else MoE(args)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: DocumentMask
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's output and its router logits (None in a dense layer)."""
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        out, logits = self.mlp(self.mlp_norm(h))
        return h + out, logits

    def init_weights(self, init: ParamInit) -> None:
        out_std = 0.02 / math.sqrt(2 * (self.layer_id + 1))  # residual outputs scaled by depth
        a = self.attention
        for w in (a.wq.weight, a.wk.weight, a.wv.weight):
            init.trunc_normal_(w, 0.02)
        init.trunc_normal_(a.wo.weight, out_std)
        for norm in (self.attention_norm, self.mlp_norm, a.q_norm, a.k_norm):
            init.constant_(norm.weight, 1.0)
        if isinstance(self.mlp, MoE):
            init.trunc_normal_(self.mlp.router.weight, 0.02)
            init.trunc_normal_(self.mlp.experts.gate_up, 0.02)
            init.trunc_normal_(self.mlp.experts.down, out_std)
        else:
            init.trunc_normal_(self.mlp.w1.weight, 0.02)
            init.trunc_normal_(self.mlp.w3.weight, 0.02)
            init.trunc_normal_(self.mlp.w2.weight, out_std)


def routed_tokens(labels: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """[B, S] bool: the tokens the load-balancing loss counts, every position of a document up
    to its last trained token (a label other than IGNORE_INDEX). Prompts count, padding (which
    no trained token follows) does not: transformers' load_balancing_loss_func given the
    attention mask, for records that end in a trained token. In pretraining every token counts.
    Documents are rows, or with `positions` the runs that start at each 0."""
    valid = (labels != IGNORE_INDEX).long()
    ahead = valid.flip(-1).cumsum(-1).flip(-1)  # trained tokens at t or after it in the row
    if positions is None:
        return ahead > 0
    docs = document_ids(positions)  # 1, 2, ... along the row
    per_doc = torch.zeros(
        *docs.shape[:-1], docs.shape[-1] + 2, dtype=torch.long, device=docs.device
    )
    per_doc.scatter_add_(-1, docs, valid)
    later = per_doc.flip(-1).cumsum(-1).flip(-1).gather(-1, docs + 1)  # in the documents after t's
    return ahead - later > 0


class Qwen3Moe(nn.Module):
    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("Qwen3MoeArgs.vocab_size must be set (it comes from the tokenizer)")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self._init_rope()

    def _init_rope(self) -> None:
        device = self.tok_embeddings.weight.device
        half = torch.arange(0, self.args.head_dim, 2, device=device).float() / self.args.head_dim
        freqs = 1.0 / self.args.rope_theta**half
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
        step: StepContext | None = None,
    ):
        """Logits; with `labels`, each sequence's summed cross entropy (the output projection run
        `loss_chunk` positions at a time, here in the root's forward where FSDP has it
        unsharded), and in training (`step`) the loss terms beside it; in the statistics pass
        (`step.counting`) this microbatch's routing counts (`routing_counts`). `positions`
        [B, S]: each token's position in its document (0 starts one); None: one causal
        sequence."""
        seqlen = tokens.shape[1]
        if seqlen > self.args.max_seq_len:
            raise ValueError(
                f"sequence of {seqlen} tokens exceeds max_seq_len {self.args.max_seq_len}"
            )
        if positions is None:
            cos, sin = self.rope_cos[None, :seqlen, None], self.rope_sin[None, :seqlen, None]
            mask = None
        else:
            cos, sin = self.rope_cos[positions][:, :, None], self.rope_sin[positions][:, :, None]
            mask = document_mask(positions)
        h = self.tok_embeddings(tokens)
        router_logits = []
        for layer in self.layers:
            h, logits = layer(h, cos, sin, mask)
            if logits is not None:
                router_logits.append(logits)
        if step is not None and step.counting:
            every = torch.ones_like(tokens, dtype=torch.bool)
            routed = every if labels is None else routed_tokens(labels, positions)
            return self.routing_counts(router_logits, routed)
        h = self.norm(h)
        if labels is None:
            return self.output(h)
        ce = chunked_cross_entropy_per_sample(h, self.output.weight, labels, loss_chunk)
        if step is None or not router_logits:  # eval reads the cross entropy alone
            return ce
        terms = {}
        if self.args.aux_loss_coef:
            routed = routed_tokens(labels, positions)
            terms["aux"] = self.balance_loss(router_logits, routed, step)
        if self.args.z_loss_coef:
            valid = (labels != IGNORE_INDEX).flatten()
            z = sum(logits.float().logsumexp(-1) ** 2 for logits in router_logits) * valid
            terms["z"] = self.args.z_loss_coef * z.view(labels.shape).sum(1)
        return ce, terms

    def routing_counts(
        self, router_logits: list[torch.Tensor], routed: torch.Tensor
    ) -> torch.Tensor:
        """[each MoE layer's expert counts (layers x E), routed tokens] as int64: how many of
        this microbatch's routing slots chose each expert in each layer, and its tokens, over
        the tokens `routed` [B, S] marks."""
        weight = routed.flatten().long()[:, None].expand(-1, self.args.top_k).flatten()
        counts = []
        for logits in router_logits:
            chosen = logits.float().softmax(-1).topk(self.args.top_k, dim=-1).indices.flatten()
            per_expert = torch.zeros(self.args.experts, dtype=torch.int64, device=chosen.device)
            counts.append(per_expert.index_add_(0, chosen, weight))
        return torch.cat([*counts, routed.sum().long()[None]])

    def expert_load(self, statistics: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each MoE layer's (by its index in `layers`) share of its routing slots per expert,
        from statistics summed over steps (`routing_counts`' layout): the load a log step
        reports (titanlite.components.expert_load). On the device, no host read."""
        counts = statistics[:-1].view(len(self.args.moe_layers), self.args.experts).double()
        shares = counts / counts.sum(-1, keepdim=True)
        return {str(i): row for i, row in zip(self.args.moe_layers, shares, strict=True)}

    def balance_loss(
        self, router_logits: list[torch.Tensor], routed: torch.Tensor, step: StepContext
    ) -> torch.Tensor:
        """Each sequence's share of the load-balancing loss over the step's routing rows R (its
        routed tokens T x the L MoE layers), f the shares of the step's routing slots per expert
        (from the statistics) and P the mean router probabilities:
        - pooled (transformers'): coef * E * sum_e f_e P_e, f and P over all of R;
        - per layer (`aux_per_layer`): coef * E * (1/L) sum_l sum_e f_le P_le, each layer's own.
        Either is sum over R of coef * E * f . p / R, so as per-token sums scaled by N / R the
        trainer's division by N leaves exactly the step's term (pattern 2)."""
        stats = step.statistics
        layers, tokens = len(router_logits), stats[-1]
        counts = stats[:-1].view(layers, -1).float()
        f = (
            counts / tokens
            if self.args.aux_per_layer
            else (counts.sum(0) / (tokens * layers))[None]
        )
        per_token = sum(  # [B x S]: sum over the layers of f . p
            (logits.float().softmax(-1) * f[i % len(f)]).sum(-1)
            for i, logits in enumerate(router_logits)
        )
        per_token = per_token.view(routed.shape) * routed
        scale = step.tokens / (tokens * layers)
        return self.args.aux_loss_coef * self.args.experts * per_token.sum(1) * scale

    def activation_bytes(self, seq_len: int, dtype: torch.dtype) -> tuple[list[int], int]:
        """What one sequence's forward keeps for backward, per block and the rest: the memory
        estimate's figure, as the routing cannot be traced on fake tensors (activations.py)."""
        return saved_bytes(self.args, seq_len, dtype)

    def num_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per active non-embedding parameter (a token meets its k
        experts, not all E) plus attention's 12 x layers x heads x head_dim x S."""
        a = self.args
        active = self.output.weight.numel() + self.norm.weight.numel()
        for layer in self.layers:
            active += sum(p.numel() for n, p in layer.named_parameters() if "experts" not in n)
            if isinstance(layer.mlp, MoE):
                active += a.top_k * 3 * a.moe_hidden * a.dim
        return 6 * active + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len
