"""The assets fault cases share, made once per catalogue: data files, a prepared folder, a tiny
Hugging Face folder, reference runs; and the ways a case interrupts a live run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from faults.harness import (
    CKPT,
    REPO,
    RESUME6,
    Broke,
    Catalogue,
    Live,
    Skipped,
    case,
    expect,
    losses,
)


def data(c: Catalogue) -> Path:
    """Data files made from the standard library's json and email sources."""

    def make() -> Path:
        d = c.work / "data"
        d.mkdir(parents=True, exist_ok=True)
        import sysconfig

        stdlib = Path(sysconfig.get_paths()["stdlib"])
        texts = [
            p.read_text()
            for p in sorted((stdlib / "json").glob("*.py"))
            + sorted((stdlib / "email").glob("*.py"))
        ]
        docs = [t[i : i + 1500] for t in texts for i in range(0, len(t), 1500)]
        rows = [json.dumps({"text": t}) for t in docs]
        (d / "good.jsonl").write_text("\n".join(rows) + "\n")
        (d / "empty.jsonl").write_text("")
        (d / "random.jsonl").write_bytes(bytes(range(256)) * 40)
        (d / "malformed.jsonl").write_text(
            "\n".join(rows[:13] + ['{"text": "cut'] + rows[13:40]) + "\n"
        )
        (d / "half.jsonl").write_text(
            "\n".join(
                json.dumps({"body": t} if i % 2 == 0 else {"text": t}) for i, t in enumerate(docs)
            )
            + "\n"
        )
        (d / "notext.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in docs) + "\n")
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"content": docs}), d / "content.parquet")
        (d / "tiny.txt").write_text("x")
        bad = [r.encode() for r in rows[:40]]
        bad[20] = bad[20][:30] + b"\xff" + bad[20][30:]
        (d / "nonutf8.jsonl").write_bytes(b"\n".join(bad) + b"\n")
        (d / "nonutf8.txt").write_bytes(
            "\n".join(docs).encode()[:60000]
            + b"\xff\xfe caf\xe9\n"
            + "\n".join(docs).encode()[60000:]
        )
        qa = [{"instruction": f"Quote part {i}.", "output": t[:400]} for i, t in enumerate(docs)]
        (d / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in qa) + "\n")
        (d / "sft_empty.jsonl").write_text(
            "\n".join(json.dumps({**r, "output": ""}) for r in qa) + "\n"
        )
        (d / "sft_half.jsonl").write_text(
            "\n".join(
                json.dumps({**r, "output": r["output"] if i % 2 else ""}) for i, r in enumerate(qa)
            )
            + "\n"
        )
        return d

    return c.once("data", make)  # type: ignore[return-value]


def prepared(c: Catalogue) -> Path:
    """good.jsonl prepared with the built-in tokenizer, in several shards."""

    def make() -> Path:
        out = c.work / "prepared"
        proc = subprocess.run(
            [sys.executable, "scripts/prepare_data.py", "--tokenizer", "builtin", "--out", str(out), "--shard-mb", "0.05", str(data(c) / "good.jsonl")],
            cwd=REPO, env=c.env, capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode:
            raise RuntimeError(f"prepare_data.py failed: {proc.stderr[-2000:]}")
        return out

    return c.once("prepared", make)  # type: ignore[return-value]


def copy_prepared(c: Catalogue, name: str) -> Path:
    return Path(
        shutil.copytree(prepared(c), c.work / "prepared-copies" / name, dirs_exist_ok=False)
    )


def hf(c: Catalogue) -> Path:
    """A tiny Llama saved by transformers (hidden 64, 2 layers, 4 heads, 2 KV heads,
    intermediate 128) with a 512-token byte-level BPE trained here."""

    def make() -> Path:
        try:
            import torch
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
            from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
        except ImportError as e:
            raise Skipped(f"needs transformers ({e}); pip install -e '.[dev]'") from None
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = c.work / "hf" / "good"
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials = ["<|begin_of_text|>", "<|end_of_text|>"]
        trainer = trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train([str(data(c) / "good.jsonl")], trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1]
        )
        fast.save_pretrained(path)
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
        )  # fmt: skip
        LlamaForCausalLM(config).save_pretrained(path)
        return path

    return c.once("hf", make)  # type: ignore[return-value]


