"""Token streams in nanoGPT's format, and random-offset batches from them.

A data directory holds `train.bin` and `val.bin` (flat uint16 token ids, as numpy's tofile writes
them) and `meta.json` ({"vocab_size", "tokenizer", and for char-level "itos"/"stoi"}). nanoGPT's
own `meta.pkl` is read too. OpenWebText prepared by nanoGPT comes without metadata: its ids are
GPT-2 BPE, so the vocabulary size then defaults to GPT-2's 50,257 unless you pass one.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import warnings
from pathlib import Path

import numpy as np
import torch

from .paths import dataset_candidates, resolve_path
from .tokenizers import GPT2_VOCAB_SIZE, get_tokenizer, tokenizer_from_meta, tokenizer_kind

TOKEN_DTYPE = np.uint16  # nanoGPT's choice: every vocabulary used here fits in 16 bits
SPLITS = ("train", "val")


# ---- corpus ---------------------------------------------------------------------------------

def default_corpora() -> list[Path]:
    """Fallback texts, in order: tiny Shakespeare in $MOGA_DATA or the user data folder (``moga data fetch
    shakespeare`` puts it there), then gensim's lee_background.cor when gensim is installed (located
    without importing it)."""
    candidates = dataset_candidates("tinyshakespeare.txt")
    spec = importlib.util.find_spec("gensim")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(Path(location) / "test" / "test_data" / "lee_background.cor")
    return candidates


def resolve_text_corpus(path: str | Path | None = None) -> Path:
    """The text to train on: `path`, else $MOGA_TEXT, else the first of `default_corpora()`."""
    hint = ("Pass any UTF-8 text file (or set $MOGA_TEXT to one); `moga data fetch shakespeare` downloads tiny "
            "Shakespeare where a network exists; pip install gensim also provides a small English corpus "
            "(lee_background.cor) that is found automatically.")
    found = resolve_path(path, "MOGA_TEXT", default_corpora(), hint)
    if not found.is_file():
        raise FileNotFoundError(f"{found} is not a file. {hint}")
    return found


# ---- prepare --------------------------------------------------------------------------------

def write_meta(out_dir: str | Path, meta: dict) -> Path:
    path = Path(out_dir) / "meta.json"
    path.write_text(json.dumps(meta, ensure_ascii=False, indent=1))
    return path


def prepare_text(out_dir: str | Path, text_path: str | Path | None = None, tokenizer: str = "char",
                 val_fraction: float = 0.1) -> dict:
    """Tokenize a text file into out_dir/{train,val}.bin + meta.json; returns the metadata.

    Like nanoGPT, the text (not the tokens) is split: its first 90% trains, the rest validates.
    A char tokenizer is fitted to the whole text. The whole text is held in memory.
    """
    kind = tokenizer_kind(tokenizer)  # check the cheap arguments before reading any text
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    source = resolve_text_corpus(text_path)
    try:
        text = source.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{source} is not UTF-8 text ({e})") from e
    if not text:
        raise ValueError(f"{source} is empty: a text data set needs a text to split into train and val")
    cut = int(len(text) * (1 - val_fraction))
    if cut in (0, len(text)):  # one split would be empty, and be blamed on a token file in the cache
        raise ValueError(f"{source} holds {len(text)} characters: too few to split into train and val "
                         "(a text corpus needs more characters than the context length)")
    tok = get_tokenizer(kind, text)
    if tok.vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"vocabulary of {tok.vocab_size} does not fit the uint16 token files")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**tok.meta(), "source": str(source)}
    for split, part in zip(SPLITS, (text[:cut], text[cut:])):
        ids = np.asarray(tok.encode(part), dtype=TOKEN_DTYPE)
        ids.tofile(out / f"{split}.bin")
        meta[f"{split}_tokens"] = len(ids)
    write_meta(out, meta)
    return meta


# ---- read and batch -------------------------------------------------------------------------

class _NoGlobalsUnpickler(pickle.Unpickler):
    """nanoGPT's meta.pkl is a plain dict; refusing every global keeps a hostile pickle inert."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a metadata pickle")


