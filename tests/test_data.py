from __future__ import annotations

import json
import re

import numpy as np
import pytest

from titanlite.config import parse_args
from titanlite.config.layout import resolve_layout
from titanlite.datasets.build import build_dataloader, build_dataset, build_tokenizer
from titanlite.errors import UserError
from titanlite.ops.cross_entropy import IGNORE_INDEX


def _cfg(*args):
    return parse_args(
        [
            "--training.seq_len",
            "64",
            "--training.global_batch_size",
            "4",
            "--training.local_batch_size",
            "2",
            *args,
        ]
    )[0]


def test_builtin_tokenizer_is_deterministic_and_cached(tmp_path):
    from titanlite.datasets.tokenizer import train_builtin_tokenizer

    tok = build_tokenizer(_cfg())
    assert tok.vocab_size == 2048
    text = "def f(x):\n    return {'a': x ** 2}  # ünïcode\n"
    assert tok.decode(tok.encode(text)) == text
    again = tmp_path / "again.model"
    train_builtin_tokenizer(again, 2048)
    assert again.read_bytes() == tok.sp.serialized_model_proto()


def test_builtin_sft_labels_mask_prompt_and_padding_and_counts_vary():
    cfg = _cfg("--data.mode", "sft", "--training.seq_len", "256")
    ds = build_dataset(cfg, build_tokenizer(cfg))
    assert len(ds) > 1000
    counts = []
    for i in range(0, 400, 4):
        x, y = ds[i]
        assert x.shape == y.shape == (256,)
        valid = y != IGNORE_INDEX
        counts.append(int(valid.sum()))
        idx = np.flatnonzero(valid)
        if len(idx):  # one contiguous response span; its targets are the next input tokens
            assert (np.diff(idx) == 1).all()
            assert (y[idx[:-1]] == x[idx[:-1] + 1]).all()
    assert min(counts) == 0 and max(counts) >= 30  # some prompts fill the window, some do not


def test_pretrain_packing_and_loader_state(tmp_path):
    cfg = _cfg()
    ds = build_dataset(cfg, build_tokenizer(cfg))
    x, y = ds[5]
    assert (x[1:] == y[:-1]).all() and (y != IGNORE_INDEX).all()
    loader = build_dataloader(cfg, ds, resolve_layout(cfg, 1), 0, pin_memory=False)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    want = [next(it)[0] for _ in range(3)]
    loader2 = build_dataloader(cfg, ds, resolve_layout(cfg, 1), 0, pin_memory=False)
    loader2.load_state_dict(state)
    it2 = iter(loader2)
    got = [next(it2)[0] for _ in range(3)]
    assert all((a == b).all() for a, b in zip(want, got, strict=True))


def test_synthetic_data_covers_the_vocabulary_and_depends_on_the_index_alone():
    """Random tokens at a vocabulary no tokenizer gives (a benchmark of Llama 3's 128,256): the
    same sequence for the same index on any rank and any run, different for another index or seed."""
    cfg, _ = parse_args(
        ["--data.mode", "synthetic", "--model.vocab_size", "128256", "--training.seq_len", "4096"]
    )
    assert build_tokenizer(cfg) is None
    ds = build_dataset(cfg, None, 128256)
    x, y = ds[7]
    assert x.shape == (4096,) and (x[1:] == y[:-1]).all() and (y != IGNORE_INDEX).all()
    assert x.min() >= 0 and x.max() < 128256 and len(np.unique(x)) > 4000 and x.max() > 120000
    assert (build_dataset(cfg, None, 128256)[7][0] == x).all()
    assert not (ds[8][0] == x).all()
    cfg.training.seed += 1
    assert not (build_dataset(cfg, None, 128256)[7][0] == x).all()
    cfg.training.local_batch_size = 2
    batch = next(iter(build_dataloader(cfg, ds, resolve_layout(cfg, 2), 1, pin_memory=False)))
    assert batch[0].shape == (2, 4096)