def copy_hf(c: Catalogue, name: str) -> Path:
    return Path(shutil.copytree(hf(c), c.work / "hf" / name))


def hf_args(folder: Path, *extra: str) -> tuple[str, ...]:
    return ("--model.hf_assets_path", str(folder), "--data.path", "", *extra)


def ref6(c: Catalogue) -> dict[int, float]:
    """The uninterrupted 6-step run the interrupted ones are compared with."""

    def make() -> dict[int, float]:
        dump = c.dump("ref6")
        expect(c.start(dump, ("--training.steps", "6")).finish(), 0)
        return losses(dump / "run")

    return c.once("ref6", make)  # type: ignore[return-value]


def shared_run(c: Catalogue) -> Path:
    """BASE, made once: a 4-step run with checkpoints at steps 2 and 4 (its run folder), for
    cases that only read it."""

    def make() -> Path:
        dump = c.dump("base")
        expect(c.start(dump, ("--training.steps", "4", *CKPT)).finish(), 0)
        return dump / "run"

    return c.once("base", make)  # type: ignore[return-value]


def base(c: Catalogue, name: str) -> Path:
    """A copy of BASE as the dump folder `name` holding the run folder `run`."""
    dump = c.dump(name)
    shutil.copytree(shared_run(c), dump / "run")
    return dump


def resumed_by_hand(c: Catalogue, step: int, nproc: int | None = None) -> dict[int, float]:
    """BASE continued to step 6 from its intact checkpoint `step` (checkpoint.load_step): what
    an automatic fall back must equal, bitwise."""

    def make() -> dict[int, float]:
        dump = base(c, f"by-hand-{step}-{nproc}")
        env = {"NPROC": str(nproc)} if nproc else None
        expect(c.start(dump, (*RESUME6, "--checkpoint.load_step", str(step)), env=env).finish(), 0)
        return losses(dump / "run")

    return c.once(f"by-hand-{step}-{nproc}", make)  # type: ignore[return-value]


def bitwise(c: Catalogue, run_dir: Path, ref: dict[int, float] | None = None) -> None:
    """The run's losses are `ref`'s (default: the uninterrupted 6-step run's), bitwise."""
    ref = ref6(c) if ref is None else ref
    got = losses(run_dir)
    if got != ref:
        diff = [s for s in ref if got.get(s) != ref[s]]
        raise Broke(
            f"not bitwise after the rerun: steps {diff} differ ({got.get(diff[0]) if diff else ''} vs ref)"
        )


def truncate(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size)


def own_cache(c: Catalogue, folder: Path) -> dict:
    """A cache of its own holding the shared cache's built-in tokenizers (not trained again)."""
    folder.mkdir(parents=True, exist_ok=True)
    for tok in Path(c.env["TITANLITE_CACHE"]).glob("tokenizer-*"):
        shutil.copy(tok, folder)
    return {"TITANLITE_CACHE": str(folder)}


