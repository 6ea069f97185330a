"""scripts/check_model.py end to end: a fork written from the contract passes every check, a
fork with a planted invariance bug fails naming the checks it breaks, and bad input is one line
before any rank starts. (Its cases in every mode at dp 1, 2 and 4 run in the exactness worker,
tests/test_distributed.py, through the same titanlite.analysis.model_check.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import HANG_S, REPO

SCRIPT = str(REPO / "scripts" / "check_model.py")
FORK_LM = (
    "--model.name",
    "fork_lm",
    "--model.import_module",
    "fork_model",
    "--model.flavor",
    "tiny",
)


def _check(*flags: str) -> subprocess.CompletedProcess:
    # run from tests/, where the forks' modules are: the script puts the current directory on PYTHONPATH
    return subprocess.run(
        [sys.executable, SCRIPT, *flags],
        cwd=REPO / "tests",
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )


@pytest.mark.slow
def test_the_contract_fork_passes_and_a_planted_bug_is_named():
    good = _check(*FORK_LM, "--worlds", "2")
    assert good.returncode == 0, good.stdout + good.stderr
    lines = good.stdout.splitlines()
    assert (
        lines[-1].startswith("PASS: ")
        and sum(ln.startswith("PASS  gradient dp=2") for ln in lines) == 9
    )
    assert "1 rank only" not in lines[-1], lines[-1]
    assert "PASS  initial weights" in good.stdout
    bad = _check(
        "--model.name",
        "fork_batch_stats",
        "--model.import_module",
        "fork_planted",
        "--model.flavor",
        "tiny",
        "--worlds",
        "2",
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    failed = [ln for ln in bad.stdout.splitlines() if ln.startswith("FAIL  ")]
    assert failed and all(ln.startswith("FAIL  gradient dp=2") for ln in failed), bad.stdout
    assert "PASS  initial weights" in bad.stdout and bad.stdout.splitlines()[-1].startswith(
        "FAIL: "
    )


@pytest.mark.parametrize(
    "flags, says",
    [
        ([], "name the model to check: --model.name"),
        (["--model.name", "nope"], "nope"),
        (
            ["--model.name", "fork_lm", "--model.import_module", "no_such_module"],
            "cannot be imported",
        ),
        (["--model.name", "llama3", "--worlds", "0"], "--worlds"),
        (
            [*FORK_LM, "--parallelism.axes", '["cp=2"]'],
            "model 'fork_lm' does not split its sequence positions over 'cp'",
        ),
    ],
)
def test_bad_input_is_one_line_before_any_rank(flags, says):
    r = _check(*flags)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr


@pytest.mark.slow
def test_an_hf_folder_matches_transformers_and_exports_back(tmp_path):
    """A tiny Llama saved by transformers (tied head): titanlite's model read through the
    adapter gives transformers' logits, summed loss and gradients, and exports the same tensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, rope_theta=500000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    r = _check("--model.name", "llama3", "--hf", str(tmp_path), "--worlds", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    for check in ("hf logits", "hf summed loss", "hf gradients", "hf export round trip"):
        assert f"PASS  {check}: " in r.stdout, r.stdout
    # one rank splits no batch: the verdict says what was not checked
    assert r.stdout.splitlines()[-1].endswith(
        "at 1 rank only, which splits no batch: add --worlds 2 4 to check data parallelism"
    )


def test_transformers_gradients_come_under_the_names_its_folders_use():
    """transformers 5 keeps a mixture's experts fused in memory ([experts, 2 x hidden, dim]) and
    saves one tensor per expert: check_model.py --hf compares gradients by the saved names (an
    adapter's to_hf maps to those), through transformers' own conversion, and leaves the model's
    weights as they were."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from titanlite.analysis.model_check import saved_gradients

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, 64, (2, 8))
    model(tokens, labels=tokens).loss.backward()
    grads = saved_gradients(model)
    fused = dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"].grad
    assert "model.layers.0.mlp.experts.gate_up_proj" not in grads
    for e in range(4):
        assert torch.equal(grads[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], fused[e, :8])
        assert torch.equal(grads[f"model.layers.0.mlp.experts.{e}.up_proj.weight"], fused[e, 8:])
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
