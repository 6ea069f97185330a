"""Model registry: name -> (model class, flavors, parallelize function).

A fork adds a model with one call:

    register_model(ModelSpec("mymodel", MyModel, {"small": MyArgs(...)}, parallelize_mymodel))

and selects it with `[model] name = "mymodel"` (plus `import_module = "my_pkg.my_model"` so the
registration runs inside every worker). `import_module` is imported with importlib in every
process that builds the model, so Python finds it as it finds any module: on PYTHONPATH (which
torchrun passes on to the workers) or among the installed packages; run_train.sh adds nothing,
and scripts/check_model.py adds the current directory. `build_meta_model(cfg, vocab_size)` is
the one call that turns a config into the model on the meta device, for the trainer and a
fork's own scripts alike; `./scripts/check_model.py --model.name mymodel ...` checks a model
against this contract (gradient at every layout, initial weights, a Hugging Face folder). The
built-in families (llama3/, qwen3_moe/) are thin modules over titanlite.models.common's blocks
(attention, RoPE, RMSNorm, SwiGLU, the decoder shell that holds the head and its loss), which a
fork's model may build on too. The contract for a registered model:

- `model_cls(args)` builds it; `args` is a dataclass with the fields `vocab_size` and
  `max_seq_len`, which the trainer fills in from the tokenizer and `training.seq_len`;
- `model(tokens[B, S]) -> logits[B, S, vocab]`; for data.packing and data.document_mask also
  `model(tokens, positions=positions[B, S])`, each token's position within its document (0
  starts one; see titanlite.models.common.document_attention), else build_meta_model refuses
  those options;
- the labels path, the one way a model that has it is trained and evaluated:
  `model(tokens, labels=labels[B, S], loss_chunk=n, positions=...)` -> each sequence's summed
  cross entropy [B], the output projection run n positions at a time (0: the whole sequence as
  one chunk; loss.chunk_logits_mib sets n at a large vocabulary; see
  titanlite.ops.cross_entropy.chunked_cross_entropy_per_sample). A model without `labels` gets
  logits only, and a config whose logits would be chunked is refused in one line;
- named loss terms: the labels path may return `(ce[B], {"aux": a[B], "z": z[B]})`, each term a
  per-sequence sum that the trainer divides by the step's normaliser like the cross entropy,
  adds to the loss it backpropagates and logs by name (metrics.jsonl, TensorBoard, the console,
  the summary); the logged loss stays the cross entropy. A term is exact at every layout when
  its sum over the step's sequences, divided by the step's valid tokens, is the term of the
  whole global batch: titanlite.models.step gives the three patterns (per-token sums, statistics
  of the whole step, the previous step's statistics) with an example each;
- the step context: a forward that takes `step` gets a titanlite.models.step.StepContext in
  training (the normaliser's group, the microbatch index, the accumulation count, the step's
  valid tokens as a device tensor, a counted SUM all-reduce); None elsewhere. With
  `step_statistics=True` in its ModelSpec the trainer first runs the forward without gradient
  on every microbatch of the step with `step.counting` set (and the microbatch's labels and
  positions, as in training: which tokens count is the model's to say), expecting this microbatch's
  statistics (a 1-D tensor), and hands their sum over the step to every training forward as
  `step.statistics`;
- optional expert load, for a mixture of experts with step statistics:
  `model.expert_load(statistics) -> {layer name: shares[E]}` maps the statistics, summed over
  the steps since the last log step, to each MoE layer's share of its routing slots per expert
  (summing to 1), on the device without a host read (no `.item()`, no `.tolist()`); each log
  step reports it with no collective and no host read of its own
  (titanlite.components.expert_load: the most uneven layer's max/min share on the console, max/min
  and the coefficient of variation per layer in metrics.jsonl and TensorBoard, the most and
  least loaded expert in the summary);
- the root rule: the output head and the loss run inside the root module's own forward (as
  above), never in a submodule FSDP wraps on its own or in a function after forward returns:
  FSDP gathers the root's parameters (embedding, final norm, head) for the root's forward and
  backward only, so a head used outside it would meet a sharded weight;
- for model.dropout_masks = "sample": `model(tokens, ..., sample_keys=keys[B])`, each
  sequence's int64 key, from which its dropout masks are drawn (titanlite.ops.dropout.keyed_dropout),
  so that a sequence's masks do not depend on the rank or microbatch that runs it;
- `model.init_weights(init: ParamInit)` fills every parameter through `init` (see
  titanlite.distributed.param_init) and recomputes its buffers, so initial weights do not
  depend on how the model is sharded;
- optional `model.num_flops_per_token(seq_len) -> int` for TFLOP/s and MFU;
- optional KV cache for generation (titanlite.components.generate): `model.kv_cache(lengths[B])`
  returns a cache, and `model(tokens, cache=cache)` gives the logits of right-padded prompts
  first, then of one token per row at a time; without it generation runs full forwards;
- the axis rules, for a model that declares mesh axes beyond data parallelism (`axes=("cp",)`
  in its ModelSpec; the config's parallelism.axes = ["cp=2"] sets their degrees): the mesh is
  dp_replicate x dp_shard x the axes, in the order of titanlite.config.layout's AXIS_KINDS, the
  one table that says what each axis splits; ParallelDims derives every group from it. The
  ranks along an axis read the same sequences (one dp_rank).
  A sequence split (`cp`): each rank gets one equal piece of every sequence's positions
  (ParallelDims.piece: tokens, labels and positions cut the same way; `positions` keeps the
  global within-document values), so the loss, the token counts and the normaliser need
  nothing more: every rank sums its own positions' loss and counts its own labels, and the
  normaliser's group and the gradient sum include the axis (FSDP shards over dp_shard and it).
  The model makes each piece see its whole sequence: attention gathers it over the axis
  (ParallelDims.axis_group(name) gives the group; all-to-all over heads, or a ring), position
  embeddings and document boundaries come from global positions (the piece's offset is
  seq_rank x its length), and a per-sequence sum it needs whole (a norm over the sequence) is
  all-reduced over the axis. The diagnostics sum each replica's pieces; the memory estimate
  traces one piece on the model unsplit, without the exchange's own buffers.
  A tensor split (`tp`): every rank of the axis gets the whole sequences and holds a slice of
  the model's tensors, every parameter a DTensor on ParallelDims.tensor_mesh (the shared
  blocks' plans: titanlite.models.common.tensor_parallel); the normaliser's group
  (ParallelDims.dp_group) and FSDP's and DDP's gradient sums leave the axis out, so the plan
  reduces over it what it keeps replicated (DTensor does, for a replicated placement), and every
  rank of the axis returns the same per-sequence losses, counted once. The plan runs before the
  data-parallel wrapping (parallelize_blocks): FSDP then shards each slice, and DDP, which takes
  no DTensor, becomes torch's FSDP-based replicate;
- `parallelize_fn(model, parallel_dims, job_config) -> nn.Module` applies activation
  checkpointing, compile and FSDP/DDP/HSDP (usually via titanlite.distributed.parallelize);
- optional `hf`: an HFAdapter, how the model reads and writes a Hugging Face folder:
  `architectures` (config.json's names it reads), `args_from_config` and `config_from_args`
  (config.json <-> the args), `from_hf` and `to_hf` (one full tensor at a time, HF name <->
  titanlite name, any permutation applied both ways; a parameter a folder holds in pieces,
  one tensor per expert say, is read piece by piece, `from_hf` giving each one's Index in it,
  and written as the list `to_hf` returns), and `keys`, every config.json key
  `args_from_config` uses, declared with its kind, bounds, what null means and its relations to
  other keys (titanlite.models.hf_keys: `values = MY_KEYS.read(config)` in `args_from_config`
  gives them checked), since a folder's configs are read whole and every value through its
  declaration (titanlite.models.hf_files: a key neither used nor known to be harmless is
  refused, and so is a value outside its bounds, in one line before any worker starts). The
  tied-head rule: a head tied to its
  embedding is one Parameter assigned to both modules, so named_parameters lists it once, under
  the embedding's name; `to_hf` therefore sees it once and the export writes no head tensor,
  `from_hf` returns None for a folder's head copy when the args say tied, and
  `config_from_args` writes `tie_word_embeddings`.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from titanlite.config import JobConfig
from titanlite.config.layout import AXIS_KINDS, extra_axes, loss_chunks
from titanlite.errors import UserError, foreign
from titanlite.models.common.tensor_parallel import check_tensor_split
from titanlite.models.hf_files import read_config
from titanlite.models.hf_keys import ConfigKeys
from titanlite.models.step import LossPath
from titanlite.tools.records import read_json

# Where a Hugging Face tensor goes in a parameter: an index (ints and slices, leading dims) of
# the parameter it fills a piece of; None: the whole parameter.
Index = tuple[int | slice, ...] | None


@dataclass(frozen=True)
class HFAdapter:
    """A model's mapping to a Hugging Face transformers folder (config.json + safetensors).

    The weight maps work on one full tensor at a time, so a sharded model is converted tensor
    by tensor and no rank ever holds the whole model. Where a folder splits one parameter into
    several tensors (each expert of a mixture of experts on its own), `from_hf` places each as
    a piece of it (name, tensor, index) and `to_hf` returns the list of pieces."""

    architectures: tuple[str, ...]  # config.json "architectures" this adapter reads
    args_from_config: Callable[[dict], Any]  # config.json -> the model's args
    config_from_args: Callable[[Any], dict]  # the model's args -> config.json
    # (HF name, tensor, args) -> titanlite's name and tensor, or name, tensor and the Index of
    # the piece it fills; None: no place of its own (a tied copy)
    from_hf: Callable[[str, Any, Any], tuple | None]
    # (titanlite name, tensor, args) -> HF's name and tensor, or a list of them
    to_hf: Callable[[str, Any, Any], tuple[str, Any] | list[tuple[str, Any]]]
    # the config.json keys args_from_config reads, each declared with its kind, bounds, null and
    # default, and the relations between them (models/hf_keys.py): a folder's config.json is
    # checked against them before any worker starts; args_from_config reads through them too
    keys: ConfigKeys | None = None
    # further config.json keys args_from_config reads, undeclared (a fork's, read as it likes);
    # with `keys`, titanlite's own and the harmless ones (models/hf_files.py), every key of a
    # folder's config.json must be one of them
    reads: frozenset[str] = frozenset()
    # args -> what of the training objective config.json cannot carry, each one line said at
    # export (the weights are exact; a trainer reading the folder would optimise another loss)
    unsaid: Callable[[Any], list[str]] | None = None

    def read(self, name: str, tensor: Any, args: Any) -> tuple[str, Any, Index] | None:
        """from_hf, its answer always (titanlite name, tensor, Index) or None."""
        mapped = self.from_hf(name, tensor, args)
        if mapped is None or len(mapped) == 3:
            return mapped
        return (*mapped, None)

    def write(self, name: str, tensor: Any, args: Any) -> list[tuple[str, Any]]:
        """to_hf, its answer always a list of (HF name, tensor)."""
        out = self.to_hf(name, tensor, args)
        return out if isinstance(out, list) else [out]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type
    flavors: dict[str, Any]
    parallelize_fn: Callable[..., Any]
    hf: HFAdapter | None = None
    # the mesh axes beyond data parallelism the model splits itself over (parallelism.axes; the
    # contract's axis rules, AXIS_KINDS' names); an axis a config names and the model does not is refused
    axes: tuple[str, ...] = ()
    # the step-statistics pass: the forward, without gradient and with step.counting set, on
    # every microbatch before the step's first training forward (titanlite.models.step)
    step_statistics: bool = False


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add a model; registering the same name again replaces it (convenient in notebooks)."""
    _REGISTRY[spec.name] = spec
    return spec


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        match = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f"did you mean '{match[0]}'?" if match else f"registered: {', '.join(_REGISTRY)}"
        raise UserError(
            f"unknown model.name '{name}' ({hint}); a fork registers its model with "
            "register_model() in the module named by model.import_module"
        )
    return _REGISTRY[name]


