"""Image classification datasets by name: scikit-learn digits, Fashion-MNIST, CIFAR-10, CIFAR-100.

Every loader returns an `ImageDataset` (see dataset.py). Nothing is downloaded: each reads the
standard files from a directory the user gives, an environment variable, or a known default.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .cifar import load_image_tree, read_cifar_pickles
from .dataset import STANDARD_STATS, ImageBatches, ImageDataset, Split, build_image_dataset, split_train_val
from .idx import read_idx_pair
from .paths import dataset_candidates, resolve_path

# Deferred on purpose, imported where used: scikit-learn (about 2 s to import), only for the digits data set.

__all__ = ["FASHION_MNIST_DIR", "IMAGE_DATASETS", "STANDARD_STATS", "ImageBatches", "ImageDataset", "Split",
           "build_image_dataset", "load_cifar10", "load_cifar100", "load_digits", "load_fashion_mnist",
           "load_image_dataset", "locate_image_data", "split_train_val"]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


def _take_per_class(x: np.ndarray, y: np.ndarray, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The first `limit` items of each class, in their original order."""
    if limit is None:
        return x, y
    keep = np.concatenate([np.flatnonzero(y == c)[:limit] for c in np.unique(y)])
    keep.sort()
    return x[keep], y[keep]


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


_CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


def locate_image_data(name: str, root: str | Path | None = None) -> Path:
    """Where the files of ``name`` (fashion-mnist, cifar10, cifar100) are, searched as moga.data.paths
    describes; FileNotFoundError says how to get them."""
    if name == "fashion-mnist":
        return resolve_path(root, "MOGA_FASHION_MNIST", dataset_candidates("fashion-mnist") + [FASHION_MNIST_DIR],
                            _FASHION_MNIST_HINT)
    folder = _CIFAR_FOLDERS[name]
    env_var = f"MOGA_{name.upper()}"
    hint = (f"Pass root: a directory holding {folder}/ (the official python version, extracted), "
            f"or a folder or tar(.gz) of train/<class>/*.jpg and test/<class>/*.jpg; or set ${env_var} "
            "(or $MOGA_DATA to a directory holding it).")
    names = (folder, "cifar10-jpeg.tar.gz") if name == "cifar10" else (folder,)
    return resolve_path(root, env_var, dataset_candidates(*names), hint)


def load_fashion_mnist(root: str | Path | None = None, *, val_size: int | float = 5000, split_seed: int = 0,
                       normalize="train", flatten: bool = False, augment: bool = False) -> ImageDataset:
    """Fashion-MNIST (60k train, 10k test, 28x28 grayscale) from IDX files in root."""
    directory = locate_image_data("fashion-mnist", root)
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
    num_classes = 10 if name == "cifar10" else 100
    folder = _CIFAR_FOLDERS[name]
    path = locate_image_data(name, root)
    first_batch = "data_batch_1" if name == "cifar10" else "train"
    pickles = path.is_dir() and ((path / first_batch).is_file() or (path / folder).is_dir())
    if pickles:
        splits, classes = read_cifar_pickles(path, name)
        splits = {s: _take_per_class(x, y, limit_per_class) for s, (x, y) in splits.items()}
    else:
        splits, classes = load_image_tree(path, limit_per_class=limit_per_class, cache=cache, cache_dir=cache_dir)
    if len(classes) != num_classes:
        raise ValueError(f"{path}: found {len(classes)} classes, {name} has {num_classes}")
    if not pickles:  # the pickle batches are whole pickles: a cut one does not load at all
        _check_promised_sizes(path, name, splits, classes, limit_per_class)
    return build_image_dataset(name, classes, splits["train"], splits.get("test"), val_size=val_size,
                               split_seed=split_seed, normalize=normalize, flatten=flatten, augment=augment)


_PER_CLASS = {"cifar10": {"train": 5000, "test": 1000}, "cifar100": {"train": 500, "test": 100}}


def _check_promised_sizes(path: Path, name: str, splits, classes, limit_per_class: int | None) -> None:
    """A JPEG tree or tar has the official count of every class in each split (a cut file has fewer)."""
    for split, per_class in _PER_CLASS[name].items():
        want = per_class if limit_per_class is None else min(limit_per_class, per_class)
        labels = splits[split][1] if split in splits else np.zeros(0, np.int64)
        counts = np.bincount(labels, minlength=len(classes))
        short = [(classes[i], int(n)) for i, n in enumerate(counts) if n != want]
        if short:
            cls, n = short[0]
            raise ValueError(
                f"{path}: its {split} split has {int(counts.sum())} images; {name} promises {want * len(classes)} "
                f"({want} per class), but {cls} has {n}. The data set is incomplete: download or copy it again "
                "(data.limit_per_class takes a smaller equal number of each class).")


def load_cifar10(root: str | Path | None = None, *, val_size: int | float = 5000, split_seed: int = 0,
                 normalize="train", flatten: bool = False, augment: bool = True,
                 limit_per_class: int | None = None, cache: bool = True,
                 cache_dir: str | Path | None = None) -> ImageDataset:
    """CIFAR-10 with the depth paper's recipe by default: a fixed-seed 45k/5k train/val split,
    random 32x32 crops of the 4-pixel zero-padded image and horizontal flips on training batches,
    and per-channel normalization by the 45k training images' own mean and std.

    root: a directory with `cifar-10-batches-py/` (pickle batches), or a folder or tar(.gz) of
    `<split>/<class>/*.jpg` (decoded once and cached in cache_dir; class index = sorted class
    name). Default: $MOGA_CIFAR10, else $MOGA_DATA or the user data folder (moga.data.paths). `limit_per_class` keeps
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
