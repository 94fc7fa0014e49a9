"""Multi-turn sampling: one KV cache kept across turns, observations fed through the batched decode step
(used by ``treadle.rollouts``).

Contract: :func:`sample_turns` takes B distinct prompts, a ``respond(row, turn_ids)`` callback and one
:class:`~treadle.generation.sampling.SamplingParams`, and returns a :class:`MultiTurnOutput`: the rows laid out
as in single-turn sampling, each completion interleaving sampled turns with fed (environment) tokens, with the
mask of the sampled tokens and their sampling log-probs. :func:`generate_turns` is the same call with the
settings as keywords.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from treadle.generation.cache import RaggedWrites, expand_cache, prefill
from treadle.generation.sampling import SamplingParams, process_logits, sampled_logps, token_presence
from treadle.generation.single import (
    SHRINK_FRACTION,
    DecodeState,
    GenerationOutput,
    check_prompts,
    left_pad,
    model_device,
    resolve_backend,
    sample_completions,
)
from treadle.models import cache_argument, eval_mode, unwrapped_for_generation

__all__ = ["MultiTurnOutput", "Respond", "generate_turns", "pack_turns", "reprefill_turns", "sample_turns"]


@dataclass
class MultiTurnOutput(GenerationOutput):
    """A :class:`GenerationOutput` whose completions interleave sampled turns with fed (environment) tokens;
    ``sampling_logps`` is 0 on fed tokens and padding."""

    sampled_mask: Tensor = field(kw_only=True)  # (B*G, C) 1 on tokens the model sampled, 0 on fed tokens, padding


# respond(row, turn_ids) -> Future or value: the tokens to feed after the turn, or None when the rollout is over
Respond = Callable[[int, list[int]], "Future | list[int] | None"]


def sample_turns(
    model,
    prompts: list[list[int]],
    respond: Respond,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
) -> MultiTurnOutput:
    """Multi-turn sampling on the fast path, with each row's KV cache kept across turns.

    Rows are laid out as in single-turn sampling (prompt b's rollouts are rows b*G .. b*G+G-1). A model turn
    ends at EOS; then ``respond(row, turn_ids)`` is called (``turn_ids``: the turn's tokens, EOS included) and
    returns, now or as a ``concurrent.futures.Future``, the token ids to feed next (an environment's
    observation, maybe empty) or None when the rollout is over. Fed tokens go through the same batched forward
    as sampled ones, one per step, so only the new tokens are prefilled, never the transcript; a row whose
    future is not done yet sits out (a masked column) while the other rows keep sampling.
    ``params.max_new_tokens`` bounds sampled plus fed tokens per row: a turn cut by it, or an observation that
    does not fit (then dropped, as TRL does), marks the row truncated. Raises ValueError for a model the fast
    path cannot run (``treadle.rollouts`` then re-prefills each turn through single-turn sampling).
    """
    check_prompts(prompts)
    with unwrapped_for_generation(model) as inner, eval_mode(model), torch.no_grad():
        resolve_backend("fast", inner)
        prompt_ids, prompt_mask = left_pad(prompts, params.pad_token_id, model_device(inner))
        rows = _decode_turns(inner, prompt_ids, prompt_mask, params, respond, generator)
    return pack_turns(
        prompt_ids,
        prompt_mask,
        params.num_generations,
        rows.tokens,
        rows.sampled,
        rows.truncated,
        params.pad_token_id,
        rows.logps,
    )


def generate_turns(
    model, prompts: list[list[int]], respond: Respond, *, generator: torch.Generator | None = None, **settings
) -> MultiTurnOutput:
    """:func:`sample_turns` with the sampling settings as ``generate``'s keywords (``SamplingParams.of``, as
    ``generate_completions`` takes them)."""
    return sample_turns(model, prompts, respond, SamplingParams.of(**settings), generator=generator)


def pack_turns(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    group: int,
    tokens: list[list[int]],
    sampled: list[list[int]],
    truncated: list[bool],
    pad_token_id: int,
    logps: list[list[float]] | None = None,
) -> MultiTurnOutput:
    """A MultiTurnOutput from the distinct prompts (B, P) and each row's completion tokens, sampled flags,
    truncation and (optionally) sampled-token log-probs, right-padded."""
    device = prompt_ids.device
    width = max(1, max(len(t) for t in tokens))
    ids = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
    mask, sampled_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    logp_tensor = torch.zeros(ids.shape, dtype=torch.float32)
    for row, (t, s) in enumerate(zip(tokens, sampled)):
        ids[row, : len(t)] = torch.as_tensor(t, dtype=torch.long)
        mask[row, : len(t)] = 1
        sampled_mask[row, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        if logps is not None:
            logp_tensor[row, : len(logps[row])] = torch.as_tensor(logps[row], dtype=torch.float32)
    return MultiTurnOutput(
        prompt_ids=prompt_ids.repeat_interleave(group, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(group, dim=0),
        completion_ids=ids.to(device),
        completion_mask=mask.to(device),
        is_truncated=torch.tensor(truncated, device=device),
        sampled_mask=sampled_mask.to(device),
        sampling_logps=logp_tensor.to(device) if logps is not None else None,
    )


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
            turn = self.tokens[row][self.turn_start[row] :]
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
            futures.wait(
                [f for f in self.pending.values() if isinstance(f, Future)], return_when=futures.FIRST_COMPLETED
            )
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


def _decode_turns(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    params: SamplingParams,
    respond: Respond,
    generator: torch.Generator | None,
) -> _TurnRows:
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
        logps = sampled_logps(scores, sampled)
        added = [rows.emit(r, t, lp) for r, t, lp in zip(row_ids, sampled.tolist(), logps.tolist())]
        keep = [i for i, r in enumerate(row_ids) if rows.mode[r] != _DONE]
        if not keep:
            break
        if len(keep) < (1 - SHRINK_FRACTION) * len(row_ids):  # enough rows finished to pay for a compaction
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
        self.uniforms = (
            torch.rand((rows, params.max_new_tokens), generator=generator, device=where).to(device)
            if self.do_sample
            else None
        )

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
        self.model, self.cache_name, self.pad = model, cache_argument(model), params.pad_token_id
        logits, self.cache = prefill(model, prompt_ids, prompt_mask, self.cache_name)
        self.capacity = width + params.max_new_tokens + 1  # the last slot takes the padding of ragged writes
        if not expand_cache(self.cache, group, capacity=self.capacity):
            raise ValueError(
                "multi-turn sampling with a kept KV cache needs plain full-attention layers; "
                "use treadle.generation.reprefill_turns (generation_backend='hf') for this model"
            )
        self.writes = RaggedWrites.attach(self.cache)
        self.state = DecodeState.start(prompt_ids, prompt_mask, logits, params)
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
        readable = self.valid[rows, None, :span] & (
            torch.arange(span, device=device)[None, None, :] <= index[:, :, None]
        )  # (r, k, T)
        mask = torch.zeros(readable.shape, dtype=self.dtype, device=device).masked_fill(
            ~readable, torch.finfo(self.dtype).min
        )[:, None]  # (r, 1, k, T) additive: eager and SDPA read it alike
        self.writes.rows, self.writes.index, self.writes.span = (None if subset is None else rows), index, span
        out = self.model(
            **{self.cache_name: self.cache},
            input_ids=inputs,
            attention_mask=mask,
            position_ids=state.positions[rows, None] + offsets,
            use_cache=True,
        )
        last = out.logits[torch.arange(len(added), device=device), (lengths - 1).clamp(min=0)]  # (r, V)
        # a row that added nothing keeps the logits of its last real token (its next step may sample from them)
        state.logits[rows] = torch.where(lengths[:, None] > 0, last.to(state.logits.dtype), state.logits[rows])
        state.positions[rows] += lengths
        self.slots[rows] += lengths


def _model_dtype(model) -> torch.dtype:
    param = next(iter(model.parameters()), None)
    return param.dtype if param is not None else torch.float32


def reprefill_turns(
    model,
    prompts: list[list[int]],
    respond,
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    backend: str = "auto",
) -> MultiTurnOutput:
    """:func:`sample_turns`' contract, one single-turn sampling call per turn on every active row's whole
    transcript: the baseline, and the fallback for models the fast path cannot run (``engines.LocalEngine`` with
    backend "hf", or "auto"). Simple, but every turn prefills everything again, and a turn starts only when every
    row's environment has answered."""
    eos, max_new_tokens, num_generations = set(params.eos_token_ids), params.max_new_tokens, params.num_generations
    rows = len(prompts) * num_generations
    base = [p for p in prompts for _ in range(num_generations)]
    tokens: list[list[int]] = [[] for _ in range(rows)]
    sampled: list[list[int]] = [[] for _ in range(rows)]
    logps: list[list[float]] = [[] for _ in range(rows)]
    truncated = [False] * rows
    active, turn = list(range(rows)), 0
    while active:
        room = max(max_new_tokens - len(tokens[r]) for r in active)
        contexts = prompts if turn == 0 else [base[r] + tokens[r] for r in active]
        turn_params = replace(params, num_generations=num_generations if turn == 0 else 1, max_new_tokens=room)
        out = sample_completions(model, contexts, turn_params, generator=generator, backend=backend)
        lengths = out.completion_mask.sum(dim=1).tolist()
        answers = {}
        for i, r in enumerate(active):
            new = out.completion_ids[i, : lengths[i]].tolist()[: max_new_tokens - len(tokens[r])]
            tokens[r] += new
            sampled[r] += [1] * len(new)
            logps[r] += out.sampling_logps[i, : len(new)].tolist()
            if new and new[-1] in eos:
                answers[r] = respond(r, new)
            else:
                truncated[r] = True
        active = []
        for r, answer in answers.items():
            value = answer.result() if hasattr(answer, "result") else answer
            if value is None:
                continue
            if len(tokens[r]) + len(value) >= max_new_tokens:
                truncated[r] = True
                continue
            tokens[r] += value
            sampled[r] += [0] * len(value)
            logps[r] += [0.0] * len(value)
            active.append(r)
        turn += 1
    prompt_ids, prompt_mask = left_pad(prompts, params.pad_token_id, model_device(model))
    return pack_turns(prompt_ids, prompt_mask, num_generations, tokens, sampled, truncated, params.pad_token_id, logps)
