"""Sampling settings (:class:`SamplingParams`) and logits processing: what distribution a completion is drawn from.

The distribution is transformers' ``generate``: the same logits processors in the same order (repetition
penalty, then, when sampling, temperature, top-k, top-p, min-p), then softmax and a categorical draw. The processors
are pure functions on ``(N, V)`` float scores; :func:`sampled_logps` gives the log-probs of drawn tokens under
the processed scores, i.e. of the distribution actually sampled from (what an importance-sampling correction
against the sampler needs). :func:`sampler_options` maps TRL's ``min_p`` and ``generation_kwargs`` onto
``SamplingParams`` fields.

The decode loop's draw, :func:`multinomial_draw`, is ``torch.multinomial(probs, 1)`` done cheaper with the same
result: the same tokens and the same generator state after, bit for bit. With ``buffers`` (a dict the caller keeps
across decode steps, see :func:`reused`) a step allocates no (N, V) tensor, and ``process_logits(inplace=True)``
edits the step's logits in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from treadle.text import eos_ids

__all__ = [
    "GENERATION_KWARGS",
    "SamplingParams",
    "apply_min_p",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "multinomial_draw",
    "process_logits",
    "reused",
    "sample_next_tokens",
    "sampled_logps",
    "sampler_options",
    "token_presence",
]

# multinomial_draw: approximate noise ratios within this relative distance of a row's best are re-checked with the
# exact noise (the vectorised log1p may differ from torch's scalar one by an ulp or two of a double: a relative
# 2^-23 at most on the float32 ratio, so 1e-6 leaves an 8x margin)
NEAR_TIE = 1e-6

# generation_kwargs (GenerationConfig names) that the own sampler takes, and the SamplingParams field each sets
GENERATION_KWARGS = {
    "min_p": "min_p",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "suppress_tokens": "suppress_token_ids",
}
# names the config sets through a field of its own, with the reason generation_kwargs may not override them
OWN_FIELDS = {
    "temperature": "the trained log-probs (and distillation's divergence) use the sampling temperature "
    "too; set the config's temperature",
    "max_new_tokens": "set the config's max_completion_length",
    "do_sample": "training samples; evaluate greedily with eval_temperature=0",
    "eos_token_id": "the tokenizer's eos_token_id ends completions",
    "pad_token_id": "the tokenizer's pad token pads completions",
}


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
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (after top-p); 0 disables
    repetition_penalty: float = 1.0  # CTRL penalty (Keskar et al. 2019); 1 disables
    do_sample: bool = True  # False: greedy (argmax after the repetition penalty)
    suppress_token_ids: tuple[int, ...] = ()  # never sampled (generate's suppress_tokens): image tokens

    def __post_init__(self):
        checks = [
            (
                self.num_generations >= 1,
                f"num_generations must be >= 1, got {self.num_generations}; "
                "pass the number of completions wanted per prompt (e.g. 8)",
            ),
            (
                self.max_new_tokens >= 1,
                f"max_new_tokens must be >= 1, got {self.max_new_tokens}; "
                "pass the longest completion length you accept (e.g. 64)",
            ),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable it"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}; use 0 to disable it"),
            (
                0.0 <= self.min_p <= 1.0,
                f"min_p must be in [0, 1], got {self.min_p}; 0.01-0.2 is typical, 0 or None disables it",
            ),
            (
                self.repetition_penalty > 0.0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}; use 1.0 to disable it",
            ),
            (
                not self.do_sample or self.temperature > 0.0,
                f"temperature must be > 0 when sampling, got {self.temperature}; 1.0 samples the model as is "
                f"(generate_completions: do_sample=False decodes greedily)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def of(
        cls,
        *,
        num_generations: int,
        max_new_tokens: int,
        eos_token_id: int | list[int] | None,
        pad_token_id: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        repetition_penalty: float = 1.0,
        do_sample: bool = True,
    ) -> SamplingParams:
        """The settings under ``generate``'s keywords (one ``eos_token_id``: an id, a list, or None, which never stops
        early), as the keyword calls ``generate_completions`` and ``generate_turns`` take them."""
        return cls(
            num_generations=num_generations,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_ids(eos_token_id),
            pad_token_id=pad_token_id,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            repetition_penalty=repetition_penalty,
            do_sample=do_sample,
        )


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


def apply_repetition_penalty(scores: Tensor, seen: Tensor, penalty: float, inplace: bool = False) -> Tensor:
    """Make already-seen tokens less likely: a positive score is divided by ``penalty``, a negative one multiplied.

    ``scores`` (N, V) are raw logits, ``seen`` (N, V) bool marks the tokens of the prompt (padding excluded) and
    of the completion so far, as transformers' ``RepetitionPenaltyLogitsProcessor`` does. ``inplace`` edits
    ``scores`` (touching only the seen tokens) and returns it.
    """
    if inplace:
        values = scores[seen]  # (n_seen,): the same numbers as below, computed for the seen tokens only
        scores[seen] = torch.where(values < 0, values * penalty, values / penalty)
        return scores
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def apply_temperature(scores: Tensor, temperature: float, inplace: bool = False) -> Tensor:
    """Divide the scores by ``temperature`` (> 1 flattens the distribution, < 1 sharpens it)."""
    return scores.div_(temperature) if inplace else scores / temperature


def apply_top_k(scores: Tensor, top_k: int, inplace: bool = False) -> Tensor:
    """Keep the ``top_k`` highest scores of each row (ties with the k-th are kept too); the rest become -inf."""
    k = min(top_k, scores.shape[-1])
    kth = torch.topk(scores, k, dim=-1).values[:, -1:]  # (N, 1)
    return _masked_fill(scores, scores < kth, inplace)


def apply_top_p(scores: Tensor, top_p: float, inplace: bool = False) -> Tensor:
    """Nucleus filtering: drop the least likely tokens whose total probability is at most ``1 - top_p``.

    Equivalently, keep the smallest set of most likely tokens whose mass reaches ``top_p``. The most likely
    token is always kept.
    """
    ascending, order = torch.sort(scores, dim=-1)  # (N, V)
    mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)  # mass of this token and all less likely ones
    drop_sorted = mass_below <= 1.0 - top_p
    drop_sorted[:, -1] = False
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return _masked_fill(scores, drop, inplace)


def apply_min_p(scores: Tensor, min_p: float, inplace: bool = False) -> Tensor:
    """Min-p filtering (Nguyen et al. 2024): drop the tokens whose probability is below ``min_p`` times that of
    the most likely token (kept itself, as ``min_p <= 1``), as transformers' ``MinPLogitsWarper``."""
    probs = scores.softmax(dim=-1)
    return _masked_fill(scores, probs < min_p * probs.amax(dim=-1, keepdim=True), inplace)


