"""The rollout-engine contract: prompt token ids and one ``SamplingParams`` in, completions out.

A trainer asks its engine for completions and tells it when the policy changed; nothing else. The result is a
``generation.single.GenerationOutput``: prompt b's G completions are rows ``b*G .. b*G+G-1``, with left-padded
prompts, right-padded completions, their masks (1 up to and including the first EOS), truncation flags (no EOS
within ``max_new_tokens``), and ``sampling_logps``, each sampled token's log-prob under the distribution it was
actually drawn from (after temperature, top-k and top-p), which an importance-sampling correction against the
sampler needs. The own sampler (``engines.local.LocalEngine``) samples from the live model; an engine that holds
its own copy of the weights (vLLM) refreshes it in ``load_weights``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from treadle.generation.sampling import SamplingParams
from treadle.generation.single import GenerationOutput

__all__ = ["RolloutEngine"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What GRPO samples through (``GRPOTrainer.build_engine`` returns one)."""

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *,
                 generator: torch.Generator | None = None, prompt_inputs: dict | None = None) -> GenerationOutput:
        """``params.num_generations`` completions of each distinct prompt; ``generator`` seeds the draws
        (the same generator state gives the same completions for the same weights). ``prompt_inputs``: a VLM's
        vision inputs for the prompts (``pixel_values`` ..., as its processor made them; GRPO passes it only for
        prompts with images)."""
        ...

    def load_weights(self, model) -> None:
        """The policy changed: sample from ``model``'s current weights from now on (full weights or, for a PEFT
        model, its adapters). An engine that holds its own copy of the weights may set ``sync_unchanged`` (True:
        the weights it was sent differ from the last ones but its log-probs did not move) and GRPO reports it to
        the health checks (``weight_sync``)."""
        ...

    def close(self) -> None:
        """Release what the engine holds (threads, processes, memory); a closed engine is not used again."""
        ...
