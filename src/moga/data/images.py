"""Image classification datasets held as in-memory tensors, with deterministic, resumable batches.

Every loader returns an `ImageDataset`: train/val/test splits of images [N, C, H, W] (uint8
pixels, or float in [0, 1]) and int64 labels. Validation is always carved out of the training
set with a fixed seed; the official test set is kept apart. Batches are converted to float,
augmented (if asked), normalized and optionally flattened on the fly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from .augment import channel_stats, normalize, random_crop, random_hflip, to_float
from .cifar import load_image_tree, read_cifar_pickles
from .idx import read_idx_pair
from .paths import DEV_DATA_DIR, resolve_path
from .sampler import BatchSampler, make_generator

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]

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
            x = normalize(x, self.mean, self.std)
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
    n_val = round(val_size * num_items) if isinstance(val_size, float) else int(val_size)
    if not 0 <= n_val < num_items:
        raise ValueError(f"val_size {val_size} leaves no training data out of {num_items} items")
    perm = torch.randperm(num_items, generator=make_generator(seed))
    return perm[n_val:].sort().values, perm[:n_val].sort().values


def _take_per_class(x: np.ndarray, y: np.ndarray, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The first `limit` items of each class, in their original order."""
    if limit is None:
        return x, y
    keep = np.concatenate([np.flatnonzero(y == c)[:limit] for c in np.unique(y)])
    keep.sort()
    return x[keep], y[keep]


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


# ---- loaders ------------------------------------------------------------------------------------

