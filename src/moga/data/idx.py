"""The IDX format of MNIST and Fashion-MNIST, gzip or raw.

Layout: two zero bytes, a type code, the number of dimensions, then each dimension as a
big-endian int32, then the values in C order.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (gzip is detected from its content, not its name)."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{path}: corrupt gzip data ({e})") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{path}: not an IDX file (magic bytes {raw[:4].hex() or 'missing'}; "
                         "expected 0000 then a type code such as 08 and the number of dimensions)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">i4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(f"{path}: header says shape {shape} ({expected} bytes) but the file has {len(raw)} bytes")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def find_idx_file(directory: Path, stem: str) -> Path:
    """`stem.gz` or `stem` in directory."""
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"{directory} has neither {stem}.gz nor {stem}")


def read_idx_pair(directory: Path, prefix: str, image_shape: tuple[int, int], num_classes: int):
    """Images [N, H, W] uint8 and labels [N] of `{prefix}-images-idx3-ubyte` / `-labels-idx1-ubyte`."""
    images = read_idx(find_idx_file(directory, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(find_idx_file(directory, f"{prefix}-labels-idx1-ubyte"))
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != image_shape:
        raise ValueError(f"{prefix} images: expected uint8 [N, {image_shape[0]}, {image_shape[1]}], "
                         f"got {images.dtype} {list(images.shape)}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise ValueError(f"{prefix}: {len(images)} images but labels of shape {list(labels.shape)}")
    if labels.size and labels.max() >= num_classes:
        raise ValueError(f"{prefix}: label {labels.max()} out of range for {num_classes} classes")
    return images, labels.astype(np.int64)
