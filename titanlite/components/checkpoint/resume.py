"""Whether this run may resume from a saved step (same model and data, this run folder's) or
start from another run's, and which config changes take effect on resume. Torch-free but for
check_fits: the preflight asks it, the trainer again."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from titanlite.components.checkpoint.index import step_dir
from titanlite.config import JobConfig
from titanlite.config.fields import IDENTITY_KEYS, identity
from titanlite.config.job_config import sections
from titanlite.config.layout import mesh_text, resolve_layout
from titanlite.config.unused import unused_in
from titanlite.distributed.param_init import canonical_name
from titanlite.errors import UserError
from titanlite.tools.records import read_json

# Optimizer hyperparameters that a resume restores from the checkpoint (AdamW's param groups and
# the scheduler's base lr) unless checkpoint.restore_hparams is false.
RESTORED = (
    "optimizer.lr",
    "optimizer.beta1",
    "optimizer.beta2",
    "optimizer.eps",
    "optimizer.weight_decay",
)
# What only a fresh run does: set on a resume, they change nothing, and the resume says why.
FRESH_ONLY = {
    "eval.at_start": "a resumed run does not evaluate before its first step (step 0 was the first run's)",
    "checkpoint.initial_load_path": "a resume continues from its own checkpoint",
    "checkpoint.initial_load_model_only": "a resume continues from its own checkpoint",
}


def check_resumable(
    folder: Path, step: int, cfg: JobConfig, run_dir: Path, data: list[dict] | None = None
) -> str | None:
    """Refuse, in one line, a checkpoint trained on something else, or one outside this run folder
    that another run wrote (resuming would prune its checkpoints). `data`: what this run's data
    holds (None: not known yet), compared by content. Returns what changed in the data, which
    data.accept_change lets through (None: nothing)."""
    path = step_dir(folder, step)
    state = json.loads((path / "state.json").read_text())  # find() read it
    owner, mine = state.get("run_folder"), run_dir.resolve()
    if owner and Path(owner) != mine and not folder.resolve().is_relative_to(mine):
        # A new run from one needs a checkpoint.folder of its own too: in this one, it would
        # resume (and be refused here) again. A run that is gone (moved, removed) is not offered.
        start = (
            f"start a new run from one with checkpoint.initial_load_path = '{path}' (and "
            "checkpoint.initial_load_model_only = false to keep its optimizer) and another checkpoint.folder"
        )
        if Path(owner).is_dir():
            fix = f"resume that run with its own --job.run_name, or {start}"
        else:
            fix = f"that run folder is no longer there (moved or removed); to go on from its checkpoints, {start}"
        raise UserError(
            f"checkpoint.folder '{folder}' holds the checkpoints of run '{owner}'; {fix}"
        )
    _require(state, "identity", path)
    saved = state.get("data")  # what its data held, by content (none: data.path is compared)
    theirs, unused = (
        state["identity"],
        unused_in(cfg),
    )  # a key this run leaves unused trains nothing
    diff = [
        f"{k}: checkpoint {theirs.get(k)!r}, config {v!r}"
        for k, v in identity(cfg).items()
        if theirs.get(k) != v and not (k == "data.path" and saved) and k not in unused
    ]
    if diff:
        raise UserError(
            f"checkpoint {path} was trained on something else ({'; '.join(diff)}); "
            "use a matching config, another checkpoint.folder, or start a new run"
        )
    changed = data_change(saved, data) if saved and data is not None else None
    if changed and not cfg.data.accept_change:
        raise UserError(
            f"the data changed since checkpoint {path} was written: {changed}; resume on the "
            "data it trained on, or add --data.accept_change true to go on with this data knowingly "
            "(recorded in run.json and events.jsonl)"
        )
    return changed


def _require(state: dict, key: str, path: Path) -> None:
    """What a resume compares, recorded: else one line with the way out."""
    if not isinstance(state.get(key), dict):
        raise UserError(
            f"checkpoint {path} records no {key} in its state.json, so it cannot resume; start "
            f"a new run from its weights with checkpoint.initial_load_path = '{path}'"
        )


def data_change(saved: list[dict], now: list[dict]) -> str | None:
    """How the data a run trains on now differs, by content, from what a checkpoint recorded;
    None: the same (wherever it lives now)."""
    if len(saved) != len(now):
        return f"data.path names {len(now)} dataset(s), the checkpoint's run {len(saved)}"
    for old, new in zip(saved, now, strict=True):
        where = f"'{new['path']}'" if new["path"] else "the built-in data"
        if old["content"] != new["content"]:
            return (
                f"{where} holds other data than the run trained on (content {str(old['content'])[:12]} then, "
                f"{str(new['content'])[:12]} now: a file added, removed or edited, or another preparation)"
            )
        if abs(old["weight"] - new["weight"]) > 1e-9:
            return f"{where} weighs {new['weight']:g} in the mixture, {old['weight']:g} then"
    return None


def flat_config(cfg: JobConfig) -> dict[str, Any]:
    """{"section.key": value} of every field: what state.json keeps of the config."""
    return {f"{name}.{f.name}": getattr(s, f.name) for name, s in sections(cfg) for f in fields(s)}


def written_at(state: dict[str, Any]) -> str:
    """The layout a checkpoint was written at, every axis named as the run names layouts
    (config.layout.mesh_text: "fsdp 1x2xcp=2"), from its state.json: the config it saved,
    resolved at the world size it ran on; its world size alone if that no longer resolves."""
    world = state["world_size"]
    cfg = JobConfig()
    for dotted, value in state.get("config", {}).items():
        section, _, key = dotted.partition(".")
        if hasattr(getattr(cfg, section, None), key):
            setattr(getattr(cfg, section), key, value)
    try:
        layout = resolve_layout(cfg, world)
    except UserError:
        return f"{world} rank(s)"
    return f"{mesh_text(layout.mode, layout.dp_replicate, layout.dp_shard, dict(layout.axes))}, {world} rank(s)"


def resume_changes(
    state: dict[str, Any], cfg: JobConfig, lr: tuple[float, float] | None = None
) -> list[str]:
    """One line per config value that differs from the checkpoint's run, saying what takes effect
    from which step; `lr`: the next step's lr under the checkpoint's schedule and this run's."""
    step = state["step"]
    before = state["config"]
    lines = []
    for key, now in flat_config(cfg).items():
        if key == "data.path" and key in before and before[key] != now and state.get("data"):
            lines.append(
                f"resume: data.path was {before[key]!r}, now {now!r}: the same data, by content"
            )
        unchecked = key in IDENTITY_KEYS or key == "checkpoint.load_step" or key not in before
        if unchecked or before[key] == now:
            continue
        if key in FRESH_ONLY:
            effect = f"not applicable: {FRESH_ONLY[key]}"
        elif key in RESTORED and cfg.checkpoint.restore_hparams:
            effect = (
                "not applied: the checkpoint's value is restored "
                "(--checkpoint.restore_hparams false applies this config's)"
            )
        else:
            effect = f"applied from step {step + 1}"
            if key in RESTORED:
                effect += " (checkpoint.restore_hparams = false)"
            elif key.startswith("lr_scheduler.") or key == "training.steps":
                moved = f"; its lr {lr[0]:.3g} -> {lr[1]:.3g}" if lr and lr[0] != lr[1] else ""
                effect += f": the schedule continues under the new setting{moved}"
        lines.append(f"resume: {key} was {before[key]!r}, now {now!r}: {effect}")
    return lines


