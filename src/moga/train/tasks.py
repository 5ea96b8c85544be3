"""What a run trains on and how its loss is measured: images, text, or a synthetic teacher.

A Task hands the engine *global* micro-batches (every process draws the same one and keeps its
slice), a resumable batch stream, ordered evaluation batches, and the loss:
cross-entropy for classes and tokens; MSE or BCE-with-logits for regression and binary targets
(on image classes they apply to one-hot targets, and accuracy is still the argmax).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn import functional as F

from moga.data import BatchSampler, cache_dir, load_image_dataset, make_generator, prepare_text
from moga.data.text import TokenDataset, resolve_text_corpus

from .config import RunConfig

MLP_MODELS = ("residual_mlp", "feedforward", "shared_weights")
TEXT_EVAL_BATCHES = 20  # nanoGPT's eval_iters, for CPU budgets
_EVAL_STREAM, _TRAIN_EVAL_STREAM, _SYNTHETIC_STREAM = 2, 3, 4


@dataclass
class Task:
    kind: str  # "image", "text" or "synthetic"
    loss_name: str  # "cross_entropy", "mse" or "bce"
    unit: str  # what throughput counts: "samples" or "tokens"
    model_inputs: dict  # constructor arguments the data decides (in_features, num_classes, vocab_size, ...)
    train_size: int  # samples (text: tokens) in the training split
    micro_batch: int  # global samples (text: sequences) per micro-batch
    steps_per_epoch: int
    data: object = field(repr=False)
    data_seed: int = 0
    block_size: int = 0

    # --- batches ------------------------------------------------------------------------------

    def train_batches(self):
        """The endless, resumable stream of global micro-batches (state_dict / load_state_dict)."""
        if self.kind == "text":
            return self.data.batches("train", self.micro_batch, self.block_size, seed=self.data_seed)
        if self.kind == "image":
            return self.data.batches("train", self.micro_batch, seed=self.data_seed)
        return TensorBatches(*self.data["train"], self.micro_batch, seed=self.data_seed)

    def eval_batches(self, split: str, batch_size: int, max_batches: int | None) -> Iterator:
        """Ordered evaluation batches of a split, without augmentation; the same ones every time."""
        if self.kind == "text":
            stream = _EVAL_STREAM if split != "train" else _TRAIN_EVAL_STREAM
            batches = self.data.batches(split, batch_size, self.block_size, seed=self.data_seed * 16 + stream)
            return (next(batches) for _ in range(max_batches or TEXT_EVAL_BATCHES))
        if self.kind == "image":
            n, batches = len(self.data.split(split)), self.data.eval_batches(split, batch_size)
        else:
            x, y = self.data[split]
            n, batches = len(x), ((x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size))
        if max_batches is None:
            limit = _train_eval_limit(self, split) if split == "train" else None
            max_batches = -(-min(n, limit or n) // batch_size)
        return itertools.islice(batches, max_batches)

    def has_split(self, split: str) -> bool:
        if self.kind == "text":
            return split in ("train", "val")
        if self.kind == "image":
            return getattr(self.data, split, None) is not None
        return split in self.data

    def fingerprint(self) -> dict:
        """What the run trains and evaluates on, cheaply identified: the bytes and SHA-256 of the prepared token
        files (text) or of every split's arrays (images, synthetic). A checkpoint records it, so that resuming
        on other data (a text file edited between stop and resume, another copy of a data set) is noticed."""
        h, size = hashlib.sha256(), 0
        if self.kind == "text":
            arrays = [self.data.tokens(split) for split in ("train", "val")]
        elif self.kind == "image":
            splits = [getattr(self.data, name, None) for name in ("train", "val", "test")]
            arrays = [a for s in splits if s is not None for a in (s.x, s.y)]
        else:
            arrays = [a for split in sorted(self.data) for a in self.data[split]]
        for a in arrays:
            a = a.detach().cpu().contiguous().numpy() if torch.is_tensor(a) else a
            h.update(f"{a.dtype}{tuple(a.shape)};".encode())
            h.update(memoryview(a).cast("B") if a.flags.c_contiguous else a.tobytes())
            size += a.nbytes
        return {"bytes": size, "sha256": h.hexdigest()}

    # --- loss ---------------------------------------------------------------------------------

    def loss(self, model, x: torch.Tensor, y: torch.Tensor,
             accuracy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """(mean loss, number of correct predictions or -1, count of predictions). ``accuracy=False`` (a training
        step) skips the argmax over all outputs and gives None for the count."""
        if self.kind == "text":
            out = model(x, y)
            logits, loss = out if isinstance(out, tuple) else (out, None)
            if loss is None:
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            if not accuracy:
                return loss, None, y.numel()
            correct = (logits.argmax(-1) == y).sum() if logits.shape[:2] == y.shape else torch.tensor(-1)
            return loss, correct, y.numel()
        out = model(x)
        if self.loss_name == "cross_entropy":
            return F.cross_entropy(out, y), (out.argmax(-1) == y).sum() if accuracy else None, len(y)
        if self.kind == "image":  # regression losses on one-hot targets
            target = F.one_hot(y, out.shape[-1]).to(out.dtype)
            if self.loss_name == "mse":
                loss = F.mse_loss(out, target)
            else:
                loss = F.binary_cross_entropy_with_logits(out, target)
            return loss, (out.argmax(-1) == y).sum() if accuracy else None, len(y)
        y = y.to(out.dtype).reshape(out.shape)
        if self.loss_name == "mse":
            return F.mse_loss(out, y), torch.tensor(-1), len(y)
        correct = ((out > 0) == (y > 0.5)).sum() if accuracy else None
        return F.binary_cross_entropy_with_logits(out, y), correct, y.numel()


def _train_eval_limit(task: Task, split: str) -> int | None:
    """Training-split evaluation looks at as many samples as the held-out split has (not all of train)."""
    for held in ("val", "test"):
        if task.has_split(held):
            data = task.data.split(held) if task.kind == "image" else task.data[held][0]
            return len(data)
    return None


class TensorBatches:
    """Endless shuffled batches of in-memory tensors; the position is the state (like ImageBatches)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, *, seed: int = 0):
        self.x, self.y = x, y
        self.sampler = BatchSampler(len(x), batch_size, seed=seed, shuffle=True, drop_last=True)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        return self

    def __next__(self):
        idx = next(self.sampler)
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


