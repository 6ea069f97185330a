"""What a model's forward keeps for backward, traced rather than guessed, for the memory
estimate (titanlite.tools.memory): the model's own forward and loss run on fake tensors
(torch._subclasses.fake_tensor: shapes and dtypes, no memory, no arithmetic) while autograd's
saved-tensor hooks count what it keeps."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from titanlite.ops.cross_entropy import cross_entropy_per_sample

logger = logging.getLogger("titanlite")


@dataclass
class SavedActivations:
    """Bytes autograd keeps for backward for one sequence: inside each block, outside them (the
    embedding, the final norm, the loss path), and one block's input."""

    blocks: list[int]
    rest: int
    block_input: int


def _fake(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fake CPU tensor (made inside a FakeTensorMode) of a parameter's shape, in `dtype`, or a
    buffer's."""
    if isinstance(t, nn.Parameter):
        return nn.Parameter(torch.empty(t.shape, dtype=dtype), requires_grad=t.requires_grad)
    return torch.empty(t.shape, dtype=t.dtype)


def saved_activations(
    model: nn.Module, seq_len: int, dtype: torch.dtype, loss_chunk: int, labels_path: bool = False
) -> SavedActivations:
    """What one sequence's forward and loss (in chunks of `loss_chunk` < seq_len positions; 0: whole)
    save for backward, traced on a fake-tensor copy of the meta model: each storage autograd keeps
    is counted once, charged to the block running when it was first saved. CPU kernels are traced,
    so SDPA keeps no attention matrix, as flash kernels on a GPU do not. Nothing is assumed of a
    fork's model but that its blocks are `model.layers`."""
    blocks = list(getattr(model, "layers", []))
    owner: list[int | None] = [None]
    storages: dict[int, tuple[int | None, int]] = {}
    block_input = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s._cdata not in held:  # a weight saved by its matmul is the parameter, not an activation
            storages.setdefault(s._cdata, (owner[0], s.nbytes()))
        return t

    def enter(i: int):
        def hook(_module: nn.Module, args: tuple) -> None:
            owner[0] = i
            if args and isinstance(args[0], torch.Tensor):
                block_input[0] = args[0].untyped_storage().nbytes()

        return hook

    def leave(_module: nn.Module, _args: tuple, _out: Any) -> None:
        owner[0] = None

    mode = FakeTensorMode()
    with mode:  # a tied parameter is one entry: the copy keeps it shared
        memo: dict[int, Any] = {
            id(t): _fake(t, dtype) for t in (*model.parameters(), *model.buffers())
        }
    fake = copy.deepcopy(model, memo)  # the module tree only: no weight is copied
    with mode:
        held = {t.untyped_storage()._cdata for t in (*fake.parameters(), *fake.buffers())}
        for i, block in enumerate(fake.layers if blocks else []):  # a copy: its hooks die with it
            block.register_forward_pre_hook(enter(i))
            block.register_forward_hook(leave)
        tokens = torch.zeros(1, seq_len, dtype=torch.long)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            # the model's one loss path (titanlite.models.step.LossPath)
            if labels_path or loss_chunk:
                fake(tokens, labels=tokens, loss_chunk=loss_chunk)
            else:
                cross_entropy_per_sample(fake(tokens), tokens)
    per_block = [0] * len(blocks)
    rest = 0
    for who, nbytes in storages.values():
        if who is None:
            rest += nbytes
        else:
            per_block[who] += nbytes
    return SavedActivations(per_block, rest, block_input[0])


ACTIVATION_FALLBACK = 34  # values per token per layer, x dim, where a forward cannot be traced
# How rough that is, against the traced figure of titanlite's Llamas and the tests' forks:
# tests/test_memory.py holds it to ROUGH_RANGE.
ROUGH_RANGE = (0.9, 1.6)
ROUGH = (
    f"rough: {ACTIVATION_FALLBACK} x dim per token per layer, {ROUGH_RANGE[0]} to {ROUGH_RANGE[1]}x "
    "the traced figure of the models it is checked on; the model's own activation_bytes() would replace it"
)


def activation_bytes(
    model: nn.Module,
    seq_len: int,
    dtype: torch.dtype,
    loss_chunk: int,
    checkpoint: str,
    dim: int,
    n_layers: int,
    labels_path: bool = False,
    vocab: int = 0,
) -> tuple[float, str]:
    """One sequence's activations kept for backward under activation checkpointing `checkpoint`,
    and where the figure comes from: traced (saved_activations), or where the forward cannot run
    on fake tensors (a router's data-dependent shapes), the model's own `activation_bytes(seq_len,
    dtype) -> (bytes per block, the rest)`, else ROUGH; logged with the trace's error. Untraced,
    the loss path's own (cross_entropy_per_sample's fp32 log-probabilities over `vocab`, where the
    whole sequence's logits are made at once) is added to the rest, as a trace would see it."""
    try:
        saved = saved_activations(model, seq_len, dtype, loss_chunk, labels_path)
        blocks, rest, block_input, source = saved.blocks, saved.rest, saved.block_input, "traced"
    except Exception as e:  # a fork's forward; the estimate still stands, a little coarser
        block_input = seq_len * dim * dtype.itemsize
        if hasattr(model, "activation_bytes"):
            blocks, rest = model.activation_bytes(seq_len, dtype)
            source = "the model's own activation_bytes()"
        else:
            blocks = [seq_len * ACTIVATION_FALLBACK * dim * dtype.itemsize] * n_layers
            rest, source = 0, ROUGH
        rest += 0 if loss_chunk else seq_len * vocab * 4 + 4  # and nll_loss's total weight
        logger.info(
            f"memory estimate: activations from {source} (the forward did not trace on fake tensors: {type(e).__name__}: {e})"
        )
    one = max(blocks, default=0)
    if checkpoint == "full":  # each block's input, and one block's recomputed activations
        return len(blocks) * block_input + one + rest, source
    if checkpoint == "selective":  # matmul/attention outputs kept: about half, and a block's rest
        return (sum(blocks) + one) / 2 + rest, source
    return sum(blocks) + rest, source
