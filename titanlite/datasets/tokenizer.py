"""Tokenizers: a SentencePiece .model, a Hugging Face tokenizer.json, or the built-in one (a
small SentencePiece model trained on first use, deterministically, on the stdlib, and cached by a
hash of everything that determines it). encode takes text only: titanlite adds BOS and EOS."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import sentencepiece as spm

from titanlite.datasets.corpus import corpus_fingerprint, stdlib_files
from titanlite.datasets.records import render
from titanlite.errors import UserError, first_line
from titanlite.models.hf_files import (
    read_generation_config,
    read_special_tokens_map,
    read_tokenizer_config,
)
from titanlite.tools.cache import atomic_write_bytes
from titanlite.tools.records import read_json

TRAINER_VERSION = 1  # bump when the training recipe below changes


class Tokenizer:
    """A SentencePiece model: no companion files (chat template, specials); without a pad token,
    padding uses EOS."""

    folder: Path | None = None
    chat_template: str | None = None
    special_tokens: dict[str, str] = {}

    def __init__(self, model_proto: bytes, source: str) -> None:
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.model_proto = model_proto
        self.source = source
        self.fingerprint = hashlib.sha256(model_proto).hexdigest()[:16]
        self.vocab_size: int = self.sp.get_piece_size()
        self.bos_id: int = self.sp.bos_id()
        self.eos_id: int = self.sp.eos_id()
        self.pad_id: int = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id
        self.stop_ids = frozenset({self.eos_id})

    def __reduce__(self):  # data-preparation worker processes rebuild it from the model bytes
        return Tokenizer, (self.model_proto, self.source)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """One thread: data preparation parallelises over processes, one per core."""
        return self.sp.encode(texts, num_threads=1)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


class HFTokenizer:
    """A Hugging Face tokenizer.json; its special tokens come from the files beside it, never from
    hard-coded ids; without a pad token, padding uses EOS (its labels are ignored anyway)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as Backend

        data = path.read_bytes()
        try:
            self.tok = Backend.from_str(data.decode("utf-8"))
        except Exception as e:
            raise UserError(
                f"'{path}' is not a Hugging Face tokenizer.json ({first_line(e)})"
            ) from None
        self.source, self.path = str(path), path
        self.folder = path.parent  # its companion files (specials, chat template) live here
        config_file = path.parent / "config.json"  # the model's, beside it
        config = read_json(config_file) if config_file.is_file() else {}
        specials = _special_tokens(path.parent, config)
        self.bos_id, self.eos_id = self._id(specials, "bos"), self._id(specials, "eos")
        self.pad_id = self._id(specials, "pad") if "pad" in specials else self.eos_id
        # What a chat template sees as bos_token, eos_token (and pad_token), as transformers passes them.
        self.special_tokens = {
            f"{k}_token": self.tok.id_to_token(self._id(specials, k)) for k in specials
        }
        self.chat_template = _chat_template(path.parent)
        # What ends a generated completion: EOS, every EOS generation_config.json and config.json
        # name (a list, for chat models), and the chat template's end of a turn.
        self.stop_ids = frozenset({self.eos_id, *_eos_ids(path.parent, config), *self._turn_end()})
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values()) + 1
        key = data + json.dumps(specials, sort_keys=True).encode()
        self.fingerprint = hashlib.sha256(key).hexdigest()[:16]

    def _id(self, specials: dict, kind: str) -> int:
        token = specials.get(kind)
        if isinstance(token, int):
            return token
        found = self.tok.token_to_id(token) if token is not None else None
        if found is None:
            raise UserError(
                f"the tokenizer in '{self.source}' names no usable {kind} token ({token!r}); its "
                f"folder's tokenizer_config.json or config.json must name one"
            )
        return found

    def _turn_end(self) -> list[int]:
        """The special token the chat template closes a message with (Llama 3's <|eot_id|>): the
        first token after a rendered message's text, if special."""
        if not self.chat_template:
            return []
        mark = "\u2063titanlite\u2063"  # text no template adds by itself
        try:
            turn = [{"role": "user", "content": mark}]
            text = render(self.chat_template, turn, False, self.special_tokens)
        except UserError:
            return []  # a template that needs more than one user message: EOS and the lists stop
        after = text.partition(mark)[2]
        ids = self.encode(after)[:1] if after else []
        specials = {int(i) for i in self.tok.get_added_tokens_decoder()}
        return [i for i in ids if i in specials]

    def __reduce__(self):  # data-preparation worker processes reload it from its file
        return HFTokenizer, (self.path,)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Batched; a preparation worker sets TOKENIZERS_PARALLELISM=false (one core each)."""
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def _special_tokens(folder: Path, config: dict) -> dict:
    """bos/eos/pad as token strings (tokenizer_config.json, special_tokens_map.json) or, failing
    those, ids (config.json; a list of EOS ids gives its first)."""
    out: dict = {}
    for data in (read_tokenizer_config(folder), read_special_tokens_map(folder)):
        for kind in ("bos", "eos", "pad"):
            token = data.get(f"{kind}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if kind not in out and isinstance(token, str):
                out[kind] = token
    for kind in ("bos", "eos", "pad"):
        value = config.get(f"{kind}_token_id")
        value = value[0] if isinstance(value, list) and value else value
        if kind not in out and isinstance(value, int):
            out[kind] = value
    return out


def _eos_ids(folder: Path, config: dict) -> list[int]:
    """The eos_token_id of generation_config.json and config.json: an id or a list of them."""
    ids = []
    for data in (read_generation_config(folder), config):
        value = data.get("eos_token_id")
        ids += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
    return ids


def _chat_template(folder: Path) -> str | None:
    """The folder's chat template: chat_template.jinja (how transformers saves it now), else
    tokenizer_config.json's "chat_template" (a string, or a list of named ones: "default")."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = read_tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_tokenizer(path: str) -> Tokenizer | HFTokenizer:
    """A tokenizer.json (or a folder holding one) is Hugging Face's; anything else must be a
    SentencePiece model (a folder's tokenizer.model: titanlite's export of the built-in one)."""
    p = Path(path).expanduser()
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return HFTokenizer(p / "tokenizer.json")
        if (p / "tokenizer.model").is_file():
            return load_tokenizer(str(p / "tokenizer.model"))
        raise UserError(
            f"'{path}' holds no tokenizer.json or tokenizer.model; point at a Hugging Face model folder"
        )
    if p.suffix == ".json":
        return HFTokenizer(p)
    try:
        return Tokenizer(p.read_bytes(), path)
    except Exception as e:  # sentencepiece raises RuntimeError/OSError with long messages
        raise UserError(
            f"model.tokenizer_path '{path}' is not a SentencePiece model ({first_line(e)}); "
            "point it at a .model file, a Hugging Face tokenizer.json, or leave it empty"
        ) from None


def builtin_tokenizer_path(cache_dir: Path, vocab_size: int) -> Path:
    key = f"{TRAINER_VERSION}:{vocab_size}:{corpus_fingerprint()}:{spm.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir / f"tokenizer-stdlib-{vocab_size}-{digest}.model"


def train_builtin_tokenizer(path: Path, vocab_size: int) -> None:
    """Train a byte-fallback BPE on the stdlib's lines and write it atomically to `path`."""

    def lines():
        for f in stdlib_files():
            for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
                if line.strip():
                    yield line

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines(),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,  # any text encodes, nothing maps to <unk>
        character_coverage=1.0,
        remove_extra_whitespaces=False,  # code: indentation is content
        normalization_rule_name="identity",  # decode(encode(text)) == text
        split_digits=True,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=["\n"],
        num_threads=1,  # deterministic
        shuffle_input_sentence=False,
        input_sentence_size=0,
        max_sentence_length=16384,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        minloglevel=2,
    )
    atomic_write_bytes(path, buf.getvalue())