@contextlib.contextmanager
def mounted(folder: Path, size: str | None = None, read_only_of: Path | None = None):
    """A tmpfs of `size` at `folder`, or a read-only bind mount of `read_only_of` (root only)."""
    folder.mkdir(parents=True, exist_ok=True)
    if read_only_of is not None:
        cmds = [
            ["mount", "--bind", str(read_only_of), str(folder)],
            ["mount", "-o", "remount,bind,ro", str(folder)],
        ]
    else:
        cmds = [["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]]
    if os.geteuid() != 0 or shutil.which("mount") is None:
        raise Skipped("needs root to mount a tmpfs or a read-only bind mount")
    for i, cmd in enumerate(cmds):
        if subprocess.run(cmd, capture_output=True).returncode:
            if i:
                subprocess.run(["umount", str(folder)], capture_output=True)
            raise Skipped(f"cannot mount here ({' '.join(cmd[:3])} failed)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def metrics_step(dump: Path, step: int) -> Callable[[], bool]:
    def reached() -> bool:
        return any(s >= step for s in _safe_losses(dump / "run"))

    return reached


def _safe_losses(run_dir: Path) -> dict[int, float]:
    try:
        return losses(run_dir)
    except (Broke, KeyError):  # a line being written
        return {}


def workers(dump: Path) -> dict[int, int]:
    """{rank: pid} of the live workers of runs under `dump`."""
    out = {}
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            if (
                b"titanlite.train" not in cmd
                or b"titanlite.launch" in cmd
                or str(dump).encode() not in b" ".join(cmd)
            ):
                continue
            env = dict(
                kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv
            )
            if (d / "stat").read_text().split(") ")[-1][:1] != "Z":
                out[int(env[b"RANK"])] = int(d.name)
        except (OSError, ValueError, KeyError):
            continue
    return out


def no_orphans(dump: Path) -> None:
    """Called once the launcher (or the script) has exited: by then every worker it started has
    exited too (the launcher waits for them before its last line)."""
    if left := workers(dump):
        raise Broke(f"workers left running after the launcher exited: {sorted(left.values())}")


def continues(c: Catalogue, dump: Path, args: tuple[str, ...] = RESUME6) -> None:
    """The same command again: it finishes, bitwise equal to the uninterrupted run."""
    expect(c.start(dump, args).finish(), 0)
    bitwise(c, dump / "run")


def stop_case(
    name: str,
    act: Callable[[Catalogue, Path, Live], None],
    code: int,
    says: str,
    args: tuple[str, ...] = RESUME6,
    then: bool = True,
) -> None:
    @case("signals/faults", name)
    def _(c: Catalogue) -> None:
        dump = c.dump(name)
        live = c.start(dump, args)
        act(c, dump, live)
        r = live.finish()
        if code < 0:  # killed: no line is promised, only that nothing is lost
            if r.code not in (code, 128 - code):
                raise Broke(f"exit {r.code}, promised {128 - code}")
        else:
            expect(r, code, says)
        no_orphans(dump)
        if then:
            continues(c, dump, args)


def at_step(
    step: int, *signals: int, gap: float = 0.0, who: str = "group"
) -> Callable[[Catalogue, Path, Live], None]:
    def act(c: Catalogue, dump: Path, live: Live) -> None:
        live.wait_for(metrics_step(dump, step))
        for i, sig in enumerate(signals):
            if i:
                time.sleep(gap)
            if who == "group":
                live.signal(sig)
            elif who == "launcher":
                os.kill(live.proc.pid, sig)
            elif who == "everyone":
                for pid in [live.proc.pid, *workers(dump).values()]:
                    os.kill(pid, sig)
            else:  # a worker rank
                os.kill(workers(dump)[int(who)], sig)

    return act


def in_save(*signals: int, gap: float = 0.3) -> Callable[[Catalogue, Path, Live], None]:
    def act(c: Catalogue, dump: Path, live: Live) -> None:
        folder = dump / "run" / "checkpoints"
        live.wait_for(lambda: metrics_step(dump, 2)() and any(folder.glob("*.tmp")))
        for i, sig in enumerate(signals):
            if i:
                time.sleep(gap)
            live.signal(sig)

    return act


def garbage(path: Path) -> None:
    path.write_bytes(b"\x00garbage\xff" * 50)


def config_edit(**change) -> Callable[[Path], tuple[str, ...]]:
    def edit(folder: Path) -> tuple[str, ...]:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        return ()

    return edit


def edit_meta(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        change(meta)
        (folder / "meta.json").write_text(json.dumps(meta))

    return edit
