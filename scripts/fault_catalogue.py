#!/usr/bin/env python3
"""The fault catalogue: every mistake and fault a new user met trying titanlite (bad values, bad
data, bad Hugging Face folders, damaged checkpoints, signals and kills at any moment), each run
as that user ran it, with one verdict per case:

    HELD   titanlite kept its promise: the exit code of the table in titanlite/errors.py, one
           line naming the problem (no traceback, not printed twice), nothing written or lost,
           and where a run was cut short, the same command continuing bitwise
    BROKE  it did not; the row says how

    ./scripts/fault_catalogue.py [--cheap] [-k TEXT] [--out DIR] [--nproc 2]

--cheap runs only the cases that must stop before any worker starts, through the launcher's own
code in this process (a fraction of a second each; tests/test_catalogue.py runs them in CI); a
cheap case that reaches the workers is BROKE. Without it every case runs through ./run_train.sh
(about 20 minutes on 2 CPU cores). The mounted cases (a full or tiny disk, a read-only folder)
need root; elsewhere they are SKIPPED and say so. Exit 0 when nothing BROKE.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from titanlite.tools.venv import use_project_venv  # noqa: E402

use_project_venv(dev=True)  # any python3 will do: without titanlite's dependencies it re-executes in .venv
SMALL = ("--training.seq_len", "128", "--metrics.log_freq", "1")
CKPT = ("--checkpoint.interval", "2")


@dataclass
class Result:
    """What one launch did."""

    code: int
    out: str
    err: str

    @property
    def last(self) -> str:
        lines = [ln for ln in self.err.splitlines() if ln.strip()]
        return lines[-1] if lines else ""


class Broke(Exception):
    """A promise broken; the message says which."""


class Skipped(Exception):
    """The case cannot run here; the message says why."""


# ---- launching -----------------------------------------------------------------------------------


class Live:
    """./run_train.sh running in a session of its own (so a signal to its group is a Ctrl-C),
    its output collected as it comes."""

    def __init__(self, argv: list[str], env: dict) -> None:
        self.proc = subprocess.Popen(
            ["./run_train.sh", *argv], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(s, buf), daemon=True)
            for s, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, buf: list[str]) -> None:
        for line in stream:
            buf.append(line)

    def saw(self, text: str) -> bool:
        return any(text in ln for ln in self.out + self.err)

    def wait_for(self, ready: Callable[[], bool], timeout: float = 180) -> None:
        end = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise Broke(f"ended (exit {self.proc.poll()}) before the moment the case needs")
            time.sleep(0.01)

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def finish(self, timeout: float = 300) -> Result:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise Broke(f"still running after {timeout:.0f}s") from None
        for t in self._readers:
            t.join()
        return Result(code, "".join(self.out), "".join(self.err))


class Catalogue:
    """The fixtures, made once, and the ways to launch."""

    def __init__(self, work: Path, nproc: int, cheap: bool) -> None:
        self.work, self.nproc, self.cheap = work, nproc, cheap
        self.env = {
            **os.environ,
            "NPROC": str(nproc),
            "TITANLITE_CACHE": os.environ.get("TITANLITE_CACHE", str(work / "cache")),
        }
        self._made: dict[str, object] = {}

    def dump(self, name: str) -> Path:
        """A fresh dump folder for one case."""
        path = self.work / "runs" / re.sub(r"[^\w.-]+", "_", name)[:60]
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def argv(self, dump: Path, run_name: str, args: tuple[str, ...]) -> list[str]:
        return ["--job.dump_folder", str(dump), "--job.run_name", run_name, *SMALL, *args]

    def start(
        self, dump: Path, args: tuple[str, ...], run_name: str = "run", env: dict | None = None
    ) -> Live:
        return Live(self.argv(dump, run_name, args), {**self.env, **(env or {})})

    def run(
        self, dump: Path, args: tuple[str, ...], run_name: str = "run", env: dict | None = None
    ) -> Result:
        """One launch, to its end: through ./run_train.sh, or with --cheap in this process (a
        launch that would start workers is then BROKE: the preflight should have stopped it)."""
        if self.cheap and not env:
            return _in_process(
                ["--job.dump_folder", str(dump), "--job.run_name", run_name, *SMALL, *args], self.nproc
            )
        return self.start(dump, args, run_name, env).finish()

    def once(self, key: str, make: Callable[[], object]) -> object:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]


def _in_process(args: list[str], nproc: int) -> Result:
    """titanlite.launch's main as run_train.sh calls it, in this process, stopped where it would
    start the workers."""
    import torch.distributed.launcher.api as launcher_api

    from titanlite import launch

    if "--config" not in args:
        args = ["--config", "train_configs/debug_model.toml", *args]
    argv = [
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "--max-restarts",
        "0",
        "-m",
        "titanlite.train",
        *args,
    ]

    def reached(*_a, **_k):
        raise RuntimeError("reached the workers")

    err, out = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    real = launcher_api.elastic_launch
    launcher_api.elastic_launch = reached
    cwd = os.getcwd()
    try:
        os.chdir(REPO)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = launch.main(argv)
    except RuntimeError as e:
        if "reached the workers" not in str(e):
            raise
        raise Broke("not stopped before the workers (the preflight let it through)") from None
    finally:
        os.chdir(cwd)
        launcher_api.elastic_launch = real
        for s, h in handlers.items():
            signal.signal(s, h)
    return Result(code, out.getvalue(), err.getvalue())


# ---- what a promise is -----------------------------------------------------------------------------


def _core(line: str) -> str:
    """A console line without the rank prefixes torchrun and titanlite add."""
    return re.sub(r"^(\[rank\d+\]:\s*|\[titanlite r\d+\]\s*)", "", line.strip())


def expect(r: Result, code: int, says: str = "") -> None:
    """The exit code promised, and for a stop one last line of titanlite's that holds `says`, no
    traceback, and that line printed once."""
    if r.code != code:
        raise Broke(f"exit {r.code}, promised {code}: {r.last[:200]}")
    if code == 0:
        return
    if "Traceback" in r.err:
        raise Broke(f"a traceback: {r.last[:200]}")
    last = _core(r.last)
    if not last.startswith("titanlite: "):
        raise Broke(f"the last line is not titanlite's: {r.last[:200]}")
    if says and says not in last:
        raise Broke(f"the line does not say {says!r}: {last[:300]}")
    lines = [_core(ln) for ln in (r.out + r.err).splitlines()]
    if lines.count(last) > 1:
        raise Broke(f"the line is printed {lines.count(last)} times")


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and mtime (what "nothing written" compares)."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "run.lock"
    }


def unchanged(before: dict, folder: Path) -> None:
    after = listing(folder)
    if after != before:
        changed = sorted(
            set(after) ^ set(before) | {k for k in after if k in before and after[k] != before[k]}
        )
        raise Broke(f"written: {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}")


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def bitwise(c: Catalogue, run_dir: Path, ref: dict[int, float] | None = None) -> None:
    """The run's losses are `ref`'s (default: the uninterrupted 6-step run's), bitwise."""
    ref = ref6(c) if ref is None else ref
    got = losses(run_dir)
    if got != ref:
        diff = [s for s in ref if got.get(s) != ref[s]]
        raise Broke(
            f"not bitwise after the rerun: steps {diff} differ ({got.get(diff[0]) if diff else ''} vs ref)"
        )


def refused(c: Catalogue, name: str, args: tuple[str, ...], says: str, env: dict | None = None) -> None:
    """A bad input: exit 2 in one line, nothing written (the dump folder stays empty)."""
    dump = c.dump(name)
    expect(c.run(dump, args, env=env), 2, says)
    unchanged({}, dump)


# ---- fixtures ----------------------------------------------------------------------------------


def data(c: Catalogue) -> Path:
    """Data files made from the standard library's json and email sources."""

    def make() -> Path:
        d = c.work / "data"
        d.mkdir(parents=True, exist_ok=True)
        import sysconfig

        stdlib = Path(sysconfig.get_paths()["stdlib"])
        texts = [
            p.read_text()
            for p in sorted((stdlib / "json").glob("*.py")) + sorted((stdlib / "email").glob("*.py"))
        ]
        docs = [t[i : i + 1500] for t in texts for i in range(0, len(t), 1500)]
        rows = [json.dumps({"text": t}) for t in docs]
        (d / "good.jsonl").write_text("\n".join(rows) + "\n")
        (d / "empty.jsonl").write_text("")
        (d / "random.jsonl").write_bytes(bytes(range(256)) * 40)
        (d / "malformed.jsonl").write_text("\n".join(rows[:13] + ['{"text": "cut'] + rows[13:40]) + "\n")
        (d / "half.jsonl").write_text(
            "\n".join(json.dumps({"body": t} if i % 2 == 0 else {"text": t}) for i, t in enumerate(docs))
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
            "\n".join(docs).encode()[:60000] + b"\xff\xfe caf\xe9\n" + "\n".join(docs).encode()[60000:]
        )
        qa = [{"instruction": f"Quote part {i}.", "output": t[:400]} for i, t in enumerate(docs)]
        (d / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in qa) + "\n")
        (d / "sft_empty.jsonl").write_text("\n".join(json.dumps({**r, "output": ""}) for r in qa) + "\n")
        (d / "sft_half.jsonl").write_text(
            "\n".join(json.dumps({**r, "output": r["output"] if i % 2 else ""}) for i, r in enumerate(qa))
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
    return Path(shutil.copytree(prepared(c), c.work / "prepared-copies" / name, dirs_exist_ok=False))


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
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1])
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


