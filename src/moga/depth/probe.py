"""The probe input: one small batch a model's forward accepts, derived from the model when not given.

- Hugging Face models (a ``config`` and a ``forward`` taking these names): ``input_ids`` of shape
  (1, 8) below ``vocab_size`` (of ``text_config`` where there is one), ``decoder_input_ids`` (1, 4) for
  encoder-decoders, ``pixel_values`` (1, ``num_channels``, ``image_size``, ``image_size``) from the
  (vision) config, ``input_features`` (1, ``num_mel_bins``, 2 ``max_source_positions``) for speech
  encoders, and ``use_cache=False``.
- Other models, from their first module with parameters: an ``Embedding`` gets indices (2, 8), a
  ``Linear`` a batch (2, ``in_features``), a ``LayerNorm``/``RMSNorm`` a batch (2, ``normalized_shape``),
  a ``ConvNd`` a batch (1, ``in_channels``, 32, ...).

Values come from a fixed seed and leave the global random state alone. Anything else: pass
``example_input`` (a tensor, a tuple of positional arguments, or a dict of keyword arguments).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

SEQ = 8


def example_call(model: nn.Module, example=None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for ``model(*args, **kwargs)``."""
    if example is not None:
        if isinstance(example, dict):
            return (), dict(example)
        return (tuple(example) if isinstance(example, (tuple, list)) else (example,)), {}
    first = next((p for p in model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    gen = torch.Generator().manual_seed(0)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        kwargs = _hf_inputs(model, config, gen)
        if kwargs:
            return (), {k: v.to(device, dtype if v.is_floating_point() else v.dtype) if isinstance(v, torch.Tensor)
                        else v for k, v in kwargs.items()}
    for module in model.modules():
        if next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None:
            x = _leaf_input(module, gen)
            if x is None:
                break
            return (x.to(device, dtype if x.is_floating_point() else x.dtype),), {}
    raise ValueError(
        f"cannot derive a probe input for {type(model).__name__}: its first module with parameters is not an "
        "Embedding, Linear, LayerNorm, RMSNorm or ConvNd, and it is not a Hugging Face model with input_ids, "
        "pixel_values or input_features. Pass example_input= (a tensor, a tuple of positional arguments or a dict of keyword "
        "arguments that model(...) accepts); one small batch is enough")


def _leaf_input(module: nn.Module, gen: torch.Generator) -> torch.Tensor | None:
    if isinstance(module, nn.Embedding):
        return torch.randint(0, module.num_embeddings, (2, SEQ), generator=gen)
    if isinstance(module, nn.Linear):
        return torch.randn(2, module.in_features, generator=gen)
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and module.normalized_shape:
        return torch.randn(2, *module.normalized_shape, generator=gen)
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        dims = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[type(module)]
        return torch.randn(1, module.in_channels, *([32] * dims), generator=gen)
    return None


def _hf_inputs(model: nn.Module, config, gen: torch.Generator) -> dict:
    try:
        names = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    text = getattr(config, "text_config", None) or config
    vision = getattr(config, "vision_config", None) or config
    kwargs = {}
    vocab = getattr(text, "vocab_size", None)
    if "input_ids" in names and isinstance(vocab, int):
        kwargs["input_ids"] = torch.randint(1, vocab, (1, SEQ), generator=gen)
        if "decoder_input_ids" in names and getattr(config, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = torch.randint(1, vocab, (1, SEQ // 2), generator=gen)
    size = getattr(vision, "image_size", None)
    if "pixel_values" in names and size is not None:
        h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
        kwargs["pixel_values"] = torch.randn(1, getattr(vision, "num_channels", 3), h, w, generator=gen)
    mels, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if "input_features" in names and mels and positions:
        kwargs["input_features"] = torch.randn(1, mels, 2 * positions, generator=gen)
        if "decoder_input_ids" in names and isinstance(vocab, int):
            kwargs["decoder_input_ids"] = torch.randint(1, vocab, (1, SEQ // 2), generator=gen)
    if kwargs and "use_cache" in names:
        kwargs["use_cache"] = False
    return kwargs
