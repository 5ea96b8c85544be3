import gzip
import shutil

import numpy as np
import pytest
import torch

from moga.data import FASHION_MNIST_DIR, IMAGE_DATASETS, load_fashion_mnist, load_image_dataset, read_idx


def test_digits_are_scaled_split_and_deterministic():
    raw = load_image_dataset("digits", normalize=None)
    assert raw.num_classes == 10 and raw.image_shape == (1, 8, 8) and raw.test is None
    assert len(raw.train) + len(raw.val) == 1797 and len(raw.val) == round(0.2 * 1797)
    assert raw.train.x.dtype == torch.float32
    assert raw.train.x.min() == 0 and raw.train.x.max() == 1  # 0..16 scaled to [0, 1]
    again = load_image_dataset("digits", normalize=None)
    assert torch.equal(raw.val.x, again.val.x) and torch.equal(raw.val.y, again.val.y)
    other = load_image_dataset("digits", normalize=None, split_seed=1)
    assert not torch.equal(raw.val.y, other.val.y)
    from sklearn.datasets import load_digits as sklearn_digits

    all_labels = torch.cat([raw.train.y, raw.val.y])
    assert torch.equal(torch.bincount(all_labels), torch.bincount(torch.from_numpy(sklearn_digits().target)))

def test_normalization_gives_zero_mean_unit_std_on_train():
    digits = load_image_dataset("digits")
    x = digits.transform(digits.train.x)
    assert abs(x.mean().item()) < 1e-5 and abs(x.std(unbiased=False).item() - 1) < 1e-4


def test_unknown_dataset_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown image dataset 'mnist'") as info:
        load_image_dataset("mnist")
    for name in IMAGE_DATASETS:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="no root"):
        load_image_dataset("digits", root="/tmp")


@pytest.fixture(scope="module")
def fashion():
    if not FASHION_MNIST_DIR.is_dir():
        pytest.skip(f"{FASHION_MNIST_DIR} absent (install the Debian package dataset-fashion-mnist)")
    return load_image_dataset("fashion-mnist", normalize=None)


def test_fashion_mnist_real_files(fashion):
    assert (len(fashion.train), len(fashion.val), len(fashion.test)) == (55_000, 5_000, 10_000)
    assert fashion.train.x.dtype == torch.uint8 and fashion.image_shape == (1, 28, 28)
    labels = torch.cat([fashion.train.y, fashion.val.y])
    assert torch.bincount(labels).tolist() == [6000] * 10
    assert torch.bincount(fashion.test.y).tolist() == [1000] * 10
    assert fashion.classes[9] == "Ankle boot"
    # mean/std of the 55k split are close to the published full-set constants
    normalized = load_image_dataset("fashion-mnist", flatten=True)
    assert abs(normalized.mean.item() - 0.2860) < 2e-3 and abs(normalized.std.item() - 0.3530) < 2e-3
    assert normalized.input_shape == (784,)


def write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">i4").tobytes()
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def fake_fashion_dir(tmp_path, n_train=40, n_test=20):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10)
    return tmp_path


def test_fashion_mnist_reads_uncompressed_files(tmp_path):
    data = load_fashion_mnist(fake_fashion_dir(tmp_path), val_size=10, normalize=None)
    assert (len(data.train), len(data.val), len(data.test)) == (30, 10, 20)
    raw = read_idx(tmp_path / "t10k-images-idx3-ubyte")
    assert torch.equal(data.test.x[:, 0], torch.from_numpy(raw))


def test_idx_gzip_and_raw_agree(tmp_path):
    source = FASHION_MNIST_DIR / "t10k-labels-idx1-ubyte.gz"
    if not source.is_file():
        pytest.skip(f"{source} absent")
    raw = tmp_path / "labels"
    with gzip.open(source) as f, open(raw, "wb") as out:
        shutil.copyfileobj(f, out)
    assert np.array_equal(read_idx(source), read_idx(raw))
    assert read_idx(raw).shape == (10_000,)


def test_corrupt_idx_files_give_clear_errors(tmp_path):
    directory = fake_fashion_dir(tmp_path)
    images = directory / "train-images-idx3-ubyte"
    good = images.read_bytes()
    images.write_bytes(b"\x08\x03" + good[2:])  # wrong magic
    with pytest.raises(ValueError, match="not an IDX file"):
        load_fashion_mnist(directory)
    images.write_bytes(good[:-5])  # truncated data
    with pytest.raises(ValueError, match="header says shape"):
        load_fashion_mnist(directory)
    images.write_bytes(b"\x1f\x8b" + b"garbage")  # looks gzipped, is not
    with pytest.raises(ValueError, match="gzip"):
        load_fashion_mnist(directory)
    labels = directory / "t10k-labels-idx1-ubyte"
    images.write_bytes(good)
    write_idx(labels, np.arange(20) % 11)  # label 10 does not exist
    with pytest.raises(ValueError, match="out of range"):
        load_fashion_mnist(directory)
    labels.unlink()
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        load_fashion_mnist(directory)


def test_missing_fashion_mnist_directory_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist") as info:
        load_image_dataset("fashion-mnist", root=tmp_path / "nowhere")
    assert "pass it as root" in str(info.value)
