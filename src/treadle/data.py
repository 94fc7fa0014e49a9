"""Data plumbing: collators, seeded (resumable, distributed) samplers and column checks.

Samplers here are deterministic functions of (seed, epoch, rank): the order of an epoch can be rebuilt in a
new process, which is what makes resuming mid-epoch exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from treadle.models import forward_parameters  # noqa: F401  re-exported: trainer.py imports it from here


# ---------------------------------------------------------------------------------------------------------
# Collators
# ---------------------------------------------------------------------------------------------------------
class PaddingCollator:
    """Stacks a list of row dicts into a batch dict of tensors.

    Sequences of different lengths are right-padded (``padding_side="left"`` pads on the left):
    ``input_ids`` with ``pad_token_id``, ``labels`` with -100 (ignored by the loss), masks and everything
    else with 0. Keys whose values are strings are kept as lists. With ``pad_to_multiple_of`` the length is
    rounded up (tensor cores like multiples of 8).
    """

    def __init__(self, pad_token_id: int = 0, padding_side: str = "right", pad_to_multiple_of: int | None = None):
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side
        self.pad_to_multiple_of = pad_to_multiple_of

    def pad_value(self, key: str) -> int:
        if key == "labels" or key.endswith("_labels"):
            return -100
        if key.endswith("input_ids"):
            return self.pad_token_id
        return 0

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        if not rows:
            raise ValueError("cannot collate an empty list of rows")
        batch = {}
        for key in rows[0]:
            values = [row[key] for row in rows]
            if isinstance(values[0], str) or (isinstance(values[0], (list, tuple)) and values[0]
                                              and isinstance(values[0][0], (str, dict))):
                batch[key] = values
                continue
            batch[key] = self.stack(key, values)
        return batch

    def stack(self, key: str, values: list) -> torch.Tensor:
        tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in values]
        if tensors[0].dim() == 0 or all(t.shape == tensors[0].shape for t in tensors):
            if self.pad_to_multiple_of is None or tensors[0].dim() == 0:
                return torch.stack(tensors)
        length = max(t.shape[0] for t in tensors)
        if self.pad_to_multiple_of:
            length = math.ceil(length / self.pad_to_multiple_of) * self.pad_to_multiple_of
        out = tensors[0].new_full((len(tensors), length, *tensors[0].shape[1:]), self.pad_value(key))
        for i, t in enumerate(tensors):
            if self.padding_side == "right":
                out[i, : t.shape[0]] = t
            else:
                out[i, length - t.shape[0]:] = t
        return out


def collator_for(processing_class) -> PaddingCollator:
    """The default collator: pads with the tokenizer's pad token (or 0 when there is none)."""
    pad = getattr(processing_class, "pad_token_id", None)
    return PaddingCollator(pad_token_id=0 if pad is None else pad)


# ---------------------------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------------------------
class SeededSampler(Sampler[int]):
    """Shuffles (or not) with a permutation that depends only on ``seed + epoch``, splits it across ranks,
    and can start part-way into the epoch (``skip``) so a resumed run sees exactly the batches it would have.

    With ``world_size > 1`` every rank gets ``ceil(n / world_size)`` indices (the last ones wrap around, as in
    ``DistributedSampler``), rank r taking positions r, r + world_size, ... of the permutation.
    """

    def __init__(self, num_samples: int, *, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1):
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select the epoch's permutation and drop its first ``skip`` indices (of this rank)."""
        self.epoch = epoch
        self.skip = skip

    def epoch_order(self) -> list[int]:
        """This epoch's order of all rows, the same on every rank."""
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def indices(self) -> list[int]:
        order = self.epoch_order()
        per_rank = math.ceil(self.num_samples / self.world_size)
        total = per_rank * self.world_size
        order += order[: total - len(order)]
        return order[self.rank: total: self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.skip:])

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.world_size) - self.skip

    def num_real_rows(self) -> int:
        """How many of this rank's indices (from the start of the epoch) are not wrap-around repeats."""
        return len(range(self.rank, self.num_samples, self.world_size))


class RepeatSampler(SeededSampler):
    """Index order for online RL (GRPO): each prompt ``mini_repeat_count`` times in a row (a group), a batch of
    ``batch_size`` distinct prompts (global: all ranks), and each whole batch yielded ``repeat_count`` times.

    Every rank draws the same global order (the groups of a batch may span ranks) and keeps its contiguous
    slice of each global batch. Example, 4 prompts, ``mini_repeat_count=2, batch_size=2, repeat_count=2``,
    one rank, no shuffle::

        >>> list(RepeatSampler(4, mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=False))
        [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]

    Incomplete last batches are dropped, so every group is whole.
    """

    def __init__(self, num_samples: int, *, mini_repeat_count: int, batch_size: int, repeat_count: int = 1,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1):
        if batch_size * mini_repeat_count % world_size:
            raise ValueError(f"a global batch of {batch_size} prompts x {mini_repeat_count} repeats cannot be "
                             f"split evenly over {world_size} ranks")
        if num_samples < batch_size:
            raise ValueError(f"the dataset has {num_samples} rows but one batch needs {batch_size} distinct "
                             f"prompts; use a smaller batch or more data")
        super().__init__(num_samples, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size)
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count

    def indices(self) -> list[int]:
        order = self.epoch_order()
        rows_per_rank = self.batch_size * self.mini_repeat_count // self.world_size
        out = []
        for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
            batch = [i for i in order[start: start + self.batch_size] for _ in range(self.mini_repeat_count)]
            mine = batch[self.rank * rows_per_rank: (self.rank + 1) * rows_per_rank]
            out.extend(mine * self.repeat_count)
        return out

    def __len__(self) -> int:
        batches = self.num_samples // self.batch_size
        per_rank = self.batch_size * self.mini_repeat_count // self.world_size
        return batches * per_rank * self.repeat_count - self.skip

    def num_real_rows(self) -> None:
        return None  # repeats are the point here: nothing to discount


# ---------------------------------------------------------------------------------------------------------
# Columns
# ---------------------------------------------------------------------------------------------------------
def column_names(dataset) -> list[str] | None:
    names = getattr(dataset, "column_names", None)
    if isinstance(names, dict):  # a DatasetDict
        raise TypeError(f"got a DatasetDict with splits {list(names)}; pass one split, e.g. dataset['train']")
    return list(names) if names is not None else None


def unused_columns(dataset, accepted: set[str], keep: Sequence[str] = ()) -> list[str]:
    """Columns of a datasets.Dataset that the model's forward (``accepted``) does not take."""
    names = column_names(dataset)
    if names is None:
        return []
    return [c for c in names if c not in accepted and c not in keep]


def require_columns(dataset, required: Sequence[str], *, what: str, fix: str = "") -> None:
    """Fail before training when ``dataset`` lacks a column that ``what`` needs."""
    names = column_names(dataset)
    if names is None:
        return
    missing = [c for c in required if c not in names]
    if missing:
        raise ValueError(f"{what} needs column(s) {missing} but the dataset has {names}. {fix}".rstrip())
