"""The configuration schema: each section a `section` dataclass whose fields carry their doc and
bounds (the diagnostics', alerts' and debug sections: titanlite.config.monitor_config), plus the
plugins' sections (PLUGIN_SECTIONS). Torch-free, so the launcher validates before any worker."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any

from titanlite.config.fields import STEPS_MAX, opt, schedule, section
from titanlite.config.monitor_config import Alerts, Debug, Diagnostics

__all__ = ["Alerts", "Debug", "Diagnostics", "JobConfig", "opt"]


@section
class Job:
    description: str = opt("")
    """free text, copied into the run folder's config"""
    dump_folder: str = opt("./outputs", path="file")
    """folder that holds one run folder per run"""
    run_name: str = opt("")
    """run folder inside dump_folder (sweep/run-1 nests one); empty: <config name>-<date>-<time>"""


@section
class Model:
    name: str = opt("llama3")
    """registered model name (see titanlite.models.registry)"""
    flavor: str = opt("debugmodel")
    """size preset of the model, e.g. debugmodel, 1B, 8B; unused with hf_assets_path"""
    tokenizer_path: str = opt("", path="file")
    """SentencePiece .model or HF tokenizer.json; empty: hf_assets_path's, else built-in stdlib"""
    hf_assets_path: str = opt("", path="file")
    """Hugging Face model folder: shapes (config.json), tokenizer, pretrained weights; flavor unused"""
    builtin_vocab_size: int = opt(2048, at_least=256, at_most=1 << 18)
    """vocabulary of the built-in tokenizer (trained, cached)"""
    vocab_size: int = opt(0, at_least=0)
    """embedding rows; 0: the tokenizer's vocabulary; larger: padded (data.mode = synthetic: its range)"""
    import_module: str = opt("")
    """module imported first so it can register models (forks)"""
    dropout: float = opt(0.0, at_least=0.0, below=1.0)
    """dropout on residual branches (models whose args have `dropout`)"""
    dropout_masks: str = opt("stream", choices=("stream", "sample"))
    """stream: torch's RNG, one seed on every rank; sample: keyed by each sequence's place in the data, the same at any dp (titanlite.ops.dropout)"""


@section
class Optimizer:
    name: str = opt("AdamW", choices=("AdamW",))
    """optimizer"""
    lr: float = opt(8e-4, above=0.0)
    """peak learning rate"""
    beta1: float = opt(0.9, at_least=0.0, below=1.0)
    """AdamW beta1"""
    beta2: float = opt(0.95, at_least=0.0, below=1.0)
    """AdamW beta2"""
    eps: float = opt(1e-8, above=0.0)
    """AdamW epsilon"""
    weight_decay: float = opt(0.1, at_least=0.0)
    """decoupled weight decay of matrices (never of norms and biases)"""
    weight_decay_embeddings: bool = opt(False)
    """decay embedding tables (and a tied output head) too"""


@section
class LRScheduler:
    warmup_steps: int = opt(200, at_least=0)
    """linear warmup steps from lr/warmup_steps to lr"""
    decay_type: str = opt("cosine", choices=("cosine", "linear", "constant"))
    """decay after warmup"""
    min_lr_factor: float = opt(0.0, at_least=0.0, at_most=1.0)
    """final lr as a fraction of the peak lr"""


@section
class SpikeGuard:
    skip: str = opt("off", choices=("off", "grad_norm", "loss"))
    """skip the update of a step whose grad_norm (or global loss) exceeds the recent mean + k std"""
    k: float = opt(6.0, above=0.0)
    """standard deviations above the recent mean that make a spike"""
    window: int = opt(100, at_least=1, at_most=STEPS_MAX)
    """applied steps whose values form the history"""
    min_history: int = opt(20, at_least=1, at_most=STEPS_MAX)
    """values it needs before it judges a step"""
    max_consecutive: int = opt(3, at_least=0)
    """skips in a row allowed; one more stops the run"""


@section
class Training:
    global_batch_size: int = opt(8, at_least=1)
    """sequences per optimizer step, over all ranks"""
    local_batch_size: int = opt(8, at_least=1)
    """sequences per microbatch per rank"""
    seq_len: int = opt(2048, at_least=1)
    """tokens per sequence"""
    steps: int = opt(10, at_least=1)
    """optimizer steps to run"""
    max_norm: float = opt(1.0, at_least=0.0)
    """clip the global gradient norm to this; 0 disables clipping"""
    seed: int = opt(42, at_least=0, at_most=2**63 - 1)
    """seed of init, data order and everything random"""
    deterministic: bool = opt(False)
    """bitwise repeatable GPU runs: deterministic algorithms, a fixed cuBLAS workspace (slower)"""
    device: str = opt("auto", choices=("auto", "cpu", "cuda"))
    """auto: cuda when available, else cpu"""
    mixed_precision_param: str = opt("auto", choices=("auto", "float32", "bfloat16"))
    """dtype of params in forward/backward; auto: bfloat16 on cuda, float32 on cpu"""
    mixed_precision_reduce: str = opt("float32", choices=("float32", "bfloat16"))
    """dtype of gradient reduction"""
    activation_checkpoint: str = opt("none", choices=("none", "selective", "full"))
    """recompute in backward: full: each block; selective: its pointwise ops (matmul and attention outputs kept)"""
    compile: bool = opt(False)
    """torch.compile each transformer block"""


