"""Data plumbing: collators, seeded (resumable, distributed) samplers and the epoch iteration and step plan the
Trainer runs on them, column checks and evaluation batches. The text rules live in ``treadle.text``, token rows to
tensors (padding, packing, positions) in ``treadle.packing``, loading a dataset a config names in
``treadle.cli.loading``.

Samplers here are deterministic functions of (seed, epoch, rank): the order of an epoch can be rebuilt in a
new process, which is what makes resuming mid-epoch exact.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader, Sampler

from treadle import distributed as dist
from treadle.errors import PreflightError
from treadle.streaming import StreamLoader, is_stream
from treadle.text import is_conversation, pad_token_id


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
            if isinstance(values[0], str) or (
                isinstance(values[0], (list, tuple)) and values[0] and isinstance(values[0][0], (str, dict))
            ):
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
                out[i, length - t.shape[0] :] = t
        return out


def collator_for(processing_class) -> PaddingCollator:
    """The default collator: pads ``input_ids`` with ``pad_token_id(processing_class)``."""
    return PaddingCollator(pad_token_id=pad_token_id(processing_class))


# ---------------------------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------------------------
class SeededSampler(Sampler[int]):
    """Shuffles (or not) with a permutation that depends only on ``seed + epoch``, splits it across ranks,
    and can start part-way into the epoch (``skip``) so a resumed run sees exactly the batches it would have.

    With ``world_size > 1`` every rank gets ``ceil(n / world_size)`` indices (the last ones wrap around, as in
    ``DistributedSampler``), rank r taking positions r, r + world_size, ... of the permutation.
    """

    def __init__(self, num_samples: int, *, seed: int = 0, shuffle: bool = True, rank: int = 0, world_size: int = 1):
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.skip = 0

    def start_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select the epoch's permutation and drop its first ``skip`` indices (of this rank)."""
        self.epoch = epoch
        self.skip = skip

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """torch's sampler convention (``DistributedSampler.set_epoch``), with ``start_epoch``'s ``skip``."""
        self.start_epoch(epoch, skip)

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
        return order[self.rank : total : self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.skip :])

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

    def __init__(
        self,
        num_samples: int,
        *,
        mini_repeat_count: int,
        batch_size: int,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if batch_size * mini_repeat_count % world_size:
            raise ValueError(
                f"a global batch of {batch_size} prompts x {mini_repeat_count} repeats cannot be "
                f"split evenly over {world_size} ranks"
            )
        if num_samples < batch_size:
            raise ValueError(
                f"the dataset has {num_samples} rows but one batch needs {batch_size} distinct "
                f"prompts; use a smaller batch or more data"
            )
        super().__init__(num_samples, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size)
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count

    def indices(self) -> list[int]:
        order = self.epoch_order()
        rows_per_rank = self.batch_size * self.mini_repeat_count // self.world_size
        out = []
        for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
            batch = [i for i in order[start : start + self.batch_size] for _ in range(self.mini_repeat_count)]
            mine = batch[self.rank * rows_per_rank : (self.rank + 1) * rows_per_rank]
            out.extend(mine * self.repeat_count)
        return out

    @property
    def batches_per_epoch(self) -> int:
        """Whole batches in an epoch (before ``repeat_count``), however many of them a resumed epoch skips."""
        return self.num_samples // self.batch_size

    def __len__(self) -> int:
        per_rank = self.batch_size * self.mini_repeat_count // self.world_size
        return self.batches_per_epoch * per_rank * self.repeat_count - self.skip

    def num_real_rows(self) -> None:
        return None  # repeats are the point here: nothing to discount


def seeded_sampler(dataset, *, seed: int, shuffle: bool) -> SeededSampler | None:
    """A SeededSampler over ``dataset`` for this rank of the process group (None for an iterable dataset)."""
    if not hasattr(dataset, "__len__"):
        return None
    return SeededSampler(
        len(dataset), seed=seed, shuffle=shuffle, rank=dist.get_rank(), world_size=dist.get_world_size()
    )


def build_dataloader(dataset, args, *, batch_size: int, collate_fn, sampler=None, drop_last: bool = False):
    """A DataLoader with ``args``' worker settings. Its own generator keeps the global torch RNG untouched, so
    that starting an epoch mid-way (resume) draws the same dropout masks. A stream (``streaming.is_stream``) gets a
    ``streaming.StreamLoader`` instead: this rank's shard, batched and collated the same way. A batch size above the
    rows there are (``per_device_train_batch_size: 10000000`` on 40 rows) is capped at them: the same single batch,
    and the header and samples/s report the real one (``device_batch_rows``)."""
    if is_stream(dataset):
        return StreamLoader(
            dataset,
            batch_size=batch_size,
            collate_fn=collate_fn,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            drop_last=drop_last,
        )
    rows = _length(sampler if sampler is not None else dataset)
    if not drop_last and rows and batch_size > rows:
        batch_size = rows
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory and args.device.type == "cuda",
        generator=torch.Generator().manual_seed(args.data_seed),
    )


