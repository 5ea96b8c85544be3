"""The common shape of an image dataset: in-memory splits, and deterministic, resumable batches.

Images are [N, C, H, W] (uint8 pixels, or float in [0, 1]) with int64 labels. Validation is
carved out of the training set with a fixed seed; the official test set is kept apart. Batches
are converted to float, augmented (if asked), normalized and optionally flattened on the fly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from .augment import channel_stats, random_crop, random_hflip, to_float
from .augment import normalize as normalize_channels  # `normalize` is also an option name below
from .sampler import BatchSampler, make_generator

# Published per-channel statistics of the full training sets, for normalize="standard".
STANDARD_STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
}

_AUGMENT_STREAM = 1  # sampler streams: 0 shuffles, 1 augments


@dataclasses.dataclass
class Split:
    x: torch.Tensor  # [N, C, H, W]: uint8 pixels, or float in [0, 1]
    y: torch.Tensor  # [N] int64 class indices

    def __len__(self) -> int:
        return len(self.y)


@dataclasses.dataclass(repr=False)
class ImageDataset:
    name: str
    classes: list[str]
    train: Split
    val: Split | None = None
    test: Split | None = None
    mean: torch.Tensor | None = None  # per channel, in [0, 1] pixel units; None: no normalization
    std: torch.Tensor | None = None
    flatten: bool = False  # batches as [N, C*H*W], for MLPs
    augment: bool = False  # random crop + horizontal flip on shuffled training batches
    crop_padding: int = 4

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train.x.shape[1:])

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one model input as batches deliver it."""
        return (int(np.prod(self.image_shape)),) if self.flatten else self.image_shape

    def split(self, name: str) -> Split:
        split = getattr(self, name, None) if name in ("train", "val", "test") else None
        if split is None:
            have = [s for s in ("train", "val", "test") if getattr(self, s) is not None]
            raise KeyError(f"{self.name} has no split {name!r}; it has {have}")
        return split

    def transform(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Raw images to model inputs: augment (only when a generator is given), scale, normalize, flatten."""
        if generator is not None:
            x = random_hflip(random_crop(x, self.crop_padding, generator), generator)
        x = to_float(x)
        if self.mean is not None:
            x = normalize_channels(x, self.mean, self.std)
        return x.flatten(1) if self.flatten else x

    def batches(self, split: str = "train", batch_size: int = 128, *, seed: int = 0,
                shuffle: bool | None = None, augment: bool | None = None, drop_last: bool | None = None,
                device: torch.device | str | None = None) -> ImageBatches:
        """Endless batches; shuffled, augmented (if the dataset says so) and full-sized for "train",
        in order and complete otherwise. See `ImageBatches`."""
        training = split == "train"
        return ImageBatches(self, split, batch_size, seed=seed,
                            shuffle=training if shuffle is None else shuffle,
                            augment=(self.augment and training) if augment is None else augment,
                            drop_last=training if drop_last is None else drop_last, device=device)

    def eval_batches(self, split: str = "val", batch_size: int = 1000,
                     device: torch.device | str | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One ordered pass over a split, without augmentation."""
        data = self.split(split)
        for start in range(0, len(data), batch_size):
            x, y = data.x[start:start + batch_size], data.y[start:start + batch_size]
            yield self.transform(x.to(device)), y.to(device)

    def to(self, device: torch.device | str) -> ImageDataset:
        """A copy whose splits live on `device`, so batches are gathered there."""
        move = lambda s: None if s is None else Split(s.x.to(device), s.y.to(device))  # noqa: E731
        return dataclasses.replace(self, train=move(self.train), val=move(self.val), test=move(self.test))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={len(getattr(self, s))}" for s in ("train", "val", "test") if getattr(self, s))
        return (f"ImageDataset({self.name!r}, {sizes}, classes={self.num_classes}, "
                f"input_shape={self.input_shape}, normalized={self.mean is not None}, augment={self.augment})")


class ImageBatches:
    """Endless (x, y) batches of one split, fully determined by the seed and the position.

    Shuffling and augmentation are drawn from (seed, epoch, batch index), so
    `load_state_dict(state_dict())` resumes a run bit for bit.
    """

    def __init__(self, dataset: ImageDataset, split: str, batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, augment: bool = False, drop_last: bool = True,
                 device: torch.device | str | None = None):
        self.dataset, self.data, self.augment, self.device = dataset, dataset.split(split), augment, device
        self.sampler = BatchSampler(len(self.data), batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __iter__(self) -> ImageBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = self.sampler.position
        idx = next(self.sampler).to(self.data.x.device)
        x, y = self.data.x[idx].to(self.device), self.data.y[idx].to(self.device)
        generator = make_generator(self.sampler.seed, _AUGMENT_STREAM, epoch, index) if self.augment else None
        return self.dataset.transform(x, generator), y

    def epoch_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The remaining batches of the current epoch."""
        epoch = self.sampler.position[0]
        while self.sampler.position[0] == epoch:
            yield next(self)

    def state_dict(self) -> dict:
        return {**self.sampler.state_dict(), "batch_size": self.sampler.batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("batch_size", self.sampler.batch_size) != self.sampler.batch_size:
            raise ValueError(f"state has batch_size {state['batch_size']}, these batches {self.sampler.batch_size}")
        self.sampler.load_state_dict(state)


def split_train_val(num_items: int, val_size: int | float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted (train, val) indices of a random split; val_size is a count or a fraction in (0, 1)."""
    if isinstance(val_size, float) and not 0 <= val_size < 1:
        raise ValueError(f"a float val_size is a fraction in [0, 1), got {val_size}")
    n_val = round(val_size * num_items) if isinstance(val_size, float) else int(val_size)
    if not 0 <= n_val < num_items:
        raise ValueError(f"val_size {val_size} leaves no training data out of {num_items} items")
    perm = torch.randperm(num_items, generator=make_generator(seed))
    return perm[n_val:].sort().values, perm[:n_val].sort().values


def build_image_dataset(name: str, classes: Sequence[str], train: tuple[np.ndarray, np.ndarray],
                        test: tuple[np.ndarray, np.ndarray] | None = None, *, val_size: int | float = 0,
                        split_seed: int = 0, normalize: str | tuple | None = "train",
                        flatten: bool = False, augment: bool = False) -> ImageDataset:
    """An ImageDataset from arrays [N, C, H, W]: splits `val_size` off train with `split_seed`.

    normalize: "train" (per-channel mean/std of the training split after the validation split
    is removed: the default, and what the CIFAR recipe here uses), "standard" (published
    constants, STANDARD_STATS), None (inputs stay in [0, 1]) or an explicit (mean, std).
    """
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    x, y = as_tensor(train[0]), as_tensor(train[1]).long()
    train_idx, val_idx = split_train_val(len(y), val_size, split_seed)
    data = ImageDataset(name, list(classes), Split(x[train_idx], y[train_idx]),
                        Split(x[val_idx], y[val_idx]) if len(val_idx) else None,
                        Split(as_tensor(test[0]), as_tensor(test[1]).long()) if test is not None else None,
                        flatten=flatten, augment=augment)
    if normalize == "train":
        data.mean, data.std = channel_stats(data.train.x)
    elif normalize == "standard":
        if name not in STANDARD_STATS:
            raise ValueError(f"no standard statistics for {name}; use normalize='train'")
        data.mean, data.std = (torch.tensor(v) for v in STANDARD_STATS[name])
    elif normalize is not None and normalize != "none":
        if isinstance(normalize, str):
            raise ValueError(f"normalize={normalize!r}: use 'train', 'standard', None or (mean, std)")
        data.mean, data.std = (torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in normalize)
    return data
