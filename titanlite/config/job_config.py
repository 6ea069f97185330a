"""The configuration schema. Every field carries a one-line doc in its metadata ("help") and,
for numbers, its bounds. The sections of the diagnostics, alerts and debugging switches are in
titanlite.config.monitor_config. A plugin adds a section of its own (PLUGIN_SECTIONS), which a
config has only when it names it.

This module imports nothing heavy (no torch) so the launcher can validate a config before it
starts any worker process.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any

from titanlite.config.fields import STEPS_MAX, opt, schedule
from titanlite.config.monitor_config import Alerts, Debug, Diagnostics

__all__ = ["Alerts", "Debug", "Diagnostics", "JobConfig", "opt"]


@dataclass
class Job:
    description: str = opt("", "free text, copied into the run folder's config")
    dump_folder: str = opt("./outputs", "folder that holds one run folder per run", path="file")
    run_name: str = opt(
        "",
        "run folder inside dump_folder (sweep/run-1 nests one); empty: <config name>-<date>-<time>",
    )


@dataclass
class Model:
    name: str = opt("llama3", "registered model name (see titanlite.models.registry)")
    flavor: str = opt("debugmodel", "size preset of the model, e.g. debugmodel, 1B, 8B")
    tokenizer_path: str = opt(
        "",
        "SentencePiece .model or HF tokenizer.json; empty: hf_assets_path's, else built-in stdlib",
        path="file",
    )
    hf_assets_path: str = opt(
        "",
        "Hugging Face model folder: shapes (config.json), tokenizer, pretrained weights; flavor unused",
        path="file",
    )
    builtin_vocab_size: int = opt(
        2048,
        "vocabulary of the built-in tokenizer (trained, cached)",
        at_least=256,
        at_most=1 << 18,
    )
    vocab_size: int = opt(
        0,
        "embedding rows; 0: the tokenizer's vocabulary; larger: padded (data.mode = synthetic: its range)",
        at_least=0,
    )
    import_module: str = opt("", "module imported first so it can register models (forks)")
    dropout: float = opt(
        0.0,
        "dropout on residual branches (models whose args have `dropout`)",
        at_least=0.0,
        below=1.0,
    )
    dropout_masks: str = opt(
        "stream",
        "stream: torch's RNG, one seed on every rank; sample: keyed by each sequence's place in the data, "
        "the same at any dp (titanlite.ops.dropout)",
        choices=("stream", "sample"),
    )


@dataclass
class Optimizer:
    name: str = opt("AdamW", "optimizer", choices=("AdamW",))
    lr: float = opt(8e-4, "peak learning rate", above=0.0)
    beta1: float = opt(0.9, "AdamW beta1", at_least=0.0, below=1.0)
    beta2: float = opt(0.95, "AdamW beta2", at_least=0.0, below=1.0)
    eps: float = opt(1e-8, "AdamW epsilon", above=0.0)
    weight_decay: float = opt(
        0.1, "decoupled weight decay of matrices (never of norms and biases)", at_least=0.0
    )
    weight_decay_embeddings: bool = opt(
        False, "decay embedding tables (and a tied output head) too"
    )


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "linear warmup steps from lr/warmup_steps to lr", at_least=0)
    decay_type: str = opt("cosine", "decay after warmup", choices=("cosine", "linear", "constant"))
    min_lr_factor: float = opt(
        0.0, "final lr as a fraction of the peak lr", at_least=0.0, at_most=1.0
    )


@dataclass
class SpikeGuard:
    skip: str = opt(
        "off",
        "skip the update of a step whose grad_norm (or global loss) exceeds the recent mean + k std",
        choices=("off", "grad_norm", "loss"),
    )
    k: float = opt(6.0, "standard deviations above the recent mean that make a spike", above=0.0)
    window: int = opt(
        100, "applied steps whose values form the history", at_least=1, at_most=STEPS_MAX
    )
    min_history: int = opt(
        20, "values it needs before it judges a step", at_least=1, at_most=STEPS_MAX
    )
    max_consecutive: int = opt(3, "skips in a row allowed; one more stops the run", at_least=0)


@dataclass
class Training:
    global_batch_size: int = opt(8, "sequences per optimizer step, over all ranks", at_least=1)
    local_batch_size: int = opt(8, "sequences per microbatch per rank", at_least=1)
    seq_len: int = opt(2048, "tokens per sequence", at_least=1)
    steps: int = opt(10, "optimizer steps to run", at_least=1)
    max_norm: float = opt(
        1.0, "clip the global gradient norm to this; 0 disables clipping", at_least=0.0
    )
    seed: int = opt(
        42, "seed of init, data order and everything random", at_least=0, at_most=2**63 - 1
    )
    deterministic: bool = opt(
        False,
        "bitwise repeatable GPU runs: deterministic algorithms, a fixed cuBLAS workspace (slower)",
    )
    device: str = opt(
        "auto", "auto: cuda when available, else cpu", choices=("auto", "cpu", "cuda")
    )
    mixed_precision_param: str = opt(
        "auto",
        "dtype of params in forward/backward; auto: bfloat16 on cuda, float32 on cpu",
        choices=("auto", "float32", "bfloat16"),
    )
    mixed_precision_reduce: str = opt(
        "float32", "dtype of gradient reduction", choices=("float32", "bfloat16")
    )
    activation_checkpoint: str = opt(
        "none",
        "recompute in backward: full: each block; selective: its pointwise ops (matmul and attention outputs kept)",
        choices=("none", "selective", "full"),
    )
    compile: bool = opt(False, "torch.compile each transformer block")


@dataclass
class Parallelism:
    dp_replicate: int = opt(1, "data-parallel replicas (DDP, or the outer dim of HSDP)", at_least=1)
    dp_shard: int = opt(-1, "FSDP shards per replica; -1: all ranks left after dp_replicate")
    mode: str = opt(
        "auto",
        "auto: hsdp if both degrees > 1, ddp if only dp_replicate > 1, else fsdp",
        choices=("auto", "fsdp", "ddp", "hsdp"),
    )
    axes: list[str] = opt(
        [],
        "extra mesh axes that split every sequence's positions over their ranks (context parallelism), "
        'as name=degree, e.g. ["cp=2"] (CLI: a JSON list); the model must declare them (ModelSpec.axes)',
    )
    skip_grad_sync: str = opt(
        "auto",
        "no gradient reduction on non-final microbatches; auto: on for ddp, off for fsdp/hsdp",
        choices=("auto", "on", "off"),
    )
    reshard_after_forward: str = opt(
        "auto",
        "fsdp/hsdp: always: free each block's gathered params after its forward (backward gathers "
        "them again); never: keep them until its backward; auto: never if the whole model's "
        "gathered params take <= 5% of this rank's memory",
        choices=("auto", "always", "never"),
    )


@dataclass
class Data:
    mode: str = opt(
        "pretrain",
        "pretrain: packed documents; sft: prompt/response; synthetic: random tokens < model.vocab_size (benchmarks)",
        ("pretrain", "sft", "synthetic"),
    )
    path: str = opt(
        "",
        "prepared folder, or raw .txt/.jsonl/.jsonl.gz/.parquet/.arrow file or folder; mixture: "
        "'a:0.7,b:0.3'; empty: built-in stdlib data",
        path="mixture",
    )
    text_field: str = opt(
        "text", "the field (jsonl) or column (parquet, arrow) that holds a document's text"
    )
    cache_dir: str = opt(
        "", "tokenizer and token caches; empty: $TITANLITE_CACHE or ~/.cache/titanlite", path="file"
    )
    num_workers: int = opt(
        0, "StatefulDataLoader worker processes per rank", at_least=0, at_most=64
    )
    packing: bool = opt(
        False,
        "sft: pack several records per sequence; attention and RoPE positions restart at each record",
    )
    document_mask: bool = opt(
        False, "pretrain: attention stays within each document and RoPE positions restart at each"
    )
    accept_change: bool = opt(
        False,
        "resume although the data's content changed since the checkpoint (recorded in run.json and events.jsonl)",
    )


@dataclass
class Eval:
    fraction: float = opt(
        0.0,
        "hold out this fraction of the data's sequences (sft: records) as the eval set; never trained on",
    )
    path: str = opt(
        "",
        "eval data of its own (prepared folder or raw files, no mixture); not with fraction",
        path="file",
    )
    every: int = schedule(0, "evaluate")
    at_end: bool = opt(True, "also evaluate after the last step")
    at_start: bool = opt(
        False,
        "also evaluate the model as loaded, before the first step (step 0; a resumed run does not repeat it)",
    )
    max_sequences: int = opt(
        0, "evaluate on this many sequences spread over the eval set; 0: all of it", at_least=0
    )
    local_batch_size: int = opt(
        0, "sequences per eval forward per rank; 0: training.local_batch_size", at_least=0
    )
    prompts: list[str] = opt(
        [],
        "at each eval, decode these prompts into <run>/samples.jsonl and TensorBoard (CLI: one prompt, or a JSON list)",
        whole_items=True,
    )
    prompt_format: str = opt(
        "auto",
        "how a prompt is put to the model: text (BOS + text), alpaca (an instruction), chat (a user "
        "turn); auto: sft data: chat if the tokenizer has a chat template, else alpaca; pretrain: text",
        choices=("auto", "text", "alpaca", "chat"),
    )
    sample_tokens: int = opt(64, "new tokens decoded per prompt", at_least=1, at_most=1 << 16)
    temperature: float = opt(0.0, "sampling temperature of the prompts; 0: greedy", at_least=0.0)
    top_p: float = opt(
        0.9,
        "nucleus sampling: the smallest set of tokens with this much probability",
        above=0.0,
        at_most=1.0,
    )


@dataclass
class Loss:
    normalization: str = opt(
        "global",
        "global: sum / valid tokens of the whole step (exact); local_mean: naive per-rank mean",
        choices=("global", "local_mean"),
    )
    chunk_logits_mib: float = opt(
        256.0,
        "most MiB one chunk of fp32 logits may take: the output projection and cross entropy run "
        "chunk by chunk over the sequence; 0: the whole sequence at once",
        at_least=0.0,
    )


@dataclass
class Metrics:
    log_every: int = schedule(10, "log", "the first and last steps always log")
    enable_tensorboard: bool = opt(True, "write TensorBoard events into <run folder>/tb")
    enable_wandb: bool = opt(False, "also log to Weights & Biases (needs `pip install wandb`)")
    wandb_project: str = opt("titanlite", "W&B project")
    wandb_entity: str = opt("", "W&B entity (user or team); empty: your default entity")
    wandb_mode: str = opt(
        "online",
        "online: stream to W&B; offline: write into <run folder>/wandb, no network (`wandb sync` later)",
        choices=("online", "offline"),
    )


@dataclass
class Checkpoint:
    every: int = schedule(0, "save a checkpoint")
    at_end: bool = opt(False, "also save a checkpoint after the last step")
    folder: str = opt(
        "checkpoints", "where checkpoints live; a relative path is inside the run folder"
    )
    keep_latest_k: int = opt(
        2, "complete checkpoints kept (older ones are deleted after a save); 0: all", at_least=0
    )
    load_step: int = opt(
        -1, "resume from this step's checkpoint; -1: the newest complete one, if any"
    )
    async_mode: str = opt(
        "off",
        "off: training waits for the write; async: it waits only for a copy to host memory",
        choices=("off", "async"),
    )
    export_weights: bool = opt(
        False, "at the end, save the full model weights (torch.save) as <run folder>/weights.pt"
    )
    export_hf: bool = opt(
        False,
        "at the end, write <run folder>/hf: safetensors, config.json and tokenizer files for transformers",
    )
    export_dtype: str = opt(
        "float32", "dtype of the exported Hugging Face weights", choices=("float32", "bfloat16")
    )
    initial_load_path: str = opt(
        "",
        "a new run starts from this Hugging Face folder or titanlite step folder (read only)",
        path="file",
    )
    initial_load_drop: list[str] = opt(
        [],
        "tensors of initial_load_path's checkpoint this run leaves unread (any other it cannot take is refused)",
    )
    initial_load_model_only: bool = opt(
        True, "initial_load_path: weights only; false: also AdamW state and LR schedule position"
    )
    restore_hparams: bool = opt(
        True,
        "on resume, lr, betas, eps and weight_decay come from the checkpoint; false: from this config",
    )

    @property
    def saves(self) -> bool:
        """Whether the run saves checkpoints at all (a stop by signal saves one then too)."""
        return self.every > 0 or self.at_end


@dataclass
class Comm:
    timeout_s: int = opt(
        600,
        "a collective waiting longer than this stops the run, naming the ranks that did not arrive",
        at_least=1,
    )
    trace_buffer: int = opt(
        2000,
        "NCCL flight recorder: collectives kept per rank, dumped into <run>/comm_trace on a timeout; 0: off",
        at_least=0,
        at_most=STEPS_MAX,
    )


# The most ranks a rehearsal plans for: the largest clusters titanlite's users train on, and a
# preflight whose work grows with the world stays seconds long.
REHEARSAL_WORLD_MAX = 65536


@dataclass
class Rehearsal:
    world: int = opt(
        0,
        "rehearse the run as rank 0 of this many ranks, in one process, with torch's fake process group "
        "(./run_train.sh --rehearse W): per-rank memory, compute, traffic and diagnostics cost; 0: train",
        at_least=0,
        at_most=REHEARSAL_WORLD_MAX,
    )
    steps: int = opt(
        7,
        "steps a rehearsal runs: the first builds the optimizer state (and compiles), two are watched "
        "(memory, bytes, host reads), the rest timed (3: memory and bytes only, for a model slow here)",
        at_least=3,
        at_most=1000,
    )
    link_gbps: float = opt(
        400.0,
        "each rank's network bandwidth in Gbit/s, for the communication time per step",
        above=0.0,
    )
    device_gb: float = opt(
        80.0,
        "the memory of the devices rehearsed for, in GB (10^9 bytes): the report's fits-or-not verdict",
        above=0.0,
    )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    spike_guard: SpikeGuard = field(default_factory=SpikeGuard)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    data: Data = field(default_factory=Data)
    eval: Eval = field(default_factory=Eval)
    loss: Loss = field(default_factory=Loss)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    diagnostics: Diagnostics = field(default_factory=Diagnostics)
    alerts: Alerts = field(default_factory=Alerts)
    debug: Debug = field(default_factory=Debug)
    rehearsal: Rehearsal = field(default_factory=Rehearsal)
    # [faults] (titanlite.faults), a plugin's section: None, and in no --help or config.toml,
    # until a config or a flag names it
    faults: Any = None


# The sections plugins add: name -> (the section's dataclass, the hook a trainer builds from it),
# each "module:name", imported once a config names the section.
PLUGIN_SECTIONS = {
    "faults": ("titanlite.faults.switches:FaultSwitches", "titanlite.faults.inject:Faults")
}


def _load(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def plugin_section(name: str) -> Any:
    """A plugin section's defaults (its module imported now)."""
    return _load(PLUGIN_SECTIONS[name][0])()


def plugin_hook(cfg: JobConfig, name: str, *args: Any) -> Any:
    """The hook of plugin `name` built from its section and `args`; None when `cfg` has none."""
    section = getattr(cfg, name)
    return None if section is None else _load(PLUGIN_SECTIONS[name][1])(section, *args)


def with_plugins() -> JobConfig:
    """The defaults of every section, the plugins' included: what a run that named none of them
    ran with (a comparison of runs reads a missing section so)."""
    return JobConfig(**{name: plugin_section(name) for name in PLUGIN_SECTIONS})


def sections(cfg: JobConfig) -> list[tuple[str, Any]]:
    """(name, section) of every section `cfg` has: the core's, and the plugins' it names."""
    return [(f.name, getattr(cfg, f.name)) for f in fields(cfg) if getattr(cfg, f.name) is not None]
