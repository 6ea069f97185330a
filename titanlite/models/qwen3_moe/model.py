"""Qwen3-MoE on titanlite.models.common's blocks: RMSNorm, grouped-query attention with an
explicit head_dim and RMSNorm on each q and k head, RoPE on the two halves of a head
(transformers' layout, so its weights need no permutation); its own are the MLPs, in each a
top-k router over SwiGLU experts (moe.py), the routing statistics and the loss terms (Qwen3
Technical Report, arXiv 2505.09388; transformers' Qwen3MoeForCausalLM is the reference the
tests hold it to).

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

import torch
import torch.nn as nn

from titanlite.distributed.param_init import ParamInit
from titanlite.models.common.attention import Attention
from titanlite.models.common.decoder import Decoder, depth_std
from titanlite.models.common.document_attention import DocumentMask, document_ids
from titanlite.models.common.rmsnorm import RMSNorm
from titanlite.models.common.rope import rope_frequencies
from titanlite.models.qwen3_moe.activations import saved_bytes
from titanlite.models.qwen3_moe.args import Qwen3MoeArgs
from titanlite.models.qwen3_moe.moe import DenseMLP, MoE
from titanlite.models.step import StepContext
from titanlite.ops.cross_entropy import IGNORE_INDEX


class Block(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3MoeArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            rope_layout="halves",
            qk_norm_eps=args.norm_eps,
        )
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
        out_std = depth_std(self.layer_id)
        self.attention.init_weights(init, out_std)
        for norm in (self.attention_norm, self.mlp_norm):
            init.constant_(norm.weight, 1.0)
        if isinstance(self.mlp, MoE):
            init.trunc_normal_(self.mlp.router.weight, 0.02)
            init.trunc_normal_(self.mlp.experts.gate_up, 0.02)
            init.trunc_normal_(self.mlp.experts.down, out_std)
        else:
            self.mlp.init_weights(init, out_std, up_std=0.02)


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


class Qwen3Moe(Decoder):
    def __init__(self, args: Qwen3MoeArgs) -> None:
        super().__init__(args, lambda i: Block(i, args))

    def rope_frequencies(self) -> torch.Tensor:
        return rope_frequencies(self.args.head_dim, self.args.rope_theta)

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
        cos, sin, mask = self.prepare(tokens, positions)
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
        ce = self.head(h, labels, loss_chunk)  # without labels, the logits
        # without labels or a step (eval reads the cross entropy alone) no terms
        if labels is None or step is None or not router_logits:
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
