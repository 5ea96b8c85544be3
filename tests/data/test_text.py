import pickle

import numpy as np
import pytest
import torch

from moga.data import TokenDataset, prepare_text, resolve_text_corpus
from moga.data import text as text_module

SAMPLE = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll: Speak, speak. Ça va? ✓\n" * 20


@pytest.fixture
def sample_file(tmp_path):
    path = tmp_path / "sample.txt"
    path.write_text(SAMPLE, encoding="utf-8")
    return path


def test_char_level_matches_nanogpt_on_tiny_shakespeare(shakespeare, tmp_path):
    meta = prepare_text(tmp_path, shakespeare, tokenizer="char")
    # nanoGPT's shakespeare_char/prepare.py reports exactly these numbers
    assert (meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]) == (65, 1_003_854, 111_540)
    data = TokenDataset(tmp_path)
    text = shakespeare.read_text(encoding="utf-8")
    assert data.tokenizer.decode(data.tokens("train")[:200]) == text[:200]
    assert data.tokenizer.decode(data.tokens("val")[-50:]) == text[-50:]


def test_gpt2_bpe_matches_nanogpt_on_tiny_shakespeare(shakespeare, tmp_path):
    meta = prepare_text(tmp_path, shakespeare, tokenizer="bpe")
    # nanoGPT's shakespeare/prepare.py (tiktoken gpt2, encode_ordinary) reports these counts
    assert (meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]) == (50257, 301_966, 36_059)
    assert meta["tokenizer"] == "gpt2"


def test_char_and_byte_files_hold_the_text(sample_file, tmp_path):
    cut = int(len(SAMPLE) * 0.9)
    meta = prepare_text(tmp_path / "char", sample_file, tokenizer="char")
    ids = np.fromfile(tmp_path / "char" / "train.bin", dtype=np.uint16)
    assert meta["itos"] == sorted(set(SAMPLE)) and len(ids) == cut
    assert "".join(meta["itos"][i] for i in ids) == SAMPLE[:cut]
    assert all(meta["stoi"][c] == i for i, c in enumerate(meta["itos"]))
    meta = prepare_text(tmp_path / "byte", sample_file, tokenizer="byte")
    assert meta["vocab_size"] == 256
    assert np.fromfile(tmp_path / "byte" / "val.bin", np.uint16).tobytes()[::2] == SAMPLE[cut:].encode()
    assert TokenDataset(tmp_path / "byte").tokenizer.decode(np.fromfile(tmp_path / "byte" / "train.bin", np.uint16)) \
        == SAMPLE[:cut]


def test_vocabularies_beyond_uint16_are_refused(tmp_path):
    path = tmp_path / "wide.txt"
    path.write_text("".join(chr(0x10000 + i) for i in range(70_000)), encoding="utf-8")
    with pytest.raises(ValueError, match="does not fit"):
        prepare_text(tmp_path / "out", path, tokenizer="char")


def test_bad_text_inputs(tmp_path, monkeypatch):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        prepare_text(tmp_path / "out", latin1)
    with pytest.raises(ValueError, match="unknown tokenizer"):
        prepare_text(tmp_path / "out", latin1, tokenizer="sentencepiece")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_text_corpus(tmp_path / "missing.txt")
    (tmp_path / "short.txt").write_text("a")  # train would be empty: blamed on a train.bin in the cache
    with pytest.raises(ValueError, match="short.txt holds 1 characters: too few to split"):
        prepare_text(tmp_path / "out", tmp_path / "short.txt")


def test_corpus_resolution_order(sample_file, tmp_path, monkeypatch):
    monkeypatch.setenv("MOGA_TEXT", str(sample_file))
    assert resolve_text_corpus() == sample_file
    other = tmp_path / "other.txt"
    other.write_text("x")
    assert resolve_text_corpus(other) == other  # an explicit file wins over the variable
    monkeypatch.delenv("MOGA_TEXT")
    monkeypatch.setattr(text_module, "default_corpora", lambda: [tmp_path / "none.txt", other])
    assert resolve_text_corpus() == other
    monkeypatch.setattr(text_module, "default_corpora", lambda: [])
    with pytest.raises(FileNotFoundError, match="MOGA_TEXT"):
        resolve_text_corpus()


