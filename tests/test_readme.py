"""Every command the READMEs show runs as shown, from a fresh copy of the repository, with nothing
activated: commands start from the bare `python3` on PATH (the scripts find the project's
interpreter themselves; here TITANLITE_PYTHON names the one running the tests, so nothing is
installed twice).

Each command is classified in COMMANDS, and a command the table does not know fails the test, so
a README cannot gain a command nobody checked:
- run: verbatim, exit 0;
- short: verbatim plus a flag that keeps it short (a training run: 2 steps; invariance: --dry-run);
- help: a long benchmark: the script starts from a fresh copy and answers --help (once a script);
- skip: it cannot run here (a download, GPUs, a cluster, paths of the reader's own data), or a test
  or an earlier README command runs the same, with why.
Commands run in README order, one README after another, so a later one may use an earlier one's
run folder (outputs/my-run).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import HANG_S, REPO

TRAIN = "--training.steps 2"
NET = "skip: a download (network)"
GPU = "skip: GPUs"
OWN = "skip: paths of the reader's own data"
COMMANDS = {
    "README.md": {
        "./run_train.sh": f"short: {TRAIN}",
        "scripts/test.sh": "skip: the test command itself",
        "./run_train.sh --help": "run",
        "./scripts/prepare_data.py --tokenizer builtin --out outputs/data/docs titanlite": "run",
        "./run_train.sh --data.path outputs/data/docs --training.steps 20": f"short: {TRAIN}",
        "./scripts/setup_smollm2.py": "skip: a download (tests/test_gguf.py converts a GGUF file as it does)",
        "./run_train.sh --config train_configs/smollm2_sft.toml --job.run_name smollm2": "skip: the setup's "
        "download",
        ".venv/bin/python -c \"from transformers import pipeline; chat = pipeline('text-generation', "
        "'outputs/smollm2/hf'); print(chat([{'role': 'user', 'content': 'Write a Python function that reverses "
        "a string.'}], max_new_tokens=64)[0]['generated_text'][-1]['content'])\"": "skip: the fine-tune's export",
        "hf download meta-llama/Llama-3.2-1B --local-dir assets/hf/Llama-3.2-1B": NET,
        "NGPU=8 ./run_train.sh --config train_configs/llama3_2_1b_sft.toml --model.hf_assets_path "
        "assets/hf/Llama-3.2-1B --data.path /data/alpaca.jsonl": GPU,
        "./run_train.sh --config train_configs/debug_moe.toml --job.run_name moe --checkpoint.export_hf true": (
            f"short: {TRAIN}"
        ),
        '.venv/bin/python -c "from transformers import AutoModelForCausalLM as M, AutoTokenizer as T; m, t = '
        "M.from_pretrained('outputs/moe/hf'), T.from_pretrained('outputs/moe/hf'); print(t.decode(m.generate("
        "**t('def parse(text):', return_tensors='pt'), max_new_tokens=24, do_sample=False)[0]))\"": "skip: a fresh "
        "copy has no .venv here (TITANLITE_PYTHON runs the tests); tests/test_qwen3_moe_hf.py loads a trained "
        "export with its tokenizer in transformers",
        "hf download Qwen/Qwen3-30B-A3B --local-dir assets/hf/Qwen3-30B-A3B": NET,
        "NGPU=8 ./run_train.sh --config train_configs/qwen3_moe_sft.toml --data.path /data/alpaca.jsonl": GPU,
        "./scripts/invariance.py --config train_configs/debug_sft.toml --dp 8 16 --steps 30 "
        "--training.global_batch_size 16": "short: --dry-run",
        "./run_train.sh --job.run_name same-data --faults.same_data true --training.steps 3": "run",
        "./scripts/inspect_step.py outputs/same-data --step 1 --rank 1": "run",
        "./scripts/diagnose_scenarios.py --quick": "help",
        "cd tests && ../scripts/check_model.py --model.name fork_lm --model.import_module fork_model "
        "--model.flavor tiny": "skip: tests/test_check_model.py runs it from tests/ (--worlds 2)",
        "./run_train.sh --job.run_name my-run --checkpoint.every 50 --checkpoint.at_end true": f"short: {TRAIN}",
        "NPROC=4 ./run_train.sh --job.run_name my-run --checkpoint.every 50 --checkpoint.at_end true --training.local_batch_size 2 --training.steps 200": (
            f"short: {TRAIN}"
        ),
        "NGPU=8 ./run_train.sh --config train_configs/llama_1b.toml --training.steps 20 "
        "--parallelism.dp_shard 8": GPU,
        "NPROC=4 ./run_train.sh --parallelism.dp_replicate 2 --training.local_batch_size 2": f"short: {TRAIN}",
        "sbatch --nodes 4 scripts/train.slurm --config train_configs/llama_1b.toml": "skip: a SLURM cluster "
        "(tests/test_operations.py runs scripts/train.slurm's two tasks here)",
        "./run_train.sh --rehearse 64": "short: --rehearsal.steps 3",
        # the README's 8B command at a size a CPU holds: its 1,024 ranks, config and data, a small model
        "./run_train.sh --rehearse 1024 --config train_configs/llama_8b.toml": "short: --model.flavor debugmodel "
        "--model.builtin_vocab_size 2048 --training.seq_len 512 --rehearsal.steps 3",
    },
    "scripts/README.md": {
        "./scripts/invariance.py --config train_configs/debug_sft.toml --dp 8 16 --steps 30 "
        "--training.global_batch_size 16": "short: --dry-run",
        "./scripts/bench.py --quick": "help",
        "./scripts/bench.py": "help",
        "./scripts/bench.py --only loss diagnostics --dp 8 --training.seq_len 512": "help",
        "python3 -m venv .venv-torchtitan && .venv-torchtitan/bin/pip install torch==2.13.0 torchtitan==0.3.0": NET,
        "./scripts/peer/bench_peer.py": "help",
        "scripts/gpu_check.sh": GPU,
        "scripts/gpu_check.sh --smoke": "skip: tests/test_gpu_check.py runs it",
        "scripts/gpu_check.sh --only speed sync": GPU,
    },
    "tests/README.md": {
        "scripts/test.sh": "skip: the test command itself",
        "scripts/test.sh tests/test_loss.py": "skip: the test command itself",
        "./scripts/golden_losses.py --check": "skip: tests/test_golden.py runs it",
        './scripts/golden_losses.py --write --why "torch 2.14: new GEMM kernels"': "skip: it rewrites the "
        "golden files",
        "./scripts/diagnose_scenarios.py --dp 4 --steps 60 --out outputs/rec-dp4 --keep "
        "tests/recordings/scenarios_dp4.json.xz": "skip: it rewrites a recording (tests/test_scenarios.py runs "
        "the scenarios and their replay)",
    },
    "titanlite/components/checkpoint/README.md": {
        "./run_train.sh --job.run_name my-run --checkpoint.every 500 --checkpoint.at_end true": "skip: README.md's "
        "stop and resume runs the same command with --checkpoint.every 50 (a 2-step run saves only at its end "
        "either way)",
        "NPROC=4 ./run_train.sh --job.run_name my-run --checkpoint.every 500 --checkpoint.at_end true --training.local_batch_size 2": (
            "skip: README.md's resume at dp=4 runs the same command"
        ),
        "./run_train.sh --checkpoint.every 500 --checkpoint.at_end true --checkpoint.async_mode async": "skip: tests/test_checkpoint.py "
        "runs async saves",
        "./run_train.sh --checkpoint.export_weights true": "skip: tests/test_hf.py exports",
        './scripts/generate.py outputs/my-run --prompt "def parse(" --prompt "import json"': "run",
        './scripts/generate.py outputs/my-run --step 1000 --prompt "def parse(" --temperature 0.8 --top-p 0.95 '
        "--seed 1": "skip: a run of 1,000 steps",
        './scripts/generate.py outputs/my-run/checkpoints/step-00001000 --prompt "def parse(" '
        "--max-new-tokens 128": "skip: a run of 1,000 steps",
        "hf download meta-llama/Llama-3.2-1B --local-dir assets/hf/Llama-3.2-1B": NET,
        "NGPU=8 ./run_train.sh --config train_configs/llama3_2_1b_sft.toml --model.hf_assets_path "
        "assets/hf/Llama-3.2-1B --data.path /data/alpaca.jsonl": GPU,
        '.venv/bin/python -c "from transformers import AutoModelForCausalLM as M; '
        "M.from_pretrained('outputs/<run>/hf')\"": "skip: a run's export (tests/test_hf.py loads one)",
    },
    "titanlite/components/README.md": {
        "./run_train.sh --config train_configs/llama3_2_1b_sft.toml --model.hf_assets_path assets/hf/Llama-3.2-1B "
        "--checkpoint.initial_load_path outputs/sft-a/checkpoints/step-00001000 --data.path /data/round2.jsonl": (
            "skip: a downloaded model and an earlier fine-tune"
        ),
    },
    "titanlite/components/run/README.md": {
        "NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 ./run_train.sh --job.run_name big ...": "skip: "
        "two nodes",
        "NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 ./run_train.sh --job.run_name big ...": "skip: "
        "two nodes",
        "sbatch --nodes 4 scripts/train.slurm --config train_configs/llama_1b.toml": "skip: a SLURM cluster",
    },
    "titanlite/datasets/README.md": {
        "./scripts/prepare_data.py --tokenizer assets/hf/Llama-3.2-1B --out /data/tok/fineweb "
        "/data/raw/*.parquet": OWN,
        "./run_train.sh --config train_configs/llama_1b.toml --data.path /data/tok/fineweb": OWN,
    },
}
BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.S | re.M)


def readme_commands(path: Path) -> list[str]:
    """The shell commands of a README's bash blocks: continuations joined, comments dropped."""
    commands = []
    for block in BLOCK.findall(path.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())  # no '#' inside quotes here
            if command:
                commands.append(command)
    return commands