def test_user_files(tmp_path):
    good = tmp_path / "sft.jsonl"
    good.write_text(
        json.dumps({"instruction": "Say hi", "input": "", "output": "hi"})
        + "\n"
        + json.dumps({"instruction": "Add", "input": "1+1", "output": "2"})
        + "\n"
    )
    cfg = _cfg(
        "--data.mode",
        "sft",
        "--data.path",
        str(good),
        "--training.global_batch_size",
        "2",
        "--training.local_batch_size",
        "1",
    )
    ds = build_dataset(cfg, build_tokenizer(cfg))
    assert len(ds) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x", "output": "y"}\n{oops\n')
    cfg.data.path = str(bad)
    with pytest.raises(UserError, match="line 2 is not valid JSON"):
        build_dataset(cfg, build_tokenizer(cfg))
    bad.write_text('{"instruction": "x"}\n')
    with pytest.raises(UserError, match='line 1 has no string field "output"'):
        build_dataset(cfg, build_tokenizer(cfg))
    txt = tmp_path / "corpus"
    txt.mkdir()
    (txt / "a.txt").write_text("hello world " * 200)
    cfg2 = _cfg("--data.path", str(txt))
    assert len(build_dataset(cfg2, build_tokenizer(cfg2))) > 4


def test_user_tokenizer_file(tmp_path):
    builtin = build_tokenizer(_cfg())
    mine = tmp_path / "mine.model"
    mine.write_bytes(builtin.sp.serialized_model_proto())
    cfg = _cfg("--model.tokenizer_path", str(mine))
    tok = build_tokenizer(cfg)
    assert tok.vocab_size == 2048 and tok.encode("x = 1") == builtin.encode("x = 1")
    bad = tmp_path / "bad.model"
    bad.write_text("not a model")
    with pytest.raises(UserError, match="is not a SentencePiece model"):
        build_tokenizer(_cfg("--model.tokenizer_path", str(bad)))


def test_chat_records_default_format_and_bad_records(tmp_path):
    """Without a chat template (the built-in SentencePiece tokenizer): the documented default,
    with each assistant turn and its EOS as the only targets."""
    from titanlite.datasets.records import default_segments

    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "11"},
    ]
    data = tmp_path / "chat.jsonl"
    alpaca = {"instruction": "Say hi", "input": "", "output": "hi"}
    data.write_text(json.dumps({"messages": conversation}) + "\n" + json.dumps(alpaca) + "\n")
    cfg = _cfg("--data.mode", "sft", "--data.path", str(data), "--training.seq_len", "128")
    tok = build_tokenizer(cfg)
    ds = build_dataset(cfg, tok)
    x, y = ds[0]
    prompt = ["### System:\nBe brief.", "\n\n### User:\nName a prime.", "\n\n### Assistant:\n"]
    assert default_segments(conversation, tok)[:5] == [
        ([tok.bos_id], False),
        *((tok.encode(p), False) for p in prompt),
        ([*tok.encode("7"), tok.eos_id], True),
    ]
    targets = y[y != IGNORE_INDEX].tolist()
    assert targets == [*tok.encode("7"), tok.eos_id, *tok.encode("11"), tok.eos_id]
    assert x[0] == tok.bos_id and (x == tok.bos_id).sum() == 1
    assert tok.decode(ds[1][1][ds[1][1] != IGNORE_INDEX].tolist()[:-1]) == "hi"  # alpaca beside it
    for line, needle in (
        ({"messages": []}, 'has "messages" that is not a non-empty list'),
        ({"messages": [{"role": "user"}]}, 'message 0 is not {"role": str, "content": str}'),
        (
            {"text": "x"},
            'no string field "instruction"; records need "messages" (chat) or instruction',
        ),
    ):
        data.write_text(json.dumps(line) + "\n")
        with pytest.raises(UserError, match=re.escape(needle)):
            build_dataset(cfg, tok)
