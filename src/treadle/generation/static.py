"""The static decode step: one token of every row over a static KV cache, with input shapes that never change from
token to token, so that it can be compiled once per bucket (CUDA graphs on a GPU, inductor or eager on CPU).

Contract: :class:`BucketStep` is the step of one bucket -- the rows rounded up to a power of two, the cache capacity
(prompt width + max_new_tokens) rounded up to a power of two (:func:`bucket`) -- with its own :class:`StaticKV` and
input buffers, allocated once and reused by every later generation in the bucket. ``load`` copies a prefilled
prompt batch in; each call feeds the last sampled tokens of the live rows and returns their next-token logits.
Inside the step the new key is written at the cache's slot tensor (transformers' ``StaticLayer``: ``index_copy_``)
and attention reads the whole capacity under a mask built from the prompt mask, the slot and each layer's window.

:func:`static_decoder` keeps one :class:`StaticDecoder` per model (weakly, with its buckets) and counts the
compilations (``captures``): a run compiles at most once per bucket it meets. A bucket's KV cache stays allocated as
long as the model lives (a compiled step reads those very buffers): one rows x capacity cache per bucket met. The
weights are read in place: an optimizer step (in-place updates of the same parameters) needs no new capture.

What cannot run static, said once and sampled on the dynamic path instead (:func:`static_problem`): attention other
than "sdpa" or "eager", cache layers other than transformers' plain and sliding-window ones, mixed layer kinds
without ``config.layer_types``.

``STEP_COMPILE`` settings: "auto" (CUDA: "reduce-overhead"; elsewhere "eager", as transformers compiles a static
cache's step on accelerators only), "eager", "inductor" (``torch.compile``'s default mode), "reduce-overhead"
(CUDA graphs through ``torch.compile``).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from treadle.compilation import inductor_keywords
from treadle.generation.cache import StaticKV, attention_kind, static_cache_problem

__all__ = [
    "CACHE_IMPLEMENTATIONS",
    "STEP_COMPILE",
    "BucketStep",
    "DecodeSettings",
    "StaticDecoder",
    "bucket",
    "static_decoder",
    "static_problem",
    "warn_fallback",
]

CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")  # TRL's cache_implementation values the own sampler takes
STEP_COMPILE = ("auto", "eager", "inductor", "reduce-overhead")
SMALLEST_ROWS, SMALLEST_CAPACITY = 8, 64  # the smallest buckets: fewer shapes, little waste at these sizes
# dynamo's per-function recompile limit (8 by default) would fall back to eager after 8 buckets; every bucket is
# one more compiled graph of the same function, and powers of two bound them well below this
RECOMPILE_LIMIT = 128
# torch.compile's backend under decode_compile="inductor" (tests set dynamo's "eager" backend: the same graph capture,
# guards and recompilations, without generating code)
INDUCTOR_BACKEND = "inductor"


@dataclass(frozen=True)
class DecodeSettings:
    """How the own sampler's decode runs (not what it samples: that is ``SamplingParams``), validated once."""

    cache_implementation: str | None = None  # TRL's name: "static" for the static step, None / "dynamic": not
    decode_compile: str = "auto"  # the static step's compilation, one of STEP_COMPILE

    def __post_init__(self):
        if self.cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"cache_implementation={self.cache_implementation!r} is not supported by the own sampler; use "
                "'static' (a static KV cache, the decode step compiled once per bucket) or None (the dynamic cache)"
            )
        if self.decode_compile not in STEP_COMPILE:
            raise ValueError(f"decode_compile must be one of {STEP_COMPILE}, got {self.decode_compile!r}")

    @property
    def static(self) -> bool:
        return self.cache_implementation == "static"


def bucket(n: int, smallest: int) -> int:
    """``n`` rounded up to a power of two, at least ``smallest``."""
    size = smallest
    while size < n:
        size *= 2
    return size


def resolve_compile(step_compile: str, device: torch.device) -> str:
    if step_compile == "auto":
        return "reduce-overhead" if device.type == "cuda" else "eager"
    if step_compile == "reduce-overhead" and device.type != "cuda":
        raise ValueError("decode_compile='reduce-overhead' captures CUDA graphs: use 'inductor' or 'eager' on CPU")
    return step_compile


