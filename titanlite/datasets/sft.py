"""Supervised fine-tuning: one record per sequence, only the response tokens are targets.

Records are alpaca (`instruction`, optional `input`, `output`: rendered into the alpaca prompt,
`<bos> prompt response <eos>`, the response and <eos> are targets) or chat (`messages`: see
titanlite.datasets.chat, only the assistant turns are targets).
"""

from __future__ import annotations

import numpy as np

from titanlite.components.loss import IGNORE_INDEX
from titanlite.components.tokenizer import Tokenizer
from titanlite.datasets.chat import Segment, chat_segments
from titanlite.errors import UserError

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


def render_prompt(record: dict) -> str:
    template = PROMPT_WITH_INPUT if record.get("input") else PROMPT_NO_INPUT
    return template.format(instruction=record["instruction"], input=record.get("input", ""))


def record_segments(record: dict, tok: Tokenizer) -> list[Segment]:
    if "messages" in record:
        return chat_segments(record["messages"], tok)
    prompt = [tok.bos_id, *tok.encode(render_prompt(record))]
    return [(prompt, False), ([*tok.encode(record["output"]), tok.eos_id], True)]


def to_example(segments: list[Segment], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Segments -> (inputs, labels) of seq_len, truncated or padded. Position j predicts token
    j+1; its label is that token if it belongs to a target segment, else IGNORE_INDEX. A record
    whose targets lie past the window has no valid token at all: the loss path handles that."""
    ids = np.asarray([t for seg, _ in segments for t in seg][: seq_len + 1], dtype=np.int64)
    target = np.asarray([flag for seg, flag in segments for _ in seg][: seq_len + 1], dtype=bool)
    inputs = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    inputs[: len(ids) - 1] = ids[:-1]
    labels[: len(ids) - 1] = np.where(target[1:], ids[1:], IGNORE_INDEX)
    return inputs, labels


class SFTDataset:
    """Records tokenized on access; padding and non-target positions are IGNORE_INDEX."""

    def __init__(self, records: list[dict], tok: Tokenizer, seq_len: int) -> None:
        self.records = records
        self.tok = tok
        self.seq_len = seq_len
        chat = next((r for r in records if "messages" in r), None)
        if chat is not None:  # a chat template that cannot be split into turns fails now, not mid-run
            record_segments(chat, tok)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        try:
            segments = record_segments(self.records[i], self.tok)
        except UserError as e:  # which record: the data is read in order, so it can be found
            raise UserError(f"SFT record {i + 1} of the data: {e}") from None
        return to_example(segments, self.seq_len, self.tok.pad_id)
