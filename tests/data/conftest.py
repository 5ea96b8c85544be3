"""Shared fixtures: real data where this machine has it, decoded once per test session."""

from pathlib import Path

import pytest

from moga.data import load_cifar10

from ..conftest import dataset_or_skip

PER_CLASS = 30  # images per class and split in the quick CIFAR subset


@pytest.fixture(scope="session")
def cifar_tar() -> Path:
    return dataset_or_skip("cifar10-jpeg.tar.gz", "the CIFAR-10 JPEG tar")


@pytest.fixture(scope="session")
def cifar_cache(tmp_path_factory) -> Path:
    """A cache directory shared by the session, so each CIFAR variant is decoded once."""
    return tmp_path_factory.mktemp("moga-cache")


@pytest.fixture(scope="session")
def cifar_small(cifar_tar, cifar_cache):
    """30 train and 30 test images per class from the real tar, with the default recipe."""
    return load_cifar10(cifar_tar, limit_per_class=PER_CLASS, val_size=0.1, cache_dir=cifar_cache)


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    return dataset_or_skip("tinyshakespeare.txt", "tiny Shakespeare")
