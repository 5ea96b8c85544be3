"""CIFAR on disk: the official python-pickle batches, or JPEG/PNG files in `<split>/<class>/` folders.

Both readers return ({split: (images uint8 [N, 3, H, W], labels int64 [N])}, class names).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import lzma
import os
import pickle
import tarfile
import zlib
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import numpy as np
from PIL import Image, UnidentifiedImageError

from .paths import cache_dir as default_cache_dir

Splits = dict[str, tuple[np.ndarray, np.ndarray]]

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

class _PickleLayout(NamedTuple):
    folder: str  # what the official archive extracts to
    archive: str
    train_files: list[str]
    test_files: list[str]
    label_key: str
    meta_file: str  # holds the class names
    names_key: str
    num_classes: int


_PICKLE_LAYOUTS = {
    "cifar10": _PickleLayout("cifar-10-batches-py", "cifar-10-python.tar.gz",
                             [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"],
                             "labels", "batches.meta", "label_names", 10),
    "cifar100": _PickleLayout("cifar-100-python", "cifar-100-python.tar.gz", ["train"], ["test"],
                              "fine_labels", "meta", "fine_label_names", 100),
}


class _ArrayUnpickler(pickle.Unpickler):
    """Builds only containers and numpy arrays: CIFAR batches need nothing more, and a
    pickle that names any other callable could run arbitrary code."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a CIFAR batch")
        return super().find_class(module, name)


def _read_pickle_dict(path: Path) -> dict:
    """A CIFAR batch file; its Python 2 byte-string keys become str."""
    with open(path, "rb") as f:
        try:
            obj = _ArrayUnpickler(f, encoding="bytes").load()
        except (pickle.UnpicklingError, EOFError, ValueError) as e:
            raise ValueError(f"{path}: not a readable CIFAR batch ({e})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict, found {type(obj).__name__}")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _pickle_dir(root: Path, layout: _PickleLayout) -> Path:
    for candidate in (root, root / layout.folder):
        if (candidate / layout.train_files[0]).is_file():
            return candidate
    raise FileNotFoundError(f"no CIFAR pickle batches in {root}: expected {root / layout.folder}/"
                            f"{layout.train_files[0]} (extract the official {layout.archive} in {root})")


def read_cifar_pickles(root: str | Path, name: str = "cifar10") -> tuple[Splits, list[str]]:
    """CIFAR-10 (`cifar-10-batches-py/`) or CIFAR-100 (`cifar-100-python/`, fine labels) under root."""
    layout = _PICKLE_LAYOUTS[name]
    label_key, num_classes = layout.label_key, layout.num_classes
    directory = _pickle_dir(Path(root), layout)
    splits: Splits = {}
    for split, files in (("train", layout.train_files), ("test", layout.test_files)):
        xs, ys = [], []
        for file in files:
            batch = _read_pickle_dict(directory / file)
            if "data" not in batch or label_key not in batch:
                raise ValueError(f"{directory / file}: missing 'data' or '{label_key}' (keys: {sorted(batch)})")
            x, y = np.asarray(batch["data"]), np.asarray(batch[label_key], dtype=np.int64)
            if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3 * 32 * 32 or len(y) != len(x):
                raise ValueError(f"{directory / file}: expected uint8 data [N, 3072] and N labels, "
                                 f"got {x.dtype} {list(x.shape)} and {len(y)} labels")
            if len(y) and (y.min() < 0 or y.max() >= num_classes):
                raise ValueError(f"{directory / file}: labels outside 0..{num_classes - 1}")
            xs.append(x.reshape(-1, 3, 32, 32))  # rows are the R, G, B planes in turn
            ys.append(y)
        splits[split] = (np.concatenate(xs), np.concatenate(ys))
    classes = [f"class_{i}" for i in range(num_classes)]
    if (directory / layout.meta_file).is_file():
        names = _read_pickle_dict(directory / layout.meta_file).get(layout.names_key, [])
        if len(names) == num_classes:
            classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    return splits, classes


# ---- `<split>/<class>/<image>` trees, as a folder or a tar(.gz) --------------------------------

_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png"}
_SPLITS = ("train", "test")
_CACHE_VERSION = 1


def _place(name: str) -> tuple[str, str] | None:
    """(split, class) of an image path ending in `<split>/<class>/<file>`, else None."""
    parts = PurePosixPath(name).parts
    if (len(parts) >= 3 and parts[-3] in _SPLITS and not parts[-1].startswith(".")
            and PurePosixPath(name).suffix.lower() in _IMAGE_SUFFIXES):
        return parts[-3], parts[-2]
    return None


def _read_blobs(source: Path) -> dict[tuple[str, str, str], bytes]:
    """{(split, class, file name): encoded image} for every image in the folder or tar."""
    blobs = {}
    if source.is_dir():
        for path in source.rglob("*"):
            place = _place(path.relative_to(source).as_posix())
            if place and path.is_file():
                blobs[(*place, path.name)] = path.read_bytes()
    elif not tarfile.is_tarfile(source):
        raise ValueError(f"{source} is neither a folder nor a tar archive of <split>/<class>/ images")
    else:
        _read_tar(source, blobs)
    return blobs


