"""Llama 3 <-> transformers' LlamaForCausalLM (titanlite/models/llama3/hf.py): a tiny random HF
model saved with save_pretrained (tied and untied, Llama 3 rope scaling, an intermediate size no
multiple_of rule gives) loads into titanlite's Llama with the same logits and the same gradient.
transformers is a test-only dependency (the dev extra)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from titanlite.errors import UserError
from titanlite.models.llama3 import Llama3
from titanlite.models.llama3.hf import LLAMA3_HF

TOL = 1e-5


def hf_folder(path, tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,  # the seq below reaches past it
        },
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return model


def load_titanlite(path) -> tuple[Llama3, dict]:
    args = LLAMA3_HF.args_from_config(json.loads((path / "config.json").read_text()))
    model = Llama3(dataclasses.replace(args, max_seq_len=32))
    state = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        mapped = LLAMA3_HF.from_hf(name, tensor, model.args)
        if mapped is not None:
            state[mapped[0]] = mapped[1]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert unexpected == [] and missing == (["output.weight"] if args.tie_embeddings else [])
    return model, state


@pytest.mark.parametrize("tied", [True, False])
def test_hf_llama_gives_the_same_logits_and_gradient(tmp_path, tied):
    hf = hf_folder(tmp_path, tied)
    ours, state = load_titanlite(tmp_path)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, dims=1)
    mine, theirs = ours(tokens), hf(tokens).logits
    assert ((mine - theirs).abs().max() / theirs.abs().max()).item() <= TOL
    for logits in (mine, theirs):
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        hf_name, grad = LLAMA3_HF.to_hf(name, p.grad, ours.args)
        want = hf_grads[hf_name].grad
        assert ((grad - want).norm() / want.norm()).item() <= TOL, name
    # and back: titanlite's tensors in HF's names are the files' tensors, bitwise
    files = load_file(tmp_path / "model.safetensors")
    for name, tensor in state.items():
        hf_name, back = LLAMA3_HF.to_hf(name, tensor, ours.args)
        assert torch.equal(back, files[hf_name]), name


def test_config_round_trips_and_unsupported_configs_are_one_line(tmp_path):
    hf_folder(tmp_path, tied=True)
    config = json.loads((tmp_path / "config.json").read_text())
    args = LLAMA3_HF.args_from_config(config)
    assert (args.hidden_dim, args.n_kv_heads, args.rope_scaling_factor, args.tie_embeddings) == (
        80,
        2,
        8.0,
        True,
    )
    assert LLAMA3_HF.args_from_config(LLAMA3_HF.config_from_args(args)) == args
    assert LlamaConfig(**LLAMA3_HF.config_from_args(args)).rope_parameters["rope_type"] == "llama3"
    for change, needle in (
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
        ({"head_dim": 16}, "head_dim = 16"),
    ):
        with pytest.raises(UserError, match=needle):
            LLAMA3_HF.args_from_config({**config, **change})
    del config["intermediate_size"]
    with pytest.raises(UserError, match="config.json has no 'intermediate_size'"):
        LLAMA3_HF.args_from_config(config)
    with pytest.raises(UserError, match="'model.extra.weight'"):
        LLAMA3_HF.from_hf("model.extra.weight", torch.zeros(1), args)
