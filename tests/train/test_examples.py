"""The example configs under configs/train are valid and build."""

from pathlib import Path

import pytest

from moga.train import load_config
from moga.train.build import build_model, build_optimizer

NAMES = ("fashion_mnist_residual_mlp_moga", "shakespeare_char_gpt", "cifar10_narrow_resnet",
         "cifar10_feedforward_adaptive_gd")
CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "train"
EXAMPLES = [CONFIGS / f"{name}.yaml" for name in NAMES if (CONFIGS / f"{name}.yaml").is_file()]
DATA_INPUTS = {"in_features": 784, "out_features": 10, "num_classes": 10, "in_channels": 3, "vocab_size": 65,
               "block_size": 64}


def test_there_are_examples():
    assert {p.stem for p in EXAMPLES} == set(NAMES)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_config_builds_its_model_and_optimizer(path):
    cfg = load_config(path)
    inputs = dict(DATA_INPUTS, in_features=3072 if cfg.data.name == "cifar10" else 784)
    model = build_model(cfg, inputs)
    optimizer = build_optimizer(cfg, model)
    assert optimizer.param_groups
    if cfg.model.depth_scaling == "inverse_depth":
        assert model.alpha == pytest.approx(cfg.model.k_base / model.depth)
