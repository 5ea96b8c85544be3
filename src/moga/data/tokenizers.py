"""Tokenizers: characters, UTF-8 bytes, or GPT-2's BPE rebuilt offline with tiktoken."""

from __future__ import annotations

import base64
import functools
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

# Deferred on purpose, imported where used: tiktoken (the optional `text` extra), only for GPT-2's BPE.

GPT2_VOCAB_SIZE = 50257  # 50,256 merges + <|endoftext|>
GPT2_EOT = 50256
# GPT-2's pre-tokenization regex, as tiktoken writes it (r50k_pat_str).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_INSTALL_RANKS = ("GPT-2's BPE ranks come with openai-whisper (file whisper/assets/gpt2.tiktoken): "
                  "`pip install --no-deps openai-whisper` (with tiktoken installed), or point "
                  "$MOGA_GPT2_RANKS at a gpt2.tiktoken file. Nothing is downloaded at run time.")


class CharTokenizer:
    """One id per distinct character, in sorted order (nanoGPT's shakespeare_char)."""

    kind = "char"

    def __init__(self, chars: Sequence[str]):
        self.itos = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in this {self.vocab_size}-character vocabulary") from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.itos[int(i)] for i in ids)

    def meta(self) -> dict:
        return {"tokenizer": self.kind, "vocab_size": self.vocab_size, "itos": self.itos, "stoi": self.stoi}


class ByteTokenizer:
    """The UTF-8 bytes of the text: a fixed vocabulary of 256 that needs no fitting."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def meta(self) -> dict:
        return {"tokenizer": self.kind, "vocab_size": self.vocab_size}


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (tiktoken's "gpt2"), built from local ranks; encodes without special tokens."""

    kind = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE
    eot_token = GPT2_EOT

    def __init__(self, ranks_path: str | Path | None = None):
        self.encoding = gpt2_encoding(str(ranks_path or find_gpt2_ranks()))

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)  # like nanoGPT: "<|endoftext|>" in text is plain text

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def meta(self) -> dict:
        return {"tokenizer": self.kind, "vocab_size": self.vocab_size}


def find_gpt2_ranks() -> Path:
    """gpt2.tiktoken: $MOGA_GPT2_RANKS, else the copy inside the installed openai-whisper package.

    The package is located without importing it (its imports need numba and more).
    """
    if os.environ.get("MOGA_GPT2_RANKS"):
        path = Path(os.environ["MOGA_GPT2_RANKS"]).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"$MOGA_GPT2_RANKS points to {path}, which does not exist. {_INSTALL_RANKS}")
        return path
    spec = importlib.util.find_spec("whisper")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "assets" / "gpt2.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError(f"GPT-2 BPE ranks not found. {_INSTALL_RANKS}")


@functools.lru_cache(maxsize=4)
def gpt2_encoding(ranks_path: str):
    """A tiktoken Encoding equal to tiktoken.get_encoding("gpt2"), without any download."""
    try:
        import tiktoken
    except ImportError as e:
        raise ImportError("GPT-2 BPE needs tiktoken: pip install tiktoken (or moga[text])") from e
    # Parsed here rather than by tiktoken.load: that one also copies local files into a temp-dir
    # cache keyed by path, which could serve stale ranks after the file changes.
    ranks = {}
    for line in Path(ranks_path).read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != GPT2_EOT:
        raise ValueError(f"{ranks_path}: {len(ranks)} ranks, GPT-2 has {GPT2_EOT}")
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": GPT2_EOT}, explicit_n_vocab=GPT2_VOCAB_SIZE)


TOKENIZER_KINDS = ("char", "byte", "gpt2")
_KIND_ALIASES = {"bpe": "gpt2", "gpt-2": "gpt2", "bytes": "byte", "character": "char"}


def tokenizer_kind(kind: str) -> str:
    key = _KIND_ALIASES.get(kind.lower(), kind.lower())
    if key not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer {kind!r}; valid: char, byte, gpt2 (alias bpe)")
    return key


def get_tokenizer(kind: str, text: str | None = None):
    """A tokenizer of `kind`; "char" is fitted to `text`."""
    kind = tokenizer_kind(kind)
    if kind == "char":
        if text is None:
            raise ValueError("a char tokenizer is built from the text: pass text")
        return CharTokenizer.from_text(text)
    return ByteTokenizer() if kind == "byte" else GPT2Tokenizer()


def tokenizer_from_meta(meta: dict):
    """The tokenizer described by a metadata dict (see text.write_meta)."""
    # nanoGPT's meta.pkl has no "tokenizer" key: an itos mapping means char-level.
    kind = tokenizer_kind(meta.get("tokenizer") or ("char" if "itos" in meta else "gpt2"))
    if kind == "char":
        if "itos" not in meta:
            raise ValueError("char-level metadata without its itos list")
        itos = meta["itos"]
        return CharTokenizer([itos[i] for i in sorted(itos)] if isinstance(itos, dict) else itos)
    return ByteTokenizer() if kind == "byte" else GPT2Tokenizer()
