"""SFT records: what one is, and its tokens with the target mask (torch-free: data preparation
runs it in worker processes).

Records are alpaca (`instruction`, optional `input`, `output`: rendered into the alpaca prompt,
`<bos> prompt response <eos>`, the response and <eos> are targets) or chat (`messages`: see
titanlite.datasets.chat, only the assistant turns are targets).
"""

from __future__ import annotations

import hashlib
from typing import Any

from titanlite.datasets.chat import Segment, chat_segments, check_messages
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
SFT_COLUMNS = ("messages", "instruction", "input", "output")  # what a parquet/arrow SFT reader keeps


def render_prompt(record: dict) -> str:
    template = PROMPT_WITH_INPUT if record.get("input") else PROMPT_NO_INPUT
    return template.format(instruction=record["instruction"], input=record.get("input", ""))


def sft_record(rec: Any, where: str) -> dict:
    """A checked SFT record: chat ({"messages": [...]}) or alpaca (instruction, input, output)."""
    if not isinstance(rec, dict):
        raise UserError(f"{where} is not a JSON object; each SFT record must be {{...}}")
    if rec.get("messages") is not None:
        return {"messages": check_messages(rec["messages"], where)}
    for key in ("instruction", "output"):
        if not isinstance(rec.get(key), str):
            raise UserError(
                f'{where} has no string field "{key}"; records need "messages" (chat) or '
                "instruction, input (optional) and output (alpaca)"
            )
    return {"instruction": rec["instruction"], "input": str(rec.get("input") or ""), "output": rec["output"]}


def record_segments(record: dict, tok: Any) -> list[Segment]:
    if "messages" in record:
        return chat_segments(record["messages"], tok)
    prompt = [tok.bos_id, *tok.encode(render_prompt(record))]
    return [(prompt, False), ([*tok.encode(record["output"]), tok.eos_id], True)]


def record_tokens(record: dict, tok: Any) -> tuple[list[int], list[bool]]:
    """The whole record's token ids and, per token, whether it is a target."""
    segments = record_segments(record, tok)
    return [t for ids, _ in segments for t in ids], [flag for ids, flag in segments for _ in ids]


def prompt_format(fmt: str, data_mode: str, tok: Any) -> str:
    """eval.prompt_format (and scripts/generate.py --format) resolved: "auto" is how the run's
    data put prompts: SFT: chat with a chat template, else alpaca; pretraining: text."""
    if fmt != "auto":
        return fmt
    if data_mode != "sft":
        return "text"
    return "chat" if getattr(tok, "chat_template", None) else "alpaca"


def prompt_tokens(text: str, fmt: str, tok: Any) -> list[int]:
    """A prompt to decode from, as training saw prompts: "text": BOS and the text; "alpaca":
    the alpaca prompt of an instruction; "chat": a user turn and the assistant header (the chat
    template's, else the default format's). The prompt is everything before the first target."""
    if fmt == "text":
        return [tok.bos_id, *tok.encode(text)]
    if fmt == "alpaca":
        record = {"instruction": text, "input": "", "output": ""}
    else:
        record = {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]}
    ids = []
    for segment, target in record_segments(record, tok):
        if target:
            break
        ids += segment
    return ids


def sft_format_key(tok: Any) -> str:
    """What besides the tokenizer decides an SFT record's tokens: the chat template (or the
    default format) and the alpaca prompts."""
    parts = (tok.chat_template or "<default chat format v1>", PROMPT_WITH_INPUT, PROMPT_NO_INPUT)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
