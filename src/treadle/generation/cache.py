"""Everything treadle knows of transformers' KV-cache internals, in one file.

Two cache-layer subclasses are swapped in for transformers' ``DynamicLayer`` (by replacing the layer object, or
its ``__class__``, which keeps the buffers the layer holds):

- ``PreallocatedLayer`` (single-turn and multi-turn sampling): keys/values live in buffers sized once for the
  whole generation, written in place; transformers' ``DynamicLayer`` concatenates the whole cache on every
  token, which on CPU costs more than the attention itself.
- ``RaggedLayer`` (multi-turn sampling): a preallocated layer where each row writes its new keys at its own next
  slot (``RaggedWrites``), so that a row waiting for its environment costs no columns.

``StaticKV`` (the static decode step, ``generation.static``) is a third kind: transformers' own ``StaticLayer`` for
every layer, sliding ones included (a sliding layer keeps every slot too; its window is the attention mask's
business), with buffers of a fixed (rows, heads, capacity, head dim) that a compiled step reads at the same address
on every call.

Both classes are built on first use, so that importing treadle does not import transformers. A transformers
release that renames ``DynamicLayer``'s attributes (``keys``, ``values``, ``is_initialized``) breaks this file
only.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from treadle.models import forward_signature
from treadle.packing import position_ids

__all__ = ["RaggedWrites", "StaticKV", "attention_kind", "expand_cache", "prefill", "static_cache_problem"]


def attention_kind(model) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


def prefill(model, prompt_ids: Tensor, prompt_mask: Tensor, cache_name: str, prompt_inputs: dict | None = None):
    """Run the B distinct prompts once; returns last-position logits (B, V) and the filled cache.
    ``prompt_inputs``: what else the prompts' forward takes (a VLM's ``pixel_values`` ...), prefill only."""
    positions = position_ids(prompt_mask)  # left padding shifts each prompt to start at 0
    kwargs = {}
    signature = forward_signature(model)
    for keep_name in ("logits_to_keep", "num_logits_to_keep"):  # skip the (B, P, V) logits we never read
        if keep_name in signature:
            kwargs[keep_name] = 1
            break
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=positions,
        use_cache=True,
        **kwargs,
        **(prompt_inputs or {}),
    )
    cache = out[cache_name] if cache_name in out else out["past_key_values"]
    return out.logits[:, -1], cache


def expand_cache(cache, group: int, capacity: int) -> bool:
    """Repeat each prompt's cache ``group`` times along the batch, into buffers that hold ``capacity`` tokens.

    Plain attention layers (transformers' ``DynamicLayer``) are swapped for preallocated ones; any other
    layer kind (sliding window, linear attention) is only repeated and keeps its own update rule.
    Returns whether every layer is now a preallocated full-attention layer.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:  # a cache without per-layer objects: repeat only, it keeps growing by concatenation
        cache.batch_repeat_interleave(group)
        return False
    from transformers.cache_utils import DynamicLayer  # heavy: imported when a cache is first expanded

    preallocated = _preallocated_layer_class()
    for index, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized:
            layers[index] = preallocated(layer.keys, layer.values, group, capacity)
        else:
            layer.batch_repeat_interleave(group)
    return all(isinstance(layer, preallocated) for layer in layers)


class _PreallocatedLayerMixin:
    """The methods of a DynamicLayer whose keys/values live in buffers sized for the whole generation (mixed
    into transformers' DynamicLayer by ``_preallocated_layer_class``).

    ``update`` writes the new token's key/value in place and returns views of the filled part, so each
    step copies (R, H, 1, D) instead of the whole (R, H, T, D) cache that ``torch.cat`` rewrites.
    """

    def __init__(self, keys: Tensor, values: Tensor, group: int, capacity: int):
        super().__init__()
        rows, heads, length, head_dim = keys.shape
        self._key_buffer = keys.new_empty(rows * group, heads, capacity, head_dim)
        self._value_buffer = values.new_empty(rows * group, heads, capacity, head_dim)
        # Broadcasting writes prompt b into rows b*G .. b*G+G-1 without an intermediate repeated copy.
        self._key_buffer.view(rows, group, heads, capacity, head_dim)[..., :length, :] = keys[:, None]
        self._value_buffer.view(rows, group, heads, capacity, head_dim)[..., :length, :] = values[:, None]
        self.device, self.is_initialized = keys.device, True
        self._set_length(length)

    def _set_length(self, length: int) -> None:
        self._length = length
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        start, stop = self._length, self._length + key_states.shape[-2]
        if stop > self._key_buffer.shape[2]:
            raise RuntimeError(f"preallocated KV cache full ({self._key_buffer.shape[2]} tokens)")
        self._key_buffer[:, :, start:stop] = key_states
        self._value_buffer[:, :, start:stop] = value_states
        self._set_length(stop)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length

    def batch_select_indices(self, indices: Tensor) -> None:
        # Copy only the filled part into fresh, smaller buffers; the old ones are freed.
        keys, values = self._key_buffer[indices, :, : self._length], self._value_buffer[indices, :, : self._length]
        capacity = self._key_buffer.shape[2]
        self._key_buffer = keys.new_empty(len(indices), keys.shape[1], capacity, keys.shape[3])
        self._value_buffer = values.new_empty(len(indices), values.shape[1], capacity, values.shape[3])
        self._key_buffer[:, :, : self._length] = keys
        self._value_buffer[:, :, : self._length] = values
        self._set_length(self._length)

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(
            torch.arange(self._key_buffer.shape[0], device=self.device).repeat_interleave(repeats)
        )

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self._set_length(self._length + tokens_to_remove)

    def reset(self) -> None:
        self._set_length(0)


@functools.cache
def _preallocated_layer_class():
    """Built on first use so that importing this module does not import transformers."""
    from transformers.cache_utils import DynamicLayer  # heavy: see the docstring

    return type("PreallocatedLayer", (_PreallocatedLayerMixin, DynamicLayer), {})


class RaggedWrites:
    """Where each row's new keys go in this step, shared by every layer of one cache (set by the decode loop)."""

    rows: Tensor | None  # (r,) the rows of this forward; None: all
    index: Tensor  # (r, k) slot of each new key; padding goes to the last, never-read slot
    span: int  # slots that attention reads this step

    @classmethod
    def attach(cls, cache) -> RaggedWrites:
        writes = cls()
        ragged = _ragged_layer_class()
        for layer in cache.layers:
            layer.__class__, layer.writes = ragged, writes  # a preallocated layer that writes row by row
            layer.clear_unfilled()
        return writes


class _RaggedLayerMixin:
    """``update`` writes each row's keys/values at that row's own slots (``writes.index``) and returns views of
    the first ``writes.span`` slots; which slots a query may read is the attention mask's business."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        subset = self.writes.rows
        rows = torch.arange(key_states.shape[0], device=key_states.device) if subset is None else subset
        self._key_buffer[rows[:, None], :, self.writes.index] = key_states.transpose(1, 2)
        self._value_buffer[rows[:, None], :, self.writes.index] = value_states.transpose(1, 2)
        self._set_length(max(self._length, self.writes.span))
        if subset is None:
            return self._key_buffer[:, :, : self.writes.span], self._value_buffer[:, :, : self.writes.span]
        return self._key_buffer[subset, :, : self.writes.span], self._value_buffer[subset, :, : self.writes.span]

    def clear_unfilled(self) -> None:
        # Slots a row has not written yet are read (with zero weight) by rows that have: they must hold numbers,
        # not the garbage of an empty buffer, since 0 * NaN is NaN.
        self._key_buffer[:, :, self._length :] = 0
        self._value_buffer[:, :, self._length :] = 0

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self.clear_unfilled()


@functools.cache
def _ragged_layer_class():
    return type("RaggedLayer", (_RaggedLayerMixin, _preallocated_layer_class()), {})


def static_cache_problem(cache) -> str | None:
    """Why a prefilled cache cannot move into a :class:`StaticKV`, or None: every layer must be transformers' plain
    ``DynamicLayer`` (full attention) or ``DynamicSlidingWindowLayer`` (a window, e.g. Gemma 3's local layers)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # heavy: see the docstring

    layers = getattr(cache, "layers", None)
    if not layers:
        return f"its cache ({type(cache).__name__}) has no per-layer objects"
    for layer in layers:
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) or not layer.is_initialized:
            return f"a {type(layer).__name__} cache layer has no static counterpart here"
    return None


class StaticKV:
    """One transformers ``Cache`` of ``StaticLayer``s whose buffers hold ``rows`` x ``capacity`` tokens, allocated
    once and reused by every generation that falls in the same bucket (a compiled step reads these very tensors).

    Every row writes its new key at the same slot, ``cumulative_length`` (a 0-d tensor, so that a compiled step does
    not specialise on it): the prompts are left-padded, so slot = prompt width + decode step for all rows.
    ``windows[i]``: layer i's sliding window, or None for full attention."""

    def __init__(self, prefill_cache, rows: int, capacity: int):
        from transformers.cache_utils import Cache, StaticLayer  # heavy: see the docstring

        layers, self.windows = [], []
        for layer in prefill_cache.layers:
            static = StaticLayer(max_cache_len=capacity)
            keys, values = layer.keys, layer.values
            # allocates zero-filled buffers (never garbage: masked slots are read with weight 0, and 0 * NaN is NaN)
            # and marks them static, so that CUDA graphs replay on the same addresses
            static.lazy_initialization(
                keys.new_empty(rows, keys.shape[1], 1, keys.shape[3]),
                values.new_empty(rows, values.shape[1], 1, values.shape[3]),
            )
            layers.append(static)
            self.windows.append(layer.sliding_window if getattr(layer, "is_sliding", False) else None)
        self.cache, self.rows, self.capacity = Cache(layers=layers), rows, capacity

    def fits(self, prefill_cache) -> bool:
        """Whether these buffers take ``prefill_cache``'s layers (the same count, heads, dims, dtype, device)."""
        return len(self.cache.layers) == len(prefill_cache.layers) and all(
            static.keys.shape[1::2] == layer.keys.shape[1::2]
            and static.values.shape[-1] == layer.values.shape[-1]
            and static.keys.dtype == layer.keys.dtype
            and static.keys.device == layer.keys.device
            for static, layer in zip(self.cache.layers, prefill_cache.layers)
        )

    def load(self, prefill_cache, group: int, width: int) -> None:
        """Copy the B prefilled prompts (width ``width``) into rows b*G .. b*G+G-1 and point every layer at slot
        ``width``. A sliding layer's prefill kept only its last tokens: they go to the slots just before ``width``;
        the slots before them are outside every later query's window. Rows and slots not written keep stale, finite
        numbers that the attention mask hides."""
        for static, layer in zip(self.cache.layers, prefill_cache.layers):
            prompts, heads, kept, _ = layer.keys.shape
            for buffer, source in ((static.keys, layer.keys), (static.values, layer.values)):
                grouped = buffer[: prompts * group].view(prompts, group, heads, self.capacity, buffer.shape[-1])
                grouped[..., width - kept : width, :] = source[:, None]
            static.cumulative_length.fill_(width)
