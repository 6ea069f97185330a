"""Bad values, TOML files, run names and the launcher's environment."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from faults.harness import (
    CKPT,
    REPO,
    Broke,
    Catalogue,
    bad_input,
    case,
    expect,
    listing,
    refused,
    unchanged,
)

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
    (
        "mode ddp + dp_shard 2",
        ("--parallelism.mode", "ddp", "--parallelism.dp_shard", "2"),
        "dp_shard",
    ),
    ("dp_shard 4 on 2 ranks", ("--parallelism.dp_shard", "4"), "dp_shard"),
    ("--metrics.log_every -1", ("--metrics.log_every", "-1"), "log_every"),
    ("--comm.timeout_s 0", ("--comm.timeout_s", "0"), "timeout_s"),
    ("--eval.fraction 1.5", ("--eval.fraction", "1.5"), "eval.fraction"),
    ("--checkpoint.keep_latest_k -1", ("--checkpoint.keep_latest_k", "-1"), "keep_latest_k"),
):
    bad_input("config", _name, _args, _says)
for _value in ("always", "never"):  # under ddp, by name and by "auto" with replicas only
    for _mode in (("--parallelism.mode", "ddp"), ()):
        bad_input(
            "config",
            f"{'ddp' if _mode else 'auto (ddp)'} + reshard_after_forward {_value}",
            (
                *_mode,
                "--parallelism.dp_replicate",
                "2",
                "--parallelism.reshard_after_forward",
                _value,
            ),
            "reshard_after_forward",
        )
# the memory estimate needs the device, which the workers hold: one line from them
bad_input(
    "config",
    "--training.seq_len 10000000",
    ("--training.seq_len", "10000000"),
    "memory",
    cheap=False,
)
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
bad_input(
    "config", "--config a missing file", ("--config", "train_configs/nothing.toml"), "nothing.toml"
)


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


# values beyond what the run can hold, and names that say nothing
for _name, _args, _says in (
    ("--training.seed 10^30", ("--training.seed", "1" + "0" * 30), "training.seed"),
    ("--comm.timeout_s 10^15", ("--comm.timeout_s", "1" + "0" * 15), "comm.timeout_s"),
    ("--model.import_module that does not exist", ("--model.import_module", "no_such_module_xyz"), "no_such_module_xyz"),
):  # fmt: skip
    bad_input("config", _name, _args, _says)


@case("config", "an empty --job.dump_folder", cheap=True)
def _(c: Catalogue) -> None:
    """Refused: it would put the run folder in the current folder (here, the repository)."""
    stray = REPO / "empty-dump-folder-run"
    try:
        r = c.run(
            c.dump("empty-dump"), ("--job.dump_folder", "", "--training.steps", "2"), stray.name
        )
        if stray.exists():
            raise Broke(f"wrote {stray}")
        expect(r, 2, "job.dump_folder")
    finally:
        shutil.rmtree(stray, ignore_errors=True)


# the launcher's environment
for _name, _env, _says in (
    ("NPROC=100000", {"NPROC": "100000"}, "NPROC"),
    ("MAX_RESTARTS of 20 digits", {"MAX_RESTARTS": "9" * 20}, "MAX_RESTARTS"),
    ("NODE_RANK=1 without NNODES", {"NODE_RANK": "1"}, "NODE_RANK"),
    ("LOG_RANK=0,-1", {"LOG_RANK": "0,-1"}, "LOG_RANK"),
):
    bad_input("environment", _name, (), _says, env=_env)


@case("environment", "TITANLITE_CACHE names a file")
def _(c: Catalogue) -> None:
    dump = c.dump("cache-a-file")
    cache = c.work / "a-cache-file"
    cache.write_text("x")
    expect(
        c.run(dump, ("--training.steps", "2"), env={"TITANLITE_CACHE": str(cache)}),
        2,
        "TITANLITE_CACHE",
    )
    unchanged({}, dump)


@case("environment", "MASTER_PORT already in use", ci=True)
def _(c: Catalogue) -> None:
    import socket

    dump = c.dump("port-in-use")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        r = c.run(dump, ("--training.steps", "2"), env={"MASTER_PORT": port})
    expect(r, 2, "MASTER_PORT")
    unchanged({}, dump)