def read_meta(data_dir: str | Path) -> dict | None:
    """meta.json, else nanoGPT's meta.pkl, else None."""
    data_dir = Path(data_dir)
    if (data_dir / "meta.json").is_file():
        return json.loads((data_dir / "meta.json").read_text(encoding="utf-8"))
    if (data_dir / "meta.pkl").is_file():
        with open(data_dir / "meta.pkl", "rb") as f:
            try:
                meta = _NoGlobalsUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
                raise ValueError(f"{data_dir / 'meta.pkl'}: refused, not a plain metadata pickle ({e}); nothing "
                                 "in it was run. Delete it, or write the metadata as meta.json") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{data_dir / 'meta.pkl'}: a metadata pickle holds a dict, got {type(meta).__name__}")
        return meta
    return None


class TokenDataset:
    """The train/val token files of a nanoGPT-style data directory."""

    def __init__(self, data_dir: str | Path, vocab_size: int | None = None):
        self.data_dir = Path(data_dir)
        for split in SPLITS:
            path = self.data_dir / f"{split}.bin"
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found: a data directory holds train.bin and val.bin "
                                        "(make them from a text file with prepare_text)")
            if path.stat().st_size == 0:
                raise ValueError(f"{path} is empty: it holds no token ids")
            if path.stat().st_size % np.dtype(TOKEN_DTYPE).itemsize:
                raise ValueError(f"{path}: odd size, not a file of uint16 token ids")
        meta = read_meta(self.data_dir)
        if meta is None:
            if vocab_size is None:
                warnings.warn(f"{self.data_dir} has no meta.json: assuming GPT-2 BPE ids (vocab_size "
                              f"{GPT2_VOCAB_SIZE}), as in nanoGPT's OpenWebText; pass vocab_size otherwise",
                              stacklevel=2)
                meta = {"tokenizer": "gpt2", "vocab_size": GPT2_VOCAB_SIZE}
            else:
                meta = {"tokenizer": None, "vocab_size": vocab_size}
        elif vocab_size is not None and vocab_size < meta["vocab_size"]:
            raise ValueError(f"vocab_size {vocab_size} is below the data's {meta['vocab_size']}")
        self.meta = meta
        # A larger vocab_size than the data needs is allowed: models often pad it (nanoGPT: 50304).
        self.vocab_size = int(vocab_size or meta["vocab_size"])

    @property
    def tokenizer(self):
        if self.meta.get("tokenizer") is None and "itos" not in self.meta:
            raise ValueError(f"{self.data_dir}: no metadata says which tokenizer made these ids")
        return tokenizer_from_meta(self.meta)

    def tokens(self, split: str) -> np.memmap:
        if split not in SPLITS:
            raise KeyError(f"split must be one of {SPLITS}, got {split!r}")
        return np.memmap(self.data_dir / f"{split}.bin", dtype=TOKEN_DTYPE, mode="r")

    def batches(self, split: str, batch_size: int, block_size: int, *, seed: int = 0,
                device: torch.device | str | None = None) -> TokenBatches:
        return TokenBatches(self.data_dir / f"{split}.bin", batch_size, block_size, seed=seed, device=device)


class TokenBatches:
    """nanoGPT's get_batch: B random windows, x = ids[i:i+T], y = ids[i+1:i+T+1] (int64).

    Offsets come from a CPU torch.Generator seeded with `seed`; its state is the state_dict,
    so a resumed run draws the same windows it would have drawn.
    """

    def __init__(self, path: str | Path, batch_size: int, block_size: int, *, seed: int = 0,
                 device: torch.device | str | None = None):
        self.path, self.batch_size, self.block_size = Path(path), batch_size, block_size
        self.device = torch.device(device) if device is not None else None
        num_tokens = self.path.stat().st_size // np.dtype(TOKEN_DTYPE).itemsize
        if num_tokens <= block_size:
            raise ValueError(f"{self.path} has {num_tokens} tokens, need more than block_size={block_size}")
        self.num_offsets = num_tokens - block_size
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        # A fresh memmap per batch, as nanoGPT does, so pages read earlier are not kept mapped.
        data = np.memmap(self.path, dtype=TOKEN_DTYPE, mode="r")
        starts = torch.randint(self.num_offsets, (self.batch_size,), generator=self.generator).numpy()
        windows = torch.from_numpy(data[starts[:, None] + np.arange(self.block_size + 1)].astype(np.int64))
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if self.device is not None and self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
