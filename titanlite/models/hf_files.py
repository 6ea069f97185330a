"""A Hugging Face folder's configs, read whole: config.json, generation_config.json,
tokenizer_config.json and special_tokens_map.json. Every key is one titanlite uses (the model's
adapter declares its own: HFAdapter.keys), one known to be harmless (below, with why), or
refused in one line; and every value titanlite reads passes its declaration (titanlite.models.
hf_keys: a kind, bounds, what null means, relations such as two keys that say one thing and must
agree, since titanlite would take one and transformers the other).

Harmless means: it does not change what the model computes in training, or transformers'
LlamaForCausalLM ignores it as titanlite does. The lists were checked against the configs of
SmolLM2-135M, Llama 3.2 1B and Llama 3.1 8B and against transformers' common config keys
(tests/test_hf_files.py). Torch-free: the preflight reads through here too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from titanlite.errors import UserError
from titanlite.models.hf_keys import ConfigKeys, Key, Relation, same
from titanlite.tools.records import read_json

# config.json keys titanlite reads for every model (the adapter adds its own)
CONFIG_USED = frozenset(
    {
        "architectures",  # which adapter reads the folder (models/registry.py)
        "model_type",  # the same, where architectures is missing
        "max_position_embeddings",  # the context it was trained on (a start-up note; exports)
        "bos_token_id",  # the tokenizer's special tokens where its own files name none
        "eos_token_id",  # ... and what ends a generated completion
        "pad_token_id",
    }
)
CONFIG_HARMLESS = frozenset(
    {
        # bookkeeping: names, versions, the dtype it was saved in (titanlite trains in its own)
        "_name_or_path", "_model_name_or_path", "transformers_version", "torch_dtype", "dtype", "auto_map",
        "name_or_path",
        # the unknown token's id: the tokenizer's business (a byte-level one never emits it)
        "unk_token_id",
        # inference and output switches of transformers' forward
        "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
        "use_return_dict", "output_scores", "return_dict_in_generate",
        # only a random init reads it (the folder's weights replace that init)
        "initializer_range",
        # tensor-parallel slicing of the MLP in transformers 4, numerically the same model
        "pretraining_tp",
        # task heads and labels, which a causal LM does not use
        "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params", "prefix",
        "num_labels", "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
        "tie_encoder_decoder", "decoder_start_token_id", "sep_token_id", "chunk_size_feed_forward",
        "pruned_heads", "tokenizer_class",
        # generation defaults kept in old configs (generation_config.json's now): sampling only
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
        "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
        "num_return_sequences", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
        # nanotron's (SmolLM2's) keys, which transformers' Llama ignores as titanlite does
        "is_llama_config", "rope_interleaved",
    }
)  # fmt: skip
# keys harmless only at these values (elsewhere titanlite's Llama would train another model)
CONFIG_HARMLESS_AT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "attention_dropout": (
        lambda v: v in (0, 0.0, None),
        "titanlite's Llama applies no attention dropout",
    ),
    "sliding_window": (lambda v: v is None, "titanlite's Llama attends to the whole sequence"),
    "use_sliding_window": (
        lambda v: v in (False, None),
        "titanlite's Llama attends to the whole sequence",
    ),
    "layer_types": (
        lambda v: isinstance(v, list) and set(v) <= {"full_attention"},
        "titanlite's Llama has full attention in every layer",
    ),
    "quantization_config": (
        lambda v: v is None,
        "its weights are quantized; titanlite reads full-precision weights",
    ),
}
# The keys every model's config.json may hold that titanlite reads itself (the adapter declares
# its own: HFAdapter.keys), and the keys that say one thing twice: where a config holds both,
# they must agree.
COMMON_KEYS = ConfigKeys(
    "Hugging Face",
    (
        Key("max_position_embeddings", "whole", at_least=1, default=None),
        Key("bos_token_id", "ids", at_least=0, null="no such token named here", default=None),
        Key("eos_token_id", "ids", at_least=0, null="no such token named here", default=None),
        Key("pad_token_id", "ids", at_least=0, null="no such token named here", default=None),
    ),
    (
        same("rope_theta", "rope_parameters.rope_theta"),
        # rope_parameters also holds rope_theta: compare what both hold
        same(
            "rope_scaling",
            "rope_parameters",
            lambda a, b: isinstance(a, dict) and isinstance(b, dict) and all(b.get(k) == v for k, v in a.items()),
        ),
        same("torch_dtype", "dtype"),
        *(
            Relation(
                (ids, "vocab_size"),
                lambda i, v: not isinstance(v, int) or all(x < v for x in (i if isinstance(i, list) else [i])),
                f"{ids} must be below vocab_size (a token id is a row of the embedding)",
            )
            for ids in ("bos_token_id", "eos_token_id", "pad_token_id")
        ),
    ),
)  # fmt: skip

GENERATION_USED = frozenset({"eos_token_id"})  # what ends a completion
# generation_config.json configures decoding only, never training; titanlite's generation takes
# its own flags (scripts/generate.py) and reads the EOS ids alone. These are transformers' keys
# (5.x; tests/test_hf_files.py holds the list to GenerationConfig's, so a new one is named).
GENERATION_HARMLESS = frozenset(
    {
        "max_length", "max_new_tokens", "min_length", "min_new_tokens", "early_stopping", "max_time",
        "stop_strings", "do_sample", "num_beams", "use_mtp", "use_cache", "cache_implementation", "cache_config",
        "max_cache_len", "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff",
        "eta_cutoff", "repetition_penalty", "encoder_repetition_penalty", "length_penalty", "no_repeat_ngram_size",
        "bad_words_ids", "renormalize_logits", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
        "token_healing", "guidance_scale", "watermarking_config", "num_return_sequences", "output_attentions",
        "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate", "pad_token_id",
        "bos_token_id", "encoder_no_repeat_ngram_size", "decoder_start_token_id", "is_assistant",
        "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
        "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit", "assistant_lookbehind",
        "target_lookbehind", "assistant_ensemble_weight", "speculation_type", "compile_config", "disable_compile",
        "continuous_batching_config", "low_memory", "penalty_alpha", "dola_layers", "diversity_penalty",
        "num_beam_groups", "constraints", "force_words_ids", "prefill_chunk_size", "_from_model_config",
        "transformers_version",
    }
)  # fmt: skip

TOKENIZER_USED = frozenset({"bos_token", "eos_token", "pad_token", "chat_template"})
TOKENIZER_HARMLESS = frozenset(
    {
        # titanlite formats every sequence itself (pretraining: <bos> text <eos>; SFT: the chat
        # template or its prompt format) and encodes without the wrapper's own specials
        "add_bos_token", "add_eos_token",
        # the wrapper's class and bookkeeping; tokenizer.json holds the tokenization itself
        "tokenizer_class", "name_or_path", "auto_map", "processor_class", "model_input_names", "backend",
        "is_local", "local_files_only", "files_loaded", "special_tokens_map_file", "tokenizer_file",
        "fast_tokenizer_files", "slow_tokenizer_class", "device_map", "init_inputs",
        "model_specific_special_tokens", "response_template", "chat_control_tokens",
        # how transformers converts a SentencePiece model when there is no tokenizer.json
        "legacy", "sp_model_kwargs",
        "model_max_length", "padding_side", "truncation_side", "clean_up_tokenization_spaces",
        "spaces_between_special_tokens", "errors", "split_special_tokens", "use_default_system_prompt",
        # special tokens that are not bos, eos or pad: tokenizer.json's added tokens hold them
        "added_tokens_decoder", "additional_special_tokens", "extra_special_tokens", "unk_token",
        "sep_token", "cls_token", "mask_token", "vocab_size",
    }
)  # fmt: skip
TOKENIZER_HARMLESS_AT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "add_prefix_space": (
        lambda v: v in (False, None),
        "transformers would put a space before every text that tokenizer.json alone does not",
    ),
    "do_lower_case": (lambda v: v in (False, None), "transformers would lower-case every text"),
}
SPECIAL_TOKENS_USED = frozenset({"bos_token", "eos_token", "pad_token"})
SPECIAL_TOKENS_HARMLESS = frozenset(
    {"unk_token", "sep_token", "cls_token", "mask_token", "additional_special_tokens"}
)


def check_whole(
    path: Path,
    data: dict,
    used: Iterable[str],
    harmless: frozenset[str],
    harmless_at: dict[str, tuple[Callable[[Any], bool], str]] | None = None,
) -> dict:
    """`data` (the file at `path`) with every key used, harmless, or refused in one line."""
    used = frozenset(used)
    for key, value in data.items():
        if key in used or key in harmless:
            continue
        rule = (harmless_at or {}).get(key)
        if rule is not None:
            ok, why = rule
            if ok(value):
                continue
            raise UserError(
                f"{path}: {key} = {value!r}, and {why}; use a folder without it (or with it off), or a "
                "model whose adapter reads it"
            )
        raise UserError(
            f"{path}: key '{key}' is one titanlite neither uses nor knows to be harmless (it reads the "
            "folder's configs whole: titanlite/models/hf_files.py lists the keys); if it changes nothing "
            "in training, remove it, else use a model whose adapter reads it"
        )
    return data


def read_config(folder: Path, reads: Iterable[str] = (), keys: ConfigKeys | None = None) -> dict:
    """config.json whole: the adapter's keys (`reads`, and those `keys` declares) and titanlite's,
    the harmless ones, or one refusal; every declared key (titanlite's own, COMMON_KEYS, and
    `keys`) read through its declaration, so a value out of bounds or two keys that disagree are
    one refusal too."""
    path = folder / "config.json"
    config = read_json(path, "a Hugging Face model folder's config.json is a JSON object")
    declared = COMMON_KEYS + keys if keys is not None else COMMON_KEYS
    check_whole(
        path, config, {*CONFIG_USED, *reads, *declared.names}, CONFIG_HARMLESS, CONFIG_HARMLESS_AT
    )
    declared.read(config, path)
    return config


def _read_optional(folder: Path, name: str, used, harmless, harmless_at=None) -> dict:
    """`folder/name` read whole ({} without one)."""
    path = folder / name
    if not path.is_file():
        return {}
    return check_whole(
        path, read_json(path, f"{name} is a JSON object"), used, harmless, harmless_at
    )


def read_generation_config(folder: Path) -> dict:
    """generation_config.json whole ({} without one)."""
    return _read_optional(folder, "generation_config.json", GENERATION_USED, GENERATION_HARMLESS)


def read_tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json whole ({} without one)."""
    return _read_optional(
        folder, "tokenizer_config.json", TOKENIZER_USED, TOKENIZER_HARMLESS, TOKENIZER_HARMLESS_AT
    )