def _length(source) -> int | None:
    try:
        return len(source)
    except TypeError:  # an iterable dataset, a sampler without a length
        return None


def device_batch_rows(args, dataloader) -> int:
    """The rows of one micro-batch on one device: ``per_device_train_batch_size``, or fewer when the training
    dataloader's batches were capped at the rows the dataset holds (``build_dataloader``)."""
    return min(
        args.per_device_train_batch_size, getattr(dataloader, "batch_size", None) or args.per_device_train_batch_size
    )


def step_rows(args, dataloader) -> int:
    """The rows of one optimizer step over every process: ``device_batch_rows`` x accumulation x processes."""
    return device_batch_rows(args, dataloader) * args.gradient_accumulation_steps * dist.get_world_size()


@runtime_checkable
class ResumableSampler(Protocol):
    """A sampler that can start an epoch part-way (SeededSampler and RepeatSampler are): ``start_epoch(epoch,
    skip)`` selects the epoch's order and drops its first ``skip`` indices of this rank, so that a resumed run
    skips the rows it already trained on without loading them."""

    def start_epoch(self, epoch: int, skip: int = 0) -> None: ...


def epoch_batches(dataloader, epoch: int, skip_batches: int = 0) -> Iterator:
    """The batches of epoch ``epoch`` from batch ``skip_batches`` on. A ResumableSampler skips without
    loading; with any other sampler the skipped batches are loaded and dropped (exact, only slower). A stream's
    loader continues from its checkpointed position (``StreamLoader.training_batches``: one endless epoch)."""
    if isinstance(dataloader, StreamLoader):
        return dataloader.training_batches(skip_batches)
    sampler = getattr(dataloader, "sampler", None)
    batch_size = getattr(dataloader, "batch_size", None)
    if isinstance(sampler, ResumableSampler) and batch_size:
        sampler.start_epoch(epoch, skip_batches * batch_size)
        return iter(dataloader)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    return itertools.islice(iter(dataloader), skip_batches, None)


def plan_steps(dataloader, args, micro_batches_per_batch: int = 1) -> tuple[int, int, int]:
    """(optimizer steps per epoch, total steps, epochs) of a run over ``dataloader``, from its length, the
    micro-batches each of its batches feeds, and ``args`` (``gradient_accumulation_steps``, ``max_steps`` or else
    ``num_train_epochs``)."""
    accum = args.gradient_accumulation_steps
    try:
        batches = len(dataloader) * micro_batches_per_batch
    except TypeError:
        if args.max_steps <= 0:
            raise PreflightError(
                "the training dataset is a stream (no length): set max_steps, the optimizer steps to train"
            ) from None
        return args.max_steps, args.max_steps, 1
    if batches == 0:
        raise PreflightError(
            f"the training dataloader is empty: {len(dataloader.dataset)} rows with batch size "
            f"{dataloader.batch_size} and drop_last={dataloader.drop_last}; give more rows, a "
            f"smaller per_device_train_batch_size, or dataloader_drop_last: false"
        )
    steps_per_epoch = math.ceil(batches / accum)
    if args.max_steps > 0:
        return steps_per_epoch, args.max_steps, math.ceil(args.max_steps / steps_per_epoch)
    return steps_per_epoch, math.ceil(args.num_train_epochs * steps_per_epoch), math.ceil(args.num_train_epochs)


