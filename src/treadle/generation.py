"""Sampling G completions per prompt for online RL (GRPO), fast on CPU, with a transformers fallback.

Contract: :func:`generate_completions` takes B *distinct* prompts (token-id lists) and returns B*G rows, each
prompt repeated G times consecutively, as a :class:`GenerationOutput` (left-padded prompts, right-padded
completions, masks, truncation flags). The sampling distribution is transformers' ``generate``: the same
logits processors in the same order (repetition penalty, temperature, top-k, top-p), then softmax and
``torch.multinomial``.

How the fast path ("fast") beats ``model.generate(num_return_sequences=G)`` without changing the
distribution -- it avoids work rather than doing the same work faster:

1. Each distinct prompt is prefilled ONCE; its KV cache and its next-token logits are then repeated G times
   along the batch dimension. ``generate`` repeats the prompt first and prefills B*G rows, which for few-shot
   prompts (~100 tokens) and short completions (16-64 tokens) is a large share of the whole cost.
2. The KV cache is written into buffers allocated once for the whole completion (prompt + max_new_tokens),
   and attention reads a view of the filled part. transformers' ``DynamicCache`` concatenates the whole
   cache on every token, which on CPU costs more than the attention itself.
3. It stops as soon as every row has produced EOS, and rows that have finished are dropped from the batch
   (the cache is compacted once enough of them have finished to pay for the copy).
4. Only the last position's logits are computed at prefill, and the logits processors work on (rows, V)
   tensors with a per-row "seen tokens" mask for the repetition penalty, so nothing per token grows with
   the length of the history.

Departures from ``generate`` worth knowing: the fast path draws its random numbers in a different order
(fewer rows at prefill, finished rows dropped), so with the same seed it gives *different samples from the
same distribution*; greedy decoding (``do_sample=False``) gives the same tokens. The "hf" backend draws
from the global RNG, which is seeded from ``generator`` inside a forked RNG state when one is given.

A GPU backend (vLLM) plugs in at :func:`_run_backend`; see the comment there.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from treadle.models import causal_lm_problem, eval_mode, forward_signature, unwrapped_for_generation
from treadle.packing import position_ids
from treadle.text import eos_ids

__all__ = [
    "GenerationOutput",
    "MultiTurnOutput",
    "SamplingParams",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "completion_masks",
    "distinct_prompts",
    "generate_completions",
    "generate_turns",
    "pack_turns",
    "left_pad",
    "process_logits",
    "sample_next_tokens",
    "token_presence",
]

BACKENDS = ("auto", "fast", "hf")

# Drop finished rows once at least this fraction of the batch has finished. A compaction copies the cache of
# the remaining rows, about what one decoding step reads anyway, so waiting for 1/8 of the rows repays it
# within ~8 steps while still shedding dead rows early.
_SHRINK_FRACTION = 0.125


@dataclass
class GenerationOutput:
    """B*G sampled completions; row ``b*G + g`` is the g-th completion of prompt b."""

    prompt_ids: Tensor  # (B*G, P) left-padded with pad_token_id
    prompt_mask: Tensor  # (B*G, P) 1 on prompt tokens, 0 on padding
    completion_ids: Tensor  # (B*G, C) right-padded with pad_token_id, C <= max_new_tokens
    completion_mask: Tensor  # (B*G, C) 1 up to and including the first EOS, 0 after
    is_truncated: Tensor  # (B*G,) bool: no EOS within max_new_tokens


@dataclass(frozen=True)
class SamplingParams:
    """The sampling settings of one call, validated once; field meanings follow ``GenerationConfig``."""

    num_generations: int  # G completions per prompt
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]  # empty: never stop early, every row is truncated
    pad_token_id: int
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables
    top_k: int = 0  # keep the k most likely tokens; 0 disables
    repetition_penalty: float = 1.0  # CTRL penalty (Keskar et al. 2019); 1 disables
    do_sample: bool = True  # False: greedy (argmax after the repetition penalty)

    def __post_init__(self):
        checks = [
            (self.num_generations >= 1, f"num_generations must be >= 1, got {self.num_generations}; "
                                        "pass the number of completions wanted per prompt (e.g. 8)"),
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}; "
                                       "pass the longest completion length you accept (e.g. 64)"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable it"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}; use 0 to disable it"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}; "
                                            "use 1.0 to disable it"),
            (not self.do_sample or self.temperature > 0.0,
             f"temperature must be > 0 when sampling, got {self.temperature}; 1.0 samples the model as is "
             f"(generate_completions: do_sample=False decodes greedily)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# ---------------------------------------------------------------------------------------------------------
# Logits processors: pure functions on (N, V) float scores, in transformers' order.
# ---------------------------------------------------------------------------------------------------------

def token_presence(token_ids: Tensor, mask: Tensor, vocab_size: int) -> Tensor:
    """(N, V) bool: whether each vocabulary id occurs among the unmasked ``token_ids`` (N, T) of its row."""
    seen = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=token_ids.device)
    # Masked positions are sent to an extra column that is dropped, so padding never counts as seen.
    index = token_ids.masked_fill(mask == 0, vocab_size).clamp(max=vocab_size)  # (N, T)
    seen.scatter_(1, index, True)
    return seen[:, :vocab_size]


def apply_repetition_penalty(scores: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """Make already-seen tokens less likely: a positive score is divided by ``penalty``, a negative one multiplied.

    ``scores`` (N, V) are raw logits, ``seen`` (N, V) bool marks the tokens of the prompt (padding excluded) and
    of the completion so far, as transformers' ``RepetitionPenaltyLogitsProcessor`` does.
    """
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def apply_temperature(scores: Tensor, temperature: float) -> Tensor:
    """Divide the scores by ``temperature`` (> 1 flattens the distribution, < 1 sharpens it)."""
    return scores / temperature


def apply_top_k(scores: Tensor, top_k: int) -> Tensor:
    """Keep the ``top_k`` highest scores of each row (ties with the k-th are kept too); the rest become -inf."""
    k = min(top_k, scores.shape[-1])
    kth = torch.topk(scores, k, dim=-1).values[:, -1:]  # (N, 1)
    return scores.masked_fill(scores < kth, float("-inf"))


def apply_top_p(scores: Tensor, top_p: float) -> Tensor:
    """Nucleus filtering: drop the least likely tokens whose total probability is at most ``1 - top_p``.

    Equivalently, keep the smallest set of most likely tokens whose mass reaches ``top_p``. The most likely
    token is always kept.
    """
    ascending, order = torch.sort(scores, dim=-1)  # (N, V)
    mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)  # mass of this token and all less likely ones
    drop_sorted = mass_below <= 1.0 - top_p
    drop_sorted[:, -1] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def process_logits(logits: Tensor, params: SamplingParams, seen: Tensor | None = None) -> Tensor:
    """Turn next-token logits (N, V) into the float32 scores that are sampled from (or argmax-ed).

    Order as in transformers' ``generate``: repetition penalty, then (sampling only) temperature, top-k, top-p.
    ``seen`` (N, V) is required when ``params.repetition_penalty != 1``.
    """
    scores = logits.float()
    if params.repetition_penalty != 1.0:
        scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
    if not params.do_sample:
        return scores  # the warpers below never change the argmax, and generate skips them when greedy
    if params.temperature != 1.0:
        scores = apply_temperature(scores, params.temperature)
    if params.top_k > 0:
        scores = apply_top_k(scores, params.top_k)
    if params.top_p < 1.0:
        scores = apply_top_p(scores, params.top_p)
    return scores


def sample_next_tokens(scores: Tensor, do_sample: bool, generator: torch.Generator | None = None) -> Tensor:
    """(N,) next tokens from processed scores (N, V): a multinomial draw, or the argmax when greedy."""
    if not do_sample:
        return scores.argmax(dim=-1)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


# ---------------------------------------------------------------------------------------------------------
# Inputs and outputs.
# ---------------------------------------------------------------------------------------------------------

def distinct_prompts(prompt_ids: list[list[int]], group: int) -> tuple[list[list[int]], int]:
    """``(distinct prompts, completions per prompt)`` for rows that may hold whole groups: when every run of
    ``group`` rows repeats one prompt, each prompt once and ``group`` (the layout :func:`generate_completions`
    returns); otherwise every row's prompt and 1."""
    grouped = len(prompt_ids) % group == 0 and all(prompt_ids[i] == prompt_ids[i - i % group]
                                                   for i in range(len(prompt_ids)))
    return (prompt_ids[::group], group) if grouped else (prompt_ids, 1)


