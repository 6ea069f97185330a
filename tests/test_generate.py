"""titanlite.components.generate on a tiny random Llama that transformers' LlamaForCausalLM shares
weights with (tests/test_hf.py makes both): greedy decoding with the KV cache equals the
cache-free path (a model without `kv_cache`), `generate(do_sample=False)` and a plain argmax
loop, and stops at EOS or any of several stop ids; sampling draws from its own generator only;
the input never exceeds max_seq_len; the broadcast choice wins on every rank, on both paths. scripts/generate.py on
a trained run folder is in tests/test_hf.py, next to the run it reads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import load_script
from test_hf import hf_folder, load_titanlite

from titanlite.components.generate import generate

PROMPTS = [[1, 17, 5], [1, 40, 2, 33, 90, 61, 8]]  # two lengths: the batch is padded on the right
NEW = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """titanlite's model (max_seq_len 32) and transformers' on the same random weights."""
    path = tmp_path_factory.mktemp("generate")
    hf = hf_folder(path, tied=False).eval()
    return load_titanlite(path).eval(), hf


# The model as a fork's without a KV cache: generate takes the cache-free path.
NoCache = load_script("bench_generate").CacheFree


def argmax_loop(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def test_greedy_equals_transformers_and_an_argmax_loop_and_stops_at_eos(models):
    ours, hf = models
    out = generate(ours, PROMPTS, NEW, eos_id=None)
    assert out == generate(NoCache(ours), PROMPTS, NEW, eos_id=None)
    for prompt, new in zip(PROMPTS, out, strict=True):
        theirs = hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=NEW,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert new == theirs == argmax_loop(ours, prompt, NEW), (prompt, new, theirs)
    # an EOS id the first prompt reaches at its 4th new token (and the second, if at all, elsewhere)
    eos = out[0][3]
    first = out[0].index(eos)
    stopped = generate(ours, PROMPTS, NEW, eos_id=eos)
    assert stopped[0] == out[0][: first + 1]
    assert stopped[1] == (out[1][: out[1].index(eos) + 1] if eos in out[1] else out[1])
    assert generate(NoCache(ours), PROMPTS, NEW, eos_id=eos) == stopped
    # several stop ids (generation_config.json's list, a chat's end of turn): the first reached stops
    late, early = out[1][5], out[1][2]
    for model in (ours, NoCache(ours)):
        both = generate(model, PROMPTS, NEW, eos_id=[late, early])
        assert both[1] == out[1][: min(out[1].index(early), out[1].index(late)) + 1]
    assert ours.training is False
    ours.train()
    generate(ours, PROMPTS[:1], 2, eos_id=None)
    assert ours.training is True  # the flag is restored
    ours.eval()


def test_kv_cache_logits_equal_full_forwards(models):
    """Two prompts of different lengths, right-padded, then one token per row at a time, one row
    leaving midway: every real position's logits equal a full forward of its own sequence, so
    the cache's columns, each row's RoPE positions and the masks are right, not only the argmax."""
    ours, _ = models
    a = [1, 40, 2, 33, 90, 61, 8, 3, 9, 27, 81, 4]
    b = [5, 17, 70, 11, 2, 64, 30, 12, 9, 1]
    with torch.no_grad():
        cache = ours.kv_cache(torch.tensor([5, 3]))
        first = ours(torch.tensor([a[:5], [*b[:3], 0, 0]]), cache=cache)
        got_a, got_b = [first[0, :5]], [first[1, :3]]
        for k in range(7):  # a: positions 5..7, then it leaves; b: positions 3..9
            if k == 3:
                cache.keep(torch.tensor([1]))
            rows = [[b[3 + k]]] if k >= 3 else [[a[5 + k]], [b[3 + k]]]
            out = ours(torch.tensor(rows), cache=cache)
            got_b.append(out[-1])
            if k < 3:
                got_a.append(out[0])
        want_a, want_b = ours(torch.tensor([a[:8]]))[0], ours(torch.tensor([b]))[0]
    torch.testing.assert_close(torch.cat(got_a), want_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat(got_b), want_b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one token per row"):
        ours(torch.tensor([[1, 2]]), cache=cache)


def test_sampling_uses_its_own_generator_only(models):
    ours, _ = models
    state = torch.get_rng_state()

    def sample(seed: int, top_p: float = 0.9) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return generate(ours, PROMPTS, NEW, eos_id=None, temperature=1.5, top_p=top_p, generator=g)

    a = sample(1)
    assert a == sample(1) and a != sample(2)
    assert a != generate(ours, PROMPTS, NEW, eos_id=None)  # it does sample
    assert sample(3, top_p=1e-6) == generate(
        ours, PROMPTS, NEW, eos_id=None
    )  # only the top token is left
    assert torch.equal(torch.get_rng_state(), state)


def test_input_never_exceeds_max_seq_len(models):
    ours, _ = models
    assert ours.args.max_seq_len == 32
    long = [(7 * i) % 96 for i in range(40)]
    assert generate(ours, [long], 5, eos_id=None) == generate(ours, [long[-27:]], 5, eos_id=None)
    assert (
        len(generate(ours, [long], 100, eos_id=None)[0]) == 31
    )  # the last one fills the 32 positions
    with pytest.raises(ValueError, match="at least one token"):
        generate(ours, [[]], 5, eos_id=None)


@pytest.mark.parametrize("cached", [True, False])
def test_every_rank_takes_the_broadcast_choice(models, monkeypatch, cached):
    """Stands in for a 2-rank group: the broadcast hands this rank other tokens than its own
    logits chose (as a last-bit difference would); the sequences follow the broadcast ones."""
    ours, _ = models
    calls = []

    def broadcast(tensor, group=None, group_src=None):
        calls.append((group, group_src, tensor.shape[0]))
        tensor.copy_((tensor + 1) % 96)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "broadcast", broadcast)
    group = object()
    out = generate(ours if cached else NoCache(ours), PROMPTS, 4, eos_id=None, group=group, src=1)
    assert calls == [(group, 1, 2)] * 4  # one broadcast of the batch's tokens per step
    for prompt, new in zip(PROMPTS, out, strict=True):
        seq = list(prompt)
        for (
            token
        ) in new:  # each token is the broadcast one, computed after the broadcast tokens before it
            with torch.no_grad():
                assert token == (int(ours(torch.tensor([seq]))[0, -1].argmax()) + 1) % 96
            seq.append(token)


def test_bench_generate_times_both_paths_and_checks_their_tokens(capsys):
    assert (
        load_script("bench_generate").main(["--prompt-len", "8", "--new", "4", "--rounds", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "KV cache" in out and "cache-free" in out and "tokens equal" in out
