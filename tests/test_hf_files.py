"""A Hugging Face folder's configs, read whole (titanlite.models.hf_files): real folders' configs
load (SmolLM2-135M, Llama 3.2 1B, Llama 3.1 8B as their config.json, generation_config.json and
tokenizer_config.json hold them, and every key transformers writes for a LlamaConfig or its
tokenizer); a key titanlite does not know, one that would make it train another model than
transformers, two that disagree, or a size that is not whole, is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titanlite.errors import UserError
from titanlite.models.hf_files import read_config, read_generation_config, read_tokenizer_config
from titanlite.models.llama3.hf import LLAMA3_HF, args_from_config

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
    args = args_from_config(read_config(folder, LLAMA3_HF.reads))
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
    read_config(tmp_path, LLAMA3_HF.reads)
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
    read_config(tmp_path, LLAMA3_HF.reads)


@pytest.mark.parametrize(
    "change, says",
    [
        ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
        ({"sliding_window": 64}, "sliding_window = 64"),
        ({"layer_types": ["sliding_attention"] * 32}, "layer_types"),
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantized"),
        ({"partial_rotary_factor": 0.5}, "key 'partial_rotary_factor' is one titanlite neither uses nor knows"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, "rope_theta = 500000.0 and rope_parameters.rope_theta = 10000.0"),
        ({"rope_theta": 10000.0, "rope_scaling": None, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0}}, None),
        ({"dtype": "float32"}, "torch_dtype = 'bfloat16' and dtype = 'float32'"),
        ({"hidden_size": 64.5}, "hidden_size is 64.5; it must be a whole number"),
        ({"num_hidden_layers": True}, "num_hidden_layers is True"),
    ],
)  # fmt: skip
def test_a_config_key_that_would_train_another_model_is_refused_in_one_line(change, says, tmp_path):
    folder = _folder(tmp_path, config={**LLAMA, **change})
    if says is None:  # the same thing said twice, alike: fine
        read_config(folder, LLAMA3_HF.reads)
        return
    with pytest.raises(UserError) as e:
        read_config(folder, LLAMA3_HF.reads)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_rope_scaling_and_rope_parameters_that_disagree_are_refused(tmp_path):
    """transformers merges them (llama3 scaling with the parameters' theta); titanlite took one."""
    config = {
        **LLAMA,
        "rope_theta": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    with pytest.raises(
        UserError, match="rope_scaling = .* and rope_parameters = .* say the same thing"
    ):
        read_config(_folder(tmp_path, config=config), LLAMA3_HF.reads)


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
