"""Hugging Face models in titanlite: a tiny random LlamaForCausalLM saved with save_pretrained
(tied and untied, Llama 3 rope scaling, an intermediate size no multiple_of rule gives) and a
BPE tokenizer.json trained here with `tokenizers`, all made in the test (no network).

- titanlite/models/llama3/hf.py alone: same logits and gradient as transformers, exact round trip;
- through the trainer (model.hf_assets_path; tests/workers/hf_load.py, one torchrun per world
  size 1 and 2, FSDP and DDP): same logits, same gradient of one exact-loss step, training goes on;
- the tokenizer gives AutoTokenizer's ids; bad folders are one-line errors;
- scripts/generate.py on that fine-tune's run folder: transformers' greedy text.
transformers is a test-only dependency (the dev extra)."""

from __future__ import annotations

import dataclasses
import json
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import check, load_script, read_metrics, torchrun
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from titanlite.config import load_config
from titanlite.errors import UserError
from titanlite.models.llama3 import Llama3
from titanlite.models.llama3.hf import LLAMA3_HF

TOL = 1e-5


def hf_folder(path, tied: bool, vocab: int = 96) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,  # the seq below reaches past it
        },
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return model


def load_titanlite(path) -> Llama3:
    """The folder into titanlite's Llama through load_hf_weights, which refuses a missing or an
    unexpected tensor."""
    from titanlite.components.checkpoint.hf_load import load_hf_weights

    args = LLAMA3_HF.args_from_config(json.loads((path / "config.json").read_text()))
    model = Llama3(dataclasses.replace(args, max_seq_len=32))
    load_hf_weights(model, path, LLAMA3_HF, model.args)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_hf_llama_gives_the_same_logits_and_gradient(tmp_path, tied):
    hf = hf_folder(tmp_path, tied)
    ours = load_titanlite(tmp_path)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, dims=1)
    mine, theirs = ours(tokens), hf(tokens).logits
    assert ((mine - theirs).abs().max() / theirs.abs().max()).item() <= TOL
    for logits in (mine, theirs):
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        hf_name, grad = LLAMA3_HF.to_hf(name, p.grad, ours.args)
        want = hf_grads[hf_name].grad
        assert ((grad - want).norm() / want.norm()).item() <= TOL, name
    # and back: titanlite's tensors in HF's names are the files' tensors, bitwise
    files = load_file(tmp_path / "model.safetensors")
    for name, tensor in ours.named_parameters():
        hf_name, back = LLAMA3_HF.to_hf(name, tensor.detach(), ours.args)
        assert torch.equal(back, files[hf_name]), name


def test_config_round_trips_and_unsupported_configs_are_one_line(tmp_path):
    hf_folder(tmp_path, tied=True)
    config = json.loads((tmp_path / "config.json").read_text())
    args = LLAMA3_HF.args_from_config(config)
    assert (args.hidden_dim, args.n_kv_heads, args.rope_scaling_factor, args.tie_embeddings) == (
        80,
        2,
        8.0,
        True,
    )
    assert LLAMA3_HF.args_from_config(LLAMA3_HF.config_from_args(args)) == args
    assert LlamaConfig(**LLAMA3_HF.config_from_args(args)).rope_parameters["rope_type"] == "llama3"
    for change, needle in (
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            'rope_parameters.rope_type = "yarn"',
        ),
        ({"hidden_act": "gelu"}, 'hidden_act = "gelu"'),
        ({"head_dim": 16}, "head_dim = 16"),
    ):
        with pytest.raises(UserError, match=needle):
            LLAMA3_HF.args_from_config({**config, **change})
    del config["intermediate_size"]
    with pytest.raises(UserError, match="config.json: no key 'intermediate_size'"):
        LLAMA3_HF.args_from_config(config)
    with pytest.raises(UserError, match="'model.extra.weight'"):
        LLAMA3_HF.from_hf("model.extra.weight", torch.zeros(1), args)


