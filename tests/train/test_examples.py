"""The example configs under configs/train are valid, build, and train."""

import math
from pathlib import Path

import pytest
import torch

from moga.train import load_config
from moga.train.build import build_optimizer, model_from_config
from tests.conftest import corpus_text

NAMES = ("fashion_mnist_residual_mlp_moga", "shakespeare_char_gpt", "cifar10_narrow_resnet",
         "cifar10_feedforward_adaptive_gd")
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "train"
EXAMPLES = [CONFIGS / f"{name}.yaml" for name in NAMES if (CONFIGS / f"{name}.yaml").is_file()]
DATA_INPUTS = {"in_features": 784, "out_features": 10, "num_classes": 10, "in_channels": 3, "vocab_size": 65,
               "block_size": 64}


def test_there_are_examples():
    assert {p.stem for p in EXAMPLES} == set(NAMES)


def example_batch(cfg, gen: torch.Generator):
    """Inputs and targets shaped like the config's data: token ids for the GPT, images for the ResNet, else
    flat vectors."""
    if cfg.model.name == "gpt":  # text: random tokens can only be memorized, through the tables alone
        text = corpus_text()
        chars = sorted(set(text))  # tiny Shakespeare's 65 characters (the stand-in's fewer)
        ids = torch.tensor([chars.index(c) for c in text])
        starts = torch.randint(0, len(ids) - cfg.data.block_size - 1, (8,), generator=gen)
        tokens = torch.stack([ids[s:s + cfg.data.block_size + 1] for s in starts])
        return tokens[:, :-1], tokens[:, 1:]
    shape = (32, 3, 32, 32) if cfg.model.name == "resnet" else (32, 3072 if cfg.data.name == "cifar10" else 784)
    return torch.randn(shape, generator=gen), torch.randint(0, 10, (32,), generator=gen)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_config_lowers_the_loss_in_a_few_steps(path):
    """The config's model, optimizer and peak learning rate make progress on a fixed batch."""
    cfg = load_config(path)
    torch.manual_seed(cfg.seed)
    inputs = dict(DATA_INPUTS, in_features=3072 if cfg.data.name == "cifar10" else 784)
    model = model_from_config(cfg, inputs)
    optimizer = build_optimizer(cfg, model)
    if cfg.model.depth_scaling == "inverse_depth":
        assert model.alpha == pytest.approx(cfg.model.k_base / model.depth)
    x, y = example_batch(cfg, torch.Generator().manual_seed(0))

    def closure():
        optimizer.zero_grad()
        logits = model(x)
        logits = logits[0] if isinstance(logits, tuple) else logits  # the GPT returns (logits, loss)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        return loss

    losses = [float(optimizer.step(closure)) for _ in range(6)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.95 * losses[0], losses
