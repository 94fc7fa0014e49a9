"""The rollout-engine contract: what an on-policy trainer samples through, for its whole lifecycle.

A trainer asks its engine for completions, tells it when the policy changed, and reads what the engine reports;
it never asks what type the engine is. ``RolloutEngine`` is the contract and the base class of every engine (its
reports have defaults, so an engine states only what differs):

- **what it samples**: ``generate`` (single-turn: prompt token ids and one ``SamplingParams`` in, a
  ``generation.single.GenerationOutput`` out; a VLM's vision inputs ride along as ``prompt_inputs``) and
  ``generate_turns`` (multi-turn: a ``respond(row, turn_ids)`` callback feeds each turn's observation; a
  ``generation.turns.MultiTurnOutput`` out). Prompt b's G completions are rows ``b*G .. b*G+G-1``, with left-padded
  prompts, right-padded completions, their masks (1 up to and including the first EOS), truncation flags (no EOS
  within ``max_new_tokens``) and ``sampling_logps``, each sampled token's log-prob under the distribution it was
  actually drawn from (after temperature, top-k and top-p), which an importance-sampling correction against the
  sampler needs;
- **whether its log-probs are exact** (``exact_logps``): True when it samples the live policy with the trainer's
  own kernels, so that its log-probs differ from the trained ones only where the sampling settings reshape the
  distribution (then no correction is needed for them; trainers/grpo/correction.py);
- **its policy version** (``policy_version``): the version of the weights it samples from, as the last
  ``load_weights`` named it (the trainer's optimizer step);
- **the weight push** (``load_weights(model, version)``): the policy changed, sample from its current weights; an
  engine holding its own copy refreshes it and may check the push (``sync_unchanged``: True when weights that
  differ from the last ones left its log-probs unchanged; None when not checked);
- **where it samples** (``samples_elsewhere``): True when the sampling runs in another process (the vLLM server), so
  that a thread of the trainer's process that drives it only waits (asynchronous generation then drives it from
  a thread, ``take_turns``);
- **close**: release what it holds (threads, processes, memory); a closed engine is not used again.

The own sampler (``engines.local.LocalEngine``) samples from the live model; the vLLM engines hold their own copy of
the weights and sample single-turn rollouts only.
"""

from __future__ import annotations

import threading

import torch

from treadle.generation.sampling import SamplingParams
from treadle.generation.single import GenerationOutput
from treadle.generation.turns import MultiTurnOutput, Respond

__all__ = ["EngineSide", "RolloutEngine", "take_turns"]


class RolloutEngine:
    """What on-policy trainers sample through (``OnPolicyTrainer.build_engine`` returns one); subclass it."""

    exact_logps: bool = False  # True: sampling_logps are the live policy's own, with the trainer's own kernels
    policy_version: int | None = None  # the weights it samples from (the version the last load_weights named)
    sync_unchanged: bool | None = None  # its check of the last push: True when changed weights moved nothing
    samples_elsewhere: bool = False  # True: it samples in another process; a thread driving it only waits
    single_turn_only: str | None = None  # generate_turns' refusal, where an engine words it (default: below)

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        prompt_inputs: dict | None = None,
    ) -> GenerationOutput:
        """``params.num_generations`` completions of each distinct prompt; ``generator`` seeds the draws
        (the same generator state gives the same completions for the same weights). ``prompt_inputs``: a VLM's
        vision inputs for the prompts (``pixel_values`` ..., as its processor made them; given only for prompts
        with images)."""
        raise NotImplementedError(f"{type(self).__name__} must implement generate")

    def generate_turns(
        self,
        prompt_ids: list[list[int]],
        respond: Respond,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
    ) -> MultiTurnOutput:
        """Multi-turn rollouts of each distinct prompt (``generation.turns.sample_turns``' contract): a model turn
        ends at EOS, then ``respond(row, turn_ids)`` returns the tokens to feed next (or a Future of them), or None
        when the rollout is over. An engine that samples single-turn completions only keeps this refusal
        (``single_turn_only`` says why)."""
        raise ValueError(
            self.single_turn_only
            or f"{type(self).__name__} samples single-turn rollouts only: multi-turn rollouts (tools=, "
            f"env_factory=) need an engine that implements generate_turns (the own sampler does)"
        )

    def load_weights(self, model, version: int | None = None) -> None:
        """The policy changed: sample from ``model``'s current weights from now on (full weights or, for a PEFT
        model, its adapters), and report ``version`` as ``policy_version``."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_weights")

    def close(self) -> None:
        """Release what the engine holds (threads, processes, memory); a closed engine is not used again."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Turns:
    """One engine, the lock its users take turns under, and the user whose weights it holds now."""

    def __init__(self, engine: RolloutEngine):
        self.engine, self.lock, self.holder = engine, threading.Lock(), None


class EngineSide(RolloutEngine):
    """One user's side of an engine that two threads share, each with weights of its own (``take_turns``): every call
    runs under the shared lock, and a ``generate`` after the other side pushed its weights pushes this side's
    again (its ``load_weights`` model and version) before it samples. The first side made owns the engine and
    closes it; the other's ``close`` leaves it open."""

    def __init__(self, turns: _Turns, *, owner: bool):
        self.turns, self.owner = turns, owner
        self.model, self.policy_version = None, None

    @property
    def exact_logps(self) -> bool:
        return self.turns.engine.exact_logps

    @property
    def sync_unchanged(self) -> bool | None:
        return self.turns.engine.sync_unchanged

    @property
    def samples_elsewhere(self) -> bool:
        return self.turns.engine.samples_elsewhere

    def generate(self, prompt_ids, params, *, generator=None, prompt_inputs=None) -> GenerationOutput:
        with self.turns.lock:
            self._hold()
            return self.turns.engine.generate(prompt_ids, params, generator=generator, prompt_inputs=prompt_inputs)

    def generate_turns(self, prompt_ids, respond, params, *, generator=None) -> MultiTurnOutput:
        with self.turns.lock:
            self._hold()
            return self.turns.engine.generate_turns(prompt_ids, respond, params, generator=generator)

    def load_weights(self, model, version: int | None = None) -> None:
        with self.turns.lock:
            self.model, self.policy_version = model, version
            self.turns.engine.load_weights(model, version)
            self.turns.holder = self

    def _hold(self) -> None:
        """The engine holds this side's weights (pushed again when the other side pushed its own since)."""
        if self.turns.holder is not self and self.model is not None:
            self.turns.engine.load_weights(self.model, self.policy_version)
            self.turns.holder = self

    def close(self) -> None:
        if self.owner:
            self.turns.engine.close()


def take_turns(engine: RolloutEngine) -> tuple[EngineSide, EngineSide]:
    """(the owner's side, another side) of ``engine``, shared by two threads with weights of their own: the trainer,
    which evaluates its current weights, and the rollout worker of asynchronous generation, which samples the
    training batches from the weights pushed to it (trainers/onpolicy/producer.py). Given a side, its owner's
    engine is shared again: (that side, a new side)."""
    if isinstance(engine, EngineSide):
        return engine, EngineSide(engine.turns, owner=False)
    turns = _Turns(engine)
    return EngineSide(turns, owner=True), EngineSide(turns, owner=False)
