"""Text from the model: greedy or nucleus (top-p) decoding of a few prompts, for samples at eval
time and for scripts/generate.py.

There is no KV cache (the model has none): every new token is one full forward over each
prompt's prefix, so n new tokens after a prompt of p cost about n forwards of length p + n/2.
That is fine for what this is for, a few prompts of tens of tokens at eval time or from the
script, and it needs nothing from the model beyond `model(tokens) -> logits`.

Under FSDP every forward is collective, so every rank of the group calls `generate` with the same
prompts; each step's chosen tokens are then broadcast from one rank, so all ranks extend the
same sequences and stop together even where their logits differ in the last bit.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from titanlite.datasets.records import prompt_tokens
from titanlite.distributed.parallelize import unwrap


class TextTokenizer(Protocol):  # titanlite.datasets.tokenizer's Tokenizer and HFTokenizer
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def max_seq_len(model: nn.Module) -> int:
    """The longest input the model takes (its args.max_seq_len: RoPE tables end there)."""
    args = getattr(unwrap(model), "args", None)
    if args is None or not hasattr(args, "max_seq_len"):
        raise ValueError("generate needs model.args.max_seq_len (the longest input the model takes)")
    return args.max_seq_len


def choose(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """The next token of each row of `logits` [n, vocab]: the argmax at temperature 0; else a
    draw from softmax(logits / temperature) restricted to the smallest set of most likely tokens
    whose mass reaches top_p (the most likely token always stays). The draw uses `generator`
    alone, on its own device, so it never touches torch's global RNG."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    probs, order = probs.sort(dim=-1, descending=True)
    if top_p < 1.0:
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        probs = probs.masked_fill(before >= top_p, 0.0)
    device = generator.device if generator is not None else probs.device
    picked = torch.multinomial(probs.to(device), 1, generator=generator).to(order.device)
    return order.gather(-1, picked).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    eos_id: int | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    group: dist.ProcessGroup | None = None,
    src: int = 0,
) -> list[list[int]]:
    """The new tokens of each prompt: up to `max_new_tokens`, ending with `eos_id` where the
    model chose it. Greedy at temperature 0, else nucleus sampling (see `choose`) with
    `generator` (None: a fresh one seeded 0 on the model's device).

    Prompts run as one batch, left-aligned and padded on the right: under causal attention the
    padding never reaches the positions whose logits are read; a finished prompt leaves the
    batch. Input never exceeds the model's max_seq_len: at most max_seq_len - 1 new tokens, and a
    prompt keeps only its last max_seq_len - (new tokens) tokens.

    With torch.distributed initialized and `group` (None: the world) of more than one rank,
    every rank of the group must call this with the same prompts (FSDP's forwards are
    collective); each step's tokens are broadcast from the group's rank `src`, so all ranks
    return the same. The model runs in eval mode; its training flag is restored after.
    """
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be >= 0 and top_p in (0, 1]; got {temperature}, {top_p}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    limit = max_seq_len(model)
    n_new = max(0, min(max_new_tokens, limit - 1))
    seqs = [list(p[-(limit - n_new) :]) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    device = next(model.parameters()).device
    if generator is None and temperature > 0:
        generator = torch.Generator(device=device).manual_seed(0)
    lockstep = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    active = list(range(len(prompts)))
    was_training = model.training
    model.eval()
    try:
        for _ in range(n_new):
            if not active:
                break
            lengths = torch.tensor([len(seqs[i]) for i in active])
            batch = torch.zeros(len(active), int(lengths.max()), dtype=torch.long)
            for row, i in enumerate(active):
                batch[row, : len(seqs[i])] = torch.tensor(seqs[i])
            logits = model(batch.to(device))
            last = logits[torch.arange(len(active), device=logits.device), lengths.to(logits.device) - 1]
            tokens = choose(last, temperature, top_p, generator)
            if lockstep:
                dist.broadcast(tokens, group=group, group_src=src)
            for i, token in zip(active, tokens.tolist(), strict=True):
                seqs[i].append(token)
                outs[i].append(token)
            active = [i for i in active if outs[i][-1] != eos_id]
    finally:
        model.train(was_training)
    return outs


def sample_text(
    model: nn.Module,
    tokenizer: TextTokenizer,
    texts: list[str],
    max_new_tokens: int,
    *,
    fmt: str = "text",
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    group: dist.ProcessGroup | None = None,
    src: int = 0,
) -> list[str]:
    """The completion of each text (without the prompt and without EOS). `fmt` puts a text to
    the model as training put prompts (titanlite.datasets.records.prompt_tokens: "text" is BOS
    and the text; "alpaca", "chat" the SFT prompt of an instruction or a user turn). The
    completion is the decoded whole minus the decoded prompt, so a token that joins onto the
    prompt's last word decodes as it would in running text. Distributed: as `generate` (every
    rank of `group` calls it with the same texts)."""
    prompts = [prompt_tokens(t, fmt, tokenizer) for t in texts]
    outs = generate(
        model,
        prompts,
        max_new_tokens,
        eos_id=tokenizer.eos_id,
        temperature=temperature,
        top_p=top_p,
        generator=generator,
        group=group,
        src=src,
    )
    completions = []
    for prompt, out in zip(prompts, outs, strict=True):
        if out and out[-1] == tokenizer.eos_id:
            out = out[:-1]
        head, whole = tokenizer.decode(prompt), tokenizer.decode(prompt + out)
        completions.append(whole[len(head) :] if whole.startswith(head) else tokenizer.decode(out))
    return completions