def _masked_fill(scores: Tensor, drop: Tensor, inplace: bool) -> Tensor:
    return scores.masked_fill_(drop, float("-inf")) if inplace else scores.masked_fill(drop, float("-inf"))


def process_logits(
    logits: Tensor, params: SamplingParams, seen: Tensor | None = None, inplace: bool = False
) -> Tensor:
    """Turn next-token logits (N, V) into the float32 scores that are sampled from (or argmax-ed).

    Order as in transformers' ``generate``: suppressed tokens, repetition penalty, then (sampling only)
    temperature, top-k, top-p, min-p. ``seen`` (N, V) is required when ``params.repetition_penalty != 1``.
    ``inplace`` (float32 ``logits`` that the caller gives up, e.g. a decode step's) edits and returns ``logits``
    itself, with the same numbers; the default leaves ``logits`` untouched. Top-p and min-p still build (N, V)
    temporaries either way.
    """
    scores = logits.float()
    inplace = inplace and scores is logits
    if params.suppress_token_ids:
        suppressed = torch.tensor(params.suppress_token_ids, device=scores.device)
        fill = scores.index_fill_ if inplace else scores.index_fill
        scores = fill(-1, suppressed, -float("inf"))
    if params.repetition_penalty != 1.0:
        scores = apply_repetition_penalty(scores, seen, params.repetition_penalty, inplace)
    if not params.do_sample:
        return scores  # the warpers below never change the argmax, and generate skips them when greedy
    if params.temperature != 1.0:
        scores = apply_temperature(scores, params.temperature, inplace)
    if params.top_k > 0:
        scores = apply_top_k(scores, params.top_k, inplace)
    if params.top_p < 1.0:
        scores = apply_top_p(scores, params.top_p, inplace)
    if params.min_p > 0.0:
        scores = apply_min_p(scores, params.min_p, inplace)
    return scores


def sampler_options(min_p: float | None = None, generation_kwargs: dict | None = None) -> dict:
    """The ``SamplingParams`` fields that TRL's ``min_p`` and ``generation_kwargs`` set (keys in
    ``GENERATION_KWARGS``; as in TRL, ``generation_kwargs`` override ``min_p`` and the top-p / top-k / penalty
    fields). Any other key raises ValueError, one line naming it."""
    options = {} if min_p is None else {"min_p": float(min_p)}
    if generation_kwargs is None:
        return options
    if not isinstance(generation_kwargs, dict):
        raise ValueError(
            f"generation_kwargs must be a dict of GenerationConfig names, e.g. {{'min_p': 0.05}}, got "
            f"{generation_kwargs!r}"
        )
    for key, value in generation_kwargs.items():
        if key in OWN_FIELDS:
            raise ValueError(f"generation_kwargs[{key!r}] is not taken: {OWN_FIELDS[key]}")
        if key not in GENERATION_KWARGS:
            raise ValueError(
                f"generation_kwargs[{key!r}] has no counterpart in treadle's own sampler, which takes "
                f"{', '.join(GENERATION_KWARGS)}; remove it"
            )
        options[GENERATION_KWARGS[key]] = tuple(int(t) for t in value) if key == "suppress_tokens" else value
    return options