def models_reading(architectures: list[str]) -> list[str]:
    """The registered models whose HFAdapter reads a config.json of these architectures."""
    return [
        n for n, s in _REGISTRY.items() if s.hf and set(architectures) & set(s.hf.architectures)
    ]


def get_flavor(spec: ModelSpec, flavor: str) -> Any:
    if flavor not in spec.flavors:
        match = difflib.get_close_matches(flavor, list(spec.flavors), n=1)
        hint = f"did you mean '{match[0]}'?" if match else f"valid: {', '.join(spec.flavors)}"
        raise UserError(f"model.flavor '{flavor}' is not a flavor of {spec.name} ({hint})")
    return spec.flavors[flavor]


@dataclass
class MetaModel:
    """A model built on the meta device (no memory yet) with what the trainer needs to know."""

    spec: ModelSpec
    args: Any  # the flavor with vocab_size, max_seq_len (and dropout) filled in
    model: nn.Module
    flops_per_token: int  # training FLOPs per token; 0 if the model does not say
    loss_chunk: int = (
        0  # training's loss chunk in positions (0: the whole sequence); the plan's loss_chunks
    )
    eval_loss_chunk: int = 0  # the same at eval's local batch

    def loss_path(self, evaluating: bool = False) -> LossPath:
        """How training (or eval) calls the model for its loss: the labels path whenever the
        forward has one, the chunk a parameter of it."""
        takes = inspect.signature(self.spec.model_cls.forward).parameters
        return LossPath(
            own={"labels", "loss_chunk"} <= takes.keys(),
            chunk=self.eval_loss_chunk if evaluating else self.loss_chunk,
            step="step" in takes and not evaluating,
            statistics=self.spec.step_statistics and not evaluating,
        )


