import io
import os
import pickle
import tarfile
import time

import numpy as np
import pytest
import torch
from PIL import Image

from moga.data import CIFAR10_CLASSES, STANDARD_STATS, decode_image_tree, load_cifar10, load_image_dataset
from moga.data import cifar as cifar_module

from .conftest import PER_CLASS

# ---- official python-pickle batches, written here in their format ---------------------------


def dump_batch(path, x, labels, label_key=b"labels", extra=None):
    """As the official files: a Python 2 dict with byte-string keys, data as uint8 [N, 3072]."""
    batch = {b"batch_label": b"test batch", label_key: [int(v) for v in labels],
             b"data": x.reshape(len(x), -1), b"filenames": [b"f%d.png" % i for i in range(len(x))], **(extra or {})}
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)


def random_images(n, seed):
    return np.random.default_rng(seed).integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)


@pytest.fixture
def cifar10_pickles(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i in range(1, 6):
        dump_batch(folder / f"data_batch_{i}", random_images(20, i), np.arange(20) % 10)
    test = random_images(30, 0)
    test[0] = 0
    test[0, 0] = 255  # a pure red image: the first 1024 values are the red plane
    dump_batch(folder / "test_batch", test, np.arange(30) % 10)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [c.encode() for c in CIFAR10_CLASSES], b"num_vis": 3072}, f, protocol=2)
    return tmp_path, test


def test_cifar10_pickle_batches(cifar10_pickles):
    root, test = cifar10_pickles
    data = load_image_dataset("cifar10", root=root, val_size=10, normalize=None)
    assert (len(data.train), len(data.val), len(data.test)) == (90, 10, 30)
    assert data.classes == list(CIFAR10_CLASSES) and data.image_shape == (3, 32, 32)
    assert torch.equal(data.test.x, torch.from_numpy(test))  # test split keeps file order
    assert data.test.x[0, 0].eq(255).all() and data.test.x[0, 1:].eq(0).all()
    assert torch.equal(data.test.y, torch.arange(30) % 10)
    # the directory itself works as root too
    same = load_image_dataset("cifar10", root=root / "cifar-10-batches-py", val_size=10, normalize=None)
    assert torch.equal(same.val.x, data.val.x)


def test_cifar100_uses_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    fine, coarse = np.arange(200) % 100, np.arange(200) % 20
    dump_batch(folder / "train", random_images(200, 1), fine, label_key=b"fine_labels",
               extra={b"coarse_labels": coarse.tolist()})
    dump_batch(folder / "test", random_images(100, 2), np.arange(100), label_key=b"fine_labels",
               extra={b"coarse_labels": (np.arange(100) % 20).tolist()})
    data = load_image_dataset("cifar100", root=tmp_path, val_size=0, normalize=None)
    assert data.num_classes == 100 and data.val is None
    assert torch.equal(data.train.y, torch.from_numpy(fine))


def test_pickles_naming_other_code_are_refused(cifar10_pickles):
    root, _ = cifar10_pickles
    with open(root / "cifar-10-batches-py" / "data_batch_3", "wb") as f:
        pickle.dump({b"data": os.getcwd}, f, protocol=2)  # would call into os on load
    with pytest.raises(ValueError, match="refusing to load"):
        load_image_dataset("cifar10", root=root)


