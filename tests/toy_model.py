"""The least a registered model can be: logits only, no positions, no loss inside. The tests
check the one-line refusals of what it cannot do (packing, the loss in chunks); a model that
offers all of the contract is tests/fork_model.py.

Selected with `--model.name toy_mlp --model.import_module toy_model`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from titanlite.distributed.parallelize import parallelize_blocks
from titanlite.models.registry import ModelSpec, register_model


@dataclass(frozen=True)
class ToyArgs:
    dim: int = 32
    n_layers: int = 2
    vocab_size: int = -1
    max_seq_len: int = 64
    dropout: float = 0.0  # accepted and unused: the tests reach the refusal of keyed dropout


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class ToyMLP(nn.Module):
    """Bag-of-previous-token model: embedding, residual MLP blocks, output head."""

    def __init__(self, args: ToyArgs) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args.dim) for _ in range(args.n_layers))
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def init_weights(self, init) -> None:
        init.normal_(self.embed.weight, 0.5)
        for layer in self.layers:
            init.trunc_normal_(layer.up.weight, 0.05)
            init.trunc_normal_(layer.down.weight, 0.05)
            init.constant_(layer.up.bias, 0.0)
            init.constant_(layer.down.bias, 0.0)
        init.trunc_normal_(self.head.weight, 0.05)


def parallelize_toy(model, dims, cfg):
    return parallelize_blocks(model, model.layers, dims, cfg)


register_model(ModelSpec("toy_mlp", ToyMLP, {"tiny": ToyArgs()}, parallelize_toy))
