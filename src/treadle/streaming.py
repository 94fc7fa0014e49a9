"""Streaming datasets: training on rows read as they come (``datasets.IterableDataset``, ``load_dataset(...,
streaming=True)``, a torch ``IterableDataset`` or any iterable of row dicts), one shard per rank, resumable.

A stream has no length, so a run over one needs ``max_steps`` (``data.plan_steps`` says so in one line), and it
never ends: when the stream runs out, it is read again (its next pass; ``set_epoch(pass)`` reshuffles a shuffled
``datasets`` stream). Each rank reads its own shard: ``datasets.distributed.split_dataset_by_node`` for a
``datasets`` stream (whole files / shards per rank when their number divides by the world size, else every
``world_size``-th row), every ``world_size``-th row of any other iterable. A trainer that transforms rows (SFT
tokenises and packs, GRPO repeats each prompt ``num_generations`` times) wraps the dataset in a :class:`Stream`
whose ``transform`` maps a chunk of source rows to the rows trained on, lazily.

Resuming continues at the exact row. Every checkpoint holds this rank's ``StreamLoader.state_dict()``: the
stream's pass, the batches read, and (where the format allows) the source's own state at the start of the chunk
being read plus the rows of that chunk already used:

- ``"state"``: a ``datasets.IterableDataset`` without a shuffle buffer. Resuming loads the source's
  ``state_dict`` and reads on from there: nothing before the chunk is read again (but the stream's first
  ``HEAD_ROWS`` rows, its fingerprint: ``head_fingerprint``, which ties a checkpoint to its data).
- ``"skip"``: a shuffled ``datasets`` stream (its shuffle buffer is not in its ``state_dict``), a torch
  ``IterableDataset`` or a plain iterable. Resuming reads the pass again from its start and drops the batches
  already trained on: exact, and as slow as reading them.

The loop reaches a stream through the Trainer's existing hooks: ``data.build_dataloader`` returns a
:class:`StreamLoader` for a stream, and ``data.epoch_batches`` (what ``training_windows`` reads) asks it for its
batches from a step on.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Iterator

from treadle.errors import PreflightError

SKIP, STATE = "skip", "state"


class Stream:
    """``source`` (a stream) with ``transform`` applied chunk by chunk: ``transform(rows) -> rows`` maps a list of
    at most ``chunk_size`` source rows to the list of rows to train on (more, fewer, or other rows), and must
    depend on nothing else, so that a resumed chunk gives the same rows."""

    def __init__(self, source, transform: Callable[[list], list] | None = None, chunk_size: int = 1):
        if not is_stream(source):
            raise TypeError(f"Stream needs an iterable dataset without a length, got {type(source).__name__}")
        self.source, self.transform, self.chunk_size = source, transform, chunk_size

    @property
    def column_names(self):
        """The source's columns; None (unknown until read) when a transform makes other rows."""
        return getattr(self.source, "column_names", None) if self.transform is None else None

    def __iter__(self) -> Iterator:
        """One pass over the transformed rows (all of them: no rank split; the loader splits)."""
        return iter(StreamLoader(self, batch_size=1, collate_fn=lambda rows: rows[0]))