def left_pad(prompts: list[list[int]], pad_token_id: int, device: torch.device | str = "cpu"
             ) -> tuple[Tensor, Tensor]:
    """Stack token-id lists into (ids, mask), both (B, P), padded on the left so that every prompt ends at P-1."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def completion_masks(raw_ids: Tensor, eos_token_ids: tuple[int, ...], pad_token_id: int
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Cut raw completions (N, C) after their first EOS.

    Returns ``(completion_ids, completion_mask, is_truncated)``: ids with pad after the first EOS, the mask
    (1 up to and including the first EOS), and (N,) bool for rows without EOS. Trailing columns that are
    padding in every row are dropped, so C shrinks to the longest completion.
    """
    width = raw_ids.shape[1]
    if eos_token_ids:
        is_eos = torch.isin(raw_ids, torch.tensor(eos_token_ids, device=raw_ids.device))  # (N, C)
    else:
        is_eos = torch.zeros_like(raw_ids, dtype=torch.bool)
    is_truncated = ~is_eos.any(dim=1)
    # argmax finds the first True; rows without EOS keep every column.
    length = torch.where(is_truncated, width, is_eos.int().argmax(dim=1) + 1)  # (N,)
    completion_mask = (torch.arange(width, device=raw_ids.device)[None, :] < length[:, None]).long()
    completion_ids = raw_ids.masked_fill(completion_mask == 0, pad_token_id)
    keep = int(length.max()) if length.numel() else 0
    return completion_ids[:, :keep], completion_mask[:, :keep], is_truncated