def check_first_batch(dataloader, label_names: Sequence[str] | None = None) -> None:
    """Collate the first rows of the training set before training, so that a data problem fails at once and
    names the columns. With ``label_names``, a batch that has none of them is refused too (the model computes
    its loss from labels)."""
    dataset = dataloader.dataset
    if hasattr(dataset, "__len__") and len(dataset) == 0:
        raise PreflightError("the training dataset is empty; give it rows")
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return  # an iterable dataset: its first batch fails on its own, in the loop
    rows = [dataset[i] for i in range(min(2, len(dataset)))]
    try:
        batch = dataloader.collate_fn(rows)
    except Exception as e:
        columns = column_names(dataset) or (list(rows[0]) if isinstance(rows[0], dict) else "?")
        raise PreflightError(
            f"the data collator failed on the first training rows (columns: {columns}): {type(e).__name__}: {e}"
        ) from e
    if label_names and isinstance(batch, dict) and not any(k in batch for k in label_names):
        raise PreflightError(
            f"the model needs {list(label_names)} to compute its loss but the training batches only "
            f"have {sorted(batch)}; add a labels column (for causal LMs, labels = input_ids with "
            f"-100 on ignored tokens), or override compute_loss"
        )


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


def drop_unused_columns(
    dataset, keep: set[str] | None, *, description: str, model_name: str, announced: set[str] | None = None
):
    """``dataset`` without the columns outside ``keep`` (None keeps all), naming them on stderr once per
    ``announced`` set. Dropping every column is an error: the model would get no inputs."""
    if keep is None or column_names(dataset) is None:
        return dataset
    dropped = unused_columns(dataset, keep)
    if not dropped:
        return dataset
    if len(dropped) == len(column_names(dataset)):
        raise ValueError(
            f"none of the {description} dataset's columns {dropped} is an argument of "
            f"{model_name}.forward (it takes {sorted(keep)}); tokenize the dataset first, or set "
            f"remove_unused_columns=False and pass a data_collator that builds the model's inputs"
        )
    key = f"{description}:{','.join(dropped)}"
    if announced is not None and key not in announced and dist.is_main_process():
        announced.add(key)
        print(
            f"treadle: dropping {description} dataset columns {dropped} that {model_name}.forward does not "
            f"take (set remove_unused_columns=False to keep them)",
            file=sys.stderr,
        )
    return dataset.remove_columns(dropped)


def batch_rows(inputs) -> int:
    """Rows in a batch: the first dimension of its first tensor (or length of its first list); 1 if neither."""
    if isinstance(inputs, dict):
        for v in inputs.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                return v.shape[0]
            if isinstance(v, list):
                return len(v)
    return 1


def eval_batches(dataloader, label_name: str) -> Iterator[tuple[Any, int | None]]:
    """``(batch, keep)`` over an evaluation dataloader. Under several processes the sampler repeats a few rows
    so that every rank runs as many forwards (``num_real_rows``); a batch holding such rows has their labels
    set to -100 (no weight in the loss) and ``keep`` = its rows to keep in predictions (None: all)."""
    real_rows = getattr(getattr(dataloader, "sampler", None), "num_real_rows", lambda: None)()
    seen = 0
    for inputs in dataloader:
        rows = batch_rows(inputs)
        keep = None if real_rows is None or seen + rows <= real_rows else max(0, real_rows - seen)
        seen += rows
        yield (inputs if keep is None else mask_label_rows(inputs, label_name, keep)), keep


