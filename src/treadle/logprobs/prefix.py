"""Shared-prefix forwards: each group's prompt computed once, followed by its completions (GRPO's ``shared_prefix``).

In GRPO every prompt is trained with its G completions; a padded or padding-free forward runs the prompt G times.
Here the rows of a batch that hold the same prompt run it once, in one of two ways:

- **Through the KV cache** (a model in this process: not DDP- or FSDP-wrapped, no gradient checkpointing, no
  compiled blocks): one forward over the K distinct prompts fills a ``DynamicCache``; its keys and values are
  selected for each row (``index_select``, so the gradient of every row's use flows back to its prompt), and a
  second forward runs every row's completion after its cached prompt. The first target is predicted by the
  prompt's last position, the others by the completion's. Each completion token attends to exactly what it attends
  to in its own row, through the model's own causal (and sliding-window) mask; the attention is
  ``(B, C, P + C)``, the padded forward's.
- **Packed under a 4D mask** (DDP and FSDP, whose wrappers expect one forward before each backward; gradient
  checkpointing, which drops a cache; ``torch_compile``): the group's rows are packed into one sequence, the prompt
  once and then each completion after it::

    [ prompt (p tokens) | completion 1 (c1) | completion 2 (c2) | ... ]     position ids: 0..p-1, p..p+c1-1, p..p+c2-1

  Each completion attends causally to the prompt and to itself, never to its siblings (a 4D mask, ``(K, 1, W, W)``,
  one packed row per group), and its position ids restart at the prompt's length. The dense mask computes all
  ``W^2`` pairs, nine in ten of them masked at G 8: the cache's way costs about a tenth of the step less on the real
  model (docs/performance.md).

Either way every completion token sees exactly the keys, values and positions it sees in its own row: the same
log-probs and gradients as the padded forward, for ``(p + sum c) / sum (p + c)`` of the token work (the prompt's
gradient arrives once, summed over the completions, where the padded backward sums G copies). Log-probs are taken
only at the targets that count (the chunked hidden-state path where the head allows it) and scattered back into the
``(B, C)`` layout the loss reads.

The batch layout is GRPO's ``Sample``: ``input_ids`` ``(B, P + C)``, prompts left-padded in the first ``P`` columns,
completions right-padded after them; positions count each row's real tokens from 0 (``packing.position_ids``).

:func:`shared_prefix_logps` returns None, and the caller runs its usual forward (padding-free or padded), when:

- no two rows of the batch share a prompt (nothing to save), or sharing would not cut the estimated cost to
  ``MIN_SAVING`` of the unshared forward's (:func:`estimated_cost`, :func:`cached_cost`: the tokens saved against
  the attention pairs; the 4D mask's grow with the square of the packed row, so long completions on a narrow model
  lose there), or (4D mask) a group's packed row would hold more than ``MAX_GROUP_TOKENS`` tokens; see
  docs/performance.md;
- the model's attention is not ``sdpa`` or ``eager`` (the two that take the 4D mask; the cache's way is checked on
  these two only): ``flash_attention_*`` and ``flex_attention`` fall back, as does a model that is not a
  transformers causal LM taking ``position_ids`` (no ``config._attn_implementation``);
- (4D mask) the model has a sliding attention window shorter than a row (a custom 4D mask replaces the model's own,
  window included: transformers returns a 4D mask as it is);
- the layout is not GRPO's (a completion token with padding before it, an empty prompt);
- the one-time check (per model, eval mode, on its first shareable batch) finds the shared forward's log-probs
  differ from the padded forward's; a warning says so once.
"""

from __future__ import annotations

import warnings
import weakref
from typing import NamedTuple

import torch
from torch import Tensor, nn

from treadle import distributed as dist
from treadle.logprobs.tokens import (
    TokenLogps,
    fast_path_head,
    forward_states,
    logps_at_rows,
    logps_from_states,
    token_logps,
)
from treadle.models import cache_argument, eval_mode, forward_signature
from treadle.packing import position_ids

__all__ = [
    "MAX_GROUP_TOKENS",
    "MIN_SAVING",
    "CachedPrefixBatch",
    "SharedPrefixBatch",
    "cached_cost",
    "estimated_cost",
    "pack_shared_prefix",
    "plan_cached_prefix",
    "prompt_first_layout",
    "shared_prefix_logps",
    "shared_prefix_problem",
    "token_ratio",
]

