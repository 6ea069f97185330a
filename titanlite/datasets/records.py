"""SFT records and their tokens with the target mask (torch-free: preparation workers run it).

Records are alpaca (`instruction`, optional `input`, `output`; the response and <eos> are
targets) or chat (`{"messages": [{"role", "content"}, ...]}`; the assistant turns are targets).
With a chat template the text is exactly what transformers' `apply_chat_template` renders, and
assistant turn i is what the conversation up to it adds to the one before it with the generation
prompt: a model trained on it generates from exactly the prompt it sees at inference.
`strftime_now` gives a fixed date (Llama 3's fallback): a record renders the same every day.

Without a template the default format is
    <bos>### System:\\n{content}\\n\\n### User:\\n{content}\\n\\n### Assistant:\\n{content}<eos>...
where each assistant content and its <eos> are the targets, and turns are separated by a blank line.
"""

from __future__ import annotations

import functools
import hashlib
import json
from datetime import datetime
from typing import Any

from titanlite.errors import UserError

Segment = tuple[list[int], bool]  # token ids, whether they are targets
FIXED_DATE = datetime(2024, 7, 26)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson filter: plain json.dumps (Jinja's own escapes HTML characters)."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=4)
def compile_template(source: str):
    """The template in a sandbox set up as transformers sets it up."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = FIXED_DATE.strftime
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise UserError(
            f"the tokenizer's chat template does not parse ({e}); fix or remove it"
        ) from None


def render(
    template: str, messages: list[dict], add_generation_prompt: bool, specials: dict[str, str]
) -> str:
    import jinja2

    try:
        variables = {"tools": None, "documents": None, **specials}
        return compile_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except (jinja2.exceptions.TemplateError, TypeError, ValueError) as e:
        raise UserError(
            f"the chat template fails on a record ({e}); fix the record or the template"
        ) from None


def template_pieces(
    template: str, messages: list[dict], specials: dict[str, str]
) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_target) pieces that concatenate to it."""
    full = render(template, messages, False, specials)
    pieces, done = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(template, messages[:i], True, specials)
        upto = render(template, messages[: i + 1], False, specials)
        if not (full.startswith(upto) and upto.startswith(prompt) and len(prompt) >= done):
            raise UserError(
                "the chat template does not render a conversation as a prefix of its continuation, "
                "so assistant turns cannot be told apart; use a template that does (Llama 3's does)"
            )
        pieces += [(full[done : len(prompt)], False), (full[len(prompt) : len(upto)], True)]
        done = len(upto)
    pieces.append((full[done:], False))
    return [(text, target) for text, target in pieces if text]


def chat_segments(messages: list[dict], tok: Any) -> list[Segment]:
    """Token segments of one conversation for tokenizer `tok` (its chat_template, if any)."""
    template = tok.chat_template
    if template is None:
        return default_segments(messages, tok)
    pieces = template_pieces(template, messages, tok.special_tokens)
    segments = [(tok.encode(text), target) for text, target in pieces]
    first = next((ids for ids, _ in segments if ids), [])
    if first[:1] != [tok.bos_id]:
        segments.insert(0, ([tok.bos_id], False))
    return segments


def default_segments(messages: list[dict], tok: Any) -> list[Segment]:
    """The documented default format (module docstring)."""
    segments: list[Segment] = [([tok.bos_id], False)]
    for i, message in enumerate(messages):
        header = ("\n\n" if i else "") + f"### {message['role'].capitalize()}:\n"
        if message["role"] == "assistant":
            answer = [*tok.encode(message["content"]), tok.eos_id]
            segments += [(tok.encode(header), False), (answer, True)]
        else:
            segments.append((tok.encode(header + message["content"]), False))
    return segments


def check_messages(messages: Any, where: str) -> list[dict]:
    """A chat record's messages: a non-empty list of {"role": str, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise UserError(
            f'{where} has "messages" that is not a non-empty list; chat records need one'
        )
    for j, m in enumerate(messages):
        ok = isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))
        if not ok:
            raise UserError(
                f'{where} message {j} is not {{"role": str, "content": str}}; fix that message'
            )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
SFT_COLUMNS = ("messages", "instruction", "input", "output")  # what an arrow SFT reader keeps


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
    given = str(rec.get("input") or "")
    return {"instruction": rec["instruction"], "input": given, "output": rec["output"]}


def record_segments(record: dict, tok: Any) -> list[Segment]:
    if "messages" in record:
        return chat_segments(record["messages"], tok)
    template = PROMPT_WITH_INPUT if record.get("input") else PROMPT_NO_INPUT
    text = template.format(instruction=record["instruction"], input=record.get("input", ""))
    prompt = [tok.bos_id, *tok.encode(text)]
    return [(prompt, False), ([*tok.encode(record["output"]), tok.eos_id], True)]


def record_tokens(record: dict, tok: Any) -> tuple[list[int], list[bool]]:
    """The whole record's token ids and, per token, whether it is a target."""
    segments = record_segments(record, tok)
    return [t for ids, _ in segments for t in ids], [flag for ids, flag in segments for _ in ids]


def prompt_format(fmt: str, data_mode: str, tok: Any) -> str:
    """eval.prompt_format (scripts/generate.py --format) resolved: "auto" is how the run's data
    put prompts: SFT: chat with a chat template, else alpaca; pretraining: text."""
    if fmt != "auto":
        return fmt
    if data_mode != "sft":
        return "text"
    return "chat" if getattr(tok, "chat_template", None) else "alpaca"


def prompt_tokens(text: str, fmt: str, tok: Any) -> list[int]:
    """A prompt to decode from, as training saw prompts ("text": BOS and the text; "alpaca", "chat":
    everything before the first target of a record holding it)."""
    if fmt == "text":
        return [tok.bos_id, *tok.encode(text)]
    if fmt == "alpaca":
        record = {"instruction": text, "input": "", "output": ""}
    else:
        turns = [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
        record = {"messages": turns}
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
