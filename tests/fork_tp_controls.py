"""The field's tensor-parallel defects, each planted in titanlite's Llama 3 at the model check's
size (registered from outside the package): every one leaves the loss one process's and moves
the gradient, so only a gradient check sees it (tests/test_distributed.py runs each through
scripts/check_model.py's cases).

- tp_control_no_backward_sum: the head's input gathered for the vocab-parallel head, its
  gradient taken as the same on every rank, so the backward's sum over the axis is left out
  (each rank keeps its own vocabulary rows' share).
- tp_control_local_vocab: the loss's value from the vocab-parallel cross entropy, its gradient
  from each rank's own vocabulary slice alone (a softmax over the rank's rows, targets outside
  them dropped), as a vocab-parallel loss without its all-reduces differentiates.
- tp_control_unreduced_norm: the blocks' norms left as plain parameters on the residual
  stream's pieces (sequence parallelism), so their gradients cover one rank's positions and are
  never summed over the axis.
- tp_control_router_counts: titanlite's Qwen3-MoE whose routing counts are all-reduced in place
  over the axis, whose ranks already count the same whole sequences: the load-balancing term's
  expert shares, and its gradient, double (its cross entropy is untouched).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from titanlite.distributed.parallelize import parallelize_blocks
from titanlite.models.common.tensor_parallel import (
    attention_plan,
    decoder_plan,
    swiglu_plan,
    vocab_parallel_head,
)
from titanlite.models.llama3 import Llama3, llama3_flavors
from titanlite.models.llama3.parallelize import parallelize_llama
from titanlite.models.qwen3_moe import Qwen3Moe, qwen3_moe_flavors
from titanlite.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from titanlite.models.registry import ModelSpec, register_model
from titanlite.ops.cross_entropy import IGNORE_INDEX
from titanlite.ops.vocab_parallel import vocab_parallel_cross_entropy, vocab_slice

FLAVORS = {"tiny": llama3_flavors["tiny"]}
MOE_FLAVORS = {"tiny": qwen3_moe_flavors["tiny_strong"]}


def _whole(h: torch.Tensor, mesh) -> torch.Tensor:
    """The residual stream's pieces gathered whole, the gradient taken as the same on every rank
    (the default): the backward slices it instead of summing the ranks' shares."""
    if not isinstance(h, DTensor):
        h = DTensor.from_local(h, mesh, [Shard(1)], run_check=False)
    return h.redistribute(mesh, [Replicate()]).to_local()


class NoBackwardSum(Llama3):
    def head(self, h, labels=None, loss_chunk=0):
        if self.vocab_mesh is None or labels is None:
            return super().head(h, labels, loss_chunk)
        mesh, weight = self.vocab_mesh, self.output.weight
        lo, _ = vocab_slice(weight.shape[0], mesh.size(), mesh.get_local_rank())
        logits = F.linear(_whole(self.norm(h), mesh), weight.to_local())
        return vocab_parallel_cross_entropy(logits, labels, lo, mesh.get_group())


class LocalVocab(Llama3):
    def head(self, h, labels=None, loss_chunk=0):
        if self.vocab_mesh is None or labels is None:
            return super().head(h, labels, loss_chunk)
        normed = self.norm(h)
        exact = vocab_parallel_head(normed, self.output.weight, labels, loss_chunk)
        mesh, weight = self.vocab_mesh, self.output.weight
        lo, hi = vocab_slice(weight.shape[0], mesh.size(), mesh.get_local_rank())
        logits = F.linear(_whole(normed, mesh), weight.to_local()).float()
        targets = torch.where((labels >= lo) & (labels < hi), labels - lo, IGNORE_INDEX)
        own = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        )
        own = own.view(labels.shape).sum(-1)
        return exact.detach() + own - own.detach()


class RouterCountsOverTP(Qwen3Moe):
    def routing_counts(self, router_logits, routed):
        counts = super().routing_counts(router_logits, routed)
        if self.vocab_mesh is not None:
            dist.all_reduce(counts[:-1], group=self.vocab_mesh.get_group())
        return counts


def parallelize_unreduced_norm(model: nn.Module, dims, cfg) -> nn.Module:
    mesh = dims.tensor_mesh
    if mesh is not None:
        for block in model.layers:
            attention_plan(block.attention, mesh)
            swiglu_plan(block.feed_forward, mesh)
        decoder_plan(model, mesh)
    return parallelize_blocks(model, model.layers, dims, cfg)


_CONTROLS = {
    "tp_control_no_backward_sum": (NoBackwardSum, parallelize_llama),
    "tp_control_local_vocab": (LocalVocab, parallelize_llama),
    "tp_control_unreduced_norm": (Llama3, parallelize_unreduced_norm),
}
for name, (cls, fn) in _CONTROLS.items():
    register_model(ModelSpec(name, cls, FLAVORS, fn, axes=("tp",)))
register_model(
    ModelSpec(
        "tp_control_router_counts",
        RouterCountsOverTP,
        MOE_FLAVORS,
        parallelize_qwen3_moe,
        axes=("tp",),
        step_statistics=True,
    )
)
TP_CONTROLS = (*_CONTROLS, "tp_control_router_counts")