# Share only when the shared forward's estimated cost (``estimated_cost``: tokens, plus attention pairs, which the
# dense 4D mask computes for the whole packed row) is at most this fraction of the unshared one's
# (docs/performance.md).
MIN_SAVING = 0.8
# A packed group row longer than this falls back: its dense (W, W) mask and attention cost more than the tokens saved.
MAX_GROUP_TOKENS = 8192
# The attention implementations that take a custom 4D mask, and the mask each wants.
_MASK_KIND = {"sdpa": "bool", "eager": "additive"}
# Result of the one-time exactness check, per model (weak: does not keep models alive).
_CHECKED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
# Models already told (one warning each) why they cannot share.
_NOTED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class SharedPrefixBatch(NamedTuple):
    """A GRPO batch packed by :func:`pack_shared_prefix`: K groups, one packed row each."""

    input_ids: Tensor  # (K, W): each group's prompt once, then its completions; 0 in the unused tail
    position_ids: Tensor  # (K, W): 0..p-1 on the prompt, p.. again on every completion
    allowed: Tensor  # (K, 1, W, W) bool: query token may attend to key token (the unused tail: to itself)
    rows: Tensor  # (M,): flat index into input_ids.view(-1) of the token that predicts each target that counts
    labels: Tensor  # (M,): the targets that count, in (row, column) order of the (B, C) completion layout
    targets: Tensor  # (B, C) bool: the completion targets that count (their real tokens)


class CachedPrefixBatch(NamedTuple):
    """A GRPO batch laid out by :func:`plan_cached_prefix`: the K distinct prompts, then every row's completion."""

    prompt_ids: Tensor  # (K, P): each distinct prompt once, left-padded as in the batch
    prompt_mask: Tensor  # (K, P)
    group_of: Tensor  # (B,): each row's prompt (a row of prompt_ids)
    completion_ids: Tensor  # (B, C - 1): the completion tokens that predict a next one
    attention_mask: Tensor  # (B, P + C - 1): the row's prompt padding, then its completion's
    targets: Tensor  # (B, C) bool: the completion targets that count (their real tokens)
    labels: Tensor  # (M,): those targets, in (row, column) order


def token_ratio(prompt_lengths: list[int], completion_lengths: list[list[int]]) -> float:
    """Tokens of the shared forward over those of the unshared one: ``sum_k (p_k + sum c) / sum_k sum (p_k + c)``.

    >>> token_ratio([256], [[32] * 8])  # (P + G C) / (G (P + C))
    0.2222222222222222
    """
    shared = sum(p + sum(cs) for p, cs in zip(prompt_lengths, completion_lengths))
    unshared = sum(len(cs) * p + sum(cs) for p, cs in zip(prompt_lengths, completion_lengths))
    return shared / max(unshared, 1)


def _groups(input_ids: Tensor, real: Tensor, prompt_width: int) -> list[list[int]]:
    """The rows of the batch grouped by identical prompt (ids and padding), in order of first appearance."""
    prompts = torch.where(real[:, :prompt_width], input_ids[:, :prompt_width], -1)  # (B, P)
    _, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    groups: dict[int, list[int]] = {}
    for row, key in enumerate(inverse.tolist()):
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def _is_grpo_layout(real: Tensor, prompt_width: int) -> bool:
    """Whether ``real`` ``(B, P + C)`` is GRPO's layout: each prompt left-padded and ending in its last column, each
    completion right-padded."""
    prompt, completion = real[:, :prompt_width], real[:, prompt_width:]  # (B, P), (B, C)
    right_padded = torch.arange(completion.shape[1], device=real.device) < completion.sum(dim=1)[:, None]
    if not bool((completion == right_padded).all()) or not bool(prompt[:, -1].all()):
        return False  # a completion token after padding, or a prompt whose last column is padding
    return bool((position_ids(prompt)[:, -1] + 1 == prompt.sum(dim=1)).all())  # else a hole inside a prompt


