"""The own KV-cached sampler as a rollout engine (``engines.base.RolloutEngine``): exact, reproducible, CPU default.

It samples from the live model object it was given, so ``load_weights`` only records which model that is (the
DDP / FSDP wrapper after ``train()`` wraps it) and its version; no weights are copied and ``close`` has nothing to
release. Its log-probs are exact (``exact_logps``): the live policy's, with the trainer's own kernels. Multi-turn
rollouts keep each row's KV cache across turns (``generation.turns.sample_turns``) or, with backend "hf" or a model
the fast path cannot run under "auto", re-prefill the whole transcript each turn
(``generation.turns.reprefill_turns``).

``decode`` (``generation.static.DecodeSettings``): with ``cache_implementation="static"`` single-turn sampling
(training and evaluation) decodes over a static KV cache with a compiled step; multi-turn rollouts keep their ragged
cache (each row writes at its own slot, which the static step does not do) and say so once.
"""

from __future__ import annotations

import warnings

import torch

from treadle.engines.base import RolloutEngine
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import BACKENDS, GenerationOutput, sample_completions
from treadle.generation.static import DecodeSettings, warn_fallback
from treadle.generation.turns import MultiTurnOutput, Respond, reprefill_turns, sample_turns

__all__ = ["LocalEngine"]


class LocalEngine(RolloutEngine):
    """``generation.single.sample_completions`` behind the engine contract; ``backend`` is "fast", "hf" or "auto"."""

    exact_logps = True  # the live policy itself, sampled with the trainer's own kernels

    def __init__(self, model, backend: str = "auto", decode: DecodeSettings | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.model, self.backend, self.decode = model, backend, decode or DecodeSettings()

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        prompt_inputs: dict | None = None,
    ) -> GenerationOutput:
        with eager():
            return sample_completions(
                self.model,
                prompt_ids,
                params,
                generator=generator,
                backend=self.backend,
                prompt_inputs=prompt_inputs,
                decode=self.decode,
            )

    def generate_turns(
        self,
        prompt_ids: list[list[int]],
        respond: Respond,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
    ) -> MultiTurnOutput:
        """ "fast"/"auto" keep each row's KV cache across turns ("auto" falls back when the model cannot), "hf"
        re-prefills the whole transcript each turn."""
        if self.decode.static:
            warn_fallback(self.model, "multi-turn rollouts keep a ragged cache (each row writes at its own slot)")
        with eager():
            if self.backend != "hf":
                try:
                    return sample_turns(self.model, prompt_ids, respond, params, generator=generator)
                except ValueError as error:  # raised before any turn when the fast path cannot run this model
                    if self.backend == "fast":
                        raise
                    warnings.warn(  # never silently slower: say why (e.g. sliding-window layers, Gemma 3)
                        f"multi-turn sampling re-prefills each turn for {type(self.model).__name__}: {error}",
                        stacklevel=2,
                    )
            return reprefill_turns(self.model, prompt_ids, respond, params, generator=generator, backend=self.backend)

    def load_weights(self, model, version: int | None = None) -> None:
        self.model, self.policy_version = model, version  # the live model: its weights are the policy's, no copy


def eager():
    """The sampler runs the model eagerly: blocks compiled for training (``torch_compile``) would recompile at every
    decode step's new shape until torch gives up on them (``recompile_limit``)."""
    return torch.compiler.set_stance("force_eager")
