"""What makes two runs train the same thing: one definition, used by the checkpointer (a
checkpoint resumes only into a run that shares it) and by run comparison (two runs get an
invariance verdict only if they share it).

Everything else may differ: the layout (dp degrees, mode, local batch, accumulation), logging,
and settings that change the curve without changing what is trained (optimizer, precision,
dropout), which run comparison reports and whose effect its verdict shows.
"""

from __future__ import annotations

from typing import Any

IDENTITY_KEYS = (
    "model.name",
    "model.flavor",
    "model.builtin_vocab_size",
    "model.vocab_size",
    "model.tokenizer_path",
    "model.hf_assets_path",
    "data.mode",
    "data.path",  # with a mixture's weights
    "data.text_field",
    "data.packing",  # which records share a sequence
    "data.document_mask",  # what a token attends to
    "eval.fraction",  # which sequences are held out of training
    "training.seed",
    "training.global_batch_size",
    "training.seq_len",  # the data position is counted in sequences of this length
    "optimizer.weight_decay_embeddings",  # which parameter group a table is in: the optimizer's layout
    "checkpoint.initial_load_path",  # the weights a new run starts from
    "checkpoint.initial_load_model_only",
)


def identity(cfg: Any) -> dict[str, Any]:
    """The identity keys' values of a JobConfig, as {"section.key": value}."""
    out = {}
    for dotted in IDENTITY_KEYS:
        section, key = dotted.split(".")
        out[dotted] = getattr(getattr(cfg, section), key)
    return out