def plan_cached_prefix(input_ids: Tensor, attention_mask: Tensor, prompt_width: int) -> CachedPrefixBatch | None:
    """Lay out a GRPO batch (as :func:`pack_shared_prefix` takes it) for the KV cache's way: each distinct prompt
    once, each row's completion after it; None where the layout is not GRPO's.

    >>> ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0], [0, 0, 4, 3, 2]])
    >>> plan = plan_cached_prefix(ids, (ids > 0).long(), prompt_width=3)
    >>> plan.prompt_ids.tolist(), plan.group_of.tolist(), plan.completion_ids.tolist(), plan.labels.tolist()
    ([[0, 5, 6], [0, 0, 4]], [0, 0, 1], [[7], [9], [3]], [7, 8, 9, 3, 2])
    """
    real = attention_mask.bool()  # (B, T)
    if not _is_grpo_layout(real, prompt_width):
        return None
    groups = _groups(input_ids, real, prompt_width)
    group_of = torch.empty(real.shape[0], dtype=torch.long)
    for k, members in enumerate(groups):
        group_of[members] = k
    first = torch.tensor([members[0] for members in groups], device=input_ids.device)
    targets = real[:, prompt_width:]  # (B, C)
    return CachedPrefixBatch(
        input_ids[first, :prompt_width],
        attention_mask[first, :prompt_width],
        group_of.to(input_ids.device),
        input_ids[:, prompt_width:-1],
        attention_mask[:, :-1],
        targets,
        input_ids[:, prompt_width:][targets],
    )


def pack_shared_prefix(input_ids: Tensor, attention_mask: Tensor, prompt_width: int) -> SharedPrefixBatch | None:
    """Pack a GRPO batch (``input_ids``, ``attention_mask`` ``(B, P + C)``, prompts in the first ``prompt_width``
    columns) with each distinct prompt once, or None where the layout is not GRPO's (see the module docstring).

    >>> ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0]])  # one prompt [5, 6] left-padded, two completions
    >>> packed = pack_shared_prefix(ids, (ids > 0).long(), prompt_width=3)
    >>> packed.input_ids.tolist(), packed.position_ids.tolist(), packed.labels.tolist()
    ([[5, 6, 7, 8, 9]], [[0, 1, 2, 3, 2]], [7, 8, 9])
    """
    real = attention_mask.bool()  # (B, T)
    if not _is_grpo_layout(real, prompt_width):
        return None
    prompt, completion = real[:, :prompt_width], real[:, prompt_width:]  # (B, P), (B, C)
    completion_lengths = completion.sum(dim=1)  # (B,)
    groups = _groups(input_ids, real, prompt_width)
    lengths_p, lengths_c = prompt.sum(dim=1).tolist(), completion_lengths.tolist()
    width = max(lengths_p[g[0]] + sum(lengths_c[r] for r in g) for g in groups)
    ids, positions, segments, rows = [], [], [], [torch.zeros(0, dtype=torch.long)] * len(lengths_c)
    for k, members in enumerate(groups):
        p = lengths_p[members[0]]
        parts = [input_ids[members[0], prompt_width - p : prompt_width]]
        pos, seg, offset = [torch.arange(p)], [torch.zeros(p, dtype=torch.long)], p
        for i, r in enumerate(members, start=1):
            c = lengths_c[r]
            parts.append(input_ids[r, prompt_width : prompt_width + c])
            pos.append(torch.arange(p, p + c))
            seg.append(torch.full((c,), i))
            # the first target is predicted by the prompt's last token, each next one by the completion token before
            rows[r] = torch.cat([torch.tensor([k * width + p - 1]), k * width + offset + torch.arange(max(c - 1, 0))])[
                :c
            ]
            offset += c
        tail = width - offset
        ids.append(torch.cat([*(t.cpu() for t in parts), torch.zeros(tail, dtype=input_ids.dtype)]))
        positions.append(torch.cat([*pos, torch.zeros(tail, dtype=torch.long)]))
        segments.append(torch.cat([*seg, torch.full((tail,), -1)]))
    segment = torch.stack(segments)  # (K, W): 0 prompt, i completion i, -1 unused tail
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # (W, W)
    same = (segment[:, None, :] == 0) | (segment[:, None, :] == segment[:, :, None])  # (K, W query, W key)
    used = segment >= 0  # (K, W)
    allowed = (causal & same & used[:, None, :] & used[:, :, None]) | torch.eye(width, dtype=torch.bool)
    device = input_ids.device
    return SharedPrefixBatch(
        torch.stack(ids).to(device),
        torch.stack(positions).to(device),
        allowed[:, None].to(device),
        torch.cat(rows).to(device),
        input_ids[:, prompt_width:][completion],
        completion,
    )


