"""Rows of token ids into tensors: right-padded, packed side by side without padding (SFT's packed dataset,
GRPO / DPO padding-free forwards), and THE position-id rule.

Positions count a row's real tokens from 0 (``position_ids``): after left padding (sampling, GRPO's training
forwards) and in every row packed into a shared sequence. Rows packed side by side get ``position_ids``
restarting at 0 in each row and no attention mask: transformers then builds a block-diagonal causal mask from the
position ids (a new row wherever a position is not the previous one + 1; eager, sdpa and flash attention alike),
so no token attends across rows.
"""

from __future__ import annotations

import array
import bisect
from collections.abc import Sequence
from typing import NamedTuple

import torch


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """The position of each real token (``mask == 1``) among its row's real tokens, from 0; 0 at padding before a
    row's first real token. ``mask``: (B, T) of 0 / 1 or bool.

    >>> position_ids(torch.tensor([[0, 1, 1], [1, 1, 0]])).tolist()
    [[0, 0, 1], [0, 1, 1]]
    """
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)


def long_tensor(values: Sequence[int], shape: tuple[int, ...]) -> torch.Tensor:
    """An int64 tensor of ``shape`` from a flat sequence of ints (or an ``array.array("q")``).

    Goes through one C array: 3-4x faster than ``torch.tensor`` on Python lists, which for a small model costs
    more than its forward pass (``python -m benchmarks.trainers``).
    """
    try:
        flat = values if isinstance(values, array.array) else array.array("q", values)
        return torch.frombuffer(flat, dtype=torch.int64).view(shape).clone()  # clone: owns its memory
    except (TypeError, ValueError, OverflowError):  # values an int64 C array refuses, or none: the general path
        return torch.tensor(list(values), dtype=torch.long).view(shape)


def right_padded(rows: Sequence[Sequence[int]], width: int, value: int) -> torch.Tensor:
    """A ``(len(rows), width)`` int64 tensor of the rows, each right-padded with ``value`` (``long_tensor``)."""
    flat = array.array("q")
    try:
        for row in rows:
            flat.extend(row)
            flat.extend([value] * (width - len(row)))
    except TypeError:  # values an int64 C array refuses: long_tensor's general path decides
        flat = [v for row in rows for v in [*row, *[value] * (width - len(row))]]
    return long_tensor(flat, (len(rows), width))


def prompt_completion_batch(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """(prompt, completion) token rows, each prompt + completion right-padded with ``pad_token_id`` to the longest:
    ``input_ids``, ``attention_mask`` (1 on real tokens) and ``completion_mask`` (1 on completion tokens only, so the
    prompt never counts in a loss), each ``(N, T)`` int64 (DPO's and KTO's collators).

    >>> batch = prompt_completion_batch([([5, 6], [7]), ([5], [8, 9, 4])], pad_token_id=0)
    >>> batch["input_ids"].tolist(), batch["completion_mask"].tolist()
    ([[5, 6, 7, 0], [5, 8, 9, 4]], [[0, 0, 1, 0], [0, 1, 1, 1]])
    """
    length = max(len(p) + len(c) for p, c in pairs)
    # Flat Python lists, converted once per column: a tensor per row and slice copies into the batch cost more than
    # a small model's forward pass (``python -m benchmarks.trainers``).
    ids, attention, completion = [], [], []
    for prompt, answer in pairs:
        pad = length - len(prompt) - len(answer)
        ids += [*prompt, *answer] + [pad_token_id] * pad
        attention += [1] * (len(prompt) + len(answer)) + [0] * pad
        completion += [0] * len(prompt) + [1] * len(answer) + [0] * pad
    shape = (len(pairs), length)
    return {
        "input_ids": long_tensor(ids, shape),
        "attention_mask": long_tensor(attention, shape),
        "completion_mask": long_tensor(completion, shape),
    }


def best_fit_bins(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing: the indices of ``sizes`` grouped into bins of at most ``capacity``, longest first.

    >>> best_fit_bins([5, 3, 4, 2], 8)
    [[0, 1], [2, 3]]
    """
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, bin index), sorted: best fit = the smallest that fits
    for i in order:
        size = sizes[i]
        if size > capacity:
            raise ValueError(
                f"row {i} has {size} tokens, more than max_length={capacity} (a packed row's length); truncate first"
            )
        at = bisect.bisect_left(free, (size, -1))
        if at == len(free):
            bins.append([i])
            space, index = capacity - size, len(bins) - 1
        else:
            space, index = free.pop(at)
            bins[index].append(i)
            space -= size
        bisect.insort(free, (space, index))
    return bins


class PackedBatch(NamedTuple):
    """A padded ``(B, T)`` batch repacked without padding by ``pack_padded_batch``."""

    input_ids: torch.Tensor  # (K, W): the real tokens of the B rows, whole rows side by side in K <= B packed rows
    position_ids: torch.Tensor  # (K, W): 0, 1, ... restarting at each row (0 in the unused tail of a packed row)
    index: torch.Tensor  # (B, T): where each real token of the padded batch sits in input_ids.view(-1); 0 at padding


def pack_padded_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedBatch:
    """Repack the real tokens (``attention_mask == 1``) of a padded batch, each row's tokens in their order, into
    packed rows as wide as its longest row (``best_fit_bins``): a packed row never costs more attention than the
    padded batch's rows did, and the padding is gone. Positions restart in every row (the packing rule above), so
    a model called with ``position_ids`` and no attention mask sees each row exactly as it saw it padded, with
    positions counted from its first real token.

    >>> packed = pack_padded_batch(torch.tensor([[7, 8, 9], [0, 5, 6], [4, 0, 0]]),
    ...                            torch.tensor([[1, 1, 1], [0, 1, 1], [1, 0, 0]]))
    >>> packed.input_ids.tolist(), packed.position_ids.tolist()
    ([[7, 8, 9], [5, 6, 4]], [[0, 1, 2], [0, 1, 0]])
    """
    real = attention_mask.bool()  # (B, T)
    lengths = real.sum(dim=1).tolist()
    width = max(max(lengths), 1)
    bins = best_fit_bins(lengths, width)
    starts = [0] * len(lengths)  # flat start of each row in the packed (K, W) tensor
    for k, members in enumerate(bins):
        offset = k * width
        for i in members:
            starts[i], offset = offset, offset + lengths[i]
    ranks = position_ids(real)  # (B, T): each real token's position in its row
    index = torch.where(real, torch.tensor(starts, device=real.device)[:, None] + ranks, 0)  # (B, T)
    flat_ids = input_ids.new_zeros(len(bins) * width)
    flat_ids[index[real]] = input_ids[real]
    flat_positions = torch.zeros_like(flat_ids)
    flat_positions[index[real]] = ranks[real]
    return PackedBatch(flat_ids.view(len(bins), width), flat_positions.view(len(bins), width), index)