# --- a dataset's fingerprint: what ties a checkpoint to the rows it trained on (its marker holds it, resume checks it)
def dataset_fingerprint(rows) -> str:
    """A SHA-256 over the rows of a dataset (each row as sorted-key JSON, non-JSON values by ``repr``)."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=repr).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def sampled_dataset_fingerprint(dataset, most: int = 1024) -> str | None:
    """The length of ``dataset`` and ``dataset_fingerprint`` of up to ``most`` evenly spaced rows of it (the first
    and last included): cheap at any size, and a different dataset of the same length differs in them. None for a
    dataset without a length or indexing (an iterable dataset)."""
    try:
        n = len(dataset)
        rows = (
            [dataset[i] for i in sorted({round(k * (n - 1) / (most - 1)) for k in range(most)})]
            if n > most
            else [dataset[i] for i in range(n)]
        )
    except (TypeError, NotImplementedError, KeyError):
        return None
    return f"{n}:{dataset_fingerprint(rows)}"


def is_stream(dataset) -> bool:
    """Whether ``dataset`` is read as a stream: iterable, without a length (a ``datasets.IterableDataset``, a torch
    ``IterableDataset``, a generator ...), not a ``datasets.Dataset`` or a list."""
    return isinstance(dataset, Stream) or (
        hasattr(dataset, "__iter__")
        and not hasattr(dataset, "__len__")
        and not isinstance(dataset, (str, bytes, dict))
    )


HEAD_ROWS = 64  # the rows of a stream's start its fingerprint reads


def head_fingerprint(dataset, most: int = HEAD_ROWS) -> str | None:
    """``"stream:<rows>:<sha256>"`` of a stream's first ``most`` source rows (``dataset_fingerprint``):
    what a resumed streamed run checks its data against, as a map-style run checks its sampled rows (another file
    or dataset starts with other rows). None for what is not a stream, or an iterator that can be read only once
    (reading its head would take those rows from training)."""
    if not is_stream(dataset):
        return None
    source = dataset.source if isinstance(dataset, Stream) else dataset
    if iter(source) is source:
        return None
    rows = list(itertools.islice(iter(source), most))
    return f"stream:{len(rows)}:{dataset_fingerprint(rows)}"


def resume_mode(source) -> str:
    """``"state"`` when resuming can load the source's own ``state_dict`` exactly, else ``"skip"``."""
    if not (hasattr(source, "state_dict") and hasattr(source, "load_state_dict") and hasattr(source, "_ex_iterable")):
        return SKIP
    return SKIP if _shuffle_buffered(source) else STATE


def _shuffle_buffered(source) -> bool:
    # datasets keeps its shuffle buffer out of state_dict (resuming would lose the buffered rows); the buffer is an
    # examples iterable of its own somewhere in the chain (private to datasets: read, never changed)
    node = getattr(source, "_ex_iterable", None)
    while node is not None:
        if "Shuffled" in type(node).__name__:
            return True
        node = getattr(node, "ex_iterable", None)
    return False


def rank_shard(source, rank: int, world_size: int, epoch: int = 0):
    """This rank's rows of ``source`` for pass ``epoch``: an object to iterate (a fresh one per pass)."""
    if hasattr(source, "set_epoch"):
        source.set_epoch(epoch)
    if not hasattr(source, "_ex_iterable"):  # not a datasets stream
        return source if world_size == 1 else _every_nth(source, rank, world_size)
    # a new object per pass even for one rank: a resumed pass loads its state into it, and datasets would start
    # every later pass of the same object from that state
    from datasets.distributed import split_dataset_by_node  # optional heavy package, imported by a stream's use only

    return split_dataset_by_node(source, rank=rank, world_size=world_size)


class _every_nth:
    def __init__(self, source, rank: int, world_size: int):
        self.source, self.rank, self.world_size = source, rank, world_size

    def __iter__(self):
        return itertools.islice(iter(self.source), self.rank, None, self.world_size)