def _read_tar(source: Path, blobs: dict) -> None:
    """The images of a tar(.gz), which must end as a whole archive does: a cut one is an error, not fewer images."""
    last = None

    def cut(what: str) -> ValueError:
        after = f"; the last whole image is {last}" if last else ""
        return ValueError(f"{source} is {what}: it ends after {len(blobs)} images{after}. Download or copy it "
                          "again (a half-finished download or copy looks like this).")

    try:
        # One streaming pass: random access into a .tar.gz would re-inflate from the start.
        with tarfile.open(source, "r:*") as tar:
            for member in tar:
                place = _place(member.name)
                if place and member.isfile():
                    blobs[(*place, PurePosixPath(member.name).name)] = tar.extractfile(member).read()
                    last = member.name
            # tarfile stops quietly where a cut tar ends; a whole one ends with two zero blocks (then
            # padding, and a .gz with its checksum: reading to the end checks that too)
            tar.fileobj.seek(tar.offset)
            end = tar.fileobj.read(2 * tarfile.BLOCKSIZE)
            while tar.fileobj.read(1 << 20):
                pass
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, lzma.LZMAError) as e:
        raise cut(f"cut short or damaged ({type(e).__name__}: {e})") from None
    if len(end) < 2 * tarfile.BLOCKSIZE or any(end):
        raise cut("cut short (no end-of-archive marker)")


def _decode(blobs: list[tuple[str, bytes]], source: Path) -> np.ndarray:
    """Decode to uint8 [N, 3, H, W]; every image must have the size of the first."""
    out = None
    for i, (name, blob) in enumerate(blobs):
        try:
            with Image.open(io.BytesIO(blob)) as image:
                pixels = np.asarray(image.convert("RGB"))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            why = ("not a JPEG or PNG image" if isinstance(e, UnidentifiedImageError)
                   else f"{type(e).__name__}: {e}")
            raise ValueError(f"{source}: the image {name} cannot be decoded ({why}). Replace that file, or "
                             "download or copy the data set again.") from None
        if out is None:
            out = np.empty((len(blobs), *pixels.shape), np.uint8)
        if pixels.shape != out.shape[1:]:
            raise ValueError(f"{source}: {name}: image of shape {pixels.shape}, others are {out.shape[1:]}")
        out[i] = pixels
    return out.transpose(0, 3, 1, 2).copy()


def decode_image_tree(source: str | Path, limit_per_class: int | None = None) -> tuple[Splits, list[str]]:
    """Decode `<split>/<class>/*.jpg` (split in train/test) from a folder or a tar(.gz).

    Class index = position in the sorted class names (for CIFAR-10 this is the official order,
    airplane=0 ... truck=9). Images are taken in sorted file-name order within each class;
    `limit_per_class` keeps the first that many of each class and split.
    """
    source = Path(source)
    blobs = _read_blobs(source)
    found = {split: sorted({c for s, c, _ in blobs if s == split}) for split in _SPLITS}
    if not found["train"]:
        raise FileNotFoundError(f"{source}: no images laid out as train/<class>/<image>.jpg")
    classes = found["train"]
    if found["test"] and found["test"] != classes:
        raise ValueError(f"{source}: test classes {found['test']} differ from train classes {classes}")
    names_at: dict[tuple[str, str], list[str]] = {}
    for split, cls, name in blobs:
        names_at.setdefault((split, cls), []).append(name)
    splits: Splits = {}
    for split in (s for s in _SPLITS if found[s]):
        chosen, labels = [], []
        for label, cls in enumerate(classes):
            names = sorted(names_at.get((split, cls), []))[:limit_per_class]
            chosen += [(f"{split}/{cls}/{n}", blobs[(split, cls, n)]) for n in names]
            labels += [label] * len(names)
        splits[split] = (_decode(chosen, source), np.asarray(labels, np.int64))
    return splits, classes


def _fingerprint(source: Path) -> str:
    """Changes when the source changes: size and mtime of the archive, or of every file in the folder."""
    if source.is_dir():
        entries = sorted((p.relative_to(source).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                         for p in source.rglob("*") if p.is_file())
    else:
        entries = [source.stat().st_size, source.stat().st_mtime_ns]
    return hashlib.sha1(json.dumps(entries).encode()).hexdigest()


def load_image_tree(source: str | Path, *, limit_per_class: int | None = None, cache: bool = True,
                    cache_dir: str | Path | None = None) -> tuple[Splits, list[str]]:
    """`decode_image_tree`, cached as an uncompressed .npz in cache_dir (default: $MOGA_CACHE or
    ~/.cache/moga) so the decode (about 10 s for CIFAR-10's 60k JPEGs) happens once."""
    source = Path(source).resolve()
    if not cache:
        return decode_image_tree(source, limit_per_class)
    key = hashlib.sha1(json.dumps([_CACHE_VERSION, str(source), _fingerprint(source),
                                   limit_per_class]).encode()).hexdigest()[:16]
    stem = source.name.split(".")[0]
    path = Path(cache_dir or default_cache_dir()).expanduser() / f"{stem}-{key}.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as f:
            splits = {s: (f[f"{s}_x"], f[f"{s}_y"]) for s in _SPLITS if f"{s}_x" in f}
            return splits, [str(c) for c in f["classes"]]
    splits, classes = decode_image_tree(source, limit_per_class)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"{s}_{k}": a for s, (x, y) in splits.items() for k, a in (("x", x), ("y", y))}
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")  # write then rename: no half-written cache
    np.savez(tmp, classes=np.asarray(classes), **arrays)
    os.replace(tmp, path)
    return splits, classes