def hf_args(spec: ModelSpec, folder: Path, tokenizer_vocab: int) -> Any:
    """The model's args from a Hugging Face folder's config.json, through the spec's adapter; the
    tokenizer's ids must fit the embedding."""
    config = read_json(
        folder / "config.json", "a Hugging Face model folder's config.json is a JSON object"
    )
    archs = config.get("architectures") or [config.get("model_type", "?")]
    if spec.hf is None or not set(archs) & set(spec.hf.architectures):
        reads = ", ".join(spec.hf.architectures) if spec.hf else "nothing: it has no HFAdapter"
        raise UserError(
            f"'{folder}' holds a {', '.join(archs)} but model '{spec.name}' reads {reads}; "
            "use a folder of that architecture, or a model.name whose adapter reads it"
        )
    args = spec.hf.args_from_config(read_config(folder, spec.hf.reads, spec.hf.keys))
    if tokenizer_vocab > args.vocab_size:
        raise UserError(
            f"the tokenizer's ids reach {tokenizer_vocab - 1} but config.json's vocab_size is "
            f"{args.vocab_size}; use the folder's own tokenizer"
        )
    return args


def build_meta_model(cfg: JobConfig, vocab_size: int) -> MetaModel:
    """cfg.model on the meta device: imports model.import_module (a fork's registration), looks
    up the name, takes the shapes from the flavor (vocabulary: model.vocab_size, else the
    tokenizer's `vocab_size`; 0: no tokenizer) or from model.hf_assets_path's config.json, fills
    in training.seq_len and model.dropout. Next: `spec.parallelize_fn`, then
    titanlite.distributed.parallelize.materialize."""
    m = cfg.model
    if m.vocab_size and m.vocab_size < vocab_size:
        raise UserError(
            f"model.vocab_size is {m.vocab_size} but the tokenizer's ids reach {vocab_size - 1}; "
            f"set it to {vocab_size} or more, or 0 for the tokenizer's own"
        )
    if m.import_module:
        with foreign(f"model.import_module '{m.import_module}'", "fix the module, or name another"):
            try:
                importlib.import_module(m.import_module)
            except ModuleNotFoundError as e:
                if e.name is None or not m.import_module.startswith(e.name):
                    raise  # the module was found; something it imports was not
                raise UserError(
                    f"model.import_module '{m.import_module}' cannot be imported ({e}); check the module path "
                    "and PYTHONPATH (the folder you run from is searched too)"
                ) from None
    import titanlite.models  # noqa: F401  (registers the built-in models)

    spec = get_model_spec(m.name)
    if m.hf_assets_path:
        args = hf_args(spec, Path(m.hf_assets_path).expanduser(), vocab_size)
    else:
        args = replace(get_flavor(spec, m.flavor), vocab_size=m.vocab_size or vocab_size)
    args = replace(args, max_seq_len=cfg.training.seq_len)
    if cfg.rehearsal.world and 0 < cfg.rehearsal.blocks < getattr(args, "n_layers", 0):
        # a rehearsal that measures its first blocks and derives the rest (titanlite/rehearsal)
        args = replace(args, n_layers=cfg.rehearsal.blocks)
    if m.dropout:
        if not hasattr(args, "dropout"):
            raise UserError(f"model.dropout is set but model '{m.name}' has no dropout; remove it")
        args = replace(args, dropout=m.dropout)
    chunks = loss_chunks(cfg, args.vocab_size)
    _check_capabilities(spec, cfg, any(chunks))
    where = spec.model_cls.__module__
    fork = foreign(f"model '{m.name}' ({where})", "fix the model's code")
    with torch.device("meta"), contextlib.nullcontext() if where.startswith("titanlite.") else fork:
        model = spec.model_cls(args)
    split = math.prod(
        d for n, d in extra_axes(cfg.parallelism.axes) if not AXIS_KINDS[n].distinct_tokens
    )
    if split > 1:
        check_tensor_split(model, split)
    flops = (
        model.num_flops_per_token(cfg.training.seq_len)
        if hasattr(model, "num_flops_per_token")
        else 0
    )
    return MetaModel(spec, args, model, flops, *chunks)


