"""Damaged data sets are errors that name the file and what is wrong, never a silently shorter data set.

Each test builds its own small CIFAR-10 layout (10 classes x 2 train and 2 test JPEGs of 32x32) and
damages it: a tar cut inside the test split, a cut .tar.gz, a corrupt JPEG, a missing test image; and
an empty text file.
"""

import gzip
import io
import tarfile

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from moga.data import CIFAR10_CLASSES, load_cifar10

PER_CLASS = 2


def _jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


def _members():
    """(name, JPEG) in the order a CIFAR tar holds them: train, then test, class by class."""
    names = [f"cifar10/{split}/{cls}/{i:04d}.jpg"
             for split in ("train", "test") for cls in CIFAR10_CLASSES for i in range(PER_CLASS)]
    return [(name, _jpeg(seed)) for seed, name in enumerate(names)]


def _tar(members) -> tuple[bytes, dict]:
    """The uncompressed tar and the byte offset of each member's header."""
    buf, offsets = io.BytesIO(), {}
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            offsets[name] = buf.tell()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), offsets


def _load(path):
    return load_cifar10(path, limit_per_class=PER_CLASS, val_size=2, cache=False)


def test_the_whole_small_tar_loads(tmp_path):
    raw, _ = _tar(_members())
    (tmp_path / "c.tar").write_bytes(raw)
    data = _load(tmp_path / "c.tar")
    assert len(data.test) == 10 * PER_CLASS


@pytest.mark.parametrize("where", ["between two images", "inside an image"])
def test_a_tar_cut_inside_the_test_split_is_an_error(tmp_path, where):
    raw, offsets = _tar(_members())
    cut = offsets["cifar10/test/horse/0001.jpg"] + (0 if where == "between two images" else 700)
    path = tmp_path / "cut.tar"
    path.write_bytes(raw[:cut])
    with pytest.raises(ValueError, match=r"cut\.tar is cut short") as err:
        _load(path)
    assert "horse/0000.jpg" in str(err.value)  # the last whole image, so one sees where it ends


def test_a_cut_tar_gz_names_the_file(tmp_path):
    raw, _ = _tar(_members())
    packed = gzip.compress(raw)
    path = tmp_path / "cifar10.tar.gz"
    path.write_bytes(packed[: len(packed) * 3 // 5])
    with pytest.raises(ValueError, match=r"cifar10\.tar\.gz is cut short or damaged \(EOFError: Compressed"):
        _load(path)
    from moga.train.cli import train
    import typer

    app = typer.Typer(add_completion=False)
    app.command("train")(train)
    app.command("other")(lambda: None)
    out = CliRunner().invoke(app, ["train", "data.name=cifar10", f"data.root={path}", "data.limit_per_class=2",
                                   "train.steps=1", "-q", "-o", str(tmp_path / "run")])
    assert out.exit_code == 2 and "cifar10.tar.gz is cut short" in out.output, out.output
    assert "Aborted" not in out.output


def test_a_missing_test_image_breaks_the_promised_split_sizes(tmp_path):
    members = [m for m in _members() if m[0] != "cifar10/test/ship/0001.jpg"]
    raw, _ = _tar(members)  # a whole tar, one image short
    (tmp_path / "short.tar").write_bytes(raw)
    with pytest.raises(ValueError, match=r"short\.tar: its test split has 19 images; cifar10 promises 20 "
                                         r"\(2 per class\), but ship has 1"):
        _load(tmp_path / "short.tar")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_jpeg_is_named(tmp_path, damage):
    members = _members()
    name, data = members[5]
    members[5] = (name, b"\x00not a jpeg" * 20 if damage == "garbage" else data[: len(data) // 2])
    raw, _ = _tar(members)
    (tmp_path / "bad.tar").write_bytes(raw)
    with pytest.raises(ValueError, match=r"bad\.tar: the image train/bird/0001\.jpg cannot be decoded"):
        _load(tmp_path / "bad.tar")


def test_an_empty_text_file_is_named(tmp_path, monkeypatch):
    from moga.data import prepare_text

    monkeypatch.setenv("MOGA_CACHE", str(tmp_path / "cache"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt is empty"):
        prepare_text(tmp_path / "out", empty)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "train.bin").write_bytes(b"")
    (tmp_path / "dir" / "val.bin").write_bytes(b"\x01\x00" * 100)
    from moga.data import TokenDataset

    with pytest.raises(ValueError, match=r"train\.bin is empty"):
        TokenDataset(tmp_path / "dir", vocab_size=10)