def base(c: Catalogue, name: str) -> Path:
    """A copy of a 4-step run with checkpoints at steps 2 and 4 (BASE), as the dump folder
    `name` holding the run folder `run`."""

    def make() -> Path:
        dump = c.dump("base")
        expect(c.start(dump, ("--training.steps", "4", *CKPT)).finish(), 0)
        return dump / "run"

    source = c.once("base", make)
    dump = c.dump(name)
    shutil.copytree(source, dump / "run")
    return dump


RESUME6 = ("--training.steps", "6", *CKPT)


def resumed_by_hand(c: Catalogue, step: int, nproc: int | None = None) -> dict[int, float]:
    """BASE continued to step 6 from its intact checkpoint `step` (checkpoint.load_step): what
    an automatic fall back must equal, bitwise."""

    def make() -> dict[int, float]:
        dump = base(c, f"by-hand-{step}-{nproc}")
        env = {"NPROC": str(nproc)} if nproc else None
        expect(c.start(dump, (*RESUME6, "--checkpoint.load_step", str(step)), env=env).finish(), 0)
        return losses(dump / "run")

    return c.once(f"by-hand-{step}-{nproc}", make)  # type: ignore[return-value]


# ---- the cases -----------------------------------------------------------------------------------


@dataclass
class Case:
    family: str
    name: str
    run: Callable[[Catalogue], None]  # raises Broke or Skipped; returns when HELD
    cheap: bool = False  # stops before any worker


CASES: list[Case] = []


def case(family: str, name: str, cheap: bool = False):
    def register(fn: Callable[[Catalogue], None]) -> Callable[[Catalogue], None]:
        CASES.append(Case(family, name, fn, cheap))
        return fn

    return register