def load_digits(*, val_size: int | float = 0.2, split_seed: int = 0, normalize="train",
                flatten: bool = False, augment: bool = False) -> ImageDataset:
    """scikit-learn's 1,797 8x8 digits, scaled from 0..16 to [0, 1]; train/val only (no test split)."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    x = (digits.images[:, None] / 16.0).astype(np.float32)
    return build_image_dataset("digits", [str(d) for d in range(10)], (x, digits.target),
                               val_size=val_size, split_seed=split_seed, normalize=normalize,
                               flatten=flatten, augment=augment)


_FASHION_MNIST_HINT = (
    "Fashion-MNIST needs its four IDX files ({train,t10k}-{images-idx3,labels-idx1}-ubyte, gzipped or not): "
    "install the Debian package dataset-fashion-mnist (it puts them in /usr/share/datasets/fashion-mnist), "
    "or put the four files in a directory and pass it as root (or set $MOGA_FASHION_MNIST).")


def load_fashion_mnist(root: str | Path | None = None, *, val_size: int | float = 5000, split_seed: int = 0,
                       normalize="train", flatten: bool = False, augment: bool = False) -> ImageDataset:
    """Fashion-MNIST (60k train, 10k test, 28x28 grayscale) from IDX files in root."""
    directory = resolve_path(root, "MOGA_FASHION_MNIST", [FASHION_MNIST_DIR], _FASHION_MNIST_HINT)
    try:
        train_x, train_y = read_idx_pair(directory, "train", (28, 28), 10)
        test_x, test_y = read_idx_pair(directory, "t10k", (28, 28), 10)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}. {_FASHION_MNIST_HINT}") from e
    return build_image_dataset("fashion-mnist", FASHION_MNIST_CLASSES, (train_x[:, None], train_y),
                               (test_x[:, None], test_y), val_size=val_size, split_seed=split_seed,
                               normalize=normalize, flatten=flatten, augment=augment)


def _load_cifar(name: str, root, *, val_size, split_seed, normalize, flatten, augment,
                limit_per_class, cache, cache_dir) -> ImageDataset:
    num_classes, env_var = (10, "MOGA_CIFAR10") if name == "cifar10" else (100, "MOGA_CIFAR100")
    folder = "cifar-10-batches-py" if name == "cifar10" else "cifar-100-python"
    hint = (f"Pass root: a directory holding {folder}/ (the official python version, extracted), "
            f"or a folder or tar(.gz) of train/<class>/*.jpg and test/<class>/*.jpg; or set ${env_var}.")
    defaults = [DEV_DATA_DIR / "cifar10-jpeg.tar.gz"] if name == "cifar10" else []
    path = resolve_path(root, env_var, defaults, hint)
    first_batch = "data_batch_1" if name == "cifar10" else "train"
    if path.is_dir() and ((path / first_batch).is_file() or (path / folder).is_dir()):
        splits, classes = read_cifar_pickles(path, name)
        splits = {s: _take_per_class(x, y, limit_per_class) for s, (x, y) in splits.items()}
    else:
        splits, classes = load_image_tree(path, limit_per_class=limit_per_class, cache=cache, cache_dir=cache_dir)
    if len(classes) != num_classes:
        raise ValueError(f"{path}: found {len(classes)} classes, {name} has {num_classes}")
    return build_image_dataset(name, classes, splits["train"], splits.get("test"), val_size=val_size,
                               split_seed=split_seed, normalize=normalize, flatten=flatten, augment=augment)


def load_cifar10(root: str | Path | None = None, *, val_size: int | float = 5000, split_seed: int = 0,
                 normalize="train", flatten: bool = False, augment: bool = True,
                 limit_per_class: int | None = None, cache: bool = True,
                 cache_dir: str | Path | None = None) -> ImageDataset:
    """CIFAR-10 with the depth paper's recipe by default: a fixed-seed 45k/5k train/val split,
    random 32x32 crops of the 4-pixel zero-padded image and horizontal flips on training batches,
    and per-channel normalization by the 45k training images' own mean and std.

    root: a directory with `cifar-10-batches-py/` (pickle batches), or a folder or tar(.gz) of
    `<split>/<class>/*.jpg` (decoded once and cached in cache_dir; class index = sorted class
    name). Default: $MOGA_CIFAR10, else this project's development copy. `limit_per_class` keeps
    the first images of each class per split (for quick tests).
    """
    return _load_cifar("cifar10", root, val_size=val_size, split_seed=split_seed, normalize=normalize,
                       flatten=flatten, augment=augment, limit_per_class=limit_per_class, cache=cache,
                       cache_dir=cache_dir)


def load_cifar100(root: str | Path | None = None, *, val_size: int | float = 5000, split_seed: int = 0,
                  normalize="train", flatten: bool = False, augment: bool = True,
                  limit_per_class: int | None = None, cache: bool = True,
                  cache_dir: str | Path | None = None) -> ImageDataset:
    """CIFAR-100 (fine labels) with the same recipe as `load_cifar10`; root holds `cifar-100-python/`
    (default: $MOGA_CIFAR100)."""
    return _load_cifar("cifar100", root, val_size=val_size, split_seed=split_seed, normalize=normalize,
                       flatten=flatten, augment=augment, limit_per_class=limit_per_class, cache=cache,
                       cache_dir=cache_dir)


IMAGE_DATASETS = {"digits": load_digits, "fashion-mnist": load_fashion_mnist,
                  "cifar10": load_cifar10, "cifar100": load_cifar100}
_ALIASES = {"fashion_mnist": "fashion-mnist", "fashionmnist": "fashion-mnist", "fmnist": "fashion-mnist",
            "cifar-10": "cifar10", "cifar-100": "cifar100"}


def load_image_dataset(name: str, root: str | Path | None = None, **opts) -> ImageDataset:
    """Load a dataset by name ("digits", "fashion-mnist", "cifar10", "cifar100"); opts go to its loader."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in IMAGE_DATASETS:
        raise ValueError(f"unknown image dataset {name!r}; valid names: {', '.join(IMAGE_DATASETS)}")
    if root is not None:
        if key == "digits":
            raise ValueError("digits ship with scikit-learn and take no root")
        opts["root"] = root
    return IMAGE_DATASETS[key](**opts)