def to_cpu(x):
    """A detached CPU copy of a prediction tensor (of the first one, as float, for a tuple of outputs)."""
    if isinstance(x, tuple):
        return x[0].detach().float().cpu() if x else None
    return x.detach().cpu()


def mask_label_rows(inputs, label_name: str, keep: int):
    """The batch with the labels of every row from ``keep`` on set to -100 (no weight in the loss)."""
    labels = inputs.get(label_name) if isinstance(inputs, dict) else None
    if not isinstance(labels, torch.Tensor):
        return inputs
    labels = labels.clone()
    labels[keep:] = -100
    return {**inputs, label_name: labels}


def require_eval_dataset(args, eval_dataset) -> None:
    """Refuse, before any work, an ``eval_strategy`` that would evaluate with no evaluation dataset."""
    if args.eval_strategy != "no" and eval_dataset is None:
        raise PreflightError(
            f"eval_strategy={args.eval_strategy!r} but there is no evaluation dataset; give one "
            f"(eval_dataset: in a config, eval_dataset= in Python) or set eval_strategy: no"
        )


def require_columns(dataset, required: Sequence[str], *, what: str, fix: str = "") -> None:
    """Fail before training when ``dataset`` lacks a column that ``what`` needs."""
    names = column_names(dataset)
    if names is None:
        return
    missing = [c for c in required if c not in names]
    if missing:
        raise ValueError(f"{what} needs column(s) {missing} but the dataset has {names}. {fix}".rstrip())


class DatasetFileError(PreflightError):
    """A dataset file that is not what its name says (a JSON line that does not parse, no rows, a column of the
    wrong type), named with its line or row."""


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")  # roles chat templates render


def check_text_columns(dataset, columns, *, source: str, first_row: int = 0) -> None:
    """Refuse a row whose text column holds something else than text or chat messages (a number, null ...),
    or chat messages of a role no chat template renders (``CHAT_ROLES``; a template would print an unknown one
    literally, ``<|hacker|>``, and train on it) or without ``content`` (an assistant turn with ``tool_calls``
    may leave it out), naming ``source``, the row (numbered from ``first_row``: 1 for the lines of a JSONL file)
    and the column. ``dataset``: a ``datasets.Dataset`` or a list of row dicts."""
    rows = dataset if isinstance(dataset, list) else None
    present = [
        c
        for c in columns
        if (rows is not None and any(c in r for r in rows)) or (rows is None and c in (column_names(dataset) or ()))
    ]
    for column in present:
        for i, value in enumerate([r.get(column) for r in rows] if rows is not None else dataset[column]):
            where = f"{source}, {f'line {i + first_row}' if first_row else f'row {i}'}: column {column!r}"
            if not (isinstance(value, str) or is_conversation(value)):
                what = "nothing (null / empty)" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
                raise DatasetFileError(f"{where} holds {what}, not text (or chat messages); fix that row or drop it")
            if not isinstance(value, str):
                _check_messages(value, where)


def _check_messages(messages, where: str) -> None:
    for j, message in enumerate(messages):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise DatasetFileError(
                f"{where}, message {j} has role {str(role)[:40]!r}, which no chat template "
                f"renders (it would be trained on literally); use one of {list(CHAT_ROLES)}"
            )
        if message.get("content") is None and not message.get("tool_calls"):
            raise DatasetFileError(
                f"{where}, message {j} ({role}) has no 'content'; give each message its text "
                f"as 'content' (an assistant turn with 'tool_calls' may leave it out)"
            )


def empty_texts(values) -> list[int]:
    """The positions of ``values`` (texts or chat messages) that hold no text: ``""``, whitespace, or messages
    whose contents are all empty."""
    return [
        i
        for i, v in enumerate(values)
        if (isinstance(v, str) and not v.strip())
        or (is_conversation(v) and not any(str(m.get("content") or "").strip() for m in v))
    ]
