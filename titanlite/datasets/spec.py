"""What `data.path` names, checked without torch (the preflight runs this before torchrun starts):
empty (the built-in data), one path, or a mixture `a:0.7,b:0.3`. Each path is a prepared folder
(scripts/prepare_data.py) or raw inputs, which the trainer prepares into its cache on first use,
up to RAW_LIMIT_BYTES (larger inputs are prepared once, with every core, by the script).
"""

from __future__ import annotations

from pathlib import Path

from titanlite.config.command_line import mixture_items
from titanlite.datasets.corpus import discover
from titanlite.datasets.prepared import Prepared, is_prepared
from titanlite.errors import UserError

RAW_LIMIT_BYTES = 2 << 30


def parse_data_path(path: str) -> list[tuple[str, float]]:
    """[(path, weight)]: [] for the built-in data, weights normalised to sum to 1."""
    parts = mixture_items(path)
    if not parts:
        return []
    if len(parts) == 1:
        return [(parts[0][0], 1.0)]
    if any(w is None or w <= 0 for _, w in parts) or any(not name for name, _ in parts):
        raise UserError(
            f"data.path '{path}' lists several datasets; give each a positive weight: 'a:0.7,b:0.3'"
        )
    total = sum(w for _, w in parts)
    return [(name, w / total) for name, w in parts]


def check_data(mode: str, path: str, key: str = "data.path") -> None:
    """Every dataset of data.path (or `key`'s) exists; a prepared one is complete, intact and of
    this mode; raw inputs are of known kinds and small enough to prepare on the fly."""
    for name, _ in parse_data_path(path):
        p = Path(name).expanduser()
        if not p.exists():
            raise UserError(
                f"{key} '{name}' does not exist; point it at a prepared folder, a data file or folder, "
                "or leave it empty for the built-in data"
            )
        if is_prepared(p):
            Prepared(p).check_mode(mode)
            continue
        size = sum(f.stat().st_size for f in discover(p))
        if size > RAW_LIMIT_BYTES:
            raise UserError(
                f"{key} '{name}' holds {size / 2**30:.1f} GiB of raw data; prepare it once with every core "
                f"(./scripts/prepare_data.py --tokenizer TOKENIZER --mode {mode} --out FOLDER {name}) "
                f"and point {key} at FOLDER"
            )


def check_data_files(cfg) -> None:
    """data.path and eval.path (a JobConfig's) name data that exists and fits data.mode."""
    check_data(cfg.data.mode, cfg.data.path)
    e = cfg.eval
    if e.path:
        if len(parse_data_path(e.path)) != 1:
            raise UserError(
                f"eval.path '{e.path}' names several datasets; give one (no mixture weights)"
            )
        check_data(cfg.data.mode, e.path, "eval.path")


def check_data_tokenizer(path: str, tokenizer_path: str) -> None:
    """Prepared datasets were tokenized with the run's tokenizer (the built-in one is trained on
    first use, so the trainer checks that case itself)."""
    from titanlite.datasets.tokenizer import load_tokenizer

    folders = [Path(n).expanduser() for n, _ in parse_data_path(path)]
    prepared = [p for p in folders if is_prepared(p)]
    if prepared and tokenizer_path:
        tok = load_tokenizer(tokenizer_path)
        for p in prepared:
            Prepared(p).check_tokenizer(tok)


def data_identity(cfg, path: str | None = None) -> list[dict] | None:
    """What data.path (or `path`) trains on, by content: [{"content", "weight", "path"}]; None for
    synthetic data, raw inputs or the built-in data (the workers prepare them and know it then)."""
    if cfg.data.mode == "synthetic":
        return None
    out = []
    for name, weight in parse_data_path(cfg.data.path if path is None else path) or [("", 1.0)]:
        folder = Path(name).expanduser()
        if not name or not is_prepared(folder):
            return None
        out.append({"content": Prepared(folder).content, "weight": weight, "path": name})
    return out


def eval_is_training_data(cfg) -> str | None:
    """The dataset of data.path whose content eval.path holds too (its eval loss is then no
    held-out loss), else None; raw inputs not prepared yet have no key, so are not compared."""
    held = data_identity(cfg, cfg.eval.path) if cfg.eval.path else None
    if held:
        for d in data_identity(cfg) or []:
            if d["content"] == held[0]["content"]:
                return d["path"]
    return None