# ---------------------------------------------------------------------------------------------------------
# The public entry point.
# ---------------------------------------------------------------------------------------------------------

def generate_completions(model, prompts: list[list[int]], *, num_generations: int, max_new_tokens: int,
                         eos_token_id: int | list[int] | None, pad_token_id: int, temperature: float = 1.0,
                         top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0,
                         do_sample: bool = True, generator: torch.Generator | None = None,
                         backend: str = "auto") -> GenerationOutput:
    """Sample ``num_generations`` completions for each of the distinct ``prompts``.

    Runs under ``torch.no_grad()`` with the model in eval mode and restores every submodule's train/eval mode
    afterwards. A DDP-wrapped model is unwrapped (generation runs no backward, so no gradient sync is needed),
    an FSDP2 model has its parameters gathered for the whole call (see ``treadle.models.unwrapped_for_generation``).

    ``backend``: "fast" (prefill once, shared preallocated KV cache; transformers causal LMs only), "hf"
    (``model.generate`` with ``num_return_sequences=G``) or "auto" (fast when the model supports it, else hf).
    ``eos_token_id=None`` never stops early. ``generator`` (on the model's device) makes sampling reproducible.

    Raises ValueError for bad arguments, and when the chosen backend cannot run this model.
    """
    params = SamplingParams(num_generations=num_generations, max_new_tokens=max_new_tokens,
                            eos_token_ids=eos_ids(eos_token_id), pad_token_id=pad_token_id,
                            temperature=temperature, top_p=top_p, top_k=top_k,
                            repetition_penalty=repetition_penalty, do_sample=do_sample)
    _check_prompts(prompts)
    with unwrapped_for_generation(model) as inner, eval_mode(model), torch.no_grad():
        name = _resolve_backend(backend, inner)
        prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, _model_device(inner))
        raw_ids = _run_backend(name, inner, prompt_ids, prompt_mask, params, generator)
    completion_ids, completion_mask, is_truncated = completion_masks(raw_ids, params.eos_token_ids, pad_token_id)
    return GenerationOutput(
        prompt_ids=prompt_ids.repeat_interleave(num_generations, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(num_generations, dim=0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        is_truncated=is_truncated,
    )


def _check_prompts(prompts) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists, one per distinct prompt")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. a BOS token)")


def _run_backend(name: str, model, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> Tensor:
    """Dispatch to a backend; each returns raw completion ids (B*G, C<=max_new_tokens), EOS not yet cut.

    Seam for a GPU inference engine: a vLLM backend would be one more ``if name == "vllm"`` branch here,
    calling a ``_generate_vllm(model, prompt_ids, prompt_mask, params, generator)`` with the same contract
    (weights synced from ``model`` before sampling), plus "vllm" in ``BACKENDS`` and in ``_resolve_backend``.
    """
    if name == "fast":
        return _generate_fast(model, prompt_ids, prompt_mask, params, generator)
    if name == "hf":
        return _generate_hf(model, prompt_ids, prompt_mask, params, generator)
    raise AssertionError(f"unresolved backend {name!r}")  # _resolve_backend only returns the names above


def _resolve_backend(backend: str, model) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    problem = _fast_path_problem(model)
    if backend == "fast" and problem:
        raise ValueError(f"backend='fast' cannot run this model: {problem}. Use backend='hf' or 'auto'.")
    if backend == "fast" or (backend == "auto" and not problem):
        return "fast"
    if not callable(getattr(model, "generate", None)):
        raise ValueError(f"{type(model).__name__} cannot generate: the fast path refuses it ({problem}) and it "
                         "has no `generate` method. Pass a transformers causal LM (e.g. LlamaForCausalLM).")
    if backend == "auto":  # the architecture matrix (tests/test_architectures.py) lists who takes the fast path
        warnings.warn(f"generation_backend='auto' uses 'hf' for {type(model).__name__}: {problem}", stacklevel=4)
    return "hf"


def _fast_path_problem(model) -> str | None:
    """Why the fast path cannot run ``model``, or None when it can."""
    problem = causal_lm_problem(model)
    if problem is not None:
        return problem
    signature = forward_signature(model)
    if _cache_argument(model) is None or "position_ids" not in signature or "attention_mask" not in signature:
        return "its forward() does not take a KV cache, position_ids and attention_mask"
    return None


def _cache_argument(model) -> str | None:
    """The forward() keyword for the KV cache: ``cache`` in transformers >= 5.x, ``past_key_values`` before."""
    signature = forward_signature(model)
    return next((name for name in ("cache", "past_key_values") if name in signature), None)


def _model_device(model) -> torch.device:
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------
# Backend "hf": transformers generate.
# ---------------------------------------------------------------------------------------------------------

def _generate_hf(model, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> Tensor:
    """``model.generate`` with a GenerationConfig built from ``params`` only.

    The model's own ``generation_config`` is set aside for the call: transformers fills every unset field
    from it (e.g. its eos_token_id, top_k=50), which would change the distribution behind our back.
    """
    from transformers import GenerationConfig

    group, sampling = params.num_generations, {}
    if params.do_sample:
        sampling = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                        num_return_sequences=group)
    else:  # generate refuses num_return_sequences > 1 when greedy; G identical rows give the same result
        prompt_ids, prompt_mask = (t.repeat_interleave(group, dim=0) for t in (prompt_ids, prompt_mask))
    config = GenerationConfig(
        max_new_tokens=params.max_new_tokens, do_sample=params.do_sample,
        repetition_penalty=params.repetition_penalty, eos_token_id=list(params.eos_token_ids) or None,
        pad_token_id=params.pad_token_id, **sampling)
    saved_config = getattr(model, "generation_config", None)
    if saved_config is not None:
        model.generation_config = GenerationConfig()
    try:
        with _global_rng_from(generator, prompt_ids.device):
            sequences = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
    finally:
        if saved_config is not None:
            model.generation_config = saved_config
    return sequences[:, prompt_ids.shape[1]:]


@contextlib.contextmanager
def _global_rng_from(generator: torch.Generator | None, device: torch.device) -> Iterator[None]:
    """``generate`` samples from the global RNG: seed it from ``generator`` and restore it afterwards."""
    if generator is None:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


# ---------------------------------------------------------------------------------------------------------
# Backend "fast": prefill once, shared preallocated KV cache, early exit.
# ---------------------------------------------------------------------------------------------------------

def _generate_fast(model, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams,
                   generator: torch.Generator | None) -> Tensor:
    """Decode all B*G rows together; returns raw ids (B*G, max_new_tokens), pad where a row stopped early."""
    group, width = params.num_generations, prompt_ids.shape[1]
    cache_name = _cache_argument(model)
    logits, cache = _prefill(model, prompt_ids, prompt_mask, cache_name)
    all_preallocated = _expand_cache(cache, group, capacity=width + params.max_new_tokens)

    state = _DecodeState.start(prompt_ids, prompt_mask, logits, params,
                               four_d_mask=all_preallocated and _attention_kind(model) == "sdpa")
    for step in range(params.max_new_tokens):
        next_tokens = sample_next_tokens(process_logits(state.logits, params, state.seen), params.do_sample,
                                         generator)
        state.record(step, next_tokens)
        unfinished = int(state.unfinished.sum())  # the one host sync per token: the price of stopping early
        if step == params.max_new_tokens - 1 or unfinished == 0:
            break
        state.drop_finished_rows(cache, unfinished)
        out = model(**{cache_name: cache}, input_ids=state.next_tokens[:, None],
                    attention_mask=state.attention_mask[..., :width + step + 1],
                    position_ids=state.positions[:, None], use_cache=True)
        state.logits = out.logits[:, -1]
        state.positions += 1
    return state.completion


def _prefill(model, prompt_ids: Tensor, prompt_mask: Tensor, cache_name: str):
    """Run the B distinct prompts once; returns last-position logits (B, V) and the filled cache."""
    positions = position_ids(prompt_mask)  # left padding shifts each prompt to start at 0
    kwargs = {}
    signature = forward_signature(model)
    for keep_name in ("logits_to_keep", "num_logits_to_keep"):  # skip the (B, P, V) logits we never read
        if keep_name in signature:
            kwargs[keep_name] = 1
            break
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                **kwargs)
    cache = out[cache_name] if cache_name in out else out["past_key_values"]
    return out.logits[:, -1], cache


@dataclass
class _DecodeState:
    """Per-row decoding state; "rows" are the still-active rows, ``row_ids`` their index in the output."""

    logits: Tensor  # (R, V) next-token logits
    seen: Tensor | None  # (R, V) bool tokens so far, for the repetition penalty (None when disabled)
    attention_mask: Tensor  # (R, P + max_new_tokens) prompt mask then ones, or (R, 1, 1, P + max_new_tokens) bool
    positions: Tensor  # (R,) position id of the token fed next
    row_ids: Tensor  # (R,) output row of each active row
    unfinished: Tensor  # (R,) bool
    next_tokens: Tensor  # (R,) last sampled tokens
    completion: Tensor  # (B*G, max_new_tokens) output buffer, pad-filled
    eos: Tensor | None  # (E,) EOS ids, None: never stop early

    @classmethod
    def start(cls, prompt_ids: Tensor, prompt_mask: Tensor, logits: Tensor, params: SamplingParams,
              four_d_mask: bool = False):
        group, device = params.num_generations, prompt_ids.device
        rows = prompt_ids.shape[0] * group
        seen = None
        if params.repetition_penalty != 1.0:
            seen = token_presence(prompt_ids, prompt_mask, logits.shape[-1]).repeat_interleave(group, dim=0)
        attention_mask = torch.ones(rows, prompt_ids.shape[1] + params.max_new_tokens, dtype=prompt_mask.dtype,
                                    device=device)
        attention_mask[:, :prompt_ids.shape[1]] = prompt_mask.repeat_interleave(group, dim=0)
        if four_d_mask:
            # A one-token query may attend to every non-padding key, so the (R, 1, 1, T) boolean padding mask
            # is the whole attention mask; transformers passes a 4-D mask through to SDPA untouched, which
            # spares rebuilding it from the 2-D mask on every token (~10% of a tiny model's step). Only for
            # SDPA (eager wants an additive float mask) and only when no layer is sliding-window (checked by
            # the caller), since the window would otherwise be lost.
            attention_mask = attention_mask.bool()[:, None, None, :]
        return cls(
            logits=logits.repeat_interleave(group, dim=0),
            seen=seen,
            attention_mask=attention_mask,
            positions=prompt_mask.sum(dim=1).repeat_interleave(group, dim=0),
            row_ids=torch.arange(rows, device=device),
            unfinished=torch.ones(rows, dtype=torch.bool, device=device),
            next_tokens=torch.empty(0),
            completion=torch.full((rows, params.max_new_tokens), params.pad_token_id, dtype=torch.long,
                                  device=device),
            eos=torch.tensor(params.eos_token_ids, device=device) if params.eos_token_ids else None,
        )

    def record(self, step: int, next_tokens: Tensor) -> None:
        # Rows that finished but were not dropped yet keep sampling; their tokens land after their EOS, where
        # completion_masks() overwrites them with pad.
        self.next_tokens = next_tokens
        self.completion[self.row_ids, step] = next_tokens
        if self.eos is not None:
            self.unfinished &= ~torch.isin(next_tokens, self.eos)
        if self.seen is not None:
            self.seen[torch.arange(len(next_tokens), device=next_tokens.device), next_tokens] = True

    def drop_finished_rows(self, cache, unfinished: int) -> None:
        finished = len(self.unfinished) - unfinished
        if finished == 0 or finished < _SHRINK_FRACTION * len(self.unfinished):
            return
        keep = self.unfinished.nonzero().squeeze(1)
        cache.batch_select_indices(keep)
        for name in ("seen", "attention_mask", "positions", "row_ids", "unfinished", "next_tokens"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[keep])


def _expand_cache(cache, group: int, capacity: int) -> bool:
    """Repeat each prompt's cache ``group`` times along the batch, into buffers that hold ``capacity`` tokens.

    Plain attention layers (transformers' ``DynamicLayer``) are swapped for preallocated ones; any other
    layer kind (sliding window, linear attention) is only repeated and keeps its own update rule.
    Returns whether every layer is now a preallocated full-attention layer.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:  # a cache without per-layer objects: repeat only, it keeps growing by concatenation
        cache.batch_repeat_interleave(group)
        return False
    from transformers.cache_utils import DynamicLayer

    preallocated = _preallocated_layer_class()
    for index, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized:
            layers[index] = preallocated(layer.keys, layer.values, group, capacity)
        else:
            layer.batch_repeat_interleave(group)
    return all(isinstance(layer, preallocated) for layer in layers)


def _attention_kind(model) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


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
        keys, values = self._key_buffer[indices, :, :self._length], self._value_buffer[indices, :, :self._length]
        capacity = self._key_buffer.shape[2]
        self._key_buffer = keys.new_empty(len(indices), keys.shape[1], capacity, keys.shape[3])
        self._value_buffer = values.new_empty(len(indices), values.shape[1], capacity, values.shape[3])
        self._key_buffer[:, :, :self._length] = keys
        self._value_buffer[:, :, :self._length] = values
        self._set_length(self._length)

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self._key_buffer.shape[0], device=self.device)
                                  .repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self._set_length(self._length + tokens_to_remove)

    def reset(self) -> None:
        self._set_length(0)


@functools.lru_cache(maxsize=None)
def _preallocated_layer_class():
    """Built on first use so that importing this module does not import transformers."""
    from transformers.cache_utils import DynamicLayer

    return type("PreallocatedLayer", (_PreallocatedLayerMixin, DynamicLayer), {})


# ---------------------------------------------------------------------------------------------------------
# Multi-turn sampling: one KV cache kept across turns (used by treadle.rollouts).
# ---------------------------------------------------------------------------------------------------------

@dataclass
class MultiTurnOutput(GenerationOutput):
    """A :class:`GenerationOutput` whose completions interleave sampled turns with fed (environment) tokens."""

    sampled_mask: Tensor  # (B*G, C) 1 on tokens the model sampled, 0 on fed tokens and padding
    sampled_logps: Tensor | None  # (B*G, C) each sampled token's log-prob (processed scores), else 0; None: not kept


# respond(row, turn_ids) -> Future or value: the tokens to feed after the turn, or None when the rollout is over
Respond = Callable[[int, list[int]], "Future | list[int] | None"]


def generate_turns(model, prompts: list[list[int]], respond: Respond, *, num_generations: int,
                   max_new_tokens: int, eos_token_id: int | list[int] | None, pad_token_id: int,
                   temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, repetition_penalty: float = 1.0,
                   do_sample: bool = True, generator: torch.Generator | None = None) -> MultiTurnOutput:
    """Multi-turn sampling on the fast path, with each row's KV cache kept across turns.

    Rows are laid out as in :func:`generate_completions` (prompt b's rollouts are rows b*G .. b*G+G-1). A
    model turn ends at EOS; then ``respond(row, turn_ids)`` is called (``turn_ids``: the turn's tokens, EOS
    included) and returns, now or as a ``concurrent.futures.Future``, the token ids to feed next (an
    environment's observation, maybe empty) or None when the rollout is over. Fed tokens go through the same
    batched forward as sampled ones, one per step, so only the new tokens are prefilled, never the transcript;
    a row whose future is not done yet sits out (a masked column) while the other rows keep sampling.
    ``max_new_tokens`` bounds sampled plus fed tokens per row: a turn cut by it, or an observation that does
    not fit (then dropped, as TRL does), marks the row truncated. Raises ValueError for a model the fast path
    cannot run (``treadle.rollouts`` then re-prefills each turn through ``generate_completions``).
    """
    params = SamplingParams(num_generations=num_generations, max_new_tokens=max_new_tokens,
                            eos_token_ids=eos_ids(eos_token_id), pad_token_id=pad_token_id,
                            temperature=temperature, top_p=top_p, top_k=top_k,
                            repetition_penalty=repetition_penalty, do_sample=do_sample)
    _check_prompts(prompts)
    with unwrapped_for_generation(model) as inner, eval_mode(model), torch.no_grad():
        _resolve_backend("fast", inner)
        prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, _model_device(inner))
        rows = _decode_turns(inner, prompt_ids, prompt_mask, params, respond, generator)
    return pack_turns(prompt_ids, prompt_mask, num_generations, rows.tokens, rows.sampled, rows.truncated,
                      pad_token_id, rows.logps)


def pack_turns(prompt_ids: Tensor, prompt_mask: Tensor, group: int, tokens: list[list[int]],
               sampled: list[list[int]], truncated: list[bool], pad_token_id: int,
               logps: list[list[float]] | None = None) -> MultiTurnOutput:
    """A MultiTurnOutput from the distinct prompts (B, P) and each row's completion tokens, sampled flags,
    truncation and (optionally) sampled-token log-probs, right-padded."""
    device = prompt_ids.device
    width = max(1, max(len(t) for t in tokens))
    ids = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
    mask, sampled_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    logp_tensor = torch.zeros(ids.shape, dtype=torch.float32)
    for row, (t, s) in enumerate(zip(tokens, sampled)):
        ids[row, :len(t)] = torch.as_tensor(t, dtype=torch.long)
        mask[row, :len(t)] = 1
        sampled_mask[row, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        if logps is not None:
            logp_tensor[row, :len(logps[row])] = torch.as_tensor(logps[row], dtype=torch.float32)
    return MultiTurnOutput(prompt_ids=prompt_ids.repeat_interleave(group, dim=0),
                           prompt_mask=prompt_mask.repeat_interleave(group, dim=0),
                           completion_ids=ids.to(device), completion_mask=mask.to(device),
                           is_truncated=torch.tensor(truncated, device=device), sampled_mask=sampled_mask.to(device),
                           sampled_logps=logp_tensor.to(device) if logps is not None else None)


_SAMPLE, _FEED, _WAIT, _DONE = range(4)


class _TurnRows:
    """Host-side state of every output row: its mode, its tokens so far, what it waits for or feeds next."""

    def __init__(self, rows: int, params: SamplingParams, respond: Respond):
        self.params, self.respond = params, respond
        self.mode = [_SAMPLE] * rows
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.sampled: list[list[int]] = [[] for _ in range(rows)]
        self.logps: list[list[float]] = [[] for _ in range(rows)]
        self.turn_start = [0] * rows
        self.pending: dict[int, Any] = {}  # row -> Future of its observation
        self.queue: dict[int, list[int]] = {}  # row -> observation tokens still to feed
        self.truncated = [False] * rows

    def emit(self, row: int, sampled_token: int, logp: float) -> list[int]:
        """The token row ``row`` adds this sampling step: its sampled token, or none unless it is sampling."""
        if self.mode[row] != _SAMPLE:
            return []
        self.tokens[row].append(sampled_token)
        self.sampled[row].append(1)
        self.logps[row].append(logp)
        if sampled_token in self.params.eos_token_ids:
            turn = self.tokens[row][self.turn_start[row]:]
            self.pending[row], self.mode[row] = self.respond(row, turn), _WAIT
        elif len(self.tokens[row]) >= self.params.max_new_tokens:
            self.finish(row, truncated=True)
        return [sampled_token]

    def feed(self, row: int) -> list[int]:
        """The observation row ``row`` adds now (all of it); the row then samples its next turn."""
        tokens = self.queue.pop(row)
        self.tokens[row] += tokens
        self.sampled[row] += [0] * len(tokens)
        self.logps[row] += [0.0] * len(tokens)
        self.start_turn(row)
        return tokens

    def start_turn(self, row: int) -> None:
        self.queue.pop(row, None)
        self.mode[row], self.turn_start[row] = _SAMPLE, len(self.tokens[row])
        if len(self.tokens[row]) >= self.params.max_new_tokens:
            self.finish(row, truncated=True)

    def finish(self, row: int, truncated: bool) -> None:
        self.mode[row], self.truncated[row] = _DONE, truncated

    def collect(self, block: bool) -> None:
        """Move rows whose observation has arrived to feeding it (or to done); ``block``: wait for at least one."""
        if block and self.pending:
            futures.wait([f for f in self.pending.values() if isinstance(f, Future)],
                         return_when=futures.FIRST_COMPLETED)
        for row, value in list(self.pending.items()):
            if isinstance(value, Future):
                if not value.done():
                    continue
                value = value.result()
            del self.pending[row]
            if value is None:
                self.finish(row, truncated=False)
            elif len(self.tokens[row]) + len(value) >= self.params.max_new_tokens:
                self.finish(row, truncated=True)  # no room for the observation and a reply: drop it
            elif value:
                self.mode[row], self.queue[row] = _FEED, list(value)
            else:
                self.start_turn(row)


# Observations are prefilled in a separate forward of the rows that have one ready. A row waits (costing nothing)
# until enough rows are ready to share that forward: a quarter of the active rows, or every row not waiting.
_FEED_FRACTION = 0.25


def _decode_turns(model, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams, respond: Respond,
                  generator: torch.Generator | None) -> _TurnRows:
    """The multi-turn decode loop; returns every row's tokens, sampled flags, log-probs and truncation.

    Each iteration: collect the observations that have arrived; if enough rows have one, prefill them in one
    forward of those rows only; then one sampling step of every row (a row that waits or is done adds nothing).
    """
    decoder = _RaggedDecoder(model, prompt_ids, prompt_mask, params)
    rows = _TurnRows(len(decoder.state.row_ids), params, respond)
    draws = _RowDraws(len(rows.mode), params, generator, decoder.device)
    while True:
        row_ids = decoder.state.row_ids.tolist()
        modes = [rows.mode[r] for r in row_ids]
        active = sum(m != _DONE for m in modes)
        if not active:
            break
        rows.collect(block=all(m in (_WAIT, _DONE) for m in modes))
        modes = [rows.mode[r] for r in row_ids]
        ready = [i for i, m in enumerate(modes) if m == _FEED]
        if ready and (len(ready) >= _FEED_FRACTION * active or _SAMPLE not in modes):
            decoder.forward([rows.feed(row_ids[i]) for i in ready], subset=ready)
        if _SAMPLE not in [rows.mode[r] for r in row_ids]:
            continue
        state = decoder.state
        scores = process_logits(state.logits, params, state.seen)
        sampled = draws.sample(scores, row_ids, [len(rows.tokens[r]) for r in row_ids])
        logps = scores.log_softmax(dim=-1).gather(1, sampled[:, None]).squeeze(1)
        added = [rows.emit(r, t, lp) for r, t, lp in zip(row_ids, sampled.tolist(), logps.tolist())]
        keep = [i for i, r in enumerate(row_ids) if rows.mode[r] != _DONE]
        if not keep:
            break
        if len(keep) < (1 - _SHRINK_FRACTION) * len(row_ids):  # enough rows finished to pay for a compaction
            decoder.compact(torch.tensor(keep, device=decoder.device))
            added = [added[i] for i in keep]
        if any(added):  # else the rows that sampled have all finished and the others wait: nothing to run
            decoder.forward(added)
    return rows


class _RowDraws:
    """The random numbers of multi-turn sampling, one uniform per (row, position in its completion), drawn from
    ``generator`` up front: which token a row samples at a position does not depend on which other rows were
    sampling at that step, so a rollout whose tool answered a step later samples the same tokens (reproducible
    whatever the threads' timing). A token is drawn by inverting its row's cumulative distribution, which is
    exactly the categorical distribution of the scores; greedy decoding takes the argmax."""

    def __init__(self, rows: int, params: SamplingParams, generator: torch.Generator | None, device):
        self.do_sample = params.do_sample
        where = generator.device if generator is not None else device
        self.uniforms = (torch.rand((rows, params.max_new_tokens), generator=generator, device=where).to(device)
                         if self.do_sample else None)

    def sample(self, scores: Tensor, rows: list[int], positions: list[int]) -> Tensor:
        """(N,) tokens from processed scores (N, V) of output ``rows`` at ``positions`` in their completions.
        Rows that are not sampling (waiting, done: maybe at the end of their budget) get a draw too, which
        nobody reads."""
        if not self.do_sample:
            return scores.argmax(dim=-1)
        last = self.uniforms.shape[1] - 1
        u = self.uniforms[rows, [min(p, last) for p in positions]]  # (N,)
        cdf = scores.float().softmax(dim=-1).cumsum(dim=-1)  # (N, V)
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        return tokens.clamp(max=scores.shape[-1] - 1)  # right=True: never a token of probability 0


class _RaggedDecoder:
    """The batch's KV cache (ragged: row r writes its new keys at its own next slot, so a waiting row costs no
    columns) with the per-row state; ``forward`` runs some rows' new tokens through the model."""

    def __init__(self, model, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams):
        group, width, self.device = params.num_generations, prompt_ids.shape[1], prompt_ids.device
        self.model, self.cache_name, self.pad = model, _cache_argument(model), params.pad_token_id
        logits, self.cache = _prefill(model, prompt_ids, prompt_mask, self.cache_name)
        self.capacity = width + params.max_new_tokens + 1  # the last slot takes the padding of ragged writes
        if not _expand_cache(self.cache, group, capacity=self.capacity):
            raise ValueError("multi-turn sampling with a kept KV cache needs plain full-attention layers; "
                             "use treadle.rollouts.reprefill_turns (generation_backend='hf') for this model")
        self.writes = _RaggedWrites.attach(self.cache)
        self.state = _DecodeState.start(prompt_ids, prompt_mask, logits, params)
        self.valid = torch.zeros(len(self.state.row_ids), self.capacity, dtype=torch.bool, device=self.device)
        self.valid[:, :width] = prompt_mask.bool().repeat_interleave(group, dim=0)  # slots holding a token
        self.slots = torch.full_like(self.state.positions, width)  # (R,) next free slot of each row
        self.dtype = _model_dtype(model)

    def compact(self, keep: Tensor) -> None:
        self.cache.batch_select_indices(keep)
        for name in ("seen", "positions", "row_ids", "logits"):
            if getattr(self.state, name) is not None:
                setattr(self.state, name, getattr(self.state, name)[keep])
        self.valid, self.slots = self.valid[keep], self.slots[keep]

    def forward(self, added: list[list[int]], subset: list[int] | None = None) -> None:
        """Run ``added[i]`` (maybe empty) through the model for row ``subset[i]`` (default: row i of all)."""
        state, device = self.state, self.device
        rows = torch.arange(len(added), device=device) if subset is None else torch.tensor(subset, device=device)
        step = max(len(a) for a in added)
        inputs = torch.tensor([a + [self.pad] * (step - len(a)) for a in added], device=device)  # (r, k)
        lengths = torch.tensor([len(a) for a in added], device=device)  # (r,)
        offsets = torch.arange(step, device=device)[None, :]
        real = offsets < lengths[:, None]  # (r, k)
        if state.seen is not None:
            state.seen[rows] |= token_presence(inputs, real, state.seen.shape[1])
        index = (self.slots[rows, None] + offsets).clamp(max=self.capacity - 1)  # (r, k) where new keys go
        self.valid[rows[:, None].expand_as(index)[real], index[real]] = True
        span = int((self.slots[rows] + step).clamp(max=self.capacity).max())
        readable = self.valid[rows, None, :span] & (torch.arange(span, device=device)[None, None, :]
                                                    <= index[:, :, None])  # (r, k, T)
        mask = torch.zeros(readable.shape, dtype=self.dtype, device=device).masked_fill(
            ~readable, torch.finfo(self.dtype).min)[:, None]  # (r, 1, k, T) additive: eager and SDPA read it alike
        self.writes.rows, self.writes.index, self.writes.span = (None if subset is None else rows), index, span
        out = self.model(**{self.cache_name: self.cache}, input_ids=inputs, attention_mask=mask,
                         position_ids=state.positions[rows, None] + offsets, use_cache=True)
        last = out.logits[torch.arange(len(added), device=device), (lengths - 1).clamp(min=0)]  # (r, V)
        # a row that added nothing keeps the logits of its last real token (its next step may sample from them)
        state.logits[rows] = torch.where(lengths[:, None] > 0, last.to(state.logits.dtype), state.logits[rows])
        state.positions[rows] += lengths
        self.slots[rows] += lengths


def _model_dtype(model) -> torch.dtype:
    param = next(iter(model.parameters()), None)
    return param.dtype if param is not None else torch.float32


class _RaggedWrites:
    """Where each row's new keys go in this step, shared by every layer of one cache (set by the decode loop)."""

    rows: Tensor | None  # (r,) the rows of this forward; None: all
    index: Tensor  # (r, k) slot of each new key; padding goes to the last, never-read slot
    span: int  # slots that attention reads this step

    @classmethod
    def attach(cls, cache) -> "_RaggedWrites":
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
            return self._key_buffer[:, :, :self.writes.span], self._value_buffer[:, :, :self.writes.span]
        return self._key_buffer[subset, :, :self.writes.span], self._value_buffer[subset, :, :self.writes.span]

    def clear_unfilled(self) -> None:
        # Slots a row has not written yet are read (with zero weight) by rows that have: they must hold numbers,
        # not the garbage of an empty buffer, since 0 * NaN is NaN.
        self._key_buffer[:, :, self._length:] = 0
        self._value_buffer[:, :, self._length:] = 0

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self.clear_unfilled()


@functools.lru_cache(maxsize=None)
def _ragged_layer_class():
    return type("RaggedLayer", (_RaggedLayerMixin, _preallocated_layer_class()), {})
