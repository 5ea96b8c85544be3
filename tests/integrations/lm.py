"""A tiny character-level GPT-2 task on real text, shared by the trainer tests."""

import pytest
import torch


class CharBlocks(torch.utils.data.Dataset):
    """``count`` windows of ``length`` characters at seeded random offsets, as GPT-2 causal LM examples."""

    def __init__(self, text: str, count: int, length: int = 32, seed: int = 0):
        vocab = sorted(set(text))
        self.vocab_size = len(vocab)
        ids = torch.tensor([vocab.index(c) for c in text])
        starts = torch.randint(0, len(ids) - length, (count,), generator=torch.Generator().manual_seed(seed))
        self.blocks = torch.stack([ids[s:s + length] for s in starts.tolist()])

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, k):
        return {"input_ids": self.blocks[k], "labels": self.blocks[k]}


def tiny_gpt2(vocab_size: int, seed: int = 0):
    """Two blocks of width 32, with GPT-2's dropout on, so a resumed run must restore the RNG too."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install moga[hf])",
                                       exc_type=ImportError)
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=vocab_size, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def record_losses(model) -> list[float]:
    """The loss of every training forward, in order (a forward hook: nothing in the trainer changes)."""
    losses: list[float] = []
    model.register_forward_hook(lambda m, args, out: losses.append(out.loss.item()) if m.training else None)
    return losses
