"""What a step trains on: one microbatch of tokens, labels and the masks' keys, as the loss path
reads it (titanlite.components.loss) and the loader makes it (build.py). Kept apart from the
loader so the loss path does not import the data pipeline."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class Microbatch(NamedTuple):
    """One microbatch: tokens, next-token labels, each token's position within its document (for
    document masking) and each sequence's key (for dropout masks keyed by sample)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    keys: torch.Tensor | None = None

    def to(self, device: torch.device) -> Microbatch:
        return Microbatch(*(None if t is None else t.to(device, non_blocking=True) for t in self))


def collate(items: list[tuple[np.ndarray, ...]]) -> Microbatch:
    return Microbatch(*(torch.from_numpy(np.stack(column)) for column in zip(*items, strict=True)))