def reused(buffers: dict | None, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    """An uninitialised tensor for a decode step: ``buffers[name]`` when it has this shape and dtype, else a new one
    kept there (so a step allocates only when the number of rows changed). ``buffers=None``: always a new one."""
    buffer = None if buffers is None else buffers.get(name)
    if buffer is None or buffer.shape != torch.Size(shape) or buffer.dtype != dtype or buffer.device != device:
        buffer = torch.empty(shape, dtype=dtype, device=device)
        if buffers is not None:
            buffers[name] = buffer
    return buffer


def sample_next_tokens(
    scores: Tensor, do_sample: bool, generator: torch.Generator | None = None, buffers: dict | None = None
) -> Tensor:
    """(N,) next tokens from processed scores (N, V): a multinomial draw, or the argmax when greedy.

    ``buffers`` (kept by the caller across steps): the softmax and the draw reuse its tensors, and the draw is
    :func:`multinomial_draw` (on CPU) -- the same tokens and generator state as ``torch.multinomial``."""
    if not do_sample:
        return scores.argmax(dim=-1)
    if buffers is None or scores.device.type != "cpu" or scores.dtype != torch.float32:
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)
    probs = reused(buffers, "probs", tuple(scores.shape), scores.dtype, scores.device)
    torch.ops.aten._softmax.out(scores, -1, False, out=probs)  # what scores.softmax(-1) computes
    return multinomial_draw(probs, generator, buffers)


def multinomial_draw(probs: Tensor, generator: torch.Generator | None = None, buffers: dict | None = None) -> Tensor:
    """(N,) one draw per row of float32 ``probs`` (N, V) on CPU: ``torch.multinomial(probs, 1, generator=generator)``
    bit for bit (the same tokens, the same generator state after), about 2.5x cheaper.

    torch's CPU multinomial, for one sample, draws ``q = empty_like(probs).exponential_(1)`` and returns
    ``argmax(probs / q)`` (the exponential race, a Gumbel-max in disguise). ``exponential_`` takes one float64
    uniform ``u`` per element, in row-major order, and returns ``float(-log1p(-u))`` one element at a time through
    libm. Here the same uniforms come from ``uniform_`` (the same generator calls) and ``log1p`` runs vectorised in
    float64; a vectorised log1p may differ from libm's by an ulp of a double, which can move the float32 noise by one
    ulp, so every element whose ratio comes within ``NEAR_TIE`` of its row's best is recomputed with libm's log1p
    (``math.log1p``, what torch's scalar kernel calls) before the winner is picked. Unlike ``torch.multinomial`` it
    skips the validity scan (max, min, row sums: three passes and a host sync); a NaN row raises here too.
    """
    shape, device = tuple(probs.shape), probs.device
    uniform = reused(buffers, "uniform", shape, torch.float64, device).uniform_(generator=generator)
    noise64 = reused(buffers, "noise64", shape, torch.float64, device)
    torch.log1p(torch.neg(uniform, out=noise64), out=noise64).neg_()  # -log1p(-u), as exponential_ computes it
    ratio = reused(buffers, "ratio", shape, torch.float32, device)
    ratio.copy_(noise64)  # float32 noise q
    torch.div(probs, ratio, out=ratio)  # probs / q
    winner = ratio.argmax(dim=-1)  # (N,)
    best = ratio.gather(1, winner[:, None])  # (N, 1)
    if torch.isnan(best).any():
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    near = torch.ge(ratio, best * (1 - NEAR_TIE), out=reused(buffers, "near", shape, torch.bool, device))
    for row in (near.sum(dim=-1) > 1).nonzero().squeeze(1).tolist():
        winner[row] = _exact_winner(probs[row], uniform[row], near[row].nonzero().squeeze(1))
    return winner


def _exact_winner(probs: Tensor, uniform: Tensor, candidates: Tensor) -> Tensor:
    """The first of ``candidates`` (ascending) with the largest ``probs / q`` under torch's own noise q."""
    noise = torch.tensor([-math.log1p(-u) for u in uniform[candidates].tolist()], dtype=torch.float64)
    ratio = probs[candidates] / noise.to(torch.float32)  # IEEE float32 division, as torch's div
    return candidates[ratio.argmax()]


def sampled_logps(scores: Tensor, tokens: Tensor, buffers: dict | None = None) -> Tensor:
    """(N,) float32 log-probs of ``tokens`` (N,) under the processed scores (N, V): the log-probs of the
    distribution sampled from (temperature, top-k, top-p applied; greedy: the penalised logits' softmax).
    ``buffers``: the log-sum-exp's (N, V) temporary is reused, with the same numbers as ``logsumexp``."""
    scores = scores.float()  # a reduction, not a log_softmax: no second (N, V) tensor per decode step
    picked = scores.gather(1, tokens[:, None]).squeeze(1)
    if buffers is None:
        return picked - scores.logsumexp(dim=-1)
    # torch's logsumexp, op for op (ReduceOps.cpp), with its (N, V) temporary in a reused buffer
    maxes = scores.amax(dim=-1, keepdim=True)  # (N, 1)
    maxes.masked_fill_(maxes.abs() == math.inf, 0)
    shifted = torch.sub(
        scores, maxes, out=reused(buffers, "shifted", tuple(scores.shape), scores.dtype, scores.device)
    )
    return picked - shifted.exp_().sum(dim=-1).log_().add_(maxes.squeeze(1))
