"""SentencePiece tokenizer: a user's .model, or a small one trained on the stdlib corpus.

The built-in tokenizer is trained on first use, deterministically (single thread, no sampling,
fixed file order), and cached by a hash of everything that determines it.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import sentencepiece as spm

from titanlite.datasets.corpus import corpus_fingerprint, stdlib_files
from titanlite.tools.cache import atomic_write_bytes

TRAINER_VERSION = 1  # bump when the training recipe below changes


class Tokenizer:
    def __init__(self, model_proto: bytes, source: str) -> None:
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.source = source
        self.fingerprint = hashlib.sha256(model_proto).hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    @property
    def pad_id(self) -> int:
        pad = self.sp.pad_id()
        return pad if pad >= 0 else self.eos_id

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


def load_tokenizer(path: str) -> Tokenizer:
    from titanlite.errors import UserError

    data = Path(path).expanduser().read_bytes()
    try:
        return Tokenizer(data, path)
    except Exception as e:  # sentencepiece raises RuntimeError/OSError with long messages
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"model.tokenizer_path '{path}' is not a SentencePiece model ({first}); "
            "point it at a .model file or leave it empty"
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