# A chat template in the manner of Llama 3.2's (headers, <|eot_id|>, a dated system turn),
# written for these tests.
CHAT_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "1 Jan 2000" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\nToday Date: " + date_string + "\n\n" }}
{{- system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def hf_tokenizer(path: Path, template_in_config: bool = False) -> None:
    """A byte-level BPE (Llama 3's kind) trained on a few stdlib files, with Llama 3's chat
    special tokens and CHAT_TEMPLATE, saved as transformers does (the template in
    chat_template.jinja, or the older way, in tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20]
    tok.train([str(f) for f in files], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1]
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    if template_in_config:
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": CHAT_TEMPLATE})
        )
        (path / "chat_template.jinja").unlink()


def chat_records(n: int = 48) -> list[dict]:
    """Conversations whose assistant turns differ in length (so ranks see different counts)."""
    lines = Path(sysconfig.get_paths()["stdlib"], "json", "decoder.py").read_text().splitlines()
    records = []
    for i in range(n):
        answer = " ".join(lines[i : i + 1 + i % 5])
        messages = [{"role": "user", "content": f"Line {i} of json/decoder.py?"}]
        messages.append({"role": "assistant", "content": answer or "(empty)"})
        if i % 3 == 0:
            messages = [{"role": "system", "content": "Quote exactly."}, *messages]
            messages += [
                {"role": "user", "content": "And the next?"},
                {"role": "assistant", "content": lines[i + 1]},
            ]
        records.append({"messages": messages})
    return records


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """`tied` (chat template in chat_template.jinja), `untied` (in tokenizer_config.json), and
    chat.jsonl."""
    root = tmp_path_factory.mktemp("hf_assets")
    for name in ("tied", "untied"):
        hf_folder(root / name, tied=name == "tied", vocab=320)
        hf_tokenizer(root / name, template_in_config=name == "untied")
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_records()))
    return root


@pytest.fixture(scope="module")
def loaded(assets, tmp_path_factory) -> dict[int, dict]:
    """World 2 first: world 1 continues its fine-tune's checkpoint at dp=1."""
    out, runs = {}, {}
    for world in (2, 1):
        runs[world] = tmp = tmp_path_factory.mktemp(f"hf_load{world}")
        upstream = [str(runs[2])] if world == 1 else []
        check(
            torchrun(
                world,
                "tests/workers/hf_load.py",
                str(tmp / "out.json"),
                str(assets),
                str(tmp),
                *upstream,
            )
        )
        out[world] = json.loads((tmp / "out.json").read_text())
        out[world]["runs"] = tmp
    return out


@pytest.mark.parametrize("world", (1, 2))
def test_trainer_loads_hf_weights_with_the_same_logits_and_gradient(loaded, world):
    cases = loaded[world]["cases"]
    modes = ("fsdp", "ddp", "hsdp") if world == 2 else ("fsdp", "ddp")
    assert {(c["name"], c["mode"]) for c in cases} == {
        (n, m) for n in ("tied", "untied") for m in modes
    }
    for c in cases:
        assert c["tied"] == (c["name"] == "tied")
        assert c["logits_err"] <= TOL and c["grad_err"] <= TOL, c
        losses = [r["loss"] for r in read_metrics(Path(c["run"]))]
        assert len(losses) == 2 and all(0 < v < 10 for v in losses), (c, losses)


def test_tokenizer_json_gives_autotokenizers_ids_and_the_folders_specials(assets):
    from transformers import AutoTokenizer

    from titanlite.datasets.tokenizer import load_tokenizer

    ours, theirs = (
        load_tokenizer(str(assets / "tied")),
        AutoTokenizer.from_pretrained(assets / "tied"),
    )
    text = (
        Path(sysconfig.get_paths()["stdlib"], "json", "decoder.py").read_text()[:3000]
        + " héllo 数字 123"
    )
    assert ours.encode(text) == theirs(text, add_special_tokens=False).input_ids
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        theirs.bos_token_id,
        theirs.eos_token_id,
        theirs.eos_token_id,
    )
    assert ours.decode(ours.encode(text)) == text and ours.vocab_size == len(theirs) == 300


def test_bad_hf_folders_are_one_line_errors(assets, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from titanlite import preflight
    from titanlite.components.checkpoint.hf_load import load_hf_weights
    from titanlite.models.registry import get_model_spec, hf_args

    spec = get_model_spec("llama3")

    def copy(name: str) -> Path:
        return Path(shutil.copytree(assets / "untied", tmp_path / name))

    def check_weights(folder: Path) -> None:  # the preflight's check, on the meta model
        cfg = load_config(None, ["--model.hf_assets_path", str(folder)])
        preflight.check_initial_weights(cfg, preflight._meta_model(cfg))

    no_tok = copy("no-tokenizer")
    (no_tok / "tokenizer.json").unlink()
    assert preflight.main(["--world-size", "1", "--model.hf_assets_path", str(no_tok)]) == 2
    # Weights cut short or with a damaged header: one line from the preflight, before any worker.
    size = (assets / "untied" / "model.safetensors").stat().st_size
    for name, cut, needle in (
        (
            "truncated",
            lambda f: f.truncate(size // 2),
            f"is cut short: {size // 2:,} of the {size:,} bytes",
        ),
        (
            "header",
            lambda f: (f.seek(8), f.write(b"{not json")),
            "has a damaged safetensors header",
        ),
        ("stub", lambda f: f.truncate(5), "is not a safetensors file or is cut short (5 bytes)"),
    ):
        broken = copy(name)
        with (broken / "model.safetensors").open("r+b") as f:
            cut(f)
        with pytest.raises(UserError, match=re.escape(needle)):
            check_weights(broken)
        assert preflight.main(["--world-size", "1", "--model.hf_assets_path", str(broken)]) == 2
    check_weights(assets / "untied")
    other = copy("other-arch")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(
        UserError, match="holds a GPT2LMHeadModel but model 'llama3' reads LlamaForCausalLM"
    ):
        hf_args(spec, other, 300)
    with pytest.raises(
        UserError, match="the tokenizer's ids reach 399 but config.json's vocab_size is 320"
    ):
        hf_args(spec, assets / "untied", 400)
    args = dataclasses.replace(hf_args(spec, assets / "untied", 300), max_seq_len=32)
    weights = load_file(assets / "untied" / "model.safetensors")
    for name, broken, needle in (
        (
            "missing",
            {k: v for k, v in weights.items() if k != "model.norm.weight"},
            "lacks weights for norm.weight",
        ),
        (
            "shape",
            {**weights, "model.norm.weight": torch.ones(7)},
            "'model.norm.weight' in .* has shape \\(7,\\)",
        ),
        (
            "extra",
            {**weights, "model.layers.9.mlp.up_proj.weight": torch.ones(2, 2)},
            "no parameter for",
        ),
    ):
        folder = copy(name)
        save_file(broken, folder / "model.safetensors")
        with pytest.raises(UserError, match=needle):
            load_hf_weights(Llama3(args), folder, LLAMA3_HF, args)
        with pytest.raises(
            UserError, match=needle
        ):  # the preflight says it before any worker starts
            check_weights(folder)
    # Shards and their index agree both ways, checked from the headers before any worker starts:
    # every index that loses, moves or invents a name is refused naming it.
    names = sorted(weights)
    halves = {"model-1.safetensors": names[::2], "model-2.safetensors": names[1::2]}

    def sharded(name: str, weight_map: dict[str, str]) -> Path:
        folder = copy(name)
        (folder / "model.safetensors").unlink()
        for file, part in halves.items():
            save_file({k: weights[k] for k in part}, folder / file)
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return folder

    whole = {k: f for f, part in halves.items() for k in part}
    check_weights(sharded("sharded", whole))
    for i, victim in enumerate(names[:: max(1, len(names) // 6)]):
        other = (
            "model-1.safetensors"
            if whole[victim] == "model-2.safetensors"
            else "model-2.safetensors"
        )
        for how, weight_map, needle in (
            (
                "lost",
                {k: f for k, f in whole.items() if k != victim},
                f"holds {victim}, which .* does not list",
            ),
            ("moved", {**whole, victim: other}, f"{victim}.* the index and the shards disagree"),
            ("invented", {**whole, victim + ".extra": whole[victim]}, f"lists {victim}.extra in"),
        ):
            folder = sharded(f"{how}-{i}", weight_map)
            with pytest.raises(UserError, match=re.escape(needle).replace(re.escape(".*"), ".*")):
                check_weights(folder)
    # Rotary inv_freq buffers (older transformers saved one per layer) are skipped for any model:
    # its adapter never sees them, and the weights load as they do without them.
    layers = sorted({k.split(".")[2] for k in weights if k.startswith("model.layers.")})
    buffers = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(4) for i in layers}
    folder = copy("inv-freq")
    save_file({**weights, **buffers}, folder / "model.safetensors")
    seen: list[str] = []
    spy = dataclasses.replace(
        LLAMA3_HF, from_hf=lambda n, t, a: seen.append(n) or LLAMA3_HF.from_hf(n, t, a)
    )
    with_buffers, without = Llama3(args), Llama3(args)
    load_hf_weights(with_buffers, folder, spy, args)
    load_hf_weights(without, assets / "untied", LLAMA3_HF, args)
    assert seen and not set(seen) & set(buffers)
    for (name, a), (_, b) in zip(
        with_buffers.state_dict().items(), without.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def _int_keys(d: dict) -> dict[int, float]:
    return {int(k): v for k, v in d.items()}


def test_pretrained_start_resumes_reshards_and_starts_new_runs(loaded):
    """The world-2 fine-tune (FSDP, chat records, 5 steps) and what was started from it."""
    f = loaded[2]["finetune"]
    ft = _int_keys(f["losses"]["ft"])
    assert sorted(ft) == [1, 2, 3, 4, 5] and all(
        v is not None and 0 < v < 10 for v in ft.values()
    ), ft
    later = (3, 4, 5)
    # resumed from its own step 2 (model.hf_assets_path still set: the checkpoint wins): bitwise
    assert f["resume_start_step"] == 3
    assert {s: _int_keys(f["losses"]["ft-resumed"])[s] for s in later} == {s: ft[s] for s in later}
    # resharded: FSDP dp=2 -> DDP dp=2, HSDP 2x1, and FSDP dp=1 (tests/workers/hf_load.py at world 1)
    resharded = [_int_keys(f["losses"][k]) for k in ("ft-ddp", "ft-hsdp")] + [
        _int_keys(loaded[1]["dp1_losses"])
    ]
    for other in resharded:
        assert max(abs(other[s] - ft[s]) / ft[s] for s in later) <= TOL, (other, ft)
    # a new run from the step-2 folder: the same weights as the resume, no optimizer state, step 0
    assert f["model_only_vs_resume"] == 0.0
    assert (f["model_only_optimizer_entries"], f["model_only_last_epoch"]) == (0, 0)
    # ... with the optimizer: the resume's AdamW state, this run's lr at the schedule's position 2
    assert f["optim_vs_resume"] == 0.0
    assert f["optim_lrs"] == [f["optim_want_lr"]] == [5e-4]  # position 0 would be 2.5e-4 (warmup 2)
    # the source is only read; the new runs write their own checkpoints
    assert f["source_untouched"] and f["from_ckpt_checkpoints"] == [
        "step-00000001",
        "step-00000002",
    ]
    # the exported folder as a start: the fine-tuned weights, bitwise
    assert f["export_reload_vs_trained"] == 0.0


def test_exported_folder_loads_in_transformers_with_titanlite_logits(loaded, assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = loaded[2]["runs"] / "ft" / "hf"
    saved = torch.load(loaded[2]["runs"] / "ft_logits.pt")
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out)(saved["tokens"]).logits
        before = AutoModelForCausalLM.from_pretrained(assets / "untied")(saved["tokens"]).logits
    scale = saved["logits"].abs().max()
    assert ((theirs - saved["logits"]).abs().max() / scale).item() <= TOL
    assert ((before - saved["logits"]).abs().max() / scale).item() > 1e-3  # the fine-tune moved it
    config = json.loads((out / "config.json").read_text())
    assert (config["dtype"], config["tie_word_embeddings"], config["intermediate_size"]) == (
        "float32",
        False,
        80,
    )
    tok, src = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(assets / "untied")
    text = "def f(x):\n    return x  # héllo"
    assert tok(text).input_ids == src(text).input_ids and tok.chat_template == CHAT_TEMPLATE
    assert not any(out.parent.glob("hf.tmp"))
    # the same steps resumed under HSDP 2x1 and exported from there: the same tensors
    fsdp = load_file(out / "model.safetensors")
    for layout in ("ft-hsdp", "ft-tp"):  # HSDP 2x1, and a tensor split dp=1 x tp=2
        other = load_file(loaded[2]["runs"] / layout / "hf" / "model.safetensors")
        assert other.keys() == fsdp.keys()
        assert max(((other[k] - fsdp[k]).norm() / fsdp[k].norm()).item() for k in fsdp) <= TOL


def test_export_script_writes_sharded_folders_and_refuses_bad_input(loaded, tmp_path, capsys):
    import shutil

    from transformers import AutoModelForCausalLM

    script = load_script("export_hf")
    ckpts = loaded[2]["runs"] / "ft" / "checkpoints"
    step5 = ckpts / "step-00000005"
    assert script.main([str(step5), str(tmp_path / "fp32"), "--max-shard-gb", "0.00005"]) == 0
    index = json.loads((tmp_path / "fp32" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    ours = {k: v for f in files for k, v in load_file(tmp_path / "fp32" / f).items()}
    end_of_run = load_file(loaded[2]["runs"] / "ft" / "hf" / "model.safetensors")
    assert ours.keys() == end_of_run.keys() and all(
        torch.equal(ours[k], end_of_run[k]) for k in ours
    )
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in ours.values())
    assert script.main([str(step5), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16.model.norm.weight, ours["model.norm.weight"].to(torch.bfloat16))
    # bad input: one line, exit 2, nothing written
    incomplete = Path(shutil.copytree(step5, tmp_path / "step-incomplete"))
    (incomplete / "complete").unlink()
    (tmp_path / "a-file").write_text("")  # the output folder cannot be created under it
    for argv, needle in (
        ([str(step5), str(tmp_path / "fp32")], "is a folder that is not empty"),
        ([str(incomplete), str(tmp_path / "x")], "is incomplete"),
        ([str(tmp_path / "none"), str(tmp_path / "x")], "does not exist"),
        (
            [str(step5), str(tmp_path / "a-file" / "x")],
            "'" + str(tmp_path / "a-file") + "' is a file",
        ),
    ):
        capsys.readouterr()
        assert script.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()
    # a tensor-split run's export is its checkpoint's, as one process exports it, bitwise
    split = loaded[2]["runs"] / "ft-tp"
    assert script.main([str(split / "checkpoints" / "step-00000005"), str(tmp_path / "tp")]) == 0
    alone, in_run = (
        load_file(tmp_path / "tp" / "model.safetensors"),
        load_file(split / "hf" / "model.safetensors"),
    )
    assert alone.keys() == in_run.keys() and all(torch.equal(alone[k], in_run[k]) for k in alone)
    # a checkpoint (or run) folder: its newest intact step, as every reader of checkpoints reads it
    assert script.main([str(ckpts), str(tmp_path / "newest")]) == 0
    assert f"from {step5} " in capsys.readouterr().out


def test_generate_script_continues_prompts_as_transformers_does(loaded, tmp_path, capsys):
    """scripts/generate.py on the fine-tune's run folder: greedy text from its newest checkpoint
    (step 5, whose weights the end-of-run export holds) equals transformers' greedy generate on
    the exported folder, from BOS + text (--format text) and, by default for this chat run, from
    the chat template's generation prompt of a user turn; the same from --step 5 and from the
    step folder; bad input is one line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    script = load_script("generate")
    run = loaded[2]["runs"] / "ft"
    prompts = ["def parse(text):", "Line 7 of json/decoder.py?"]
    argv = [a for p in prompts for a in ("--prompt", p)] + [
        "--max-new-tokens",
        "10",
        "--format",
        "text",
    ]
    outs = []
    for where in (
        [str(run)],
        [str(run), "--step", "5"],
        [str(run / "checkpoints" / "step-00000005")],
    ):
        assert script.main([*where, *argv]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2], outs
    hf, tok = (
        AutoModelForCausalLM.from_pretrained(run / "hf"),
        AutoTokenizer.from_pretrained(run / "hf"),
    )
    for prompt in prompts:
        ids = [tok.bos_token_id, *tok(prompt, add_special_tokens=False).input_ids]
        new = hf.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=10, eos_token_id=tok.eos_token_id
        )[0, len(ids) :].tolist()
        new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
        head = tok.decode(ids, skip_special_tokens=False)
        completion = tok.decode(ids + new, skip_special_tokens=False)[len(head) :]
        assert f"{prompt}{completion}\n" in outs[0] and completion, (prompt, completion, outs[0])
    assert script.main([str(run), "--prompt", prompts[0], "--max-new-tokens", "10"]) == 0
    chat = capsys.readouterr().out
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompts[0]}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, add_special_tokens=False).input_ids
    new = hf.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=10, eos_token_id=tok.eos_token_id
    )
    new = new[0, len(ids) :].tolist()
    new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
    head = tok.decode(ids, skip_special_tokens=False)
    completion = tok.decode(ids + new, skip_special_tokens=False)[len(head) :]
    assert chat.endswith(f"{prompts[0]}{completion}\n") and chat != outs[0], (chat, completion)
    sampled = [
        script.main([str(run), *argv, "--temperature", "1", "--seed", "3"]) for _ in range(2)
    ]
    texts = capsys.readouterr().out.split("# ")[1:]
    assert sampled == [0, 0] and texts[0] == texts[1] and texts[0] != outs[0].removeprefix("# ")
    (tmp_path / "empty").mkdir()
    for extra, needle in (
        ([str(tmp_path / "empty")], "holds no complete checkpoint (looked in '"),
        ([str(tmp_path / "none")], "does not exist; give an existing folder"),
        (
            [str(run), "--step", "3"],
            "holds no complete checkpoint of that step (complete: 2, 4, 5)",
        ),
        ([str(run / "checkpoints" / "step-00000005"), "--step", "5"], "is a step folder already"),
        ([str(run), "--top-p", "0"], "--top-p is '0'; it must be a finite number > 0 and <= 1"),
    ):
        assert script.main([*extra, "--prompt", "x"]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("generate: error: ") and needle in err and err.count("\n") == 1, err


MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sum a list."},
    {"role": "assistant", "content": "Use sum(xs)."},
    {"role": "user", "content": "And the product?"},
    {"role": "assistant", "content": "math.prod(xs), héllo"},
]


@pytest.mark.parametrize("name", ["tied", "untied"])  # chat_template.jinja; tokenizer_config.json
def test_generation_stops_at_eos_the_end_of_a_turn_and_generation_configs_list(
    assets, name, tmp_path
):
    from titanlite.datasets.tokenizer import load_tokenizer

    tok = load_tokenizer(str(assets / name))
    eot, eos = tok.tok.token_to_id("<|eot_id|>"), tok.tok.token_to_id("<|end_of_text|>")
    # the template closes a turn with <|eot_id|>; config.json names an EOS id too (as transformers reads it)
    config_eos = json.loads((assets / name / "config.json").read_text())["eos_token_id"]
    assert tok.eos_id == eos and tok.stop_ids == {eos, eot, config_eos}
    folder = tmp_path / name
    folder.mkdir()
    for f in (assets / name).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 7, 11]}))
    assert load_tokenizer(str(folder)).stop_ids == {eos, eot, config_eos, 7, 11}


@pytest.mark.parametrize("name", ["tied", "untied"])  # chat_template.jinja; tokenizer_config.json
def test_chat_records_render_as_apply_chat_template_with_only_assistant_turns_as_targets(
    assets, name
):
    from transformers import AutoTokenizer

    from titanlite.datasets.records import chat_segments, record_tokens, template_pieces
    from titanlite.datasets.sequences import to_example
    from titanlite.datasets.tokenizer import load_tokenizer
    from titanlite.ops.cross_entropy import IGNORE_INDEX

    ours, theirs = load_tokenizer(str(assets / name)), AutoTokenizer.from_pretrained(assets / name)
    date = {
        "date_string": "26 Jul 2024"
    }  # titanlite's fixed strftime_now date; transformers' is today
    want = theirs.apply_chat_template(MESSAGES, tokenize=False, **date)
    pieces = template_pieces(ours.chat_template, MESSAGES, ours.special_tokens)
    assert "".join(text for text, _ in pieces) == want and "Today Date: 26 Jul 2024" in want
    assert [text for text, target in pieces if target] == [
        "Use sum(xs).<|eot_id|>",
        "math.prod(xs), héllo<|eot_id|>",
    ]
    ids = [t for seg, _ in chat_segments(MESSAGES, ours) for t in seg]
    assert ids.count(ours.bos_id) == 1 and ids[0] == ours.bos_id  # the template's BOS, not a second
    for turn in (3, 5):  # the prompt of each assistant turn is what inference tokenizes
        prompt = theirs.apply_chat_template(
            MESSAGES[: turn - 1], add_generation_prompt=True, **date
        ).input_ids
        assert ids[: len(prompt)] == prompt
    ids, target = record_tokens({"messages": MESSAGES}, ours)
    x, y = to_example(np.asarray(ids), np.asarray(target), 256, ours.pad_id)
    assert (
        ours.decode(y[y != IGNORE_INDEX].tolist())
        == "Use sum(xs).<|eot_id|>math.prod(xs), héllo<|eot_id|>"
    )
    bad = [*MESSAGES[:2], {"role": "critic", "content": "no"}]
    with pytest.raises(
        UserError, match="the chat template fails on a record \\(unknown role critic\\)"
    ):
        chat_segments(bad, ours)


def test_bad_initial_loads_are_one_line_errors_before_any_worker(loaded, assets, tmp_path, capsys):
    import shutil

    from titanlite import preflight
    from titanlite.components.checkpoint.resume import check_fits

    ckpts = loaded[2]["runs"] / "ft" / "checkpoints"
    incomplete = Path(shutil.copytree(ckpts / "step-00000002", tmp_path / "step-00000002"))
    (incomplete / "complete").unlink()
    (tmp_path / "empty").mkdir()
    for extra, needle in (
        ((str(ckpts),), "is a checkpoint folder; point checkpoint.initial_load_path at one of its step folders, e.g. the newest: '"),
        ((str(incomplete),), "is incomplete (its save never finished)"),
        ((str(tmp_path / "none"),), "is not a folder"),
        ((str(tmp_path / "empty"),), "holds no config.json nor a checkpoint"),
        ((str(assets / "tied"), "--checkpoint.initial_load_model_only", "false"), "needs a titanlite checkpoint"),
    ):  # fmt: skip
        capsys.readouterr()
        assert preflight.main(["--world-size", "1", "--checkpoint.initial_load_path", *extra]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
    step2 = ["--world-size", "1", "--checkpoint.initial_load_path", str(ckpts / "step-00000002")]
    own = [
        "--model.hf_assets_path",
        str(assets / "untied"),
        "--data.mode",
        "sft",
        "--data.path",
        str(assets / "chat.jsonl"),
    ]
    assert preflight.main([*step2, *own]) == 0  # its own model takes every tensor it holds
    capsys.readouterr()
    assert (
        preflight.main(step2) == 2
    )  # the debug model's shapes do not fit it: refused before any worker
    assert "has shape" in capsys.readouterr().err
    # a checkpoint of another model: the first tensor that does not fit, from .metadata alone
    with pytest.raises(
        UserError,
        match="'tok_embeddings.weight' in checkpoint .* has shape \\(320, 32\\), this model's \\(7, 32\\)",
    ):
        check_fits(ckpts / "step-00000002", {"tok_embeddings.weight": torch.empty(7, 32)})
    with pytest.raises(
        UserError,
        match="holds no 'layers.9.attention.wq.weight'; it is not a checkpoint of this model",
    ):
        check_fits(ckpts / "step-00000002", {"layers.9.attention.wq.weight": torch.empty(1)})


def test_a_resume_refuses_an_hf_folder_whose_shapes_changed(loaded, assets, tmp_path, capsys):
    """model.hf_assets_path's config.json is read anew by every launch: a resume compares the model
    it builds with the args state.json recorded (a checkpoint that recorded none, or no identity,
    is refused); a folder left as it was resumes."""
    import shutil

    from titanlite import preflight

    hf = Path(shutil.copytree(assets / "untied", tmp_path / "hf"))
    run = Path(
        shutil.copytree(
            loaded[2]["runs"] / "ft", tmp_path / "ft", ignore=shutil.ignore_patterns("logs")
        )
    )
    states = sorted((run / "checkpoints").glob("step-*/state.json"))
    assert states

    def edit_states(change) -> None:
        for path in states:
            state = json.loads(path.read_text())
            change(state)
            path.write_text(json.dumps(state))

    def moved(state: dict) -> None:  # the run as if it had trained on the copy
        state["identity"]["model.hf_assets_path"] = state["config"]["model.hf_assets_path"] = str(
            hf
        )

    edit_states(moved)
    argv = [
        *("--world-size", "2", "--model.hf_assets_path", str(hf), "--data.mode", "sft"),
        *(
            "--data.path",
            str(assets / "chat.jsonl"),
            "--training.seq_len",
            "160",
            "--training.steps",
            "5",
        ),
        *("--training.global_batch_size", "4", "--training.local_batch_size", "1"),
        *(
            "--checkpoint.every",
            "2",
            "--checkpoint.at_end",
            "true",
            "--checkpoint.keep_latest_k",
            "0",
        ),
        *("--job.dump_folder", str(tmp_path), "--job.run_name", "ft"),
    ]
    assert preflight.main(argv) == 0
    config = json.loads((hf / "config.json").read_text())
    size = config["intermediate_size"]
    (hf / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * size}))
    capsys.readouterr()
    assert preflight.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the model changed since checkpoint" in err, err
    assert f"{hf}/config.json changed (intermediate_size {size}, now {2 * size})" in err, err
    (hf / "config.json").write_text(json.dumps(config))
    assert preflight.main(argv) == 0
    for key in ("model_args", "identity"):  # what the resume compares, gone
        capsys.readouterr()
        edit_states(lambda state, key=key: state.pop(key, None))
        assert preflight.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"records no {key}" in err, err
        assert "initial_load_path" in err, err


@pytest.mark.parametrize("config", ["llama3_2_1b_sft", "llama3_1_8b_sft"])
def test_sft_configs_are_ready_for_a_downloaded_folder(assets, config, capsys):
    from titanlite import preflight

    argv = ["--world-size", "8", "--config", f"train_configs/{config}.toml"]
    assert preflight.main(argv) == 2  # the folder it names is not downloaded here
    assert "is not a folder; point it at a downloaded model" in capsys.readouterr().err
    assert preflight.main([*argv, "--model.hf_assets_path", str(assets / "tied")]) == 0


def test_the_built_in_sentencepiece_tokenizer_exports_as_transformers_encodes_it(tmp_path):
    """checkpoint.export_hf writes the tokenizer the run trained with, a SentencePiece model too:
    transformers' AutoTokenizer of the exported files gives titanlite's ids for the standard
    library's text (pieces of 40 modules) and for odd whitespace and characters."""
    import random
    import sysconfig

    from transformers import AutoTokenizer

    from titanlite.components.checkpoint.hf_export import companion_files
    from titanlite.config import JobConfig
    from titanlite.datasets.build import build_tokenizer

    tok = build_tokenizer(JobConfig())
    for name, what in companion_files(None, tok).items():
        (tmp_path / name).write_bytes(what)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [
        s[i : i + 700]
        for f in sorted(stdlib.glob("*.py"))[:40]
        for s in [f.read_text(errors="replace")]
        for i in range(0, 7000, 700)
    ]
    rng = random.Random(0)
    texts += ["".join(rng.choice(" \n\tab€🚀xyz") for _ in range(50)) for _ in range(200)]
    differ = [t for t in texts if tok.encode(t) != theirs.encode(t, add_special_tokens=False)]
    assert not differ, (
        f"{len(differ)} of {len(texts)} texts encode differently, e.g. {differ[0][:40]!r}"
    )
    assert theirs.eos_token_id == tok.eos_id and theirs.bos_token_id == tok.bos_id


def _family_folder(path: Path, architecture: str, config: dict) -> Path:
    """A Hugging Face folder as far as a family check reads it: config.json and a weights file."""
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    save_file({"x": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def test_initial_weights_of_another_model_family_are_named_with_the_fix(tmp_path, capsys):
    """checkpoint.initial_load_path at a Hugging Face folder of another family (each registered
    family's folder given to a run of each other one, and a family no model reads) is refused
    before any worker in one line that names the folder's family and the model.name that reads
    it, not blamed on the folder's config.json."""
    import titanlite.models  # noqa: F401  (registers the built-in models)
    from titanlite import preflight
    from titanlite.models.registry import _REGISTRY

    families = {
        n: s for n, s in _REGISTRY.items() if s.hf is not None and "debugmodel" in s.flavors
    }
    assert len(families) >= 2
    folders = {
        name: _family_folder(
            tmp_path / name,
            spec.hf.architectures[0],
            spec.hf.config_from_args(
                dataclasses.replace(spec.flavors["debugmodel"], vocab_size=320)
            ),
        )
        for name, spec in families.items()
    }
    folders["a fork's"] = _family_folder(tmp_path / "fork", "MysteryForCausalLM", {})
    for held, folder in folders.items():
        for name in families:
            if name == held:
                continue
            argv = ["--world-size", "1", "--model.name", name, "--model.flavor", "debugmodel"]
            capsys.readouterr()
            assert preflight.main([*argv, "--checkpoint.initial_load_path", str(folder)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "config.json" not in err, err
            arch = json.loads((folder / "config.json").read_text())["architectures"][0]
            assert f"'{folder}' holds another model family ({arch})" in err, err
            fix = f"--model.name {held} --model.hf_assets_path {folder}"
            assert (fix if held in families else "a model.name whose adapter reads it") in err, err


def test_initial_weights_of_another_size_are_named_with_the_fix(tmp_path, capsys):
    """A folder of the run's family but another model (a tiny Llama given to the debug model's
    run) is named as that, with the keys that differ and the flag that trains it; the same folder
    as model.hf_assets_path trains (its config.json gives the model)."""
    from titanlite import preflight

    folder = tmp_path / "tiny"
    hf_folder(folder, tied=False, vocab=320)
    hf_tokenizer(folder)
    capsys.readouterr()  # transformers' progress bar
    start = ["--world-size", "1", "--checkpoint.initial_load_path", str(folder)]
    assert preflight.main(start) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not match its weights" not in err, err
    assert (
        f"'{folder}' holds another model than this run builds (config.json vs this run: dim 32 vs 256"
        in err
    )
    assert f"set --model.hf_assets_path {folder}" in err, err
    assert preflight.main([*start, "--model.hf_assets_path", str(folder)]) == 0, (
        capsys.readouterr().err
    )