def read_special_tokens_map(folder: Path) -> dict:
    """special_tokens_map.json whole ({} without one)."""
    return _read_optional(
        folder, "special_tokens_map.json", SPECIAL_TOKENS_USED, SPECIAL_TOKENS_HARMLESS
    )


def check_hf_folder(folder: Path, need_tokenizer: bool) -> None:
    """A Hugging Face model folder has config.json (a JSON object whose keys titanlite reads for
    every model hold what COMMON_KEYS declares), its weights and, unless another tokenizer is
    named, tokenizer.json."""
    if not folder.is_dir():
        raise UserError(
            f"model.hf_assets_path '{folder}' is not a folder; point it at a downloaded model"
        )
    if not (folder / "config.json").is_file():
        raise UserError(f"'{folder}' has no config.json; it is not a Hugging Face model folder")
    # the keys titanlite reads before the model's adapter does (the tokenizer's ids, the context)
    COMMON_KEYS.read(
        read_json(
            folder / "config.json", "a Hugging Face model folder's config.json is a JSON object"
        ),
        folder / "config.json",
    )
    if not any(
        (folder / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")
    ):
        raise UserError(
            f"'{folder}' has no model.safetensors or model.safetensors.index.json; download the weights too"
        )
    if need_tokenizer and not any(
        (folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")
    ):
        raise UserError(
            f"'{folder}' has no tokenizer.json (nor tokenizer.model); download it, or set model.tokenizer_path"
        )