@dataclass(frozen=True)
class MaskSpec:
    """How the step's attention mask is laid out for one model: boolean (SDPA) or additive (eager attention) in
    ``dtype``; ``windows``: one per layer type in ``names`` order (None: full attention); ``names``: the keys of a
    mask per layer type (``config.layer_types``' values), or None for one mask tensor shared by every layer."""

    additive: bool
    dtype: torch.dtype
    windows: tuple[int | None, ...]
    names: tuple[str, ...] | None


def static_problem(model, prefill_cache) -> str | None:
    """Why ``model`` cannot decode over a static cache, or None."""
    kind = attention_kind(model)
    if kind not in ("sdpa", "eager"):
        return f"attention implementation {kind!r} (the static step builds SDPA and eager masks only)"
    problem = static_cache_problem(prefill_cache)
    if problem is None and len(set(_layer_windows(prefill_cache))) > 1:
        layer_types = getattr(model.config, "layer_types", None)
        if layer_types is None or len(layer_types) != len(prefill_cache.layers):
            problem = "its layers mix attention kinds and its config has no layer_types to key their masks"
    return problem


def _layer_windows(prefill_cache) -> list[int | None]:
    return [layer.sliding_window if getattr(layer, "is_sliding", False) else None for layer in prefill_cache.layers]


def mask_spec(model, prefill_cache, dtype: torch.dtype) -> MaskSpec:
    windows = _layer_windows(prefill_cache)
    additive = attention_kind(model) == "eager"
    if len(set(windows)) == 1:
        return MaskSpec(additive, dtype, (windows[0],), None)
    by_name = dict(zip(model.config.layer_types, windows))
    return MaskSpec(additive, dtype, tuple(by_name.values()), tuple(by_name))


def attention_masks(readable: Tensor, slot: Tensor, spec: MaskSpec):
    """The step's mask(s) from ``readable`` (R, C) bool: which slots each row may read with full attention."""
    cols = torch.arange(readable.shape[1], device=readable.device)
    masks = []
    for window in spec.windows:
        mask = readable if window is None else readable & (cols > slot - window)
        mask = mask[:, None, None, :]  # (R, 1, 1, C): one query per row
        if spec.additive:
            mask = torch.zeros(mask.shape, dtype=spec.dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(spec.dtype).min
            )
        masks.append(mask)
    return masks[0] if spec.names is None else dict(zip(spec.names, masks))


def decode_step(
    model, cache, cache_name: str, spec: MaskSpec, tokens: Tensor, valid: Tensor, lengths: Tensor, width: Tensor
) -> Tensor:
    """One decode step of every row of a bucket: ``tokens`` (R,) in, next-token logits (R, V) out.

    ``valid`` (R, C) marks each row's prompt tokens (False on left padding), ``lengths`` (R,) each prompt's length,
    ``width`` (0-d) the padded prompt width. The slot written now is the cache's own counter (layer 0's, read before
    any layer advances it); row r reads its prompt and every slot from ``width`` up to the new one."""
    slot = cache.layers[0].cumulative_length  # (0-d) tensor: no recompilation as it moves
    cols = torch.arange(valid.shape[1], device=valid.device)
    readable = valid | ((cols >= width) & (cols <= slot))[None, :]  # (R, C)
    out = model(
        input_ids=tokens[:, None],
        attention_mask=attention_masks(readable, slot, spec),
        position_ids=(lengths + (slot - width))[:, None],  # left padding: each prompt starts at position 0
        use_cache=True,
        **{cache_name: cache},
    )
    return out.logits[:, -1]


