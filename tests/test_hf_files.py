"""A Hugging Face folder's configs, read whole (titanlite.models.hf_files): real folders' configs
load (SmolLM2-135M, Llama 3.2 1B, Llama 3.1 8B, Qwen3-30B-A3B as their config.json,
generation_config.json and tokenizer_config.json hold them, and every key transformers writes
for a LlamaConfig or its tokenizer); a key titanlite does not know, one that would make it train
another model than transformers, two that disagree, or a size that is not whole, is refused in
one line. Every key a family declares (titanlite.models.hf_keys) is tried with each kind of bad
value, and every relation broken, each one line naming the file, the key and the bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titanlite.errors import UserError
from titanlite.models.hf_files import (
    COMMON_KEYS,
    read_config,
    read_generation_config,
    read_tokenizer_config,
)
from titanlite.models.hf_keys import REQUIRED, ROPE, Key
from titanlite.models.llama3.hf import LLAMA3_HF, args_from_config
from titanlite.models.qwen3_moe.hf import QWEN3_MOE_HF

ROPE_31 = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}  # fmt: skip
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": ROPE_31, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip
CONFIGS = {
    "Llama-3.1-8B": LLAMA,
    "Llama-3.2-1B": {**LLAMA, "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "rope_scaling": {**ROPE_31, "factor": 32.0}, "tie_word_embeddings": True},
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
        "eos_token_id": 0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
        "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.48.0", "use_cache": True,
        "vocab_size": 49152,
    },
}  # fmt: skip
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
GENERATION = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009], "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.42.3"}  # fmt: skip
TOKENIZERS = {
    "Llama-3.1-8B": {"added_tokens_decoder": {}, "bos_token": "<|begin_of_text|>", "chat_template": "{{ x }}",
                     "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>", "model_input_names": ["input_ids", "attention_mask"],
                     "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"},
    "SmolLM2-135M": {"add_prefix_space": False, "added_tokens_decoder": {}, "additional_special_tokens": ["<|im_start|>"],
                     "bos_token": "<|im_start|>", "chat_template": "{{ x }}", "clean_up_tokenization_spaces": False,
                     "eos_token": "<|im_end|>", "model_max_length": 8192, "pad_token": "<|im_end|>",
                     "tokenizer_class": "GPT2Tokenizer", "unk_token": "<|endoftext|>", "vocab_size": 49152},
}  # fmt: skip


def _folder(tmp: Path, **files: dict) -> Path:
    for name, data in files.items():
        (tmp / f"{name}.json").write_text(json.dumps(data))
    return tmp


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_real_folders_configs_are_read_whole(name, tmp_path):
    folder = _folder(
        tmp_path,
        config=CONFIGS[name],
        generation_config=GENERATION,
        tokenizer_config=TOKENIZERS.get(name, {}),
    )
    args = args_from_config(read_config(folder, LLAMA3_HF.reads, LLAMA3_HF.keys))
    assert args.dim == CONFIGS[name]["hidden_size"]
    read_generation_config(folder)
    read_tokenizer_config(folder)


def test_what_transformers_writes_is_read_whole(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=256,
        rope_parameters={**ROPE_31, "rope_theta": 500000.0, "original_max_position_embeddings": 128},
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    generation = transformers.GenerationConfig(eos_token_id=[1, 2], do_sample=True, temperature=0.7)
    generation.save_pretrained(tmp_path)
    read_config(tmp_path, LLAMA3_HF.reads, LLAMA3_HF.keys)
    read_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(generation.to_dict()))  # every key
    read_generation_config(tmp_path)
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "<s>": 2, "</s>": 3}, merges=[]))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.save_pretrained(tmp_path)
    read_tokenizer_config(tmp_path)
    # every key of its configs, defaults included (save_pretrained leaves those out)
    common = {**transformers.PretrainedConfig().to_dict(), **config.to_dict()}
    (tmp_path / "config.json").write_text(json.dumps(common))
    read_config(tmp_path, LLAMA3_HF.reads, LLAMA3_HF.keys)


@pytest.mark.parametrize(
    "change, says",
    [
        ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
        ({"sliding_window": 64}, "sliding_window = 64"),
        ({"layer_types": ["sliding_attention"] * 32}, "layer_types"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantized"),
        ({"partial_rotary_factor": 0.5}, "key 'partial_rotary_factor' is one titanlite neither uses nor knows"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rope_theta = 500000.0 and rope_parameters.rope_theta = 10000.0"),
        ({"rope_theta": 10000.0, "rope_scaling": None, "rope_parameters": {**ROPE_31, "rope_theta": 10000.0}}, None),
        ({"dtype": "float32"}, 'torch_dtype = "bfloat16" and dtype = "float32"'),
        ({"hidden_size": 64.5}, "hidden_size = 64.5; it must be a whole number >= 1"),
        ({"num_hidden_layers": True}, "num_hidden_layers = true"),
    ],
)  # fmt: skip
def test_a_config_key_that_would_train_another_model_is_refused_in_one_line(change, says, tmp_path):
    folder = _folder(tmp_path, config={**LLAMA, **change})
    if says is None:  # the same thing said twice, alike: fine
        read_config(folder, LLAMA3_HF.reads, LLAMA3_HF.keys)
        return
    with pytest.raises(UserError) as e:
        read_config(folder, LLAMA3_HF.reads, LLAMA3_HF.keys)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_rope_scaling_and_rope_parameters_that_disagree_are_refused(tmp_path):
    """transformers merges them (llama3 scaling with the parameters' theta); titanlite took one."""
    config = {
        **LLAMA,
        "rope_theta": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    with pytest.raises(
        UserError, match="rope_scaling = .* and rope_parameters = .*; they say the same thing"
    ):
        read_config(_folder(tmp_path, config=config), LLAMA3_HF.reads, LLAMA3_HF.keys)


@pytest.mark.parametrize(
    "name, data, says",
    [
        ("tokenizer_config", {"add_prefix_space": True}, "add_prefix_space = True"),
        ("tokenizer_config", {"do_lower_case": True}, "do_lower_case"),
        ("tokenizer_config", {"a_new_option": 1}, "key 'a_new_option'"),
        ("generation_config", {"a_new_option": {}}, "key 'a_new_option'"),
        ("tokenizer_config", [1, 2], "a JSON list, not an object"),
    ],
)
def test_tokenizer_and_generation_configs_are_read_whole(name, data, says, tmp_path):
    (tmp_path / f"{name}.json").write_text(json.dumps(data))
    reader = read_tokenizer_config if name == "tokenizer_config" else read_generation_config
    with pytest.raises(UserError, match=says):
        reader(tmp_path)


# ---- every declared key and relation, generated -----------------------------------------------

FAMILIES = {"llama3": (LLAMA3_HF, LLAMA), "qwen3_moe": (QWEN3_MOE_HF, QWEN3_30B_A3B)}
DROP = "<absent>"  # a change that removes the key


def _put(config: dict, name: str, value) -> tuple[dict, str]:
    """config with `name` set to `value` (DROP: removed); and the name the key goes by there."""
    config = json.loads(json.dumps(config))
    target, key = config, name
    if name.startswith(ROPE):
        outer = next((k for k in ("rope_parameters", "rope_scaling") if isinstance(config.get(k), dict)), "rope_scaling")  # fmt: skip
        if not isinstance(config.get(outer), dict):
            config[outer] = {}
        target, key = config[outer], name[len(ROPE) :]
        name = f"{outer}.{key}"
    if value == DROP:
        target.pop(key, None)
    else:
        target[key] = value
    return config, name


def _bad_values(key: Key) -> list[tuple[str, object]]:
    """(what, value) of each kind of value `key` must refuse: another type, null (where the format
    has none), out of range, one titanlite cannot honour, not whole, not finite."""
    wrong = {"whole": "8", "float": "0.5", "bool": "true", "str": 1, "object": [1], "layers": "0", "ids": "1", "strs": "x"}  # fmt: skip
    out = [("another type", wrong[key.kind])]
    if key.null is None:
        out.append(("null", None))
    listed = key.kind in ("layers", "ids")
    if key.at_least is not None:
        below = key.at_least - (1e-3 if key.kind == "float" else 1)
        out.append(("below its bound", [below] if listed else below))
    if key.above is not None:
        out.append(("at its bound", key.above))
    if key.choices is not None:
        out.append(("not honoured", "gelu" if key.kind == "str" else not key.choices[0]))
    if key.kind in ("whole", "layers", "ids"):
        out += [(f"not whole {x}", [x] if key.kind == "layers" else x) for x in (8.5, 8.0)]
    if key.kind == "float":
        out += [("not finite", float("nan")), ("infinite", float("inf"))]
    return out


def _declared(family: str) -> list[Key]:
    return list((COMMON_KEYS + FAMILIES[family][0].keys).keys)


@pytest.mark.parametrize(
    "family, name, value",
    [
        pytest.param(family, key.name, value, id=f"{family}-{key.name}-{what}")
        for family in FAMILIES
        for key in _declared(family)
        for what, value in _bad_values(key)
    ],
)
def test_every_declared_key_refuses_each_bad_kind_of_value_in_one_line(
    family, name, value, tmp_path
):
    adapter, good = FAMILIES[family]
    config, named = _put(good, name, value)
    with pytest.raises(UserError) as e:
        read_config(_folder(tmp_path, config=config), adapter.reads, adapter.keys)
    said = str(e.value)
    assert "\n" not in said and said.startswith(f"{tmp_path / 'config.json'}: {named} = "), said
    assert "; it must be " in said, said
    if name in adapter.keys.names | {k.name for k in adapter.keys.keys}:
        with pytest.raises(UserError):  # the adapter reads its own keys through the declaration
            adapter.args_from_config(config)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_declared_key_takes_null_or_absence_as_declared(family, tmp_path):
    """A key whose format allows null, or that may be absent, loads so; a required key's absence
    is one line naming it."""
    adapter, good = FAMILIES[family]
    for key in _declared(family):
        for value in (None, DROP) if key.null is not None else (DROP,):
            config, named = _put(good, key.name, value)
            if key.name == "num_experts":  # the other name gives the count
                config["num_local_experts"] = 128
            folder = _folder(tmp_path, config=config)
            if key.default is REQUIRED:
                with pytest.raises(UserError, match=f"no key '{named}'"):
                    read_config(folder, adapter.reads, adapter.keys)
                continue
            try:
                adapter.args_from_config(read_config(folder, adapter.reads, adapter.keys))
            except UserError as e:  # absent, a key another needs (Llama 3's rope scaling): named
                said = str(e)
                rules = [r.rule for r in (COMMON_KEYS + adapter.keys).relations]
                assert f"no {named}" in said and any(said.endswith(r) for r in rules), said


# Each family's relations broken, one change each (DROP removes a key): every relation the family
# and COMMON_KEYS declare must be broken by one of them.
BREAKS = {
    "llama3": [
        {"num_key_value_heads": 5},
        {"head_dim": 64},
        {"hidden_size": 4100},
        {"hidden_size": 2080},
        {"rope_scaling": {**ROPE_31, "high_freq_factor": 1.0}},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        {"rope_scaling": {"type": "llama3", "factor": 8.0}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        {"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        {"dtype": "float32"},
        {"bos_token_id": 128256},
        {"eos_token_id": [128001, 200000]},
        {"pad_token_id": 130000},
    ],
    "qwen3_moe": [
        {"num_local_experts": 64},
        {"num_experts": DROP},
        {"num_experts_per_tok": 129},
        {"num_experts": DROP, "num_local_experts": 4},
        {"num_key_value_heads": 5},
        {"head_dim": 127},
        {"head_dim": DROP, "hidden_size": 2047},
        {"mlp_only_layers": [48]},
        {"decoder_sparse_step": 49},
        {"intermediate_size": DROP, "mlp_only_layers": [0]},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}},
        {"rope_theta": None, "rope_scaling": {"rope_type": "default", "rope_theta": 5.0}, "rope_parameters": {"rope_type": "default", "rope_theta": 6.0}},
        {"dtype": "float32"},
        {"bos_token_id": 151936},
        {"eos_token_id": [151645, 151936]},
        {"pad_token_id": 200000},
    ],
}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_every_relation_broken_is_one_line_naming_its_keys(family, tmp_path):
    adapter, good = FAMILIES[family]
    relations = list((COMMON_KEYS + adapter.keys).relations)
    broken = set()
    for change in BREAKS[family]:
        config = {k: v for k, v in {**good, **change}.items() if v != DROP}
        with pytest.raises(UserError) as e:
            read_config(_folder(tmp_path, config=config), adapter.reads, adapter.keys)
        said = str(e.value)
        assert "\n" not in said and said.startswith(f"{tmp_path / 'config.json'}: "), said
        hit = [
            i
            for i, rel in enumerate(relations)
            if said.endswith(f"; {rel.rule}")
            and all(k.removeprefix(ROPE) in said for k in rel.keys)
        ]
        assert hit, f"{change}: {said}"
        broken.update(hit)
    unbroken = [relations[i].keys for i in range(len(relations)) if i not in broken]
    assert not unbroken, f"relations no case breaks: {unbroken}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_real_config_of_each_family_loads(family, tmp_path):
    adapter, good = FAMILIES[family]
    config = read_config(_folder(tmp_path, config=good), adapter.reads, adapter.keys)
    args = adapter.args_from_config(config)
    assert args.vocab_size == good["vocab_size"] and args.n_layers == good["num_hidden_layers"]


def test_a_forks_adapter_reads_its_declared_keys_through_the_same_reader(tmp_path):
    """A fork declares its config.json keys (HFAdapter.keys) and reads them in args_from_config;
    hf_args, the one door to a folder's shapes, refuses a value outside them in one line."""
    from dataclasses import dataclass

    from titanlite.models.hf_keys import ConfigKeys, Relation
    from titanlite.models.registry import HFAdapter, ModelSpec, hf_args

    @dataclass(frozen=True)
    class Args:
        width: int
        vocab_size: int

    keys = ConfigKeys(
        "fork",
        (Key("width", "whole", at_least=8), Key("vocab_size", "whole", at_least=1)),
        (
            Relation(
                ("width", "vocab_size"), lambda w, v: w <= v, "width must be at most vocab_size"
            ),
        ),
    )
    adapter = HFAdapter(
        ("ForkForCausalLM",), lambda c: Args(**keys.read(c)), lambda a: {}, lambda *a: None, lambda *a: None, keys=keys
    )  # fmt: skip
    spec = ModelSpec("fork_hf", object, {}, lambda m, *a: m, hf=adapter)
    base = {"architectures": ["ForkForCausalLM"], "vocab_size": 64}
    assert hf_args(spec, _folder(tmp_path, config={**base, "width": 16}), 64) == Args(16, 64)
    for width, says in ((4, "width = 4; it must be a whole number >= 8"), (16.0, "width = 16.0"), (128, "width must be at most vocab_size")):  # fmt: skip
        with pytest.raises(UserError) as e:
            hf_args(spec, _folder(tmp_path, config={**base, "width": width}), 64)
        assert str(e.value).startswith(str(tmp_path / "config.json")) and says in str(e.value), str(
            e.value
        )
