"""Single-turn sampling: G completions per prompt for online RL (GRPO), fast on CPU, with a transformers fallback.

Contract: :func:`sample_completions` takes B *distinct* prompts (token-id lists) and one
:class:`~treadle.generation.sampling.SamplingParams` and returns B*G rows, each prompt repeated G times
consecutively, as a :class:`GenerationOutput` (left-padded prompts, right-padded completions, masks, truncation
flags, and each sampled token's log-prob under the distribution it was drawn from).
:func:`generate_completions` is the same call with the settings as keywords. The sampling distribution is
transformers' ``generate`` (``generation.sampling``).

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

A GPU engine (vLLM) plugs in as a rollout engine (``treadle.engines``), not as a backend here.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from treadle.generation.cache import attention_kind, expand_cache, prefill
from treadle.generation.head import plain_head, sliced_head
from treadle.generation.sampling import (
    SamplingParams,
    process_logits,
    reused,
    sample_next_tokens,
    sampled_logps,
    token_presence,
)
from treadle.generation.static import DecodeSettings, static_decoder, static_problem, warn_fallback
from treadle.models import cache_argument, causal_lm_problem, eval_mode, forward_signature, unwrapped_for_generation

__all__ = [
    "BACKENDS",
    "GenerationOutput",
    "check_prompts",
    "completion_masks",
    "distinct_prompts",
    "fast_path_problem",
    "generate_completions",
    "left_pad",
    "model_device",
    "positions_need_images",
    "resolve_backend",
    "sample_completions",
]

BACKENDS = ("auto", "fast", "hf")

# Drop finished rows once at least this fraction of the batch has finished. A compaction copies the cache of
# the remaining rows, about what one decoding step reads anyway, so waiting for 1/8 of the rows repays it
# within ~8 steps while still shedding dead rows early.
SHRINK_FRACTION = 0.125
DYNAMIC = DecodeSettings()  # the default decode: the dynamic (preallocated, growing-view) cache, no compiled step


@dataclass
class GenerationOutput:
    """B*G sampled completions; row ``b*G + g`` is the g-th completion of prompt b."""

    prompt_ids: Tensor  # (B*G, P) left-padded with pad_token_id
    prompt_mask: Tensor  # (B*G, P) 1 on prompt tokens, 0 on padding
    completion_ids: Tensor  # (B*G, C) right-padded with pad_token_id, C <= max_new_tokens
    completion_mask: Tensor  # (B*G, C) 1 up to and including the first EOS, 0 after
    is_truncated: Tensor  # (B*G,) bool: no EOS within max_new_tokens
    # (B*G, C) float32 log-prob of each sampled token under the processed scores it was drawn from, 0 on padding;
    # None: the sampler did not say (a replacement ``generate`` that returns fixed completions)
    sampling_logps: Tensor | None = None


def distinct_prompts(prompt_ids: list[list[int]], group: int) -> tuple[list[list[int]], int]:
    """``(distinct prompts, completions per prompt)`` for rows that may hold whole groups: when every run of
    ``group`` rows repeats one prompt, each prompt once and ``group`` (the layout :func:`generate_completions`
    returns); otherwise every row's prompt and 1."""
    grouped = len(prompt_ids) % group == 0 and all(
        prompt_ids[i] == prompt_ids[i - i % group] for i in range(len(prompt_ids))
    )
    return (prompt_ids[::group], group) if grouped else (prompt_ids, 1)