# --- building ----------------------------------------------------------------------------------

def resolve_loss(cfg: RunConfig) -> str:
    if cfg.train.loss != "auto":
        return cfg.train.loss
    return "mse" if cfg.data.kind == "synthetic" else "cross_entropy"


def build_task(cfg: RunConfig, *, main: bool = True, barrier=lambda: None) -> Task:
    """Load the data a config names; ``main`` prepares shared files (text), the rest wait at ``barrier``."""
    d, t = cfg.data, cfg.train
    seed = cfg.seed if d.seed is None else d.seed
    loss = resolve_loss(cfg)
    if d.kind == "text":
        if loss != "cross_entropy":
            raise ValueError(f"text data trains with cross_entropy, not train.loss={loss}")
        if t.batch_size == "full":
            raise ValueError("train.batch_size='full' is for image and synthetic data, not text")
        data_dir = Path(d.data_dir) if d.data_dir else None
        if data_dir is None:
            data_dir = _text_cache(d.text_path, d.tokenizer)
            if main and not (data_dir / "train.bin").is_file():
                _prepare_atomic(data_dir, d.text_path, d.tokenizer)
            barrier()
        data = TokenDataset(data_dir)
        train_tokens = len(data.tokens("train"))
        micro = _micro_batch(t.batch_size, t.grad_accum)
        per_step = t.batch_size * d.block_size
        return Task("text", loss, "tokens", {"vocab_size": data.vocab_size, "block_size": d.block_size},
                    train_tokens, micro, max(1, train_tokens // per_step), data, seed, d.block_size)
    if d.kind == "image":
        flatten = d.flatten if d.flatten is not None else cfg.model.name in MLP_MODELS
        # A saved config.yaml sets every key, unset ones as null: those are not options to pass on.
        opts = {k: getattr(d, k) for k in ("root", "val_size", "split_seed", "normalize", "augment",
                                            "limit_per_class") if k in d.model_fields_set and getattr(d, k) is not None}
        if opts.get("normalize") == "none":
            opts["normalize"] = None
        data = load_image_dataset(d.name, flatten=flatten, **opts)
        n = len(data.train)
        inputs = {"num_classes": data.num_classes, "out_features": data.num_classes,
                  "in_features": math.prod(data.image_shape),  # MLPs flatten images themselves
                  "in_channels": data.image_shape[0]}
        if loss == "bce" and data.num_classes < 2:
            raise ValueError("bce on images needs at least two classes")
    else:
        data = synthetic_data(d.in_features, d.out_features, d.n_train, d.n_val, loss, d.noise,
                              seed=d.split_seed or 0)
        n = d.n_train
        inputs = {"in_features": d.in_features, "out_features": d.out_features, "num_classes": d.out_features}
    micro = n if t.batch_size == "full" else _micro_batch(t.batch_size, t.grad_accum)
    if t.batch_size == "full" and t.grad_accum > 1:
        if n % t.grad_accum:
            raise ValueError(f"full batch of {n} samples does not split into grad_accum={t.grad_accum} micro-batches")
        micro = n // t.grad_accum
    if micro * t.grad_accum > n:
        raise ValueError(f"batch of {micro * t.grad_accum} is larger than the {n} training samples")
    steps_per_epoch = (n // micro) // t.grad_accum
    if steps_per_epoch == 0:
        raise ValueError(f"an epoch of {n // micro} micro-batches is shorter than grad_accum={t.grad_accum}")
    inputs = {k: v for k, v in inputs.items() if v is not None}
    return Task(d.kind, loss, "samples", inputs, n, micro, steps_per_epoch, data, seed)


def _micro_batch(batch_size: int, accum: int) -> int:
    if batch_size % accum:
        raise ValueError(f"train.batch_size={batch_size} does not split into grad_accum={accum} micro-batches")
    return batch_size // accum


def synthetic_data(in_features: int, out_features: int, n_train: int, n_val: int, loss: str,
                   noise: float = 0.0, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Gaussian inputs labelled by a random tanh teacher: regression targets (mse), 0/1 labels (bce) or
    classes (cross_entropy, the teacher's argmax over out_features >= 2)."""
    gen = make_generator(seed, _SYNTHETIC_STREAM)
    hidden = 32
    a = torch.randn(in_features, hidden, generator=gen) / in_features**0.5
    b = torch.randn(hidden, out_features, generator=gen) / hidden**0.5
    x = torch.randn(n_train + n_val, in_features, generator=gen)
    out = torch.tanh(x @ a) @ b * 2
    if loss == "mse":
        y = out + noise * torch.randn(out.shape, generator=gen)
    elif loss == "bce":
        y = (out > 0).float()
    else:
        if out_features < 2:
            raise ValueError("synthetic classification needs data.out_features >= 2 classes")
        y = out.argmax(-1)
    return {"train": (x[:n_train], y[:n_train]), "val": (x[n_train:], y[n_train:])}


def _text_cache(text_path: str | None, tokenizer: str) -> Path:
    source = resolve_text_corpus(text_path).resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{tokenizer}".encode()).hexdigest()[:12]
    return cache_dir() / "text" / f"{source.stem}-{tokenizer}-{key}"


def _prepare_atomic(out_dir: Path, text_path: str | None, tokenizer: str) -> None:
    """Tokenize into a temporary directory and rename it into place, so readers never see half a file."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        prepare_text(tmp, text_path, tokenizer)
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another process got there first
            if not (out_dir / "train.bin").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
