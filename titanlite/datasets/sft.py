"""Supervised fine-tuning: alpaca records rendered into a prompt; only the response is a target."""

from __future__ import annotations

import numpy as np

from titanlite.components.loss import IGNORE_INDEX
from titanlite.components.tokenizer import Tokenizer

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


class SFTDataset:
    """One record per sequence: <bos> prompt response <eos>, truncated or padded to seq_len.

    Labels are IGNORE_INDEX on the prompt and the padding, so a record whose prompt fills the
    window has no valid token at all: the loss path must handle that exactly.
    """

    def __init__(self, records: list[dict], tok: Tokenizer, seq_len: int) -> None:
        self.records = records
        self.tok = tok
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        rec = self.records[i]
        prompt = [self.tok.bos_id, *self.tok.encode(render_prompt(rec))]
        response = [*self.tok.encode(rec["output"]), self.tok.eos_id]
        ids = np.asarray((prompt + response)[: self.seq_len + 1], dtype=np.int64)
        # Position j predicts ids[j+1]; it is a target only when ids[j+1] is a response token.
        targets = ids[1:].copy()
        targets[: max(0, len(prompt) - 1)] = IGNORE_INDEX
        inputs = np.full(self.seq_len, self.tok.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        inputs[: len(ids) - 1] = ids[:-1]
        labels[: len(targets)] = targets
        return inputs, labels