def bad_input(
    family: str, name: str, args: tuple[str, ...], says: str, env: dict | None = None, cheap: bool = True
) -> None:
    """A case whose promise is a refusal: exit 2, one line holding `says`, nothing written."""
    case(family, name, cheap)(lambda c: refused(c, name, args, says, env))


def trains(
    family: str,
    name: str,
    args: Callable[[Catalogue], tuple[str, ...]],
    check: Callable[[Catalogue, Result, Path], None] | None = None,
) -> None:
    """A case whose promise is a run: exit 0 (and `check`)."""

    def run(c: Catalogue) -> None:
        dump = c.dump(name)
        r = c.run(dump, ("--training.steps", "2", *args(c)))
        expect(r, 0)
        if check:
            check(c, r, dump / "run")

    case(family, name)(run)


# config: values, files, names, the environment
for _name, _args, _says in (
    ("--training.steps abc", ("--training.steps", "abc"), "training.steps"),
    ("--optimizer.lr fast", ("--optimizer.lr", "fast"), "optimizer.lr"),
    (
        "--checkpoint.export_weights maybe",
        ("--checkpoint.export_weights", "maybe"),
        "checkpoint.export_weights",
    ),
    ("unknown key --training.stepz", ("--training.stepz", "3"), "did you mean 'training.steps'"),
    ("unknown section --traning.steps", ("--traning.steps", "3"), "traning"),
    ("--training.steps -5", ("--training.steps", "-5"), "training.steps"),
    ("--training.steps 0", ("--training.steps", "0"), "training.steps"),
    ("--training.steps 3.5", ("--training.steps", "3.5"), "training.steps"),
    ("--training.steps with no value", ("--training.steps",), "training.steps"),
    ("--training.local_batch_size 0", ("--training.local_batch_size", "0"), "local_batch_size"),
    ("--optimizer.lr -1", ("--optimizer.lr", "-1"), "optimizer.lr"),
    ("--optimizer.lr nan", ("--optimizer.lr", "nan"), "optimizer.lr"),
    ("--optimizer.lr inf", ("--optimizer.lr", "inf"), "optimizer.lr"),
    ("--lr_scheduler.warmup_steps -3", ("--lr_scheduler.warmup_steps", "-3"), "warmup_steps"),
    (
        "ddp + skip_grad_sync false (not a choice)",
        (
            "--parallelism.mode",
            "ddp",
            "--parallelism.dp_replicate",
            "2",
            "--parallelism.skip_grad_sync",
            "false",
        ),
        "skip_grad_sync",
    ),
    (
        "ddp + skip_grad_sync off (a conflict)",
        (
            "--parallelism.mode",
            "ddp",
            "--parallelism.dp_replicate",
            "2",
            "--parallelism.skip_grad_sync",
            "off",
        ),
        "skip_grad_sync",
    ),
    ("mode ddp + dp_shard 2", ("--parallelism.mode", "ddp", "--parallelism.dp_shard", "2"), "dp_shard"),
    ("dp_shard 4 on 2 ranks", ("--parallelism.dp_shard", "4"), "dp_shard"),
    ("--metrics.log_freq 0", ("--metrics.log_freq", "0"), "log_freq"),
    ("--comm.timeout_s 0", ("--comm.timeout_s", "0"), "timeout_s"),
    ("--eval.fraction 1.5", ("--eval.fraction", "1.5"), "eval.fraction"),
    ("--checkpoint.keep_latest_k -1", ("--checkpoint.keep_latest_k", "-1"), "keep_latest_k"),
):
    bad_input("config", _name, _args, _says)
# the memory estimate needs the device, which the workers hold: one line from them
bad_input("config", "--training.seq_len 10000000", ("--training.seq_len", "10000000"), "memory", cheap=False)
bad_input(
    "config",
    "a batch of 2,000,000",
    ("--training.local_batch_size", "1000000", "--training.global_batch_size", "2000000"),
    "memory",
    cheap=False,
)


def _toml(c: Catalogue, name: str, text: str | bytes) -> Path:
    path = c.work / "toml" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)  # type: ignore[operator]
    return path


_DEBUG = (REPO / "train_configs" / "debug_model.toml").read_text()
for _name, _text, _says in (
    ("TOML with a syntax error", "[training]\nsteps = 3\nseq_len = = 4\n", "line 3"),
    ("an empty TOML", "", ""),
    (
        "TOML with flavor gigantic_999b",
        _DEBUG.replace('flavor = "debugmodel"', 'flavor = "gigantic_999b"'),
        "gigantic_999b",
    ),
    ('TOML with name = "gpt5"', _DEBUG.replace('name = "llama3"', 'name = "gpt5"'), "gpt5"),
    ('TOML steps = "three"', _DEBUG.replace("steps = 100", 'steps = "three"'), "steps"),
    ("a TOML of binary bytes", b"\xff\xfe[training]\n", "UTF-8"),
):
    case("config", _name, cheap=True)(
        lambda c, n=_name, t=_text, s=_says: refused(
            c, n, ("--config", str(_toml(c, re.sub(r"\W+", "_", n) + ".toml", t))), s
        )
    )

bad_input("config", "--config a folder", ("--config", "train_configs"), "folder")
bad_input("config", "--config a missing file", ("--config", "train_configs/nothing.toml"), "nothing.toml")


@case("config", "--job.dump_folder a file", cheap=True)
def _(c: Catalogue) -> None:
    dump = c.dump("dump-a-file")
    (dump / "f").write_text("x")
    r = c.run(dump / "f", ("--training.steps", "2"))
    expect(r, 2, "is a file")


@case("config", "--checkpoint.folder a file", cheap=True)
def _(c: Catalogue) -> None:
    dump = c.dump("ckpt-a-file")
    (dump / "f").write_text("x")
    expect(c.run(dump, ("--checkpoint.folder", str(dump / "f"), *CKPT)), 2, "is a file")
    unchanged({"f": listing(dump)["f"]}, dump)


