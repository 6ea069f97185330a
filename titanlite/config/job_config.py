"""The configuration schema. Every field carries a one-line doc in its metadata ("help").

This module imports nothing heavy (no torch) so the launcher can validate a config before it
starts any worker process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field with its one-line doc and, for strings, the allowed values."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    description: str = opt("", "free text, copied into the run folder's config")
    dump_folder: str = opt("./outputs", "folder that holds one run folder per run")
    run_name: str = opt("", "name of the run folder; empty: <config name>-<date>-<time>")


@dataclass
class Model:
    name: str = opt("llama3", "registered model name (see titanlite.models.registry)")
    flavor: str = opt("debugmodel", "size preset of the model, e.g. debugmodel, 1B, 8B")
    tokenizer_path: str = opt(
        "", "SentencePiece .model or HF tokenizer.json; empty: hf_assets_path's, else built-in stdlib"
    )
    hf_assets_path: str = opt(
        "", "Hugging Face model folder: shapes (config.json), tokenizer, pretrained weights; flavor unused"
    )
    builtin_vocab_size: int = opt(2048, "vocabulary of the built-in tokenizer (trained, cached)")
    vocab_size: int = opt(
        0, "embedding rows; 0: the tokenizer's vocabulary; larger: padded (data.mode = synthetic: its range)"
    )
    import_module: str = opt("", "module imported first so it can register models (forks)")
    dropout: float = opt(0.0, "dropout on residual branches (models whose args have `dropout`)")
    dropout_masks: str = opt(
        "stream",
        "stream: torch's RNG, one seed on every rank; sample: keyed by each sequence's place in the data, "
        "the same at any dp (titanlite.ops.dropout)",
        choices=("stream", "sample"),
    )


@dataclass
class Optimizer:
    name: str = opt("AdamW", "optimizer", choices=("AdamW",))
    lr: float = opt(8e-4, "peak learning rate")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    eps: float = opt(1e-8, "AdamW epsilon")
    weight_decay: float = opt(0.1, "decoupled weight decay of matrices (never of norms and biases)")
    weight_decay_embeddings: bool = opt(False, "decay embedding tables (and a tied output head) too")


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "linear warmup steps from lr/warmup_steps to lr")
    decay_type: str = opt("cosine", "decay after warmup", choices=("cosine", "linear", "constant"))
    min_lr_factor: float = opt(0.0, "final lr as a fraction of the peak lr")


@dataclass
class Training:
    global_batch_size: int = opt(8, "sequences per optimizer step, over all ranks")
    local_batch_size: int = opt(8, "sequences per microbatch per rank")
    seq_len: int = opt(2048, "tokens per sequence")
    steps: int = opt(10, "optimizer steps to run")
    max_norm: float = opt(1.0, "clip the global gradient norm to this; 0 disables clipping")
    seed: int = opt(42, "seed of init, data order and everything random")
    deterministic: bool = opt(
        False, "bitwise repeatable GPU runs: deterministic algorithms, a fixed cuBLAS workspace (slower)"
    )
    device: str = opt("auto", "auto: cuda when available, else cpu", choices=("auto", "cpu", "cuda"))
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
    dp_replicate: int = opt(1, "data-parallel replicas (DDP, or the outer dim of HSDP)")
    dp_shard: int = opt(-1, "FSDP shards per replica; -1: all ranks left after dp_replicate")
    mode: str = opt(
        "auto",
        "auto: hsdp if both degrees > 1, ddp if only dp_replicate > 1, else fsdp",
        choices=("auto", "fsdp", "ddp", "hsdp"),
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
    )
    text_field: str = opt("text", "the field (jsonl) or column (parquet, arrow) that holds a document's text")
    cache_dir: str = opt("", "tokenizer and token caches; empty: $TITANLITE_CACHE or ~/.cache/titanlite")
    num_workers: int = opt(0, "StatefulDataLoader worker processes per rank")
    packing: bool = opt(
        False, "sft: pack several records per sequence; attention and RoPE positions restart at each record"
    )
    document_mask: bool = opt(
        False, "pretrain: attention stays within each document and RoPE positions restart at each"
    )


@dataclass
class Eval:
    fraction: float = opt(
        0.0, "hold out this fraction of the data's sequences (sft: records) as the eval set; never trained on"
    )
    path: str = opt("", "eval data of its own (prepared folder or raw files, no mixture); wins over fraction")
    interval: int = opt(
        0, "evaluate every this many steps and after the last one; 0: after the last one only"
    )
    max_sequences: int = opt(0, "evaluate on this many sequences spread over the eval set; 0: all of it")
    local_batch_size: int = opt(0, "sequences per eval forward per rank; 0: training.local_batch_size")
    prompts: list[str] = opt(
        [], "at each eval, decode these prompts into <run>/samples.jsonl and TensorBoard (CLI: a JSON list)"
    )
    prompt_format: str = opt(
        "auto",
        "how a prompt is put to the model: text (BOS + text), alpaca (an instruction), chat (a user "
        "turn); auto: sft data: chat if the tokenizer has a chat template, else alpaca; pretrain: text",
        choices=("auto", "text", "alpaca", "chat"),
    )
    sample_tokens: int = opt(64, "new tokens decoded per prompt")
    temperature: float = opt(0.0, "sampling temperature of the prompts; 0: greedy")
    top_p: float = opt(0.9, "nucleus sampling: the smallest set of tokens with this much probability")


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
    )


@dataclass
class Metrics:
    log_freq: int = opt(10, "log every this many steps (and at the first and last step)")
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
    interval: int = opt(0, "save a checkpoint every this many steps and at the last step; 0: never")
    folder: str = opt("checkpoints", "where checkpoints live; a relative path is inside the run folder")
    keep_latest_k: int = opt(2, "complete checkpoints kept (older ones are deleted after a save); 0: all")
    load_step: int = opt(-1, "resume from this step's checkpoint; -1: the newest complete one, if any")
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
        "", "a new run starts from this Hugging Face folder or titanlite step folder (read only)"
    )
    initial_load_model_only: bool = opt(
        True, "initial_load_path: weights only; false: also AdamW state and LR schedule position"
    )
    restore_hparams: bool = opt(
        True,
        "on resume, lr, betas, eps and weight_decay come from the checkpoint; false: from this config",
    )


@dataclass
class Debug:
    ignore_all_labels_steps: list[int] = opt(
        [], "steps whose labels are all set to IGNORE_INDEX (tests the zero-token skip)"
    )
    nan_loss_step: int = opt(-1, "step at which the loss is made NaN (tests the non-finite stop)")
    sync_debug: bool = opt(
        False, "cuda: torch.cuda.set_sync_debug_mode('error') outside log steps, from the second step"
    )
    skip_memory_check: bool = opt(
        False, "start even if the memory estimate says the job does not fit (to find where it really stops)"
    )
    same_data: bool = opt(False, "fault: every rank reads rank 0's share of the batch")
    corrupt_labels_rank: int = opt(-1, "fault: this rank's labels are shuffled within each sequence")
    grad_noise_rank: int = opt(-1, "fault: this rank's gradient gets noise before the reduction")
    grad_noise_scale: float = opt(1.0, "std of that noise, relative to the gradient's RMS")
    sigkill_step: int = opt(
        -1, "fault: rank sigkill_rank is killed (SIGKILL) as this step starts, in a run's first attempt"
    )
    sigkill_rank: int = opt(0, "the rank that sigkill_step kills")
    signal_step: int = opt(
        -1, "fault: as this step starts, rank 0 sends SIGINT to its launcher, as a Ctrl-C would"
    )
    hang_step: int = opt(-1, "fault: rank hang_rank stops responding as this step starts (comm timeout)")
    hang_rank: int = opt(0, "the rank that hang_step hangs")
    fail_save_step: int = opt(
        -1, "fault: the last rank's checkpoint write at this step fails as on a full disk"
    )
    sigkill_in_save: int = opt(
        -1, "fault: rank 0 is killed inside this step's checkpoint save, before it is published"
    )
    spike_step: int = opt(-1, "fault: rank 0's loss is multiplied by spike_scale at this step (a spike)")
    spike_scale: float = opt(1000.0, "the factor of spike_step")
    flip_bit_step: int = opt(
        -1, "fault: as this step starts, one bit of one parameter flips on rank flip_bit_rank (replica_drift)"
    )
    flip_bit_rank: int = opt(1, "the rank whose parameter flip_bit_step flips")
    stuck_loader_step: int = opt(
        -1,
        "fault: from this step on, rank stuck_loader_rank's loader repeats that step's batch (stale_batch)",
    )
    stuck_loader_rank: int = opt(1, "the rank whose loader stuck_loader_step freezes")
    seed_mode: str = opt(
        "shared",
        "seeds of dropout and data order (S1-1/2/3 of arXiv 2602.14462); shared is the normal one",
        choices=("shared", "rank0_differs", "per_rank"),
    )


@dataclass
class Diagnostics:
    enable: bool = opt(True, "cross-rank consistency diagnostics (need dp >= 2)")
    warmup_steps: int = opt(200, "measure every step for this many first steps")
    interval: int = opt(500, "after the warmup, measure every this many steps")
    method: str = opt(
        "auto",
        "gradient directions: exact (Gram), sketch (CountSketch); auto: exact unless it would hold "
        "unsharded grads across microbatches (fsdp with accumulation) or under hsdp",
        choices=("auto", "exact", "sketch"),
    )
    sketch_dim: int = opt(1024, "k, dimensions of each local gradient's sketch (rounded down to a prime)")
    noise_scale_ema: float = opt(0.9, "EMA decay of the gradient-noise-scale estimate")
    on_alert: str = opt("warn", "what an alert does: warn, or stop the run", choices=("warn", "stop"))
    skip_spikes: str = opt(
        "off",
        "spike guard: skip the update of a step whose grad_norm (or global loss) exceeds mean + spike_k std",
        choices=("off", "grad_norm", "loss"),
    )
    spike_k: float = opt(6.0, "spike guard: standard deviations above the recent mean that make a spike")
    spike_window: int = opt(100, "spike guard: applied steps whose values form the history")
    spike_min_history: int = opt(20, "spike guard: values it needs before it judges a step")
    spike_max_consecutive: int = opt(3, "spike guard: skips in a row allowed; one more stops the run")
    replica_check_interval: int = opt(
        100,
        "replica_drift: every this many steps, compare the replicas' parameters bitwise (ddp, hsdp); 0: off",
    )


@dataclass
class Alerts:
    """The thresholds of the named alerts' rules (titanlite.diagnostics.rules)."""

    window: int = opt(20, "measured steps that persistence rules look back on; alert cooldown")
    min_steps: int = opt(10, "burn-in: measured steps ignored before alerts, then history they need")
    spike_factor: float = opt(4.0, "dispersion_spike: loss std above this x its recent median")
    smooth_loss_tol: float = opt(
        0.05, "dispersion_spike: global loss within this fraction of its recent median"
    )
    trend_burn_in: int = opt(100, "dispersion_rising_loss_falling: measured steps before it is armed")
    trend_window: int = opt(
        100, "dispersion_rising_loss_falling: measured steps it looks back on (medians of thirds)"
    )
    trend_rise: float = opt(
        1.0, "dispersion_rising_loss_falling: rise of the median std, last vs first third of trend_window"
    )
    outlier_margin: float = opt(
        0.05, "single_rank_outlier: the rank's loss above the others' mean by this fraction"
    )
    persist_frac: float = opt(
        0.7, "single_rank_outlier / faulty_worker: share of the window the same rank stands out"
    )
    identical_std: float = opt(1e-6, "identical_data: loss std below this fraction of the loss")
    identical_cos: float = opt(0.99, "identical_data: or mean gradient cosine above this")
    cos_high: float = opt(0.5, "cosine_drop: armed while the median mean cosine is above this")
    cos_low: float = opt(0.05, "cosine_drop: fires when the mean cosine falls below this")
    faulty_margin: float = opt(0.1, "faulty_worker: rank's median cosine to others below theirs by this")
    norm_outlier_factor: float = opt(3.0, "faulty_worker: or its grad norm this many x the others' median")


# Keys that moved to another section: an older config.toml naming them still loads (with one
# deprecation line), so old run folders resume, compare and replay.
MOVED_KEYS = {
    "diagnostics.alert_window": "alerts.window",
    "diagnostics.alert_min_steps": "alerts.min_steps",
    **{
        f"diagnostics.{k}": f"alerts.{k}"
        for k in (
            "spike_factor",
            "smooth_loss_tol",
            "trend_burn_in",
            "trend_window",
            "trend_rise",
            "outlier_margin",
            "persist_frac",
            "identical_std",
            "identical_cos",
            "cos_high",
            "cos_low",
            "faulty_margin",
            "norm_outlier_factor",
        )
    },
}


@dataclass
class Comm:
    timeout_s: int = opt(
        600, "a collective waiting longer than this stops the run, naming the ranks that did not arrive"
    )
    trace_buffer: int = opt(
        2000,
        "NCCL flight recorder: collectives kept per rank, dumped into <run>/comm_trace on a timeout; 0: off",
    )


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
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
