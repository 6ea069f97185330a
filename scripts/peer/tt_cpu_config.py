"""Config functions for torchtitan 0.3.0 on CPU, loaded with
`--module tt_cpu_config --config <function>` (ConfigManager accepts a fully qualified module).

Each function starts from torchtitan's own `llama3_debugmodel()` and changes only what a
CPU run with no downloaded assets needs:
  * attention: the debugmodel's FlexAttention -> torchtitan's own ScaledDotProductAttention
    (causal SDPA; FlexAttention is compiled with inductor/triton, and its block masks need
    document positions that our random data does not carry);
  * tokenizer: a stand-in with vocab 2048 (torchtitan's tests/assets tokenizer is not in the
    wheel); the debugmodel's vocab is already 2048;
  * data: random tokens in [0, 2048) (its c4_test set is not in the wheel either);
  * parallelism.spmd_backend = "partial_dtensor" (its default "spmd_types" needs a newer
    torch's fully_shard; see below);
  * benchmark settings: seq 512, local batch 2, no activation checkpointing, no checkpoint
    saves, no validation, log every step.
Everything else (FSDP, fp32, loss, AdamW, clipping, lr schedule, gc, metrics) is torchtitan's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel

VOCAB = 2048


class RandomTokenizer(BaseTokenizer):
    """No text is tokenized: the data below is already token ids. Only the vocab size matters."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = VOCAB

    def __init__(self, config: Config, *, tokenizer_path: str | None = None, **kwargs: Any):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.eos_id = self.vocab_size - 1
        self.bos_id = 0

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("RandomTokenizer does not encode text")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("RandomTokenizer does not decode")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class RandomTokenDataLoader(BaseDataLoader):
    """Endless batches of uniform random tokens. Step k's global batch, of shape
    (local_batch_size * dp_world_size, seq_len + 1), is drawn from a generator seeded with
    (seed, k), and each dp rank takes its own rows: so 1 rank x batch 4 and 2 ranks x batch 2
    see the same tokens (used to check that gradients are summed correctly). Yields
    ({"input": x[:, :-1]}, x[:, 1:]). No positions are emitted, so the trainer builds no
    attention masks (plain causal attention)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        dataset: str = "random_tokens"
        seed: int = 1234

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        **kwargs: Any,
    ):
        self.vocab = tokenizer.get_vocab_size()
        self.seq_len = seq_len
        self.batch = local_batch_size
        self.rows = slice(dp_rank * local_batch_size, (dp_rank + 1) * local_batch_size)
        self.global_batch = local_batch_size * dp_world_size
        self.seed = config.seed
        self.gen = torch.Generator()

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        k = 0
        while True:
            self.gen.manual_seed(self.seed * 1_000_003 + k)
            x = torch.randint(
                0, self.vocab, (self.global_batch, self.seq_len + 1), generator=self.gen
            )[self.rows]
            k += 1
            yield {"input": x[:, :-1]}, x[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def _cpu_bench(num_chunks: int | None):
    config = llama3_debugmodel()
    spec = config.model_spec
    # FlexAttention -> torchtitan's own causal SDPA module, in every layer's config.
    for _fqn, _cfg, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    assert not list(spec.model.traverse(FlexAttention.Config))
    if num_chunks is not None:
        assert isinstance(config.loss, ChunkedLossWrapper.Config)
        config.loss.num_chunks = num_chunks
    config.hf_assets_path = "."  # exists; nothing is read from it
    config.tokenizer = RandomTokenizer.Config()
    config.dataloader = RandomTokenDataLoader.Config()
    config.activation_checkpoint = None  # the debugmodel default is SelectiveAC
    config.checkpoint.enable = False
    config.checkpoint.interval = 10**9
    config.validator.enable = False
    config.training.seq_len = 512
    config.training.local_batch_size = 2
    config.training.global_batch_size = 4
    config.training.steps = 40
    config.training.mixed_precision_param = "float32"
    config.metrics.log_freq = 1
    # torchtitan 0.3.0's default spmd_backend "spmd_types" hands fully_shard a
    # DataParallelMeshDims and expects it to turn spmd_types annotations into DTensor params;
    # torch 2.13.0's fully_shard does not ("When dp_mesh_dims is provided, all parameters must
    # be DTensors on the full SPMD mesh"). "partial_dtensor" is torchtitan's plain FSDP2 path
    # (DTensor only for TP/CP axes, none here): fully_shard over the 1-D fsdp mesh.
    config.parallelism.spmd_backend = "partial_dtensor"
    return config


def tt_cpu_debugmodel():
    """torchtitan's default loss for the debugmodel: ChunkedLossWrapper, 8 chunks."""
    return _cpu_bench(num_chunks=None)


def tt_cpu_debugmodel_1chunk():
    """The same with ChunkedLossWrapper.num_chunks = 1 (also `--loss.num_chunks 1`)."""
    return _cpu_bench(num_chunks=1)


def tt_cpu_debugmodel_ce():
    """torchtitan's unchunked CrossEntropyLoss (what its llama3_debugmodel_ce_loss uses)."""
    config = _cpu_bench(num_chunks=None)
    config.loss = CrossEntropyLoss.Config(global_vocab_size=VOCAB)
    return config