def prompt_first_layout(
    input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor
) -> tuple[Tensor, Tensor, int] | None:
    """Right-padded rows of prompt then response (DPO's collator: ``completion_mask`` 1 on response tokens) re-laid
    out as GRPO's: ``(ids, mask, P)`` with the prompts left-padded to ``P`` columns and the responses right-padded
    after them, so that :func:`shared_prefix_logps` can share a pair's prompt. None where a row is not prompt, then
    one run of response, then padding.

    >>> ids = torch.tensor([[5, 6, 7, 0], [4, 8, 9, 3]])
    >>> out = prompt_first_layout(ids, (ids > 0).long(), torch.tensor([[0, 0, 1, 0], [0, 1, 1, 1]]))
    >>> out[0].tolist(), out[1].tolist(), out[2]
    ([[5, 6, 7, 0, 0], [0, 4, 8, 9, 3]], [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], 2)
    """
    real, response = attention_mask.bool(), completion_mask.bool() & attention_mask.bool()  # (N, T)
    columns = torch.arange(real.shape[1], device=real.device)  # (T,)
    prompt_lengths, response_lengths = (real & ~response).sum(dim=1), response.sum(dim=1)  # (N,)
    prompt_rule = columns < prompt_lengths[:, None]
    response_rule = ~prompt_rule & (columns < (prompt_lengths + response_lengths)[:, None])
    if not bool((real == (prompt_rule | response_rule)).all() and (response == response_rule).all()):
        return None
    width_p, width_r = int(prompt_lengths.max()), max(int(response_lengths.max()), 1)
    target = torch.arange(width_p + width_r, device=real.device)  # (P + R,) output columns
    source = torch.where(
        target < width_p, target - (width_p - prompt_lengths[:, None]), prompt_lengths[:, None] + target - width_p
    )  # (N, P + R) input column of each output one
    mask = torch.where(target < width_p, source >= 0, target - width_p < response_lengths[:, None])
    ids = input_ids.gather(1, source.clamp(0, real.shape[1] - 1)).masked_fill(~mask, 0)
    return ids, mask.to(attention_mask.dtype), width_p


