import pytest

from moga.data import ByteTokenizer, CharTokenizer, GPT2Tokenizer, find_gpt2_ranks, get_tokenizer
from moga.data import tokenizers as tokenizers_module


def test_gpt2_ids_of_known_strings():
    tok = get_tokenizer("bpe")
    assert tok.encode("hello world") == [31373, 995]
    assert tok.encode("Hello, world!") == [15496, 11, 995, 0]
    assert tok.decode([31373, 995]) == "hello world"
    text = "Ünïcödé, tabs\tand  spaces\n\n'll don't 12345"
    assert tok.decode(tok.encode(text)) == text
    # encode_ordinary: the special token's text is plain text, as in nanoGPT's prepare scripts
    assert GPT2Tokenizer.eot_token not in tok.encode("<|endoftext|>")
    assert tok.encoding.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert tok.encoding.n_vocab == tok.vocab_size == 50257


def test_char_and_byte_round_trips():
    char = CharTokenizer.from_text("hello")
    assert char.itos == ["e", "h", "l", "o"] and char.encode("hole") == [1, 3, 2, 0]
    assert char.decode(char.encode("hello")) == "hello"
    with pytest.raises(ValueError, match="'z' is not in"):
        char.encode("z")
    byte = ByteTokenizer()
    assert byte.encode("é") == [0xC3, 0xA9] and byte.decode([0xC3, 0xA9]) == "é"


def test_missing_gpt2_ranks_say_how_to_install_them(monkeypatch, tmp_path):
    monkeypatch.setenv("MOGA_GPT2_RANKS", str(tmp_path / "gpt2.tiktoken"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps openai-whisper"):
        find_gpt2_ranks()
    monkeypatch.delenv("MOGA_GPT2_RANKS")
    monkeypatch.setattr(tokenizers_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps openai-whisper"):
        get_tokenizer("gpt2")


def test_truncated_ranks_are_refused(tmp_path):
    ranks = find_gpt2_ranks().read_text().splitlines()
    partial = tmp_path / "partial.tiktoken"
    partial.write_text("\n".join(ranks[:1000]))
    with pytest.raises(ValueError, match="GPT-2 has 50256"):
        GPT2Tokenizer(partial)
