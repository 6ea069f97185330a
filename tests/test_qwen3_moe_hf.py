"""titanlite's Qwen3-MoE against transformers' Qwen3MoeForCausalLM (a tiny config saved by
transformers here), fp32: logits, summed cross entropy, the load-balancing loss (transformers'
aux_loss, padding excluded by the attention mask) and every gradient of the whole objective;
folders with one tensor per expert and with fused experts read alike; an export transformers
loads to the same logits; a folder that does not hold the model is one line."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from titanlite.components.checkpoint.hf_load import hf_plan, load_hf_weights
from titanlite.errors import UserError
from titanlite.models.qwen3_moe import Qwen3Moe, qwen3_moe_flavors
from titanlite.models.qwen3_moe.hf import QWEN3_MOE_HF
from titanlite.models.step import StepContext
from titanlite.ops.cross_entropy import IGNORE_INDEX

TOL = 1e-5
VOCAB, COEF = 64, 0.01


def hf_folder(path: Path, norm_topk_prob: bool) -> Qwen3MoeForCausalLM:
    """A tiny Qwen3-MoE saved by transformers (one tensor per expert): three layers, the middle
    one dense (mlp_only_layers), 4 experts, 2 routed per token; weights drawn wide enough that
    the routing is far from uniform."""
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, mlp_only_layers=[1], router_aux_loss_coef=COEF, rope_theta=10000.0,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(path)
    return model


def load_titanlite(path: Path) -> Qwen3Moe:
    args = QWEN3_MOE_HF.args_from_config(json.loads((path / "config.json").read_text()))
    model = Qwen3Moe(dataclasses.replace(args, max_seq_len=32))
    load_hf_weights(model, path, QWEN3_MOE_HF, model.args)
    return model


def objective(model: Qwen3Moe, tokens: torch.Tensor, labels: torch.Tensor) -> tuple:
    """One process's step through the trainer's contract: the statistics pass, then the
    training forward; the summed cross entropy and aux over N, the step's trained tokens."""
    n = (labels != IGNORE_INDEX).sum()
    counting = StepContext(None, 1, 0, 1, True, lambda: n, lambda: None)
    stats = model(tokens, labels=labels, step=counting)
    step = StepContext(None, 1, 0, 1, False, lambda: n, lambda: stats)
    ce, terms = model(tokens, labels=labels, step=step)
    return ce.sum() / n, terms["aux"].sum() / n


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows, the second right-padded after 8 tokens: tokens, labels, attention mask."""
    seq = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    tokens, labels = seq[:, :-1].clone(), seq[:, 1:].clone()
    tokens[1, 8:], labels[1, 8:] = 0, IGNORE_INDEX
    mask = torch.ones_like(tokens)
    mask[1, 8:] = 0
    return tokens, labels, mask


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_gives_transformers_logits_loss_aux_and_gradients(tmp_path, norm_topk_prob):
    hf = hf_folder(tmp_path, norm_topk_prob)
    ours = load_titanlite(tmp_path)
    assert ours.args.dense_layers == (1,) and ours.args.aux_loss_coef == COEF
    tokens, labels, mask = batch()
    out = hf(tokens, attention_mask=mask, output_router_logits=True)
    real = mask.bool()[..., None]
    mine = ours(tokens)
    assert (((mine - out.logits) * real).abs().max() / out.logits.abs().max()).item() <= TOL
    n = (labels != IGNORE_INDEX).sum()
    ce_hf = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="sum") / n
    aux_hf = COEF * out.aux_loss
    ce, aux = objective(ours, tokens, labels)
    assert abs((ce - ce_hf) / ce_hf).item() <= TOL
    assert abs((aux - aux_hf) / aux_hf).item() <= TOL, (aux.item(), aux_hf.item())
    (ce + aux).backward()
    (ce_hf + aux_hf).backward()
    from titanlite.analysis.model_check import saved_gradients

    hf_grads = saved_gradients(hf)
    checked = set()
    for name, p in ours.named_parameters():
        for hf_name, grad in QWEN3_MOE_HF.write(name, p.grad, ours.args):
            want = hf_grads[hf_name]  # an expert no token chose: zero, both ways
            assert (grad - want).norm() <= TOL * want.norm() + 1e-12, hf_name
            checked.add(hf_name)
    assert checked == set(hf_grads)  # every tensor transformers saves, router and experts included
    # and back: titanlite's tensors in HF's names are the folder's, bitwise
    files = load_file(tmp_path / "model.safetensors")
    written = {
        hf_name: t for n, p in ours.named_parameters() for hf_name, t in QWEN3_MOE_HF.write(n, p.detach(), ours.args)
    }  # fmt: skip
    assert written.keys() == files.keys()
    assert all(torch.equal(written[k], files[k]) for k in files)


def test_fused_experts_read_as_one_tensor_per_expert_and_exports_load_in_transformers(tmp_path):
    hf_folder(tmp_path / "per-expert", norm_topk_prob=True)
    per_expert = load_titanlite(tmp_path / "per-expert")
    # the same weights as transformers 5 holds them in memory: each layer's experts in two tensors
    fused = tmp_path / "fused"
    shutil.copytree(tmp_path / "per-expert", fused)
    files = load_file(fused / "model.safetensors")
    for layer in (0, 2):
        at = f"model.layers.{layer}.mlp.experts"
        gate_up = [
            torch.cat([files.pop(f"{at}.{e}.{k}_proj.weight") for k in ("gate", "up")])
            for e in range(4)
        ]
        files[f"{at}.gate_up_proj"] = torch.stack(gate_up)
        files[f"{at}.down_proj"] = torch.stack(
            [files.pop(f"{at}.{e}.down_proj.weight") for e in range(4)]
        )
    save_file(files, fused / "model.safetensors", metadata={"format": "pt"})
    from_fused = load_titanlite(fused)
    for (name, a), (_, b) in zip(
        per_expert.state_dict().items(), from_fused.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    # exported by the trainer's writer, loaded by transformers: the same logits
    from titanlite.components.checkpoint.hf_export import write_hf_folder
    from titanlite.models.registry import MetaModel, get_model_spec

    meta = MetaModel(get_model_spec("qwen3_moe"), from_fused.args, from_fused, 0)
    params = dict(from_fused.named_parameters())
    error, _ = write_hf_folder(
        tmp_path / "export", params, lambda n: params[n].detach(), meta, "float32", fused, None
    )
    assert error is None, error
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    want = from_fused(tokens)
    assert ((theirs(tokens).logits - want).abs().max() / want.abs().max()).item() <= TOL


@pytest.mark.parametrize("per_layer, z", [(False, 0.0), (True, 0.0), (False, 0.001), (True, 0.01)])
def test_an_export_says_what_of_the_objective_its_config_cannot_carry(
    tmp_path, caplog, per_layer, z
):
    """The weights go out exact; a per-layer load-balancing loss or a router z-loss has no
    Qwen3MoeConfig key, so the export says so, once each, and says nothing for the pooled form."""
    from titanlite.components.checkpoint.hf_export import write_hf_folder
    from titanlite.models.registry import MetaModel, get_model_spec

    args = dataclasses.replace(
        qwen3_moe_flavors["tiny"], vocab_size=VOCAB, aux_per_layer=per_layer, z_loss_coef=z
    )
    model = Qwen3Moe(args)
    params = dict(model.named_parameters())
    meta = MetaModel(get_model_spec("qwen3_moe"), args, model, 0)
    with caplog.at_level(logging.WARNING):
        error, _ = write_hf_folder(
            tmp_path / "hf", params, lambda n: params[n].detach(), meta, "float32", None, None
        )
    assert error is None and (tmp_path / "hf" / "config.json").is_file()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == per_layer + bool(z), said
    assert any("each layer's" in m for m in said) == per_layer
    assert any("z-loss" in m for m in said) == bool(z)


def test_a_folder_that_does_not_hold_the_model_is_one_line(tmp_path):
    """Generated cases over one folder: each expert tensor missing in turn, a duplicated piece
    (a fused tensor beside its per-expert ones), a config the model cannot be."""
    hf_folder(tmp_path / "src", norm_topk_prob=True)
    files = load_file(tmp_path / "src" / "model.safetensors")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    model = Qwen3Moe(QWEN3_MOE_HF.args_from_config(config))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}

    def plan(tensors: dict) -> str:
        folder = tmp_path / "case"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(UserError) as e:
            hf_plan(shapes, folder, QWEN3_MOE_HF, model.args)
        assert "\n" not in str(e.value)
        return str(e.value)

    experts = [k for k in files if ".experts." in k]
    assert len(experts) == 2 * 4 * 3
    for name in experts:
        said = plan({k: v for k, v in files.items() if k != name})
        assert "pieces of the model's" in said and "download the folder again" in said, said
    at = "model.layers.0.mlp.experts"
    said = plan({**files, f"{at}.down_proj": torch.zeros(4, 16, 8)})
    assert "and the whole of it" in said, said
    said = plan({**files, f"{at}.9.down_proj.weight": torch.zeros(16, 8)})
    assert "has shape" in said, said
    for change, says in (
        ({"hidden_act": "gelu"}, 'hidden_act = "gelu"'),
        ({"attention_bias": True}, "attention_bias = true"),
        ({"mlp_only_layers": [0, 1, 2]}, "some layer must have experts"),
        ({"num_experts_per_tok": None}, "no key 'num_experts_per_tok'"),
    ):
        with pytest.raises(UserError) as e:
            QWEN3_MOE_HF.args_from_config(
                {k: v for k, v in {**config, **change}.items() if v is not None}
            )
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    # keys every folder's config.json passes through (models/hf_files.py): sliding-window attention
    from titanlite.models.hf_files import read_config

    (tmp_path / "src" / "config.json").write_text(
        json.dumps({**config, "use_sliding_window": True})
    )
    with pytest.raises(UserError, match="use_sliding_window") as e:
        read_config(tmp_path / "src", QWEN3_MOE_HF.reads, QWEN3_MOE_HF.keys)
    assert "\n" not in str(e.value)


def test_the_fine_tune_config_trains_a_folder_and_hands_it_back(tmp_path, capsys):
    """train_configs/qwen3_moe_sft.toml on a tiny Qwen3-MoE folder with its own tokenizer:
    the preflight passes at 8 ranks; two steps on chat records at one rank log the aux term and
    the expert load, and the exported folder loads in transformers with its tokenizer."""
    from helpers import check, read_metrics, train
    from test_hf import chat_records, hf_tokenizer

    from titanlite import preflight

    folder = tmp_path / "Qwen3-tiny"
    config = Qwen3MoeConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    hf_tokenizer(folder)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_records()))
    argv = ["--config", "train_configs/qwen3_moe_sft.toml", "--model.hf_assets_path", str(folder)]
    assert preflight.main(["--world-size", "8", *argv]) == 0, capsys.readouterr().err
    run = tmp_path / "run"
    short = [
        "--training.seq_len",
        "128",
        "--training.global_batch_size",
        "4",
        "--training.steps",
        "2",
    ]
    short += ["--training.mixed_precision_param", "float32", "--eval.fraction", "0.1"]
    short += ["--eval.sample_tokens", "4", "--data.path", str(data), "--job.dump_folder", str(run)]
    check(train(1, *argv, *short, "--job.run_name", "sft", "--metrics.log_every", "1"))
    rows = read_metrics(run / "sft")
    assert all("aux" in r["terms"] and r.get("expert_load") for r in rows if "loss" in r), rows
    exported = AutoModelForCausalLM.from_pretrained(run / "sft" / "hf", dtype=torch.float32)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(run / "sft" / "hf")("def f(x):", return_tensors="pt")
    out = exported(**ids, output_router_logits=True)
    assert torch.isfinite(out.logits).all() and out.aux_loss > 0


def test_the_per_layer_load_balancing_loss_is_each_layers_switch_loss_averaged(tmp_path):
    """aux_per_layer: coef x E x (1/L) sum_l sum_e f_le P_le, each MoE layer's f and P over its
    own routing rows (the real tokens), from transformers' router logits of the same weights."""
    hf = hf_folder(tmp_path, norm_topk_prob=True)
    ours = load_titanlite(tmp_path)
    ours.args = dataclasses.replace(ours.args, aux_per_layer=True)
    tokens, labels, mask = batch()
    real = mask.flatten().bool()
    per_layer = []
    for logits in hf(tokens, attention_mask=mask, output_router_logits=True).router_logits:
        probs = logits.float().softmax(-1)[real]
        chosen = probs.topk(2, dim=-1).indices.flatten()
        f = torch.bincount(chosen, minlength=4).float() / len(probs)
        per_layer.append(4 * (f * probs.mean(0)).sum())
    want = COEF * torch.stack(per_layer).mean()
    _, aux = objective(ours, tokens, labels)
    assert abs((aux - want) / want).item() <= TOL, (aux.item(), want.item())
    ours.args = dataclasses.replace(ours.args, aux_per_layer=False)  # pooled: another number
    assert abs((objective(ours, tokens, labels)[1] - want) / want).item() > 1e-3
