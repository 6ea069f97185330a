"""Whether a registered model trains exactly under titanlite: its gradient at every layout equals
one process's, its initial weights do not depend on the layout. scripts/check_model.py and the
suite's exactness worker run the same cases, so they cannot drift apart. Under torchrun:
`python -m titanlite.analysis.model_check OUT [--section.key VALUE ...]`. Very unequal valid-label
counts catch a loss normalised locally; packed documents catch attention leaking across them."""

from __future__ import annotations

import hashlib
import json
import math
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.analysis.check_cases import (
    GLOBAL_BATCH,
    SEQ,
    VOCAB,
    Case,
    case_config,
    cases,
    check_config,
    hf_config,
)
from titanlite.components.checkpoint.hf_export import export_hf
from titanlite.components.checkpoint.hf_load import DERIVED_BUFFERS, load_hf_weights
from titanlite.components.loss import (
    LossBalancer,
    forward_backward,
    sequence_losses,
    step_statistics,
)
from titanlite.config import JobConfig
from titanlite.config.layout import resolve_layout
from titanlite.datasets.batch import Microbatch
from titanlite.datasets.sequences import restart_positions
from titanlite.distributed.parallel_dims import ParallelDims, init_distributed
from titanlite.distributed.parallelize import materialize, unwrap
from titanlite.distributed.param_init import ParamInit, canonical_name
from titanlite.distributed.utils import clip_grad_norm_
from titanlite.errors import UserError
from titanlite.models.registry import build_meta_model
from titanlite.ops.cross_entropy import IGNORE_INDEX, cross_entropy_sum

TOL = 1e-5  # fp32: one process against a sharded reduction differ by summation order only
NO_CLIP = 1e30  # clip_grad_norm_'s bound in the check: the path runs, the gradient is kept


def unequal_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """16 sequences: 4 with no valid label, 4 with 1-2, 8 with 15-16 (ranks and microbatches of very unequal counts)."""
    g = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, VOCAB, (2, GLOBAL_BATCH, SEQ), generator=g)
    for i, n in enumerate([0, 0, 0, 0, 1, 2, 1, 2] + [16, 15, 16, 15, 16, 16, 15, 16]):
        labels[i, n:] = IGNORE_INDEX
    return tokens, labels


def documents() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """32 documents of 2-9 tokens (inputs, labels; each first half ignored, as a prompt's)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(32):
        n = int(torch.randint(2, 10, (), generator=g))
        x, y = torch.randint(0, VOCAB, (2, n), generator=g)
        y[: n // 2] = IGNORE_INDEX
        out.append((x, y))
    return out


def packed_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The documents, first fit in order, into the batch's sequences (the rest padding)."""
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    for x, y in documents():
        if sum(len(r[0]) for r in rows[-1]) + len(x) > SEQ:
            rows.append([])
        rows[-1].append((x, y))
    tokens = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    labels = torch.full((GLOBAL_BATCH, SEQ), IGNORE_INDEX)
    positions = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.long)
    for i, row in enumerate(rows):
        ends = torch.tensor([len(x) for x, _ in row]).cumsum(0).tolist()
        tokens[i, : ends[-1]] = torch.cat([x for x, _ in row])
        labels[i, : ends[-1]] = torch.cat([y for _, y in row])
        positions[i] = torch.from_numpy(restart_positions([0, *ends], SEQ))
    return tokens, labels, positions


def reference(cfg: JobConfig, packed: bool) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """One process, unsharded (packed: each document a sequence of its own): the whole batch's
    gradient, token-mean cross entropy and terms, through the model's own loss path."""
    meta = build_meta_model(cfg, 0)
    model = _alone(meta, cfg.training.seed)
    pairs = [(x[None], y[None]) for x, y in documents()] if packed else [unequal_batch()]
    micro = [Microbatch(x, y) for x, y in pairs]
    path = replace(meta.loss_path(), chunk=0)
    balancer = LossBalancer("global", None, 1, len(micro))
    stats = step_statistics(model, micro, balancer) if path.statistics else None
    balancer.begin_step([b.labels for b in micro], stats)
    sums: dict[str, torch.Tensor] = {}
    for m, b in enumerate(micro):
        out = sequence_losses(model, b, path, balancer.context(m))
        for name, t in {"loss": out.ce, **out.terms}.items():
            sums[name] = sums[name] + t.sum() if name in sums else t.sum()
    total = sum(int((b.labels != IGNORE_INDEX).sum()) for b in micro)
    (sum(sums.values()) / total).backward()
    grads = {canonical_name(n): p.grad.detach().clone() for n, p in model.named_parameters()}
    return grads, {name: (t / total).item() for name, t in sums.items()}