def test_every_readme_command_is_classified():
    tracked = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True
    )
    found = {p: readme_commands(REPO / p) for p in tracked.stdout.split()}
    found = {p: c for p, c in found.items() if c}
    assert "README.md" in found and len(found["README.md"]) > 10  # the parser found the quick start
    unknown = [
        f"{p}: {c}" for p, cmds in found.items() for c in cmds if c not in COMMANDS.get(p, {})
    ]
    assert not unknown, "README commands the table does not know (classify them):\n" + "\n".join(
        unknown
    )
    stale = [
        f"{p}: {c}" for p, table in COMMANDS.items() for c in table if c not in found.get(p, [])
    ]
    assert not stale, "classified commands no README shows any more:\n" + "\n".join(stale)


def fresh_copy(dest: Path) -> Path:
    """The repository as a clone holds it (tracked and new files, nothing git ignores)."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    return dest


def bare_path() -> str:
    """PATH without the folder of the interpreter running the tests: `python3` is a bare one."""
    mine = str(Path(sys.executable).parent)
    return os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != mine)


@pytest.mark.slow
def test_readme_commands_run_from_a_fresh_copy(tmp_path):
    root = fresh_copy(tmp_path / "titanlite")
    env = {**os.environ, "PATH": bare_path(), "TITANLITE_PYTHON": sys.executable}
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    ran, helped = 0, set()
    for readme, table in COMMANDS.items():
        for command in readme_commands(REPO / readme):
            how = table[command]
            if how.startswith("skip") or (how == "help" and shlex.split(command)[0] in helped):
                continue
            if how == "help":
                helped.add(shlex.split(command)[0])
                command = f"{shlex.split(command)[0]} --help"
            elif how.startswith("short: "):
                command = f"{command} {how.removeprefix('short: ')}"
            proc = subprocess.run(
                ["bash", "-c", command],
                cwd=root,
                env=env,
                capture_output=True,
                text=True,
                timeout=HANG_S,
            )
            assert proc.returncode == 0, (
                f"{readme}: {command}\nexit {proc.returncode}\n{proc.stderr[-3000:]}"
            )
            if "--rehearse" in command:  # a rehearsal ends in its verdict
                assert re.search(r"fits an? [\d.]+ GB device: (yes|no)", proc.stderr), proc.stderr[
                    -2000:
                ]
            ran += 1
    assert ran >= 12
    assert (root / "outputs/same-data/events.jsonl").read_text().count("identical_data") >= 1
