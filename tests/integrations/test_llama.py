"""The LLaMA factory that ships with moga: an unmodified transformers LlamaForCausalLM behind forward(x) -> logits."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from moga.optim import MOGA  # noqa: E402
from moga.train import build_config  # noqa: E402
from moga.train.build import model_from_config  # noqa: E402


def test_a_config_builds_an_unmodified_llama_with_gpt_size_keys():
    cfg = build_config({"model": {"name": "moga.integrations.llama:llama", "n_layer": 2, "n_embd": 128},
                        "data": {"name": "text", "block_size": 16}, "train": {"steps": 1}})
    model = model_from_config(cfg, {"vocab_size": 65, "block_size": 16})
    inner = model.model
    assert type(inner) is transformers.LlamaForCausalLM
    c = inner.config
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_hidden_layers) == (128, 512, 4, 2)
    assert inner.lm_head.weight is not inner.model.embed_tokens.weight  # untied
    x = torch.randint(0, 65, (2, 16))
    assert model(x, x).shape == (2, 16, 65)  # the logits, whatever the targets
    roles = {e.role for e in MOGA(model, lr=0.01).plan}
    assert roles == {"embedding", "hidden", "readout", "vector"}


def test_moga_trains_it():
    from moga.integrations.llama import llama

    torch.manual_seed(0)
    model = llama(vocab_size=16, block_size=8, n_layer=1, n_embd=32)
    opt = MOGA(model, lr=2**-4)
    x = torch.randint(0, 16, (8, 8))
    y = torch.roll(x, -1, 1)
    losses = []
    for _ in range(15):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]  # one batch, memorized: 2.78 -> 1.67 in 15 steps


def test_heads_must_divide_the_width():
    from moga.integrations.llama import llama

    with pytest.raises(ValueError, match="n_embd=48 is not a multiple of n_head=5"):
        llama(vocab_size=16, block_size=8, n_embd=48, n_head=5)
