"""The keys and values a generation has computed, so that decoding a token costs one position's
forward (titanlite.components.generate drives it through a model's `kv_cache`)."""

from __future__ import annotations

import torch


class KVCache:
    """Each layer's keys and values [B, S, kv_heads, head_dim] (after RoPE) of the positions a
    generation has run. The first forward given it runs the prompts, right-padded (`lengths`:
    each row's real tokens), under causal attention, so no real position reads a padded one;
    each later forward adds one token per row at that row's own next position, attending only
    to the row's real columns (`valid`)."""

    def __init__(self, n_layers: int, lengths: torch.Tensor) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.lengths = lengths  # [B] each row's positions so far: its next token's RoPE position
        self.valid: torch.Tensor | None = (
            None  # [B, columns] bool: the columns that hold real tokens
        )

    @property
    def decoding(self) -> bool:
        """Whether the prompts ran already, so that a forward adds one token per row."""
        return self.valid is not None

    def columns(self, seqlen: int) -> int:
        """The key columns a forward of `seqlen` tokens attends over."""
        return self.valid.shape[1] + seqlen if self.decoding else seqlen

    def open(
        self, seqlen: int, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A forward of `seqlen` tokens begins: its RoPE positions and its mask. The prompts:
        (None, None), the first positions under causal attention. Decoding: each row's next
        position [B, 1] and the row's real columns [B, 1, 1, columns]; the row's length counts
        the token from then on."""
        if not self.decoding:
            self.valid = torch.arange(seqlen, device=device)[None] < self.lengths[:, None]
            return None, None
        if seqlen != 1:
            raise ValueError("after the prompts, a KV cache takes one token per row at a time")
        at = self.lengths[:, None]
        self.valid = torch.cat([self.valid, torch.ones_like(self.valid[:, :1])], dim=1)
        self.lengths = self.lengths + 1
        return at, self.valid[:, None, None, :]

    def extend(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values, the cached ones first and these after them."""
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=1)
            v = torch.cat([self.values[layer], v], dim=1)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows go on (the others finished)."""
        self.keys = [t.index_select(0, rows) for t in self.keys]
        self.values = [t.index_select(0, rows) for t in self.values]
        self.lengths, self.valid = (
            self.lengths.index_select(0, rows),
            self.valid.index_select(0, rows),
        )