@section
class Parallelism:
    dp_replicate: int = opt(1, at_least=1)
    """data-parallel replicas (DDP, or the outer dim of HSDP)"""
    dp_shard: int = opt(-1)
    """FSDP shards per replica; -1: all ranks left after dp_replicate"""
    mode: str = opt("auto", choices=("auto", "fsdp", "ddp", "hsdp"))
    """auto: hsdp if both degrees > 1, ddp if only dp_replicate > 1, else fsdp"""
    axes: list[str] = opt([])
    """mesh axes beyond data parallelism, as name=degree, e.g. ["cp=2"] (CLI: a JSON list): cp splits every sequence's positions (context parallelism), tp the model's tensors; the model must declare them (ModelSpec.axes)"""
    skip_grad_sync: str = opt("auto", choices=("auto", "on", "off"))
    """no gradient reduction on non-final microbatches; auto: on for ddp, off for fsdp/hsdp"""
    reshard_after_forward: str = opt("auto", choices=("auto", "always", "never"))
    """fsdp/hsdp: always: free each block's gathered params after its forward (backward gathers them again); never: keep them until its backward; auto: never if the whole model's gathered params take <= 5% of this rank's memory"""


@section
class Data:
    mode: str = opt("pretrain", choices=("pretrain", "sft", "synthetic"))
    """pretrain: packed documents; sft: prompt/response; synthetic: random tokens < model.vocab_size (benchmarks)"""
    path: str = opt("", path="mixture")
    """prepared folder, or raw .txt/.jsonl/.jsonl.gz/.parquet/.arrow file or folder; mixture: 'a:0.7,b:0.3'; empty: built-in stdlib data"""
    text_field: str = opt("text")
    """the field (jsonl) or column (parquet, arrow) that holds a document's text"""
    cache_dir: str = opt("", path="file")
    """tokenizer and token caches; empty: $TITANLITE_CACHE or ~/.cache/titanlite"""
    num_workers: int = opt(0, at_least=0, at_most=64)
    """StatefulDataLoader worker processes per rank"""
    packing: bool = opt(False)
    """sft: pack several records per sequence; attention and RoPE positions restart at each record"""
    document_mask: bool = opt(False)
    """pretrain: attention stays within each document and RoPE positions restart at each"""
    accept_change: bool = opt(False)
    """resume although the data's content changed since the checkpoint (recorded in run.json and events.jsonl)"""


@section
class Eval:
    fraction: float = opt(0.0)
    """hold out this fraction of the data's sequences (sft: records) as the eval set; never trained on"""
    path: str = opt("", path="file")
    """eval data of its own (prepared folder or raw files, no mixture); not with fraction"""
    every: int = schedule(0, "evaluate")
    at_end: bool = opt(True)
    """also evaluate after the last step"""
    at_start: bool = opt(False)
    """also evaluate the model as loaded, before the first step (step 0; a resumed run does not repeat it)"""
    max_sequences: int = opt(0, at_least=0)
    """evaluate on this many sequences spread over the eval set; 0: all of it"""
    local_batch_size: int = opt(0, at_least=0)
    """sequences per eval forward per rank; 0: training.local_batch_size"""
    prompts: list[str] = opt([], whole_items=True)
    """at each eval, decode these prompts into <run>/samples.jsonl and TensorBoard (CLI: one prompt, or a JSON list)"""
    prompt_format: str = opt("auto", choices=("auto", "text", "alpaca", "chat"))
    """how a prompt is put to the model: text (BOS + text), alpaca (an instruction), chat (a user turn); auto: sft data: chat if the tokenizer has a chat template, else alpaca; pretrain: text"""
    sample_tokens: int = opt(64, at_least=1, at_most=1 << 16)
    """new tokens decoded per prompt"""
    temperature: float = opt(0.0, at_least=0.0)
    """sampling temperature of the prompts; 0: greedy"""
    top_p: float = opt(0.9, above=0.0, at_most=1.0)
    """nucleus sampling: the smallest set of tokens with this much probability"""


@section
class Loss:
    normalization: str = opt("global", choices=("global", "local_mean"))
    """global: sum / valid tokens of the whole step (exact); local_mean: naive per-rank mean"""
    chunk_logits_mib: float = opt(256.0, at_least=0.0)
    """most MiB one chunk of fp32 logits may take: the output projection and cross entropy run chunk by chunk over the sequence; 0: the whole sequence at once"""