case("config", "a unicode run_name")(
    lambda c: expect(c.run(c.dump("unicode"), ("--training.steps", "2"), run_name="ラン-ü-🚀"), 0)
)


@case("config", "run_name a/b nests inside the dump folder")
def _(c: Catalogue) -> None:
    dump = c.dump("nested")
    expect(c.run(dump, ("--training.steps", "2"), run_name="a/b"), 0)
    if not (dump / "a" / "b" / "metrics.jsonl").is_file():
        raise Broke("a/b did not make dump_folder/a/b")


for _name, _run_name in (
    ("run_name ..", ".."),
    ("run_name ../escaped", "../escaped"),
    ("an absolute run_name", "/tmp/titanlite-absrun"),
):

    @case("config", _name, cheap=True)
    def _(c: Catalogue, n=_name, rn=_run_name) -> None:
        parent = c.dump(n)
        dump = parent / "outputs"
        dump.mkdir()
        expect(c.run(dump, ("--training.steps", "2"), run_name=rn), 2, "job.run_name")
        unchanged({}, parent)


bad_input("config", "a run_name of 300 characters", ("--job.run_name", "x" * 300), "job.run_name")
for _name, _env, _says in (
    ("NPROC=0", {"NPROC": "0"}, "NPROC"),
    ("NPROC=abc", {"NPROC": "abc"}, "NPROC"),
    ("NNODES=2 without NODE_RANK", {"NNODES": "2"}, "NODE_RANK"),
    ("LOG_RANK=5 of 2 ranks", {"LOG_RANK": "5"}, "LOG_RANK"),
):
    bad_input("config", _name, (), _says, env=_env)


# data: raw files, prepared folders, the cache
def _data_arg(file: str, *extra: str) -> Callable[[Catalogue], tuple[str, ...]]:
    return lambda c: ("--data.path", str(data(c) / file), *extra)


trains("data", "good jsonl (baseline)", _data_arg("good.jsonl"))
for _name, _file, _says in (
    ("an empty .jsonl", "empty.jsonl", "empty.jsonl"),
    ("random bytes as .jsonl", "random.jsonl", "line 1"),
    ("a malformed line in the middle of a .jsonl", "malformed.jsonl", "line 14"),
    ("every other line without text", "half.jsonl", "text"),
    ("no line with text", "notext.jsonl", "text"),
    ("parquet with the column content", "content.parquet", "text"),
    ("a .txt of 1 byte", "tiny.txt", "sequences"),
    ("a non-UTF-8 byte in a .jsonl", "nonutf8.jsonl", "line 21"),
):
    case("data", _name)(lambda c, n=_name, f=_file, s=_says: refused(c, n, _data_arg(f)(c), s))
trains("data", "non-UTF-8 bytes in a .txt (decoded leniently)", _data_arg("nonutf8.txt"))


@case("data", "a mixture weight of -1", cheap=True)
def _(c: Catalogue) -> None:
    d = data(c)
    refused(c, "mixture -1", ("--data.path", f"{d / 'good.jsonl'}:0.7,{d / 'sft.jsonl'}:-1"), "weight")


@case("data", "a mixture weight abc", cheap=True)
def _(c: Catalogue) -> None:
    d = data(c)
    refused(c, "mixture abc", ("--data.path", f"{d / 'good.jsonl'}:0.7,{d / 'sft.jsonl'}:abc"), "abc")


trains("data", "a prepared folder (baseline)", lambda c: ("--data.path", str(prepared(c))))


def _damaged_prepared(name: str, damage: Callable[[Path], None], says: str, cheap: bool = True) -> None:
    @case("data", name, cheap)
    def _(c: Catalogue) -> None:
        folder = copy_prepared(c, re.sub(r"\W+", "_", name))
        damage(folder)
        refused(c, name, ("--data.path", str(folder)), says)


def _truncate(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size)