class StreamLoader:
    """Batches of ``batch_size`` rows of a stream for one rank, collated by ``collate_fn``; the dataloader the
    Trainer gets for a streaming dataset. ``iter(loader)``: one pass (evaluation); ``training_batches(skip)``: the
    endless batches of training from batch ``skip`` on, resumed from ``load_state_dict`` when it matches."""

    def __init__(
        self, dataset, *, batch_size: int, collate_fn, rank: int = 0, world_size: int = 1, drop_last: bool = False
    ):
        stream = dataset if isinstance(dataset, Stream) else Stream(dataset)
        self.dataset, self.batch_size, self.collate_fn = stream, batch_size, collate_fn
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.mode = resume_mode(stream.source)
        self.sampler = None
        self._position = {"epoch": 0, "batches": 0, "batches_in_epoch": 0, "chunk_state": None, "chunk_used": 0}
        self._restored: dict | None = None

    # ---- reading -------------------------------------------------------------------------------------------
    def _rows(self, epoch: int, start: dict | None = None) -> Iterator[dict]:
        """Rows of pass ``epoch``, transformed; from ``start`` (a saved position of this pass) when given. Tracks
        the source's state at each chunk's start and the chunk's rows used, for ``state_dict``."""
        shard = rank_shard(self.dataset.source, self.rank, self.world_size, epoch)
        loaded = start.get("chunk_state") if start is not None else None
        if loaded is not None:
            shard.load_state_dict(loaded)
        used = start.get("chunk_used", 0) if start is not None else 0
        source = iter(shard)
        size, transform = self.dataset.chunk_size, self.dataset.transform
        while True:
            # datasets reports a loaded state only once rows are read from it: the first chunk's is the loaded one
            chunk_state = loaded if loaded is not None else shard.state_dict() if self.mode == STATE else None
            loaded = None
            chunk = list(itertools.islice(source, size))
            if not chunk:
                return
            rows = transform(chunk) if transform is not None else chunk
            self._position.update(chunk_state=chunk_state, chunk_used=used)
            for row in rows[used:]:
                self._position["chunk_used"] += 1
                yield row
            used = 0

    def _batches(self, epoch: int, start: dict | None = None) -> Iterator:
        rows = self._rows(epoch, start)
        while batch := list(itertools.islice(rows, self.batch_size)):
            if len(batch) < self.batch_size and self.drop_last:
                return
            yield self.collate_fn(batch)

    def __iter__(self) -> Iterator:
        return self._batches(0)

    def training_batches(self, skip: int = 0) -> Iterator:
        """The batches of training from batch ``skip`` (counted from the run's start, over every pass) on; the
        stream is read again when it runs out. A restored position for batch ``skip`` is continued from (exactly:
        ``"state"`` from the source's state, ``"skip"`` by reading its pass again and dropping what was used)."""
        restored, self._restored = self._restored, None
        if restored is not None and restored["batches"] == skip:
            epoch, done = restored["epoch"], restored["batches_in_epoch"]
            start = restored if self.mode == STATE and restored.get("chunk_state") is not None else None
            batches = self._batches(epoch, start)
            if start is None:
                batches = itertools.islice(batches, done, None)
        else:  # no position saved for this batch: count it out from the run's start
            epoch, done, batches = 0, 0, self._batches(0)
            for _ in range(skip):
                if next(batches, None) is None:  # the pass ran out: the next one's first batch
                    epoch, done, batches = epoch + 1, 0, self._batches(epoch + 1)
                    next(batches)
                done += 1
        yield from self._endless(epoch, done, skip, batches)

    def _endless(self, epoch: int, done: int, total: int, batches: Iterator) -> Iterator:
        empty_passes = 0
        while True:
            got = False
            for batch in batches:
                got, done, total = True, done + 1, total + 1
                self._position.update(epoch=epoch, batches=total, batches_in_epoch=done)
                yield batch
            empty_passes = 0 if got else empty_passes + 1
            if empty_passes >= 2:
                raise PreflightError(
                    f"the training stream of rank {self.rank} gives no batch of {self.batch_size} "
                    f"rows when read again: its shard is too small, or it is an iterator that can "
                    f"be read once only; give more rows, or an iterable that can be read again "
                    f"(e.g. a datasets.IterableDataset)"
                )
            epoch, done, batches = epoch + 1, 0, self._batches(epoch + 1)

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's position: pass, batches read (all / this pass), the source's state at the current chunk's
        start and the chunk's rows used (``"state"`` mode), and the resume mode."""
        return {**self._position, "mode": self.mode}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state`` at the next ``training_batches`` call for its batch."""
        self._restored = dict(state)


def stream_state(dataloader) -> dict | None:
    """A StreamLoader's ``state_dict()`` for a checkpoint; None for any other dataloader."""
    return dataloader.state_dict() if isinstance(dataloader, StreamLoader) else None


def restore_stream(dataloader, state: dict | None) -> None:
    """Hand a checkpoint's stream position back to a StreamLoader (nothing for another dataloader / no state)."""
    if state is not None and isinstance(dataloader, StreamLoader):
        dataloader.load_state_dict(state)


def repeat_rows(times: int) -> Callable[[list], list]:
    """A Stream transform that repeats each row ``times`` times in a row (GRPO's groups)."""
    return lambda rows: [row for row in rows for _ in range(times)]


def require_streamable(dataset, what: str) -> None:
    """Refuse a stream where ``what`` needs a dataset with a length (one line naming the fix)."""
    if is_stream(dataset):
        raise PreflightError(
            f"{what} needs a dataset with a length, not a stream; materialise it "
            f"(datasets.Dataset.from_list(list(stream))) or turn {what} off"
        )