def _alone(meta, seed: int) -> torch.nn.Module:
    """The model unsharded, in one process, at its initial weights."""
    model = meta.spec.model_cls(meta.args)
    model.init_weights(ParamInit(model, seed))
    return model


def weights_hash(model: torch.nn.Module) -> str:
    """The full initial weights, gathered, by canonical name: one value at every layout."""
    h = hashlib.sha256()
    for name, p in sorted((canonical_name(n), p) for n, p in unwrap(model).named_parameters()):
        w = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(w.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_case(cfg: JobConfig, case: Case, world: int, ref: tuple[dict, dict]) -> dict:
    """One case at this world size (`cfg`: case_config's): the reduced gradient's largest relative error against the
    reference's (`ref`: its gradient and losses), the logged loss, and the initial weights' hash."""
    grads, losses = ref
    dp = world // (2 if case.axis else 1)
    layout = resolve_layout(cfg, world)
    reduce = cfg.training.mixed_precision_reduce
    dims = ParallelDims.build(layout, torch.device("cpu"), "float32", reduce)
    meta = build_meta_model(cfg, 0)
    model = materialize(meta.spec.parallelize_fn(meta.model, dims, cfg), dims, cfg.training.seed)
    init = weights_hash(model)
    batch = packed_batch() if case.packed else unequal_batch()
    per_rank, lb = GLOBAL_BATCH // dp, layout.local_batch
    start = dims.dp_rank * per_rank  # the ranks that split a sequence read the same ones
    micro = [
        dims.piece(Microbatch(*(t[start + m * lb : start + (m + 1) * lb] for t in batch)))
        for m in range(case.accum)
    ]
    balancer = LossBalancer(
        cfg.loss.normalization, dims.dp_group, dims.token_ranks, layout.grad_accum
    )
    path = replace(meta.loss_path(), chunk=case.loss_chunk)
    skip = layout.skip_grad_sync
    share, _, terms = forward_backward(model, micro, balancer, dims, skip_grad_sync=skip, path=path)
    logged = torch.stack([share, *terms.values()])
    dist.all_reduce(logged, group=dims.dp_group)  # a tensor split's ranks log the same share
    rel, whole = 0.0, torch.stack([g.double().norm() for g in grads.values()]).norm()
    # the norm the trainer clips by, over parameters on every mesh the layout puts them on, and
    # the clipping itself (at a bound no norm reaches: every gradient times exactly 1)
    norm = clip_grad_norm_(unwrap(model).parameters(), NO_CLIP)
    for name, p in unwrap(model).named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = grads[canonical_name(name)]
        scale = want.norm() if want.norm() > 0 else whole  # else: untouched by the reference
        rel = max(rel, ((g - want).norm() / scale).item())
    return {
        **asdict(case),
        "world": world,
        "max_rel_err": rel,
        "grad_norm_err": abs(float(norm) / float(whole) - 1),
        "logged": dict(zip(["loss", *terms], logged.tolist(), strict=True)),
        "init_hash": init,
        "ref": losses,
    }


def check(argv: list[str]) -> dict:
    """Every case at this process group's world size; the references and the unsharded init."""
    world = dist.get_world_size()
    cfg = check_config(argv)
    refs = {packed: reference(cfg, packed) for packed in (False, True)}
    results = [
        run_case(case_config(argv, c, world), c, world, refs[c.packed]) for c in cases(cfg, world)
    ]
    alone = _alone(build_meta_model(cfg, 0), cfg.training.seed)
    return {"world": world, "cases": results, "ref_hash": weights_hash(alone)}


def verdicts(results: list[dict]) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) from every world size's results: the gradient of each case, the
    logged loss and each term the model adds, and the initial weights against one process's."""
    out = []
    tol = f"off one process's (tolerance {TOL:g})"
    for res in results:
        for c in res["cases"]:
            dp = res["world"] // (2 if c["axis"] else 1)
            split = f" x {c['axis']}=2" if c["axis"] else ""
            batch = " packed" if c["packed"] else " unequal tokens"
            chunks = f" loss in chunks of {c['loss_chunk']}" if c["loss_chunk"] else ""
            where = f"dp={dp}{split} {c['mode']} accum={c['accum']}{batch}{chunks}"
            errs = {name: _rel(c["logged"].get(name), want) for name, want in c["ref"].items()}
            ok = max(c["max_rel_err"], c["grad_norm_err"], errs["loss"]) <= TOL
            detail = (
                f"gradient {c['max_rel_err']:.1e}, its norm {c['grad_norm_err']:.1e}, "
                f"loss {errs['loss']:.1e} {tol}"
            )
            out.append((f"gradient {where}", ok, detail))
            for name in sorted(set(c["ref"]) - {"loss"}):
                out.append((f"term {name} {where}", errs[name] <= TOL, f"{errs[name]:.1e} {tol}"))
            for name in sorted(set(c["logged"]) - set(c["ref"])):
                why = "logged here but not returned by one process's forward"
                out.append((f"term {name} {where}", False, why))
    ref = results[0]["ref_hash"] if results else ""
    cases = [(res["world"], c) for res in results for c in res["cases"]]
    differ = sorted({f"dp={w} {c['mode']}" for w, c in cases if c["init_hash"] != ref})
    detail = "equal to one process's at every layout"
    if differ:
        detail = f"differ from one process's at {', '.join(differ)}: init_weights must fill each parameter through ParamInit"
    out.append(("initial weights", not differ, detail))
    return out


