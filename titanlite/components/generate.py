"""Greedy or nucleus (top-p) decoding of a few prompts as one batch (eval samples,
scripts/generate.py). A model with a KV cache (`kv_cache(lengths)`, `forward(tokens, cache=...)`)
runs the prompts once, then one position per token; one without (a fork's) re-runs each prefix,
choosing the same tokens. Under FSDP each step's tokens are broadcast from one rank, so all ranks
extend the same sequences even where their logits differ in the last bit."""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
import torch.nn as nn

from titanlite.datasets.records import prompt_tokens
from titanlite.datasets.tokenizer import HFTokenizer, Tokenizer
from titanlite.distributed.parallelize import unwrap


def choose(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """The next token of each row of `logits` [n, vocab]: the argmax at temperature 0, else a draw
    from the top-p nucleus with `generator` alone (torch's global RNG stays untouched)."""
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
    eos_id: int | Collection[int] | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    group: dist.ProcessGroup | None = None,
    src: int = 0,
) -> list[list[int]]:
    """The new tokens of each prompt: up to `max_new_tokens`, ending with a stop token (`eos_id`:
    one id or several) where the model chose one. Input never exceeds the model's max_seq_len (its
    RoPE tables end there): the prompt is cut from the left to leave room for the new tokens."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    args = getattr(unwrap(model), "args", None)
    if not hasattr(args, "max_seq_len"):
        raise ValueError(
            "generate needs model.args.max_seq_len (the longest input the model takes)"
        )
    limit = args.max_seq_len
    n_new = max(0, min(max_new_tokens, limit - 1))
    seqs = [list(p[-(limit - n_new) :]) for p in prompts]
    device = next(model.parameters()).device
    if generator is None and temperature > 0:
        generator = torch.Generator(device=device).manual_seed(0)
    lockstep = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    stop = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    cached = callable(getattr(unwrap(model), "kv_cache", None))
    was_training = model.training
    model.eval()
    # A finished prompt leaves the batch (and the cache). Prompts are left-aligned and padded on
    # the right: under causal attention the padding never reaches a real position.
    starts = [len(seq) for seq in seqs]  # where each prompt's new tokens begin
    active = list(range(len(seqs)))
    cache = None
    try:
        for _ in range(n_new):
            if cache is None:
                lengths = torch.tensor([len(seqs[i]) for i in active])
                batch = torch.zeros(len(active), int(lengths.max()), dtype=torch.long)
                for row, i in enumerate(active):
                    batch[row, : len(seqs[i])] = torch.tensor(seqs[i])
                cache = unwrap(model).kv_cache(lengths.to(device)) if cached else None
                logits = model(batch.to(device), cache=cache) if cached else model(batch.to(device))
                last = logits[torch.arange(len(active), device=device), lengths.to(device) - 1]
            else:
                tokens = torch.tensor([[seqs[i][-1]] for i in active], device=device)
                last = model(tokens, cache=cache)[:, -1]
            chosen = choose(last, temperature, top_p, generator)
            if lockstep:
                dist.broadcast(chosen, group=group, group_src=src)
            for i, token in zip(active, chosen.tolist(), strict=True):
                seqs[i].append(token)
            going = [row for row, i in enumerate(active) if seqs[i][-1] not in stop]
            if not going:
                break
            if cache is not None and len(going) < len(active):
                cache.keep(torch.tensor(going, device=device))
            active = [active[row] for row in going]
    finally:
        model.train(was_training)
    return [seq[start:] for seq, start in zip(seqs, starts, strict=True)]


def sample_text(
    model: nn.Module,
    tokenizer: Tokenizer | HFTokenizer,
    texts: list[str],
    max_new_tokens: int,
    *,
    fmt: str = "text",
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[str]:
    """The completion of each text, without the prompt and the stop token; `fmt` frames a text as
    training framed prompts (prompt_tokens). The completion is the decoded whole minus the decoded
    prompt, so a token that joins onto the prompt's last word decodes as in running text."""
    prompts = [prompt_tokens(t, fmt, tokenizer) for t in texts]
    # the ids that end a completion (a fork's tokenizer without `stop_ids`: its EOS)
    stop = getattr(tokenizer, "stop_ids", None) or frozenset({tokenizer.eos_id})
    outs = generate(
        model,
        prompts,
        max_new_tokens,
        eos_id=stop,
        temperature=temperature,
        top_p=top_p,
        generator=generator,
        group=group,
    )
    completions = []
    for prompt, out in zip(prompts, outs, strict=True):
        if out and out[-1] in stop:
            out = out[:-1]
        head, whole = tokenizer.decode(prompt), tokenizer.decode(prompt + out)
        completions.append(whole[len(head) :] if whole.startswith(head) else tokenizer.decode(out))
    return completions