class BucketStep:
    """The decode step of one bucket: a static KV cache, the step's input buffers and its (compiled) function."""

    def __init__(self, model, prefill_cache, cache_name: str, rows: int, capacity: int, mode: str):
        self.kv = StaticKV(prefill_cache, rows, capacity)
        device = self.kv.cache.layers[0].keys.device
        self.spec = mask_spec(model, prefill_cache, self.kv.cache.layers[0].keys.dtype)
        self.cache_name, self.mode, self.captured = cache_name, mode, False
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.valid = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.width = torch.zeros((), dtype=torch.long, device=device)
        if mode == "reduce-overhead":  # fixed addresses: CUDA graphs read the inputs in place, no copy per replay
            for buffer in (self.tokens, self.valid, self.lengths, self.width):
                torch._dynamo.mark_static_address(buffer)
        if mode == "eager":
            self.function = decode_step
        else:
            if mode == "reduce-overhead":
                options = {"mode": "reduce-overhead"}
            else:  # the CPU code of the kernel set ATEN_CPU_CAPABILITY names (compilation.inductor_keywords)
                options = {"backend": INDUCTOR_BACKEND, **inductor_keywords(INDUCTOR_BACKEND, None)}
            self.function = torch.compile(decode_step, fullgraph=True, dynamic=False, **options)

    def load(self, prefill_cache, prompt_mask: Tensor, group: int) -> None:
        """Take a prefilled batch: B prompts (B, P) each repeated ``group`` times, rows past B*G idle."""
        width, rows = prompt_mask.shape[1], prompt_mask.shape[0] * group
        self.kv.load(prefill_cache, group, width)
        self.valid.zero_()
        self.valid[:rows, :width] = prompt_mask.bool().repeat_interleave(group, dim=0)
        self.lengths.zero_()
        self.lengths[:rows] = prompt_mask.sum(dim=1).repeat_interleave(group)
        self.width.fill_(width)

    def __call__(self, model, tokens: Tensor, row_ids: Tensor) -> Tensor:
        """Next-token logits (R, V) of rows ``row_ids`` (R,) after feeding them ``tokens`` (R,); rows not listed
        (finished, or past the batch) run too, on their last token, and are not read."""
        self.tokens.index_copy_(0, row_ids, tokens)
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs were consumed
        logits = self.function(
            model, self.kv.cache, self.cache_name, self.spec, self.tokens, self.valid, self.lengths, self.width
        )
        self.captured = self.mode != "eager"  # the first call compiled (and, on CUDA, captured) this bucket's step
        return logits.index_select(0, row_ids)  # a copy: a CUDA graph's output is overwritten by the next replay


class StaticDecoder:
    """A model's bucket steps, kept across generations."""

    def __init__(self, mode: str):
        self.mode, self.steps, self.replaced = mode, {}, 0

    @property
    def captures(self) -> int:
        """How many steps were compiled: one per bucket that decoded at least one token (eager: 0)."""
        return self.replaced + sum(step.captured for step in self.steps.values())

    def step(self, model, prefill_cache, cache_name: str, rows: int, capacity: int) -> BucketStep:
        key = (bucket(rows, SMALLEST_ROWS), bucket(capacity, SMALLEST_CAPACITY))
        step = self.steps.get(key)
        if step is None or not step.kv.fits(prefill_cache):  # new, or the model's cache changed (dtype, device)
            self.replaced += step is not None and step.captured
            step = self.steps[key] = BucketStep(model, prefill_cache, cache_name, *key, self.mode)
        return step

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around a generation's decode loop: compiled modes compile even inside the sampler's ``force_eager``
        stance (``engines.local.eager``, which keeps training's compiled blocks from recompiling per token)."""
        if self.mode == "eager":
            yield
            return
        with torch.compiler.set_stance("default"), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            yield


_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WARNED: set[str] = set()


def static_decoder(model, step_compile: str, device: torch.device) -> StaticDecoder:
    """The model's :class:`StaticDecoder` for this compile setting (a new one when the setting changed)."""
    mode = resolve_compile(step_compile, device)
    decoder = _DECODERS.get(model)
    if decoder is None or decoder.mode != mode:
        decoder = _DECODERS[model] = StaticDecoder(mode)
    return decoder


def warn_fallback(model, problem: str) -> None:
    """Say once per model class and reason that the static step is not used (never silently slower)."""
    message = f"cache_implementation='static' decodes {type(model).__name__} on the dynamic cache: {problem}"
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=4)