def _check_capabilities(spec: ModelSpec, cfg: JobConfig, chunked: bool) -> None:
    """What the config asks of the model's forward, against its signature (the contract above):
    every refusal in one line, before any weight exists."""
    takes = inspect.signature(spec.model_cls.forward).parameters
    if (cfg.data.packing or cfg.data.document_mask) and "positions" not in takes:
        raise UserError(
            f"model '{spec.name}' has no per-document attention (its forward takes no positions), "
            "which data.packing and data.document_mask need; turn them off, or give the model "
            "forward(tokens, ..., positions) (see models/llama3/model.py)"
        )
    if cfg.checkpoint.export_hf and spec.hf is None:
        raise UserError(
            f"checkpoint.export_hf: model '{spec.name}' has no HFAdapter in its registry entry; "
            "add one (see models/llama3/hf.py) or use checkpoint.export_weights"
        )
    if cfg.model.dropout and cfg.model.dropout_masks == "sample" and "sample_keys" not in takes:
        raise UserError(
            f"model.dropout_masks 'sample': model '{spec.name}' has no dropout keyed by sample (its forward "
            "takes no sample_keys); use 'stream', or give the model forward(tokens, ..., sample_keys)"
        )
    undeclared = [n for n, _ in extra_axes(cfg.parallelism.axes) if n not in spec.axes]
    if undeclared:
        raise UserError(
            f"parallelism.axes: model '{spec.name}' does not split its {AXIS_KINDS[undeclared[0]].splits} "
            f"over '{undeclared[0]}' (its ModelSpec.axes: {list(spec.axes)}); remove the axis, or declare it "
            "and split the model over it (the axis rules in titanlite/models/registry.py)"
        )
    if spec.step_statistics and not {"step", "labels"} <= takes.keys():
        raise UserError(
            f"model '{spec.name}' asks for step statistics (ModelSpec.step_statistics) but its forward takes "
            "no step or no labels; give it forward(tokens, labels=None, ..., step=None) "
            "(titanlite/models/step.py), or drop the flag"
        )
    if chunked and not {"labels", "loss_chunk"} <= takes.keys():
        raise UserError(
            f"model '{spec.name}' returns logits only (its forward takes no labels and loss_chunk), and "
            f"loss.chunk_logits_mib = {cfg.loss.chunk_logits_mib:g} asks for the loss in chunks; set it to 0, or "
            "give the model forward(tokens, labels, loss_chunk) (see models/llama3/model.py)"
        )
