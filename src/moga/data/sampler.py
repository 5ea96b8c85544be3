"""Deterministic, resumable batches of indices.

Everything random is derived from (seed, epoch, batch index), so the position alone is the
state: saving {epoch, index} and restoring it replays the exact same batches, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch


def derive_seed(seed: int, *keys: int) -> int:
    """A well-mixed 64-bit seed for one (seed, *keys) stream; nearby inputs give unrelated streams."""
    if seed < 0 or any(k < 0 for k in keys):
        raise ValueError(f"seeds must be non-negative, got {(seed, *keys)}")
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1, dtype=np.uint64)[0])


def make_generator(seed: int, *keys: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, *keys))


_PERMUTATION = 0  # stream id of the epoch permutations


class BatchSampler:
    """Batches of indices into `num_items`, reshuffled every epoch, endless.

    `next(sampler)` returns the next batch and rolls over to the next epoch by itself;
    `sampler.epoch_batches()` yields what is left of the current epoch. The position is
    (epoch, index): the epoch and the batch within it that comes next.
    """

    def __init__(self, num_items: int, batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True):
        if num_items <= 0 or batch_size <= 0:
            raise ValueError(f"need num_items > 0 and batch_size > 0, got {num_items}, {batch_size}")
        if drop_last and batch_size > num_items:
            raise ValueError(f"batch_size {batch_size} > {num_items} items with drop_last=True gives no batches")
        self.num_items, self.batch_size = num_items, batch_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = self.index = 0
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, permutation), computed once per epoch

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_items, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, index) of the batch that `next` returns."""
        if self.index >= len(self):
            return self.epoch + 1, 0
        return self.epoch, self.index

    def order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                perm = torch.randperm(self.num_items, generator=make_generator(self.seed, _PERMUTATION, epoch))
            else:
                perm = torch.arange(self.num_items)
            self._order = (epoch, perm)
        return self._order[1]

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> torch.Tensor:
        self.epoch, self.index = self.position
        start = self.index * self.batch_size
        batch = self.order(self.epoch)[start:start + self.batch_size]
        self.index += 1
        if self.index == len(self):  # a finished epoch counts as finished right away
            self.epoch, self.index = self.epoch + 1, 0
        return batch

    def epoch_batches(self):
        """The remaining batches of the current epoch."""
        epoch = self.position[0]
        while self.position[0] == epoch:
            yield next(self)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this sampler has seed {self.seed}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