def shared_prefix_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot take a shared-prefix forward at all (one line), or None when it can."""
    base = dist.unwrap_model(model)
    config = getattr(base, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if "position_ids" not in forward_signature(base) or attention is None:
        return f"{type(base).__name__} is not a transformers causal LM taking position_ids"
    if attention not in _MASK_KIND:
        return (
            f"its attention implementation {attention!r} takes no custom 4D mask (sdpa and eager do; "
            "attn_implementation='sdpa' enables it)"
        )
    if _CHECKED.get(base) is False:
        return "its one-time check found the shared forward inexact"
    return None


def _sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None


def _mask(allowed: Tensor, base: nn.Module) -> Tensor:
    """The 4D mask the model's attention takes: boolean for sdpa, additive (0 or the dtype's minimum) for eager."""
    if _MASK_KIND[base.config._attn_implementation] == "bool":
        return allowed
    dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )


def estimated_cost(rows: Tensor | list[int], width: int | None, hidden_size: int | None) -> float:
    """A forward's cost in token-equivalents: each token's projections and MLP (about ``24 h^2`` flops a layer)
    plus each attended (query, key) pair (about ``4 h``), i.e. ``tokens + pairs / (6 h)``. ``rows``: the lengths of
    unshared rows (padding-free, a causal kernel: ``n^2 / 2`` pairs each), or the number of packed rows of
    ``width`` (a dense 4D mask: ``width^2`` pairs each). Without a ``hidden_size`` the pairs are not counted.

    >>> estimated_cost([288] * 8, None, 64), estimated_cost(1, 512, 64)  # (256, 32), G 8, toy tiny
    (3168.0, 1194.6666666666665)
    """
    if width is None:
        tokens, pairs = sum(rows), sum(n * n / 2 for n in rows)
    else:
        tokens, pairs = rows * width, rows * width * width
    return tokens + (pairs / (6 * hidden_size) if hidden_size else 0.0)


def cached_cost(groups: int, width_p: int, rows: int, width_c: int, hidden_size: int | None) -> float:
    """The KV cache's way in :func:`estimated_cost`'s units: ``groups`` prompts of ``width_p`` columns (causal),
    then ``rows`` completions of ``width_c - 1`` inputs, each attending to its prompt and causally to itself.

    >>> cached_cost(1, 256, 8, 33, None), round(cached_cost(1, 256, 8, 33, 64))  # (256, 32), G 8, toy tiny
    (512.0, 779)
    """
    inputs = width_c - 1
    tokens = groups * width_p + rows * inputs
    pairs = groups * width_p * width_p / 2 + rows * inputs * (width_p + inputs / 2)
    return tokens + (pairs / (6 * hidden_size) if hidden_size else 0.0)


def _cheapest(
    plans: list[SharedPrefixBatch | CachedPrefixBatch], attention_mask: Tensor, base: nn.Module
) -> SharedPrefixBatch | CachedPrefixBatch | None:
    """The switch-off rule for a batch the model could share (module docstring): of the plans that fit (the 4D mask:
    rows within the model's sliding window, groups within ``MAX_GROUP_TOKENS``), the one of least estimated cost,
    where that is at most ``MIN_SAVING`` of the unshared forward's; else None."""
    lengths = attention_mask.sum(dim=1).tolist()
    config = getattr(base, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, window = getattr(config, "hidden_size", None), _sliding_window(config)
    costs = []
    for plan in plans:
        if isinstance(plan, CachedPrefixBatch):
            groups, width_p = plan.prompt_ids.shape
            costs.append((cached_cost(groups, width_p, *plan.targets.shape, hidden), plan))
        elif plan.input_ids.shape[1] <= MAX_GROUP_TOKENS and (window is None or max(lengths) <= window):
            costs.append((estimated_cost(plan.input_ids.shape[0], plan.input_ids.shape[1], hidden), plan))
    cost, plan = min(costs, key=lambda pair: pair[0], default=(None, None))
    return plan if cost is not None and cost <= MIN_SAVING * estimated_cost(lengths, None, hidden) else None


def takes_cache(model: nn.Module) -> bool:
    """Whether ``model`` shares through the KV cache (two forwards before the backward), else under the 4D mask
    (one forward): not for DDP and FSDP, whose wrappers expect one forward before each backward, nor under gradient
    checkpointing, which drops a cache, nor with compiled blocks (``torch_compile``: the prompts' and the
    completions' forwards are two more shapes to compile at every step, up to dynamo's recompile limit)."""
    if dist.is_ddp(model):
        return False
    base = dist.unwrap_model(model)
    checkpointing = getattr(base, "is_activation_checkpointing", None)  # transformers >= 5.2's name
    if checkpointing is None:
        checkpointing = getattr(base, "is_gradient_checkpointing", False)
    if checkpointing or dist.is_fsdp(base):
        return False
    if any(getattr(block, "_compiled_call_impl", None) is not None for block in dist.transformer_blocks(base)):
        return False
    return cache_argument(base) is not None


def shared_prefix_logps(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    prompt_width: int,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    return_mean_logits: bool = False,
) -> TokenLogps | None:
    """Per-token log-probs ``(B, C)`` of a GRPO batch's completions (``input_ids[:, prompt_width:]``) through one
    shared-prefix forward, as ``logprobs.token_logps(model, input_ids, attention_mask, start=prompt_width - 1,
    position_ids=position_ids(attention_mask))`` returns them (0 at padded targets, entropies and mean logits too);
    or None where this batch or model does not share (module docstring): the caller runs its usual forward."""
    base = dist.unwrap_model(model)
    problem = shared_prefix_problem(model)
    if problem is not None and base not in _CHECKED and base not in _NOTED:
        _NOTED.add(base)  # one note per model; the inexact check's warning is its own
        warnings.warn(f"shared_prefix: {type(base).__name__} runs its forwards unshared: {problem}", stacklevel=2)
    if problem is not None or prompt_width < 1 or attention_mask.dim() != 2:
        return None
    ways = (plan_cached_prefix, pack_shared_prefix) if takes_cache(model) else (pack_shared_prefix,)
    plans = [plan for way in ways if (plan := way(input_ids, attention_mask, prompt_width)) is not None]
    plan = _cheapest(plans, attention_mask, base)
    if plan is None:
        return None
    options = (temperature, chunk_size, return_entropy, return_mean_logits)
    if base not in _CHECKED:
        _CHECKED[base] = _is_exact(base, input_ids, attention_mask, prompt_width, plan, options)
        if not _CHECKED[base]:
            warnings.warn(
                f"{type(base).__name__}: a shared-prefix forward does not reproduce the padded one; "
                "using the unshared forwards",
                stacklevel=2,
            )
            return None
    return _shared_forward(model, base, plan, options)


def _shared_forward(model, base, plan: SharedPrefixBatch | CachedPrefixBatch, options: tuple) -> TokenLogps:
    if isinstance(plan, CachedPrefixBatch):
        states, head = _cached_states(model, base, plan)
        values = logps_from_states(states[plan.targets], head, plan.labels, options)  # (M,) each
    else:
        kwargs = {"position_ids": plan.position_ids, "attention_mask": _mask(plan.allowed, base)}
        values = logps_at_rows(model, base, plan.input_ids, kwargs, plan.rows, plan.labels, options)

    def unpack(values: Tensor | None) -> Tensor | None:  # (M,) -> (B, C), zeros at the other targets
        return None if values is None else values.new_zeros(plan.targets.shape).masked_scatter(plan.targets, values)

    return TokenLogps(*(unpack(v) for v in values))


def _cached_states(model, base, plan: CachedPrefixBatch) -> tuple[Tensor, nn.Linear | None]:
    """The states ``(B, C, H or V)`` that predict each completion target, through the KV cache's way: the prompts'
    forward fills a cache, each row takes its prompt's keys and values, then the completions' forward. Final hidden
    states and the fast path's head, or logits and None (the head's one-time check failed: both forwards again)."""
    from transformers import DynamicCache  # a transformers model: shared_prefix_problem checked

    key = cache_argument(base)
    head = fast_path_head(base)
    prompt_positions = position_ids(plan.prompt_mask)  # (K, P)
    prompt_cache = DynamicCache()
    kwargs = {"position_ids": prompt_positions, key: prompt_cache, "use_cache": True}
    out = forward_states(model, base, head, plan.prompt_ids, plan.prompt_mask, kwargs)
    if out is None:
        return _cached_states(model, base, plan)  # fast_path_head now says None
    last = out[0][:, -1].index_select(0, plan.group_of)[:, None]  # (B, 1, H or V): predicts each first target
    if plan.completion_ids.shape[1] == 0:
        return last, out[1]
    rows_cache = DynamicCache()
    for i, layer in enumerate(prompt_cache.layers):  # each row its prompt's keys and values; gradients sum back
        rows_cache.update(layer.keys.index_select(0, plan.group_of), layer.values.index_select(0, plan.group_of), i)
    starts = prompt_positions[:, -1].index_select(0, plan.group_of) + 1  # (B,): each prompt's length
    positions = starts[:, None] + torch.arange(plan.completion_ids.shape[1], device=starts.device)  # (B, C - 1)
    kwargs = {"position_ids": positions, key: rows_cache, "use_cache": True}
    rest, head = forward_states(model, base, out[1], plan.completion_ids, plan.attention_mask, kwargs)
    return torch.cat([last, rest], dim=1), head


@torch.no_grad()
def _is_exact(
    base,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_width: int,
    plan: SharedPrefixBatch | CachedPrefixBatch,
    options: tuple,
) -> bool:
    """Whether ``base`` gives the same log-probs shared as padded on this batch (eval mode: no dropout)."""
    temperature, chunk_size = options[:2]
    if dist.is_fsdp(base):
        return True  # the check's forwards would gather shards on this rank only; trust the tested rule
    with eval_mode(base):
        padded = token_logps(
            base,
            input_ids,
            attention_mask,
            start=prompt_width - 1,
            temperature=temperature,
            chunk_size=chunk_size,
            position_ids=position_ids(attention_mask),
        ).logps
        shared = _shared_forward(base, base, plan, (temperature, chunk_size, False, False)).logps
    low_precision = torch.is_autocast_enabled(input_ids.device.type) or any(
        p.dtype != torch.float32 and p.is_floating_point() for p in base.parameters()
    )
    tolerance = 5e-2 if low_precision else 1e-4
    return torch.allclose(shared.float(), padded.float(), rtol=tolerance, atol=tolerance)