def left_pad(prompts: list[list[int]], pad_token_id: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Stack token-id lists into (ids, mask), both (B, P), padded on the left so that every prompt ends at P-1."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def completion_masks(
    raw_ids: Tensor, eos_token_ids: tuple[int, ...], pad_token_id: int
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
# The public entry points.
# ---------------------------------------------------------------------------------------------------------


def sample_completions(
    model,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    backend: str = "auto",
    prompt_inputs: dict | None = None,
    decode: DecodeSettings | None = None,
) -> GenerationOutput:
    """Sample ``params.num_generations`` completions for each of the distinct ``prompts`` (token-id lists).

    Runs under ``torch.no_grad()`` with the model in eval mode and restores every submodule's train/eval mode
    afterwards. A DDP-wrapped model is unwrapped (generation runs no backward, so no gradient sync is needed),
    an FSDP2 model has its parameters gathered for the whole call (see ``treadle.models.unwrapped_for_generation``).

    ``backend``: "fast" (prefill once, shared preallocated KV cache; transformers causal LMs only), "hf"
    (``model.generate`` with ``num_return_sequences=G``) or "auto" (fast when the model supports it, else hf).
    ``generator`` (on the model's device) makes sampling reproducible. Raises ValueError for bad prompts, and
    when the chosen backend cannot run this model.

    ``prompt_inputs``: what else the B prompts' forward takes (a VLM's ``pixel_values``, ``image_grid_thw`` ...,
    as its processor made them for the left-padded prompts): the fast path puts them in the prefill only; a model
    whose positions depend on the images (M-RoPE, ``positions_need_images``) samples through "hf" instead.

    ``decode``: how the decode runs (``static.DecodeSettings``); ``cache_implementation="static"`` decodes over a
    static KV cache with a step compiled once per bucket (``generation.static``; "hf" passes it to ``generate``).
    The same tokens either way (greedy; sampled, where the kernels give the same logits).
    """
    check_prompts(prompts)
    with unwrapped_for_generation(model) as inner, eval_mode(model), torch.no_grad():
        name = resolve_backend(backend, inner)
        if prompt_inputs and name == "fast" and positions_need_images(inner):
            if backend == "fast":
                raise ValueError(
                    f"backend='fast' cannot sample {type(inner).__name__} from images: its positions "
                    f"depend on the images (M-RoPE); use backend='hf' or 'auto'"
                )
            name = "hf"
        prompt_ids, prompt_mask = left_pad(prompts, params.pad_token_id, model_device(inner))
        extras = {k: v.to(prompt_ids.device) for k, v in (prompt_inputs or {}).items()}
        raw_ids, raw_logps = _run_backend(
            name, inner, prompt_ids, prompt_mask, params, generator, extras, decode or DYNAMIC
        )
    completion_ids, completion_mask, is_truncated = completion_masks(
        raw_ids, params.eos_token_ids, params.pad_token_id
    )
    width = completion_ids.shape[1]
    return GenerationOutput(
        prompt_ids=prompt_ids.repeat_interleave(params.num_generations, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(params.num_generations, dim=0),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        is_truncated=is_truncated,
        sampling_logps=torch.where(completion_mask.bool(), raw_logps[:, :width], 0.0),  # after EOS: maybe -inf
    )


def generate_completions(
    model, prompts: list[list[int]], *, generator: torch.Generator | None = None, backend: str = "auto", **settings
) -> GenerationOutput:
    """:func:`sample_completions` with the sampling settings as ``generate``'s keywords (``SamplingParams.of``:
    ``num_generations``, ``max_new_tokens``, ``eos_token_id``, ``pad_token_id``, then ``temperature``, ``top_p``,
    ``top_k``, ``repetition_penalty``, ``do_sample``; ``eos_token_id=None`` never stops early); raises ValueError for
    bad settings too."""
    return sample_completions(model, prompts, SamplingParams.of(**settings), generator=generator, backend=backend)


def check_prompts(prompts) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists, one per distinct prompt")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. a BOS token)")


def _run_backend(
    name: str,
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    extras: dict | None = None,
    decode: DecodeSettings = DYNAMIC,
) -> tuple[Tensor, Tensor]:
    """Dispatch to a backend; each returns raw completion ids (B*G, C<=max_new_tokens), EOS not yet cut, and
    each token's sampling log-prob (B*G, C)."""
    if name == "fast":
        return _generate_fast(model, prompt_ids, prompt_mask, params, generator, extras, decode)
    if name == "hf":
        return _generate_hf(model, prompt_ids, prompt_mask, params, generator, extras, decode)
    raise AssertionError(f"unresolved backend {name!r}")  # resolve_backend only returns the names above


def resolve_backend(backend: str, model) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    problem = fast_path_problem(model)
    if backend == "fast" and problem:
        raise ValueError(f"backend='fast' cannot run this model: {problem}. Use backend='hf' or 'auto'.")
    if backend == "fast" or (backend == "auto" and not problem):
        return "fast"
    if not callable(getattr(model, "generate", None)):
        raise ValueError(
            f"{type(model).__name__} cannot generate: the fast path refuses it ({problem}) and it "
            "has no `generate` method. Pass a transformers causal LM (e.g. LlamaForCausalLM)."
        )
    if backend == "auto":  # the architecture matrix (tests/test_architectures.py) lists who takes the fast path
        warnings.warn(f"generation_backend='auto' uses 'hf' for {type(model).__name__}: {problem}", stacklevel=4)
    return "hf"


def positions_need_images(model) -> bool:
    """Whether the model's positions depend on its images (Qwen-VL's M-RoPE keeps ``rope_deltas`` from the prefill
    for its decode steps), which the fast path's plain decode positions would get wrong."""
    inner = getattr(model, "model", model)
    return hasattr(inner, "rope_deltas") or callable(getattr(inner, "get_rope_index", None))


def fast_path_problem(model) -> str | None:
    """Why the fast path cannot run ``model``, or None when it can."""
    problem = causal_lm_problem(model)
    if problem is not None:
        return problem
    signature = forward_signature(model)
    if cache_argument(model) is None or "position_ids" not in signature or "attention_mask" not in signature:
        return "its forward() does not take a KV cache, position_ids and attention_mask"
    return None


def model_device(model) -> torch.device:
    param = next(iter(model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------
# Backend "hf": transformers generate.
# ---------------------------------------------------------------------------------------------------------


def _generate_hf(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    extras: dict | None = None,
    decode: DecodeSettings = DYNAMIC,
) -> tuple[Tensor, Tensor]:
    """``model.generate`` with a GenerationConfig built from ``params`` and ``decode.cache_implementation`` only; the
    sampling log-probs come from its processed ``scores`` (after every logits processor and warper, i.e. what it
    sampled from).

    The model's own ``generation_config`` is set aside for the call: transformers fills every unset field
    from it (e.g. its eos_token_id, top_k=50), which would change the distribution behind our back.
    """
    from transformers import GenerationConfig  # heavy: only the hf backend needs it

    group, sampling, repeat = params.num_generations, {}, 1
    if params.do_sample:
        sampling = dict(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p or None,
            num_return_sequences=group,
        )
    elif extras:  # greedy: one row per prompt, repeated after (a VLM's extras repeat by its own layout)
        repeat = group
    else:  # generate refuses num_return_sequences > 1 when greedy; G identical rows give the same result
        prompt_ids, prompt_mask = (t.repeat_interleave(group, dim=0) for t in (prompt_ids, prompt_mask))
    config = GenerationConfig(
        max_new_tokens=params.max_new_tokens,
        do_sample=params.do_sample,
        repetition_penalty=params.repetition_penalty,
        eos_token_id=list(params.eos_token_ids) or None,
        pad_token_id=params.pad_token_id,
        output_scores=True,
        return_dict_in_generate=True,
        suppress_tokens=list(params.suppress_token_ids) or None,
        cache_implementation=decode.cache_implementation,
        **sampling,
    )
    saved_config = getattr(model, "generation_config", None)
    if saved_config is not None:
        model.generation_config = GenerationConfig()
    try:
        with _global_rng_from(generator, prompt_ids.device):
            out = model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, **(extras or {})
            )
    finally:
        if saved_config is not None:
            model.generation_config = saved_config
    completion = out.sequences[:, prompt_ids.shape[1] :]
    logps = [sampled_logps(scores, completion[:, step]) for step, scores in enumerate(out.scores)]
    return completion.repeat_interleave(repeat, dim=0), torch.stack(logps, dim=1).repeat_interleave(repeat, dim=0)


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


def _generate_fast(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    extras: dict | None = None,
    decode: DecodeSettings = DYNAMIC,
) -> tuple[Tensor, Tensor]:
    """Decode all B*G rows together; returns raw ids (B*G, max_new_tokens), pad where a row stopped early, and
    each token's log-prob under the scores it was drawn from."""
    group, width = params.num_generations, prompt_ids.shape[1]
    cache_name = cache_argument(model)
    logits, cache = prefill(model, prompt_ids, prompt_mask, cache_name, extras)
    if decode.static:
        problem = "it samples from images (prompt_inputs)" if extras else static_problem(model, cache)
        if problem is None:
            return _decode_static(model, cache, prompt_ids, prompt_mask, logits, params, generator, decode)
        warn_fallback(model, problem)
    all_preallocated = expand_cache(cache, group, capacity=width + params.max_new_tokens)

    state = DecodeState.start(
        prompt_ids, prompt_mask, logits, params, four_d_mask=all_preallocated and attention_kind(model) == "sdpa"
    )
    forward = NextLogits(model, cache, width)

    def next_logits(state: DecodeState, step: int) -> Tensor:
        logits = forward(state, step)
        state.positions += 1
        return logits

    return _sample_until_done(state, params, generator, cache, next_logits)


def _sample_until_done(state: DecodeState, params: SamplingParams, generator, cache, next_logits):
    """The decode loop both caches share: sample each row's next token, stop at ``max_new_tokens`` or when every row
    has ended, drop the finished rows (from ``cache`` too, unless it is None), and get the next logits."""
    for step in range(params.max_new_tokens):
        state.sample(step, params, generator)
        unfinished = state.unfinished_count()
        if step == params.max_new_tokens - 1 or unfinished == 0:
            break
        state.drop_finished_rows(cache, unfinished)
        state.logits = next_logits(state, step)
    return state.completion, state.completion_logps


def _decode_static(
    model,
    cache,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    decode: DecodeSettings,
) -> tuple[Tensor, Tensor]:
    """The decode loop of ``_generate_fast`` over a static cache (``generation.static``): the same sampling state,
    so the same rows sample the same random numbers; a finished row leaves the sampling state (as above) but keeps
    its cache row, so that the step's shapes never change."""
    rows, capacity = prompt_ids.shape[0] * params.num_generations, prompt_ids.shape[1] + params.max_new_tokens
    decoder = static_decoder(model, decode.decode_compile, prompt_ids.device)
    step_function = decoder.step(model, cache, cache_argument(model), rows, capacity)
    step_function.load(cache, prompt_mask, params.num_generations)
    del cache  # the prompts' keys now live in the bucket's buffers
    state = DecodeState.start(prompt_ids, prompt_mask, logits, params)
    with decoder.running():
        return _sample_until_done(
            state, params, generator, None, lambda state, _: step_function(model, state.next_tokens, state.row_ids)
        )


class NextLogits:
    """One decode step's forward: the last sampled tokens in, the next-token logits (R, V) out.

    A model whose logits are its head's plain product (``head.plain_head``) runs its backbone, then
    ``head.sliced_head`` into the step's reused "logits" buffer (``state.buffers``: the same numbers as its own
    forward, without a fresh (R, 1, V) tensor per step); any other model runs its own forward."""

    def __init__(self, model, cache, width: int):
        self.model, self.cache, self.width = model, cache, width
        self.backbone = model.model if plain_head(model) else None
        self.cache_name = cache_argument(self.backbone if self.backbone is not None else model)

    def __call__(self, state: DecodeState, step: int) -> Tensor:
        inputs = {
            self.cache_name: self.cache,
            "input_ids": state.next_tokens[:, None],
            "attention_mask": state.attention_mask[..., : self.width + step + 1],
            "position_ids": state.positions[:, None],
            "use_cache": True,
        }
        if self.backbone is None:
            return self.model(**inputs).logits[:, -1]
        hidden = self.backbone(**inputs).last_hidden_state[:, -1]  # (R, H)
        weight = self.model.lm_head.weight  # (V, H)
        logits = reused(state.buffers, "logits", (hidden.shape[0], weight.shape[0]), hidden.dtype, hidden.device)
        return sliced_head(hidden, weight, logits)


@dataclass
class DecodeState:
    """Per-row decoding state; "rows" are the still-active rows, ``row_ids`` their index in the output."""

    logits: Tensor  # (R, V) next-token logits
    seen: Tensor | None  # (R, V) bool tokens so far, for the repetition penalty (None when disabled)
    attention_mask: Tensor  # (R, P + max_new_tokens) prompt mask then ones, or (R, 1, 1, P + max_new_tokens) bool
    positions: Tensor  # (R,) position id of the token fed next
    row_ids: Tensor  # (R,) output row of each active row
    unfinished: Tensor  # (R,) bool
    next_tokens: Tensor  # (R,) last sampled tokens
    completion: Tensor  # (B*G, max_new_tokens) output buffer, pad-filled
    completion_logps: Tensor  # (B*G, max_new_tokens) float32 sampling log-prob of each token, 0-filled
    eos: Tensor | None  # (E,) EOS ids, None: never stop early
    buffers: dict | None = None  # the sampling step's (R, V) work tensors, reused across steps (sampling.reused)

    @classmethod
    def start(
        cls, prompt_ids: Tensor, prompt_mask: Tensor, logits: Tensor, params: SamplingParams, four_d_mask: bool = False
    ):
        group, device = params.num_generations, prompt_ids.device
        rows = prompt_ids.shape[0] * group
        seen = None
        if params.repetition_penalty != 1.0:
            seen = token_presence(prompt_ids, prompt_mask, logits.shape[-1]).repeat_interleave(group, dim=0)
        attention_mask = torch.ones(
            rows, prompt_ids.shape[1] + params.max_new_tokens, dtype=prompt_mask.dtype, device=device
        )
        attention_mask[:, : prompt_ids.shape[1]] = prompt_mask.repeat_interleave(group, dim=0)
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
            completion=torch.full((rows, params.max_new_tokens), params.pad_token_id, dtype=torch.long, device=device),
            completion_logps=torch.zeros((rows, params.max_new_tokens), dtype=torch.float32, device=device),
            eos=torch.tensor(params.eos_token_ids, device=device) if params.eos_token_ids else None,
            buffers={},
        )

    def sample(self, step: int, params: SamplingParams, generator: torch.Generator | None) -> None:
        """Draw the next token of every active row from ``self.logits`` (processed in place) and record it with
        its log-prob under the distribution it was drawn from."""
        scores = process_logits(self.logits, params, self.seen, inplace=True)
        next_tokens = sample_next_tokens(scores, params.do_sample, generator, self.buffers)
        self.record(step, next_tokens, sampled_logps(scores, next_tokens, self.buffers))

    def record(self, step: int, next_tokens: Tensor, logps: Tensor) -> None:
        # Rows that finished but were not dropped yet keep sampling; their tokens land after their EOS, where
        # completion_masks() overwrites them with pad (and the caller zeroes their log-probs).
        self.next_tokens = next_tokens
        self.completion[self.row_ids, step] = next_tokens
        self.completion_logps[self.row_ids, step] = logps
        if self.eos is not None:
            self.unfinished &= ~torch.isin(next_tokens, self.eos)
        if self.seen is not None:
            self.seen[torch.arange(len(next_tokens), device=next_tokens.device), next_tokens] = True

    def unfinished_count(self) -> int:
        """How many active rows have not produced EOS: the one host sync per token, the price of stopping early
        (none without EOS ids, when no row can finish)."""
        return len(self.unfinished) if self.eos is None else int(self.unfinished.sum())

    def drop_finished_rows(self, cache, unfinished: int) -> None:
        finished = len(self.unfinished) - unfinished
        if finished == 0 or finished < SHRINK_FRACTION * len(self.unfinished):
            return
        keep = self.unfinished.nonzero().squeeze(1)
        if cache is not None:  # None: a static cache keeps every row
            cache.batch_select_indices(keep)
        for name in ("seen", "attention_mask", "positions", "row_ids", "unfinished", "next_tokens"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[keep])