def _rel(got: float | None, want: float) -> float:
    """Relative difference; a term this layout did not log is infinitely off."""
    if got is None:
        return math.inf
    return abs(got - want) / abs(want) if want else abs(got)


def hf_verdicts(argv: list[str], folder: Path) -> list[tuple[str, bool, str]]:
    """The model read from a Hugging Face folder through its adapter against transformers' own,
    fp32, one process: logits, summed loss, every gradient; the export must give back the
    folder's tensors bitwise."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise UserError(
            "--hf compares with transformers, which is not installed: pip install transformers"
        ) from None
    hf_logging.disable_progress_bar()  # one verdict line per check, nothing between them
    meta = build_meta_model(hf_config(argv, folder), 0)
    ours = meta.spec.model_cls(meta.args)
    load_hf_weights(ours, folder, meta.spec.hf, meta.args)
    theirs = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    tokens, labels = torch.randint(0, meta.args.vocab_size, (2, 2, SEQ), generator=g)
    mine, hf = ours(tokens), theirs(tokens).logits
    logits_err = ((mine - hf).abs().max() / hf.abs().max()).item()
    losses = [cross_entropy_sum(x, labels) for x in (mine, hf)]
    loss_err = abs((losses[0] - losses[1]) / losses[1]).item()
    for loss in losses:
        loss.backward()
    hf_grads = saved_gradients(theirs)
    grad_err, worst = 0.0, ""
    for name, p in ours.named_parameters():
        for hf_name, grad in meta.spec.hf.write(name, p.grad, meta.args):
            if hf_name not in hf_grads:
                raise UserError(
                    f"the adapter's to_hf maps {name} to '{hf_name}', which transformers does not save "
                    f"(it saves e.g. {next(iter(hf_grads))}); map to the names of the folder's safetensors"
                )
            if grad.shape != hf_grads[hf_name].shape:
                raise UserError(
                    f"the adapter's to_hf gives {name} as {list(grad.shape)} but transformers saves '{hf_name}' as "
                    f"{list(hf_grads[hf_name].shape)}; to_hf must write the folder's layout (permutations, splits)"
                )
            err = ((grad - hf_grads[hf_name]).norm() / hf_grads[hf_name].norm()).item()
            grad_err, worst = max((grad_err, worst), (err, hf_name))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "export"
        export_hf(ours, out, meta, "float32", folder, None)
        written = _tensors(out)
    source = {  # what the adapter reads: not derived buffers, not a tied head's stored copy
        k: v.float()
        for k, v in _tensors(folder).items()
        if not k.endswith(DERIVED_BUFFERS) and meta.spec.hf.read(k, v, meta.args) is not None
    }
    differ = sorted(
        k
        for k in written.keys() | source.keys()
        if k not in written or k not in source or not torch.equal(written[k], source[k])
    )
    exported = f"{len(written)} tensors written back as read"
    if differ:
        exported = f"{len(differ)} tensors differ or are missing from the export, first {differ[0]}"
    tol = f"tolerance {TOL:g}"
    logits = f"largest difference {logits_err:.1e} of the largest logit ({tol})"
    grads = f"largest relative error {grad_err:.1e} ({worst}; {tol})"
    return [
        ("hf logits", logits_err <= TOL, logits),
        ("hf summed loss", loss_err <= TOL, f"{loss_err:.1e} off transformers' ({tol})"),
        ("hf gradients", grad_err <= TOL, grads),
        ("hf export round trip", not differ, exported),
    ]


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def saved_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A transformers model's gradients under its safetensors' names: saved by transformers in
    the parameters' place (its own conversion applies: transformers 5 fuses experts in memory)."""
    params = dict(model.named_parameters())
    kept = {n: p.detach().clone() for n, p in params.items()}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        try:
            for p in params.values():
                p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
            model.save_pretrained(tmp)
        finally:
            for n, p in params.items():
                p.copy_(kept[n])
        return _tensors(Path(tmp))


def main() -> None:
    init_distributed(torch.device("cpu"))
    result = check(sys.argv[2:])
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
