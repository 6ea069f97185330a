"""Hugging Face models in titanlite: a tiny random LlamaForCausalLM saved with save_pretrained
(tied and untied, Llama 3 rope scaling, an intermediate size no multiple_of rule gives) and a
BPE tokenizer.json trained here with `tokenizers`, all made in the test (no network).

- titanlite/models/llama3/hf.py alone: same logits and gradient as transformers, exact round trip;
- through the trainer (model.hf_assets_path; tests/workers/hf_load.py, one torchrun per world
  size 1 and 2, FSDP and DDP): same logits, same gradient of one exact-loss step, training goes on;
- the tokenizer gives AutoTokenizer's ids; bad folders are one-line errors.
transformers is a test-only dependency (the dev extra)."""

from __future__ import annotations

import dataclasses
import json
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import check, read_metrics, torchrun
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from titanlite.errors import UserError
from titanlite.models.llama3 import Llama3
from titanlite.models.llama3.hf import LLAMA3_HF

TOL = 1e-5


def hf_folder(path, tied: bool, vocab: int = 96) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
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


def load_titanlite(path) -> Llama3:
    """The folder into titanlite's Llama through load_hf_weights, which refuses a missing or an
    unexpected tensor."""
    from titanlite.components.hf_checkpoint import load_hf_weights

    args = LLAMA3_HF.args_from_config(json.loads((path / "config.json").read_text()))
    model = Llama3(dataclasses.replace(args, max_seq_len=32))
    load_hf_weights(model, path, LLAMA3_HF, model.args)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_hf_llama_gives_the_same_logits_and_gradient(tmp_path, tied):
    hf = hf_folder(tmp_path, tied)
    ours = load_titanlite(tmp_path)
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
    for name, tensor in ours.named_parameters():
        hf_name, back = LLAMA3_HF.to_hf(name, tensor.detach(), ours.args)
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


def hf_tokenizer(path: Path) -> None:
    """A byte-level BPE (Llama 3's kind) trained on a few stdlib files, saved as transformers does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20]
    tok.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1])
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf_assets")
    for name in ("tied", "untied"):
        hf_folder(root / name, tied=name == "tied", vocab=320)
        hf_tokenizer(root / name)
    return root


@pytest.fixture(scope="module")
def loaded(assets, tmp_path_factory) -> dict[int, list[dict]]:
    out = {}
    for world in (1, 2):
        tmp = tmp_path_factory.mktemp(f"hf_load{world}")
        check(torchrun(world, "tests/workers/hf_load.py", str(tmp / "out.json"), str(assets), str(tmp)))
        out[world] = json.loads((tmp / "out.json").read_text())
    return out


@pytest.mark.parametrize("world", (1, 2))
def test_trainer_loads_hf_weights_with_the_same_logits_and_gradient(loaded, world):
    cases = loaded[world]
    assert {(c["name"], c["mode"]) for c in cases} == {
        (n, m) for n in ("tied", "untied") for m in ("fsdp", "ddp")
    }
    for c in cases:
        assert c["tied"] == (c["name"] == "tied")
        assert c["logits_err"] <= TOL and c["grad_err"] <= TOL, c
        losses = [r["loss"] for r in read_metrics(Path(c["run"]))]
        assert len(losses) == 2 and all(0 < v < 10 for v in losses), (c, losses)


def test_tokenizer_json_gives_autotokenizers_ids_and_the_folders_specials(assets):
    from transformers import AutoTokenizer

    from titanlite.components.tokenizer import load_tokenizer

    ours, theirs = load_tokenizer(str(assets / "tied")), AutoTokenizer.from_pretrained(assets / "tied")
    text = Path(sysconfig.get_paths()["stdlib"], "json", "decoder.py").read_text()[:3000] + " héllo 数字 123"
    assert ours.encode(text) == theirs(text, add_special_tokens=False).input_ids
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.eos_token_id,
    )
    assert ours.decode(ours.encode(text)) == text and ours.vocab_size == len(theirs) == 300


def test_bad_hf_folders_are_one_line_errors(assets, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from titanlite import preflight
    from titanlite.components.hf_checkpoint import load_hf_weights
    from titanlite.models.registry import get_model_spec, hf_args

    spec = get_model_spec("llama3")

    def copy(name: str) -> Path:
        return Path(shutil.copytree(assets / "untied", tmp_path / name))

    no_tok = copy("no-tokenizer")
    (no_tok / "tokenizer.json").unlink()
    assert preflight.main(["--world-size", "1", "--model.hf_assets_path", str(no_tok)]) == 2
    other = copy("other-arch")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UserError, match="holds a GPT2LMHeadModel but model 'llama3' reads LlamaForCausalLM"):
        hf_args(spec, other, 300)
    with pytest.raises(UserError, match="the tokenizer's ids reach 399 but config.json's vocab_size is 320"):
        hf_args(spec, assets / "untied", 400)
    args = dataclasses.replace(hf_args(spec, assets / "untied", 300), max_seq_len=32)
    weights = load_file(assets / "untied" / "model.safetensors")
    for name, broken, needle in (
        (
            "missing",
            {k: v for k, v in weights.items() if k != "model.norm.weight"},
            "lacks weights for norm.weight",
        ),
        (
            "shape",
            {**weights, "model.norm.weight": torch.ones(7)},
            "'model.norm.weight' in .* has shape \\(7,\\)",
        ),
        ("extra", {**weights, "model.layers.9.mlp.up_proj.weight": torch.ones(2, 2)}, "no parameter for"),
    ):
        folder = copy(name)
        save_file(broken, folder / "model.safetensors")
        with pytest.raises(UserError, match=needle):
            load_hf_weights(Llama3(args), folder, LLAMA3_HF, args)