def test_default_corpora_include_gensim_text_only_if_installed():
    names = [p.name for p in text_module.default_corpora()]
    assert names[0] == "tinyshakespeare.txt"
    assert ("lee_background.cor" in names) == (text_module.importlib.util.find_spec("gensim") is not None)


@pytest.fixture
def token_dir(sample_file, tmp_path):
    prepare_text(tmp_path / "data", sample_file, tokenizer="char")
    return tmp_path / "data"


def test_batches_are_shifted_windows_at_the_generators_offsets(token_dir):
    data = TokenDataset(token_dir)
    tokens = data.tokens("train")
    x, y = next(data.batches("train", batch_size=8, block_size=16, seed=5))
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    starts = torch.randint(len(tokens) - 16, (8,), generator=torch.Generator().manual_seed(5))
    for row_x, row_y, i in zip(x, y, starts.tolist()):
        assert row_x.tolist() == tokens[i:i + 16].tolist() and row_y.tolist() == tokens[i + 1:i + 17].tolist()


def test_batches_are_deterministic_and_resumable(token_dir):
    data = TokenDataset(token_dir)
    run = data.batches("val", 4, 8, seed=1)
    twin = data.batches("val", 4, 8, seed=1)
    assert all(torch.equal(next(run)[0], next(twin)[0]) for _ in range(3))
    assert not torch.equal(next(data.batches("val", 4, 8, seed=2))[0], next(data.batches("val", 4, 8, seed=1))[0])
    state = run.state_dict()
    expected = [next(run) for _ in range(5)]
    resumed = data.batches("val", 4, 8, seed=123)  # the saved generator state overrides the seed
    resumed.load_state_dict(state)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(expected, resumed))
    with pytest.raises(ValueError, match="block_size"):
        data.batches("val", 4, 10_000)


def test_openwebtext_style_directory_without_metadata(token_dir):
    (token_dir / "meta.json").unlink()
    with pytest.warns(UserWarning, match="50257"):
        data = TokenDataset(token_dir)
    assert data.vocab_size == 50257 and data.tokenizer.kind == "gpt2"
    padded = TokenDataset(token_dir, vocab_size=50304)
    assert padded.vocab_size == 50304
    with pytest.raises(ValueError, match="no metadata"):
        padded.tokenizer


def test_vocab_size_below_the_metadata_is_refused(token_dir):
    with pytest.raises(ValueError, match="below"):
        TokenDataset(token_dir, vocab_size=3)
    (token_dir / "val.bin").unlink()
    with pytest.raises(FileNotFoundError, match="prepare_text"):
        TokenDataset(token_dir)


def test_nanogpt_meta_pickle(token_dir):
    meta = (token_dir / "meta.json").read_text(encoding="utf-8")
    (token_dir / "meta.json").unlink()
    import json

    itos = json.loads(meta)["itos"]
    with open(token_dir / "meta.pkl", "wb") as f:  # as nanoGPT's shakespeare_char/prepare.py writes it
        pickle.dump({"vocab_size": len(itos), "itos": dict(enumerate(itos)),
                     "stoi": {c: i for i, c in enumerate(itos)}}, f)
    data = TokenDataset(token_dir)
    assert data.vocab_size == len(itos)
    assert data.tokenizer.decode(data.tokens("train")[:30]) == SAMPLE[:30]
    with open(token_dir / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": print}, f)
    with pytest.raises(ValueError, match="meta.pkl: refused, not a plain metadata pickle .refusing to load"):
        TokenDataset(token_dir)
    (token_dir / "meta.pkl").write_bytes(b"")  # truncated
    with pytest.raises(ValueError, match="meta.pkl: refused"):
        TokenDataset(token_dir)
