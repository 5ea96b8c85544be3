"""Batched image augmentation and normalization with plain torch ops.

All randomness comes from an explicit CPU torch.Generator, drawn in a fixed order (crop offsets,
then flips), so a batch is reproducible on any device.
"""

from __future__ import annotations

import torch


def to_float(x: torch.Tensor) -> torch.Tensor:
    """uint8 pixels to float32 in [0, 1]; float inputs are taken to be in [0, 1] already."""
    return x.float().div_(255.0) if x.dtype == torch.uint8 else x.float()


def random_crop(x: torch.Tensor, padding: int, generator: torch.Generator) -> torch.Tensor:
    """Zero-pad each image of x [N, C, H, W] by `padding` pixels and cut a random H x W window.

    Same as torchvision's RandomCrop(H, padding=padding) applied per image. The padding is zero
    in pixel space (black), so call it before normalizing, as the usual CIFAR recipe does.
    """
    n, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (padding,) * 4)
    top = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(x.device)
    left = torch.randint(0, 2 * padding + 1, (n,), generator=generator).to(x.device)
    rows = (top[:, None] + torch.arange(h, device=x.device))[:, None, :, None]  # [N, 1, H, 1]
    cols = (left[:, None] + torch.arange(w, device=x.device))[:, None, None, :]  # [N, 1, 1, W]
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    channel = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    return padded[batch, channel, rows, cols]


def random_hflip(x: torch.Tensor, generator: torch.Generator, p: float = 0.5) -> torch.Tensor:
    """Mirror each image of x [N, C, H, W] left-right with probability p."""
    flip = (torch.rand(x.shape[0], generator=generator) < p).to(x.device)
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def channel_stats(x: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and (population) std of images x [N, C, H, W], in [0, 1] units."""
    if x.dtype == torch.uint8:  # exact and fast: from a 256-bin histogram per channel
        values = torch.arange(256, dtype=torch.float64, device=x.device) / 255.0
        hist = torch.stack([torch.bincount(x[:, c].flatten(), minlength=256) for c in range(x.shape[1])]).double()
        count = hist.sum(1)
        mean = (hist * values).sum(1) / count
        var = (hist * values.square()).sum(1) / count - mean.square()
    else:  # float64 sums over chunks: never a float64 copy of the whole set
        c = x.shape[1]
        total = torch.zeros(c, dtype=torch.float64, device=x.device)
        total_sq = torch.zeros_like(total)
        for start in range(0, x.shape[0], chunk):
            part = x[start:start + chunk].double().transpose(0, 1).reshape(c, -1)
            total += part.sum(1)
            total_sq += part.square().sum(1)
        count = x.shape[0] * x.shape[2] * x.shape[3]
        mean = total / count
        var = total_sq / count - mean.square()
    return mean.float().cpu(), var.clamp_min(0).sqrt().float().cpu()


def normalize(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std per channel for x [N, C, H, W]."""
    shape = (1, -1, 1, 1)
    return (x - mean.to(x.device).view(shape)) / std.to(x.device).view(shape)