def check_fits(path: Path, model_state: dict[str, Any]) -> list[str]:
    """Every tensor of the model is in the checkpoint at `path` with the same shape (read from
    DCP's .metadata, before any weight moves); else one UserError naming the first that is not.
    Returns the names of the checkpoint's model tensors."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {k.removeprefix("model."): v for k, v in metadata.items() if k.startswith("model.")}
    for name, tensor in model_state.items():
        have = saved.get(name)
        if have is None:
            raise UserError(
                f"checkpoint '{path}' holds no '{name}'; it is not a checkpoint of this model"
            )
        if tuple(have.size) != tuple(tensor.shape):
            raise UserError(
                f"'{name}' in checkpoint '{path}' has shape {tuple(have.size)}, this model's "
                f"{tuple(tensor.shape)}; use the model (and tokenizer) that run trained"
            )
    return list(saved)


def check_initial_fits(
    path: Path, model: Any, drop: list[str], tokenizer: str | None = None
) -> None:
    """A start from another run's step folder takes every tensor both ways, but those `drop`
    names: each of the model's is there in its shape, each of the checkpoint's lands in a tensor
    of its own (not one the model ties to another); and its token ids mean the same
    (`tokenizer`: this run's fingerprint, if known) or the tables they index are dropped."""
    ours = model.state_dict()
    saved = check_fits(path, {n: t for n, t in ours.items() if n not in drop})
    saved = [k for k in saved if k not in drop]
    lacking = [k for k in saved if k not in ours]
    state = read_json(path / "state.json", "it is written with every checkpoint")
    trained_with = state.get("tokenizer")  # None: synthetic tokens, or an unknown fingerprint
    other = trained_with and tokenizer and trained_with != tokenizer
    if other and not set(token_tables(model)) <= set(drop):
        raise UserError(
            f"checkpoint.initial_load_path '{path}' was trained with another tokenizer (fingerprint {trained_with}, this "
            f"run's {tokenizer}): its embedding rows stand for other tokens; use the tokenizer its run used (its "
            f"config.toml names it), or start {', '.join(token_tables(model))} afresh: name them in "
            "--checkpoint.initial_load_drop"
        )
    together = {name: set(group) for group in state.get("tied", []) for name in group}
    for names in tied_groups(model):  # names[0] is read, the rest share it
        lacking += [n for n in names[1:] if n in saved and n not in together.get(names[0], ())]
    if lacking:
        raise UserError(
            f"checkpoint.initial_load_path '{path}' holds {', '.join(lacking[:4])}{' ...' if len(lacking) > 4 else ''}, "
            "which this model would leave unread (it has no such tensor, or ties it to another); start from a "
            "checkpoint of this model, or name them in --checkpoint.initial_load_drop to leave them unread"
        )


def token_tables(model: Any) -> list[str]:
    """The parameters a token id indexes: each embedding table, and the output head (the last
    linear layer with as many outputs as a table has rows; a tied one too, as its name loads)."""
    import torch.nn as nn

    modules = list(model.named_modules())
    rows = {m.num_embeddings for _, m in modules if isinstance(m, nn.Embedding)}
    heads = [name for name, m in modules if isinstance(m, nn.Linear) and m.out_features in rows]
    tables = [name for name, m in modules if isinstance(m, nn.Embedding)] + heads[-1:]
    return [canonical_name(f"{name}.weight") for name in tables]


def tied_groups(model: Any) -> list[list[str]]:
    """The parameter names that share one tensor (a head tied to the embedding), in groups:
    state.json records them for check_initial_fits."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(canonical_name(name))
    return [names for names in by_tensor.values() if len(names) > 1]


def model_record(args: Any) -> dict[str, Any]:
    """A model's args (MetaModel.args) as state.json records them, for check_same_model."""
    return json.loads(json.dumps(asdict(args), default=str))


def hf_config(cfg: JobConfig) -> dict[str, Any] | None:
    """model.hf_assets_path's config.json as the run read it (state.json keeps it, so a resume can
    name the key that changed); None without one."""
    if not cfg.model.hf_assets_path:
        return None
    return read_json(Path(cfg.model.hf_assets_path).expanduser() / "config.json")


def check_same_model(folder: Path, step: int, meta: Any, cfg: JobConfig) -> None:
    """The model this run builds (`meta`: a MetaModel) has the args checkpoint `step` recorded:
    model.hf_assets_path's config.json is read anew by every launch, so an edit to it would
    otherwise reach the load as a size-mismatch traceback, or go unseen."""
    path = step_dir(folder, step)
    state = json.loads((path / "state.json").read_text())  # find() read it
    _require(state, "model_args", path)
    saved = state["model_args"]
    ours = model_record(meta.args)  # but dropout, a training setting a resume may change
    diff = [
        f"{k} {saved[k]!r}, now {v!r}"
        for k, v in ours.items()
        if k in saved and k != "dropout" and saved[k] != v
    ]
    if not diff:
        return
    m = cfg.model
    what = f"model.hf_assets_path's config.json ({m.hf_assets_path})"
    if not m.hf_assets_path:
        what = f"{m.name} flavor '{m.flavor}'"
    what += f" gives another model ({'; '.join(diff)})"
    before, now = state.get("hf_config") or {}, hf_config(cfg) or {}
    keys = [
        f"{k} {before.get(k)!r}, now {now.get(k)!r}"
        for k in sorted({*before, *now})
        if before.get(k) != now.get(k)
    ]
    if keys:  # the same model.hf_assets_path (an identity key): its config.json was edited
        what = f"{m.hf_assets_path}/config.json changed ({'; '.join(keys)})"
    raise UserError(
        f"the model changed since checkpoint {path} was written: {what}; restore it as it was, or start a "
        "new run under another job.run_name"
    )