def _edit_meta(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        change(meta)
        (folder / "meta.json").write_text(json.dumps(meta))

    return edit


_damaged_prepared(
    "a prepared shard's .tokens cut short", lambda f: _truncate(f / "shard-00001.tokens", 100), "shard-00001"
)
_damaged_prepared(
    "a prepared shard's .tokens deleted", lambda f: (f / "shard-00001.tokens").unlink(), "shard-00001"
)
_damaged_prepared(
    "meta.json: a shard's token count edited",
    _edit_meta(lambda m: m["shards"][0].__setitem__("tokens", m["shards"][0]["tokens"] + 7)),
    "shard-00000",
)
_damaged_prepared(
    "meta.json: dtype and vocabulary edited",
    _edit_meta(lambda m: (m.__setitem__("dtype", "int32"), m["tokenizer"].__setitem__("vocab_size", 100000))),
    "",
)
_damaged_prepared(
    "meta.json: only tokenizer.vocab_size edited",
    _edit_meta(lambda m: m["tokenizer"].__setitem__("vocab_size", 50000)),
    "vocab_size",
    cheap=False,  # the workers build the tokenizer the folder is compared with
)
_damaged_prepared(
    "meta.json: the tokenizer's fingerprint edited",
    _edit_meta(lambda m: m["tokenizer"].__setitem__("fingerprint", "0" * 16)),
    "tokeniz",
    cheap=False,
)
_damaged_prepared("meta.json cut at 300 bytes", lambda f: _truncate(f / "meta.json", 300), "meta.json")


@case("data", "a prepared offsets.npy value overwritten (unused without document masks)")
def _(c: Catalogue) -> None:
    import numpy as np

    folder = copy_prepared(c, "offsets")
    offsets = np.load(folder / "shard-00000.offsets.npy")
    offsets[3] += 5
    np.save(folder / "shard-00000.offsets.npy", offsets)
    dump = c.dump("offsets")
    expect(c.run(dump, ("--training.steps", "2", "--data.path", str(folder))), 0)
    good = c.dump("offsets-good")
    expect(c.run(good, ("--training.steps", "2", "--data.path", str(prepared(c)))), 0)
    if losses(dump / "run") != losses(good / "run"):
        raise Broke("the losses differ from the undamaged folder's")


def _own_cache(c: Catalogue, folder: Path) -> dict:
    """A cache of its own holding the shared cache's built-in tokenizers (not trained again)."""
    folder.mkdir(parents=True, exist_ok=True)
    for tok in Path(c.env["TITANLITE_CACHE"]).glob("tokenizer-*"):
        shutil.copy(tok, folder)
    return {"TITANLITE_CACHE": str(folder)}


@case("data", "the auto-prepared cache with a shard cut short")
def _(c: Catalogue) -> None:
    env = _own_cache(c, c.work / "cache-damaged")
    dump = c.dump("cache-damaged")
    expect(c.start(dump, ("--training.steps", "1"), "first", env).finish(), 0)
    shard = next(Path(env["TITANLITE_CACHE"]).glob("prepared-pretrain-*/shard-00000.tokens"))
    _truncate(shard, shard.stat().st_size // 2)
    expect(c.start(dump, ("--training.steps", "1"), "second", env).finish(), 2, "prepare it again")
    shutil.rmtree(shard.parent)
    expect(c.start(dump, ("--training.steps", "1"), "third", env).finish(), 0)


trains(
    "data",
    "SFT records (baseline)",
    lambda c: ("--data.mode", "sft", "--data.path", str(data(c) / "sft.jsonl")),
)
trains(
    "data",
    "SFT records whose outputs are all empty",
    lambda c: ("--data.mode", "sft", "--data.path", str(data(c) / "sft_empty.jsonl")),
)
trains(
    "data",
    "SFT records, half the outputs empty",
    lambda c: ("--data.mode", "sft", "--data.path", str(data(c) / "sft_half.jsonl")),
)


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


@case("data", "the data cache on a full 128 KiB tmpfs")
def _(c: Catalogue) -> None:
    with mounted(c.work / "mnt-cache", "128k") as cache:
        env = _own_cache(c, cache)
        dump = c.dump("cache-full")
        expect(c.start(dump, ("--training.steps", "1"), env=env).finish(), 2, "disk full")
        if list(cache.rglob(".shard-*")):
            raise Broke("a partial shard was left")
        unchanged({}, dump)


# tokenizers and Hugging Face folders
trains(
    "tokenizer/HF",
    "a tiny HF Llama folder (baseline)",
    lambda c: hf_args(hf(c), "--data.path", str(data(c) / "good.jsonl")),
)


def _hf_refused(name: str, change: Callable[[Path], tuple[str, ...]], says: str, cheap: bool = False) -> None:
    @case("tokenizer/HF", name, cheap)
    def _(c: Catalogue) -> None:
        folder = copy_hf(c, re.sub(r"\W+", "_", name))
        extra = change(folder)
        refused(c, name, (*hf_args(folder, "--data.path", str(data(c) / "good.jsonl")), *extra), says)


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x00garbage\xff" * 50)


_hf_refused(
    "a garbage tokenizer.json in the HF folder",
    lambda f: (_garbage(f / "tokenizer.json"), ())[1],
    "tokenizer",
)


for _file, _says in (("tokenizer.json", "tokenizer"), ("bad.model", "bad.model")):

    @case("tokenizer/HF", f"a garbage {_file} as model.tokenizer_path")
    def _(c: Catalogue, file=_file, says=_says) -> None:
        bad = c.work / "tok" / file
        bad.parent.mkdir(parents=True, exist_ok=True)
        _garbage(bad)
        args = ("--model.tokenizer_path", str(bad), "--data.path", str(data(c) / "good.jsonl"))
        refused(c, f"garbage {file}", args, says)


def _strip_vocab(folder: Path) -> tuple[str, ...]:
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["model"].pop("vocab", None)
    tok["model"].pop("merges", None)
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return ()


_hf_refused("a tokenizer.json without vocab and merges", _strip_vocab, "tokenizer")
_hf_refused(
    "an HF folder with config.json and no safetensors",
    lambda f: ((f / "model.safetensors").unlink(), ())[1],
    "safetensors",
    cheap=True,
)
_hf_refused(
    "model.safetensors cut to 300 kB",
    lambda f: (_truncate(f / "model.safetensors", 300_000), ())[1],
    "cut short",
    cheap=True,
)


def _config_edit(**change) -> Callable[[Path], tuple[str, ...]]:
    def edit(folder: Path) -> tuple[str, ...]:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        return ()

    return edit


_hf_refused(
    "config.json intermediate_size 256, the weights 128",
    _config_edit(intermediate_size=256),
    "intermediate_size",
)
_hf_refused("config.json vocab 256, the tokenizer 512", _config_edit(vocab_size=256), "vocab_size")


# checkpoints: damaged, changed, on small or read-only disks
def _fallback(name: str, damage: Callable[[Path], str]) -> None:
    """The newest checkpoint damaged: set aside with one line naming the file, the resume from
    the older intact one, bitwise."""

    @case("checkpoint", name)
    def _(c: Catalogue) -> None:
        dump = base(c, re.sub(r"\W+", "_", name))
        step4 = dump / "run" / "checkpoints" / "step-00000004"
        named = damage(step4)
        r = c.run(dump, RESUME6)
        expect(r, 0)
        if not any("step-00000004" in ln and named in ln for ln in r.err.splitlines()):
            raise Broke(f"no line names {named} of step 4")
        if not (step4.parent / "step-00000004.damaged").is_dir():
            raise Broke("step 4 was not set aside as step-00000004.damaged")
        bitwise(c, dump / "run", resumed_by_hand(c, 2))


def _cut(file: str, keep: Callable[[int], int]) -> Callable[[Path], str]:
    def damage(step: Path) -> str:
        _truncate(step / file, keep((step / file).stat().st_size))
        return file

    return damage


def _delete(file: str) -> Callable[[Path], str]:
    def damage(step: Path) -> str:
        (step / file).unlink()
        return file

    return damage


def _state_step(step: Path) -> str:
    state = json.loads((step / "state.json").read_text())
    (step / "state.json").write_text(json.dumps({**state, "step": 40}))
    return "state.json"


_fallback("a .distcp of the newest checkpoint cut to half", _cut("__0_0.distcp", lambda n: n // 2))
_fallback("its .metadata deleted", _delete(".metadata"))
_fallback("its rng-rank1.pt cut to 100 bytes", _cut("rng-rank1.pt", lambda n: 100))
_fallback("its __1_0.distcp deleted", _delete("__1_0.distcp"))
_fallback("its state.json cut at 1000 bytes", _cut("state.json", lambda n: 1000))
_fallback("its state.json step 4 edited to 40", _state_step)


@case("checkpoint", "its complete marker deleted (unfinished: the older step)")
def _(c: Catalogue) -> None:
    dump = base(c, "marker")
    (dump / "run" / "checkpoints" / "step-00000004" / "complete").unlink()
    r = c.run(dump, RESUME6)
    expect(r, 0)
    if "resumed from step 2" not in r.out + r.err:
        raise Broke("did not resume from step 2")
    bitwise(c, dump / "run", resumed_by_hand(c, 2))


def _resume_refused(name: str, args: tuple[str, ...], says: str) -> None:
    @case("checkpoint", name)
    def _(c: Catalogue) -> None:
        dump = base(c, re.sub(r"\W+", "_", name))
        before = listing(dump)
        expect(c.run(dump, (*RESUME6, *args)), 2, says)
        unchanged(before, dump)


_resume_refused("load_step 3 (not there)", ("--checkpoint.load_step", "3"), "load_step")
_resume_refused(
    "a resume with --model.flavor debugmodel_tied", ("--model.flavor", "debugmodel_tied"), "model.flavor"
)
_resume_refused(
    "a resume with --model.builtin_vocab_size 1024",
    ("--model.builtin_vocab_size", "1024"),
    "builtin_vocab_size",
)


def _hf_resume_refused(name: str, edit: Callable[[Path], object], says: str) -> None:
    """An HF run that saved step 2, its folder edited, then resumed: one line, its folder untouched."""

    @case("checkpoint", name)
    def _(c: Catalogue) -> None:
        folder = copy_hf(c, re.sub(r"\W+", "_", name))
        dump = c.dump(name)
        args = hf_args(folder, "--data.path", str(data(c) / "good.jsonl"), *CKPT)
        expect(c.run(dump, ("--training.steps", "2", *args)), 0)
        edit(folder)
        before = listing(dump)
        expect(c.run(dump, ("--training.steps", "4", *args)), 2, says)
        unchanged(before, dump)


_hf_resume_refused(
    "an HF run resumed after its config.json's intermediate_size changed",
    _config_edit(intermediate_size=256),
    "intermediate_size",
)


@case("checkpoint", "a dp=2 checkpoint resumed at NPROC=1")
def _(c: Catalogue) -> None:
    dump = base(c, "reshard")
    expect(c.start(dump, RESUME6, env={"NPROC": "1"}).finish(), 0)
    ref, got = resumed_by_hand(c, 4), losses(dump / "run")
    err = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in (5, 6))
    if err > 1e-5:
        raise Broke(f"steps 5-6 differ from the dp=2 resume by {err:.1e} (relative)")


@case("checkpoint", "two launches into one run folder at the same moment")
def _(c: Catalogue) -> None:
    dump = c.dump("two-launches")
    a, b = (c.start(dump, ("--training.steps", "4")) for _ in range(2))
    ra, rb = a.finish(), b.finish()
    codes = sorted((ra.code, rb.code))
    if codes != [0, 2]:
        raise Broke(f"exits {ra.code} and {rb.code}, promised one run (0) and one refusal (2)")
    expect(ra if ra.code == 2 else rb, 2, "in use by a live run")


def _checkpoint_folder_refused(
    name: str, says: str, size: str | None = None, read_only: bool = False
) -> None:
    """checkpoint.folder on a mount the preflight refuses: one line, nothing written."""

    @case("checkpoint", name)
    def _(c: Catalogue) -> None:
        dump = c.dump(name)
        source = c.dump(f"{name}-source") if read_only else None
        with mounted(c.work / f"mnt-{len(name)}", size, read_only_of=source) as folder:
            args = ("--training.steps", "2", *CKPT, "--checkpoint.folder", str(folder))
            expect(c.start(dump, args).finish(), 2, says)
            unchanged({}, folder)
        unchanged({}, dump)


_checkpoint_folder_refused("a checkpoint folder on a 20 MiB tmpfs", "free", size="20m")


@case("checkpoint", "the disk fills at the 2nd save (110 MiB tmpfs)")
def _(c: Catalogue) -> None:
    with mounted(c.work / "mnt-110m", "110m") as disk:
        dump = disk / "dump"
        r = c.start(dump, ("--training.steps", "4", "--checkpoint.interval", "1")).finish()
        expect(r, 3, "disk full")
        kept = sorted(p.name for p in (dump / "run" / "checkpoints").iterdir())
        if kept != ["step-00000001"]:
            raise Broke(f"the checkpoint folder holds {kept}, not step 1 alone")


def _read_only_case(name: str, args: tuple[str, ...], says: str, with_base: bool = False) -> None:
    @case("checkpoint", name)
    def _(c: Catalogue) -> None:
        src = base(c, re.sub(r"\W+", "_", name)) if with_base else c.dump(name)
        before = listing(src)
        with mounted(c.work / "mnt-ro", read_only_of=src) as ro:
            expect(c.start(ro, args).finish(), 2, says)
        unchanged(before, src)


_read_only_case("a read-only dump folder, a new run", ("--training.steps", "2"), "writable")
_read_only_case("a read-only run folder with checkpoints, resumed", RESUME6, "writable", True)
_read_only_case(
    "a read-only run folder with checkpoints, resumed without saving",
    ("--training.steps", "6"),
    "writable",
    True,
)


_checkpoint_folder_refused("a checkpoint.folder on a read-only mount", "writable", read_only=True)


_hf_resume_refused(
    "a bad tokenizer found by the workers on a resume", lambda f: _garbage(f / "tokenizer.json"), "tokenizer"
)


@case("checkpoint", "the run_name of a finished run without checkpoints")
def _(c: Catalogue) -> None:
    dump = c.dump("finished")
    expect(c.run(dump, ("--training.steps", "2")), 0)
    before = listing(dump)
    expect(c.run(dump, ("--training.steps", "4")), 2, "without a checkpoint")
    unchanged(before, dump)


# signals, kills and faults: the stop promised, then the same command continues bitwise
def metrics_step(dump: Path, step: int) -> Callable[[], bool]:
    def reached() -> bool:
        return any(s >= step for s in _safe_losses(dump / "run"))

    return reached


def _safe_losses(run_dir: Path) -> dict[int, float]:
    try:
        return losses(run_dir)
    except (ValueError, KeyError):  # a line being written
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
            env = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
            if (d / "stat").read_text().split(") ")[-1][:1] != "Z":
                out[int(env[b"RANK"])] = int(d.name)
        except (OSError, ValueError, KeyError):
            continue
    return out


def no_orphans(dump: Path) -> None:
    end = time.monotonic() + 15
    while workers(dump) and time.monotonic() < end:
        time.sleep(0.2)
    if workers(dump):
        raise Broke(f"orphan workers left: {sorted(workers(dump).values())}")


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


stop_case(
    "SIGTERM to the launcher during a step",
    at_step(3, signal.SIGTERM, who="launcher"),
    143,
    "stopped by SIGTERM",
)
stop_case("Ctrl-C (SIGINT to the process group)", at_step(3, signal.SIGINT), 130, "stopped by SIGINT")
stop_case("Ctrl-C twice 0.3 s apart", at_step(3, signal.SIGINT, signal.SIGINT, gap=0.3), 130, "SIGINT")
stop_case(
    "SIGTERM while a checkpoint is being written",
    in_save(signal.SIGTERM),
    143,
    "SIGTERM",
    ("--training.steps", "6", "--checkpoint.interval", "1"),
)
stop_case(
    "SIGTERM twice during a save",
    in_save(signal.SIGTERM, signal.SIGTERM),
    143,
    "SIGTERM",
    ("--training.steps", "6", "--checkpoint.interval", "1"),
)
stop_case("SIGKILL of worker rank 1", at_step(3, signal.SIGKILL, who="1"), 1, "rank 1")
stop_case("kill -9 of the launcher's process group", at_step(3, signal.SIGKILL), -9, "")
stop_case(
    "kill -9 of the launcher alone during an async save",
    in_save(signal.SIGKILL),
    -9,
    "",
    ("--training.steps", "6", "--checkpoint.interval", "1", "--checkpoint.async_mode", "async"),
)
stop_case("SIGTERM to worker rank 1 alone", at_step(3, signal.SIGTERM, who="1"), 143, "SIGTERM")
stop_case(
    "SIGTERM to the launcher and every worker at once (SLURM)",
    at_step(3, signal.SIGTERM, who="everyone"),
    143,
    "SIGTERM",
)
stop_case("SIGHUP to the launcher", at_step(3, signal.SIGHUP, who="launcher"), 143, "")
stop_case(
    "SIGSTOP of worker rank 1 (a frozen rank)",
    at_step(3, signal.SIGSTOP, who="1"),
    4,
    "rank(s) 1 stopped responding",
    (*RESUME6, "--comm.timeout_s", "10"),
)


@case("signals/faults", "kill -9 of the group, SFT packed with a loader worker")
def _(c: Catalogue) -> None:
    args = (
        "--training.steps",
        "6",
        *CKPT,
        "--data.mode",
        "sft",
        "--data.path",
        str(data(c) / "sft.jsonl"),
        "--data.packing",
        "true",
        "--data.num_workers",
        "1",
    )
    ref = c.dump("sft-ref")
    expect(c.start(ref, args).finish(), 0)
    dump = c.dump("sft-kill")
    live = c.start(dump, args)
    at_step(3, signal.SIGKILL)(c, dump, live)
    live.finish()
    no_orphans(dump)
    expect(c.start(dump, args).finish(), 0)
    if losses(dump / "run") != losses(ref / "run"):
        raise Broke("not bitwise after the rerun")


@case("signals/faults", "SIGTERM during data preparation")
def _(c: Catalogue) -> None:
    env = _own_cache(c, c.work / "cache-prep-stop")
    dump = c.dump("prep-stop")
    live = c.start(dump, ("--training.steps", "2"), env=env)
    live.wait_for(lambda: any(Path(env["TITANLITE_CACHE"]).glob("prepared-*/.shard-*")))
    live.signal(signal.SIGTERM)
    expect(live.finish(), 143, "before the first step; nothing was written")
    unchanged({}, dump)


@case("signals/faults", "Ctrl-C with checkpointing off")
def _(c: Catalogue) -> None:
    dump = c.dump("ctrl-c-no-ckpt")
    live = c.start(dump, ("--training.steps", "6"))
    at_step(2, signal.SIGINT)(c, dump, live)
    expect(live.finish(), 130, "checkpointing is off")


for _delay in (1.0, 2.0, 3.5):

    @case("signals/faults", f"Ctrl-C {_delay} s after the launch")
    def _(c: Catalogue, delay=_delay) -> None:
        dump = c.dump(f"ctrl-c-{delay}")
        live = c.start(dump, ("--training.steps", "6", *CKPT))
        time.sleep(delay)
        live.signal(signal.SIGINT)
        r = live.finish()
        expect(r, 130, "stopped by SIGINT")
        if "before the first step" in r.last:
            unchanged({}, dump)
        else:
            continues(c, dump)


for _sig, _after in ((signal.SIGINT, 0.0), (signal.SIGINT, 0.3), (signal.SIGINT, 0.6), (signal.SIGTERM, 0.3)):

    @case("signals/faults", f"{_sig.name} while the workers import torch (+{_after} s)")
    def _(c: Catalogue, sig=_sig, after=_after) -> None:
        dump = c.dump(f"early-{sig.name}-{after}")
        live = c.start(dump, ("--training.steps", "6", *CKPT))
        live.wait_for(lambda: bool(workers(dump)))
        time.sleep(after)
        live.signal(sig)
        r = live.finish()
        expect(r, 128 + sig, f"stopped by {sig.name}")
        if "before the first step" in r.last:
            unchanged({}, dump)
        no_orphans(dump)


for _i in range(3):

    @case("signals/faults", f"Ctrl-C as done: is printed ({_i + 1})")
    def _(c: Catalogue, i=_i) -> None:
        dump = c.dump(f"ctrl-c-done-{i}")
        live = c.start(dump, ("--training.steps", "3"))
        live.wait_for(lambda: live.saw("done:"))
        time.sleep(0.05 * i)
        live.signal(signal.SIGINT)
        expect(live.finish(), 0)


def fault(
    name: str, args: tuple[str, ...], code: int, says: str, env: dict | None = None, then: bool = True
) -> None:
    @case("signals/faults", name)
    def _(c: Catalogue) -> None:
        dump = c.dump(name)
        expect(c.start(dump, (*RESUME6, *args), env=env).finish(), code, says)
        no_orphans(dump)
        if then:
            continues(c, dump)


fault(
    "debug.sigkill_step 3 of rank 1", ("--debug.sigkill_step", "3", "--debug.sigkill_rank", "1"), 1, "rank 1"
)
fault(
    "debug.sigkill_step 3 of rank 1 with MAX_RESTARTS=1",
    ("--debug.sigkill_step", "3", "--debug.sigkill_rank", "1"),
    0,
    "",
    env={"MAX_RESTARTS": "1"},
    then=False,
)
fault("debug.signal_step 3", ("--debug.signal_step", "3"), 130, "SIGINT")
fault(
    "debug.hang_step 3 of rank 1, comm.timeout_s 5",
    ("--debug.hang_step", "3", "--debug.hang_rank", "1", "--comm.timeout_s", "5"),
    4,
    "rank(s) 1 did not arrive",
)
fault("debug.sigkill_in_save 4", ("--debug.sigkill_in_save", "4"), 1, "rank 0")
fault("debug.fail_save_step 4", ("--debug.fail_save_step", "4"), 3, "disk full")
fault("debug.nan_loss_step 3", ("--debug.nan_loss_step", "3"), 3, "non-finite", then=False)
for _phase in ("data", "forward", "backward", "optimizer", "checkpoint"):
    fault(
        f"a rank frozen (SIGSTOP) in {_phase}",
        ("--debug.freeze_step", "4", "--debug.freeze_phase", _phase, "--comm.timeout_s", "8"),
        4,
        f"rank(s) 1 stopped responding (rank 1 last seen in {_phase} of step",
    )


# ---- running them --------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--cheap", action="store_true", help="only the cases stopped before any worker, in this process"
    )
    ap.add_argument("-k", default="", help="only the cases whose family or name holds this text")
    ap.add_argument("--out", type=Path, help="work folder (default: a temporary one, removed after)")
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="titanlite-catalogue-"))
    c = Catalogue(work.resolve(), args.nproc, args.cheap)
    chosen = [
        k for k in CASES if (k.cheap or not args.cheap) and args.k.lower() in f"{k.family} {k.name}".lower()
    ]
    if not chosen:
        print(f"no case matches -k {args.k!r}", file=sys.stderr)
        return 2
    counts = {"HELD": 0, "BROKE": 0, "SKIPPED": 0}
    began = time.monotonic()
    for k in chosen:
        start = time.monotonic()
        try:
            k.run(c)
            verdict, why = "HELD", ""
        except Broke as e:
            verdict, why = "BROKE", str(e)
        except Skipped as e:
            verdict, why = "SKIPPED", str(e)
        except Exception as e:  # noqa: BLE001 - the catalogue itself failed: a row, not a crash
            verdict, why = "BROKE", f"the case failed to run: {type(e).__name__}: {e}"
        counts[verdict] += 1
        print(
            f"{verdict:<7} {time.monotonic() - start:5.1f}s  {k.family:<14} {k.name}{f'  -- {why}' if why else ''}",
            flush=True,
        )
    took = time.monotonic() - began
    print(
        f"{len(chosen)} cases in {took:.0f}s: {counts['HELD']} HELD, {counts['BROKE']} BROKE, {counts['SKIPPED']} SKIPPED"
    )
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if counts["BROKE"] else 0


if __name__ == "__main__":
    sys.exit(main())