@section
class Metrics:
    log_every: int = schedule(10, "log", "the first and last steps always log")
    enable_tensorboard: bool = opt(True)
    """write TensorBoard events into <run folder>/tb"""
    enable_wandb: bool = opt(False)
    """also log to Weights & Biases (needs `pip install wandb`)"""
    wandb_project: str = opt("titanlite")
    """W&B project"""
    wandb_entity: str = opt("")
    """W&B entity (user or team); empty: your default entity"""
    wandb_mode: str = opt("online", choices=("online", "offline"))
    """online: stream to W&B; offline: write into <run folder>/wandb, no network (`wandb sync` later)"""


@section
class Checkpoint:
    every: int = schedule(0, "save a checkpoint")
    at_end: bool = opt(False)
    """also save a checkpoint after the last step"""
    folder: str = opt("checkpoints")
    """where checkpoints live; a relative path is inside the run folder"""
    keep_latest_k: int = opt(2, at_least=0)
    """complete checkpoints kept (older ones are deleted after a save); 0: all"""
    load_step: int = opt(-1)
    """resume from this step's checkpoint; -1: the newest complete one, if any"""
    async_mode: str = opt("off", choices=("off", "async"))
    """off: training waits for the write; async: it waits only for a copy to host memory"""
    export_weights: bool = opt(False)
    """at the end, save the full model weights (torch.save) as <run folder>/weights.pt"""
    export_hf: bool = opt(False)
    """at the end, write <run folder>/hf: safetensors, config.json and tokenizer files for transformers"""
    export_dtype: str = opt("float32", choices=("float32", "bfloat16"))
    """dtype of the exported Hugging Face weights"""
    initial_load_path: str = opt("", path="file")
    """a new run starts from this Hugging Face folder or titanlite step folder (read only)"""
    initial_load_drop: list[str] = opt([])
    """tensors of initial_load_path's checkpoint this run leaves unread (any other it cannot take is refused)"""
    initial_load_model_only: bool = opt(True)
    """initial_load_path: weights only; false: also AdamW state and LR schedule position"""
    restore_hparams: bool = opt(True)
    """on resume, lr, betas, eps and weight_decay come from the checkpoint; false: from this config"""

    @property
    def saves(self) -> bool:
        """Whether the run saves checkpoints at all (a stop by signal saves one then too)."""
        return self.every > 0 or self.at_end


@section
class Comm:
    timeout_s: int = opt(600, at_least=1)
    """a collective waiting longer than this stops the run, naming the ranks that did not arrive"""
    trace_buffer: int = opt(2000, at_least=0, at_most=STEPS_MAX)
    """NCCL flight recorder: collectives kept per rank, dumped into <run>/comm_trace on a timeout; 0: off"""


# The most ranks a rehearsal plans for: the largest clusters, with a preflight still seconds long.
REHEARSAL_WORLD_MAX = 65536


@section
class Rehearsal:
    world: int = opt(0, at_least=0, at_most=REHEARSAL_WORLD_MAX)
    """rehearse the run as rank 0 of this many ranks, in one process, with torch's fake process group (./run_train.sh --rehearse W): per-rank memory, compute, traffic and diagnostics cost; 0: train"""
    steps: int = opt(7, at_least=3, at_most=1000)
    """steps a rehearsal runs: the first builds the optimizer state (and compiles), two are watched (memory, bytes, host reads), the rest timed (3: memory and bytes only, for a model slow here)"""
    link_gbps: float = opt(400.0, above=0.0)
    """each rank's network bandwidth in Gbit/s, for the communication time per step"""
    device_gb: float = opt(80.0, above=0.0)
    """the memory of the devices rehearsed for, in GB (10^9 bytes): the report's fits-or-not verdict"""
    blocks: int = opt(-1, at_least=-1)
    """blocks of the model the measured steps run, the rest derived from them (memory, traffic, compute: said so in the report); 0: the whole model; -1 (auto): 2 on a CPU where a step of the whole model is above 10^13 FLOPs, else the whole model"""


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
    # [faults] (titanlite.faults), a plugin's section: None until a config or a flag names it
    faults: Any = None


# name -> ("module:name" of its dataclass, of the hook a trainer builds), imported once named
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
    """The defaults of every section, the plugins' included (run comparison's)."""
    return JobConfig(**{name: plugin_section(name) for name in PLUGIN_SECTIONS})


def sections(cfg: JobConfig) -> list[tuple[str, Any]]:
    """(name, section) of every section `cfg` has: the core's, and the plugins' it names."""
    return [(f.name, getattr(cfg, f.name)) for f in fields(cfg) if getattr(cfg, f.name) is not None]
