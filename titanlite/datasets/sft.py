"""Supervised fine-tuning: one prepared record per sequence (SFTDataset), or several packed into
one (PackedSFTDataset); only their target tokens (the response, the assistant turns:
titanlite.datasets.records) have labels."""

from __future__ import annotations

import numpy as np

from titanlite.datasets.packing import best_fit_decreasing, restart_positions
from titanlite.datasets.prepared import Prepared
from titanlite.errors import UserError
from titanlite.ops.cross_entropy import IGNORE_INDEX


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

    def content_slots(self, i: int) -> int:
        """Slots of sequence i that hold a record's tokens rather than padding."""
        return min(len(self.data.document(i)[0]), self.seq_len + 1) - 1

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


class PackedSFTDataset(SFTDataset):
    """Records packed into sequences of seq_len (titanlite.datasets.packing: the same plan on
    every rank, so the sampler orders packs as it orders records). Each item carries positions
    that restart at every record: attention never crosses a record boundary and RoPE sees each
    record as if alone, so its loss and gradient are those of the record run by itself. A
    record longer than the window is truncated, as unpacked; one of a single token is dropped
    (it has no label to train). `records`: the records to pack (a split's part); None: all."""

    def __init__(self, data: Prepared, seq_len: int, pad_id: int, records: np.ndarray | None = None) -> None:
        super().__init__(data, seq_len, pad_id)
        lengths = data.document_lengths()
        self.slots = np.minimum(lengths, seq_len + 1) - 1  # input positions each record fills
        kept = np.arange(len(lengths)) if records is None else np.asarray(records, dtype=np.int64)
        kept = kept[self.slots[kept] > 0]
        members, self.starts = best_fit_decreasing(self.slots[kept], seq_len)
        self.members = kept[members]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def records(self, i: int) -> np.ndarray:
        """The record indices of pack i, in their order inside it."""
        return self.members[self.starts[i] : self.starts[i + 1]]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        inputs = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        starts, at = [], 0
        for r in self.records(i).tolist():
            n = int(self.slots[r])
            ids, target = self.data.document(r)
            inputs[at : at + n], labels[at : at + n] = to_example(ids, target, n, self.pad_id)
            starts.append(at)
            at += n
        starts.append(at)  # the padding after the last record is a document of its own
        return inputs, labels, restart_positions(np.asarray(starts), self.seq_len)

    def trace(self, i: int) -> list[dict]:
        return [
            {**self.data.source(r), "tokens": [0, int(self.slots[r]) + 1]} for r in self.records(i).tolist()
        ]

    def content_slots(self, i: int) -> int:
        return int(self.slots[self.records(i)].sum())