def test_missing_cifar_says_which_formats_work(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        load_cifar10(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="train/<class>"):
        load_cifar10(tmp_path, cache=False)  # exists, but holds neither format
    (tmp_path / "notes.txt").write_text("not an archive")
    with pytest.raises(ValueError, match="neither a folder nor a tar"):
        load_cifar10(tmp_path / "notes.txt", cache=False)


# ---- the real JPEG tar ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cifar_sample(cifar_tar, tmp_path_factory):
    """A few JPEGs extracted from the tar under an extra top-level folder: wrapper/<split>/<class>/."""
    wanted = {f"{s}/{c}/000{i}.jpg" for s in ("train", "test") for c in ("cat", "dog") for i in range(3)}
    root = tmp_path_factory.mktemp("cifar-sample")
    with tarfile.open(cifar_tar) as tar:
        for member in tar:
            if member.name.lstrip("./") in wanted:
                path = root / "wrapper" / member.name.lstrip("./")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(tar.extractfile(member).read())
                wanted.remove(member.name.lstrip("./"))
    assert not wanted
    return root / "wrapper"


def pixels(path):
    """A JPEG as uint8 [3, H, W], decoded independently of moga."""
    return np.array(Image.open(path).convert("RGB")).transpose(2, 0, 1)


def test_jpeg_tar_subset(cifar_small, cifar_sample):
    assert cifar_small.classes == list(CIFAR10_CLASSES)  # sorted class names = the official order
    assert len(cifar_small.train) + len(cifar_small.val) == 10 * PER_CLASS
    assert torch.bincount(cifar_small.test.y).tolist() == [PER_CLASS] * 10
    assert cifar_small.test.x.dtype == torch.uint8 and cifar_small.image_shape == (3, 32, 32)
    # test images keep class-then-file order: index 3 * PER_CLASS is test/cat/0000.jpg
    expected = pixels(cifar_sample / "test" / "cat" / "0000.jpg")
    assert torch.equal(cifar_small.test.x[3 * PER_CLASS], torch.from_numpy(expected))
    assert cifar_small.augment and cifar_small.mean is not None


def test_normalized_train_split_has_zero_mean_unit_std(cifar_small):
    x = cifar_small.transform(cifar_small.train.x)
    torch.testing.assert_close(x.mean((0, 2, 3)), torch.zeros(3), atol=1e-4, rtol=0)
    torch.testing.assert_close(x.std((0, 2, 3), unbiased=False), torch.ones(3), atol=1e-4, rtol=0)


def test_decoded_tree_is_cached(cifar_small, cifar_tar, cifar_cache, monkeypatch):
    assert len(list(cifar_cache.glob("cifar10-jpeg-*.npz"))) >= 1

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again despite the cache")

    monkeypatch.setattr(cifar_module, "decode_image_tree", no_decoding)
    again = load_cifar10(cifar_tar, limit_per_class=PER_CLASS, val_size=0.1, cache_dir=cifar_cache)
    assert torch.equal(again.train.x, cifar_small.train.x) and torch.equal(again.val.y, cifar_small.val.y)


def test_image_folder_tree(cifar_sample):
    (cifar_sample / "train" / "cat" / "._0000.jpg").write_bytes(b"junk")  # hidden files are ignored
    splits, classes = decode_image_tree(cifar_sample)
    assert classes == ["cat", "dog"]
    assert splits["train"][0].shape == (6, 3, 32, 32) and splits["train"][1].tolist() == [0, 0, 0, 1, 1, 1]
    assert np.array_equal(splits["train"][0][5], pixels(cifar_sample / "train" / "dog" / "0002.jpg"))
    assert np.array_equal(splits["test"][0][0], pixels(cifar_sample / "test" / "cat" / "0000.jpg"))
    limited, _ = decode_image_tree(cifar_sample, limit_per_class=1)
    assert limited["test"][1].tolist() == [0, 1]


def test_mismatched_image_sizes_are_an_error(cifar_sample, tmp_path):
    tree = tmp_path / "tree" / "train" / "cat"
    tree.mkdir(parents=True)
    (tree / "a.jpg").write_bytes((cifar_sample / "train" / "cat" / "0000.jpg").read_bytes())
    Image.new("RGB", (16, 16)).save(tree / "b.png")
    with pytest.raises(ValueError, match="b.png"):
        decode_image_tree(tmp_path / "tree")


@pytest.mark.slow
def test_full_tar_recipe(cifar_tar, cifar_cache):
    """The paper's 45k/5k split on the whole CIFAR-10 training set (decodes all 60k JPEGs once)."""
    start = time.perf_counter()
    data = load_cifar10(cifar_tar, cache_dir=cifar_cache)
    decode_s = time.perf_counter() - start
    assert (len(data.train), len(data.val), len(data.test)) == (45_000, 5_000, 10_000)
    assert torch.bincount(torch.cat([data.train.y, data.val.y])).tolist() == [5000] * 10
    # computed statistics land near the published ones (the JPEG re-encoding shifts them a little)
    mean, std = (torch.tensor(v) for v in STANDARD_STATS["cifar10"])
    torch.testing.assert_close(data.mean, mean, atol=0.005, rtol=0)
    torch.testing.assert_close(data.std, std, atol=0.005, rtol=0)
    start = time.perf_counter()
    again = load_cifar10(cifar_tar, cache_dir=cifar_cache)
    assert time.perf_counter() - start < decode_s
    assert torch.equal(again.val.x, data.val.x) and torch.equal(again.train.y, data.train.y)
    other = load_cifar10(cifar_tar, cache_dir=cifar_cache, split_seed=1)
    assert not torch.equal(other.val.y, data.val.y)
