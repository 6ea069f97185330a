"""Supervised fine-tuning: one prepared record per sequence; only its target tokens (the
response, the assistant turns: titanlite.datasets.records) have labels."""

from __future__ import annotations

import numpy as np

from titanlite.components.loss import IGNORE_INDEX
from titanlite.datasets.prepared import Prepared
from titanlite.errors import UserError


def to_example(
    ids: np.ndarray, target: np.ndarray, seq_len: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """A record's tokens and target mask -> (inputs, labels) of seq_len, truncated or padded.
    Position j predicts token j+1; its label is that token if it is a target, else IGNORE_INDEX.
    A record whose targets lie past the window has no valid token at all: the loss path handles
    that."""
    ids, target = ids[: seq_len + 1], target[: seq_len + 1]
    inputs = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    inputs[: len(ids) - 1] = ids[:-1]
    labels[: len(ids) - 1] = np.where(target[1:], ids[1:], IGNORE_INDEX)
    return inputs, labels


class SFTDataset:
    """Prepared records, padded or truncated to seq_len."""

    def __init__(self, data: Prepared, seq_len: int, pad_id: int) -> None:
        self.data = data
        self.seq_len = seq_len
        self.pad_id = pad_id

    def __len__(self) -> int:
        return self.data.num_docs

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        ids, target = self.data.document(i)
        return to_example(ids, target, self.seq_len, self.pad_id)

    def trace(self, i: int) -> list[dict]:
        ids, _ = self.data.document(i)
        return [{**self.data.source(i), "tokens": [0, min(len(ids), self.seq_len + 1)]}]

    def check_targets(self) -> str | None:
        """Raise if no record has a target token inside the window (every step would be skipped);
        else a start-up line when some records have none, or None."""
        first = self.data.first_targets()
        # The label of position j is token j+1: a target at token t (1 <= t <= seq_len) is seen.
        seen = (first >= 1) & (first <= self.seq_len)
        missing = int(len(first) - seen.sum())
        if missing == 0:
            return None
        where = f"SFT data '{self.data.folder}'"
        if missing == len(first):
            has = first[first >= 1]
            if not len(has):
                raise UserError(
                    f"{where}: none of its {len(first):,} records has a target token; check the data"
                )
            raise UserError(
                f"{where}: none of its {len(first):,} records has a target token within seq_len="
                f"{self.seq_len} (the prompt alone fills it); seq_len >= {int(has.min())} gives some a "
                f"target, >= {int(has.max())} all of them"
            )
        return (
            f"{where}: {missing:,} of {len(first):,} records ({missing / len(first):.1%}) have no target "
            f"token within seq_len={self.seq_len}; they add no valid tokens"
        )
