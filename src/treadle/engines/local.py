"""The own KV-cached sampler as a rollout engine (``engines.base.RolloutEngine``): exact, reproducible, CPU default.

It samples from the live model object it was given, so ``load_weights`` only records which model that is (the
DDP / FSDP wrapper after ``train()`` wraps it); no weights are copied and ``close`` has nothing to release.
"""

from __future__ import annotations

import torch

from treadle.generation.sampling import SamplingParams
from treadle.generation.single import BACKENDS, GenerationOutput, sample_completions

__all__ = ["LocalEngine"]


class LocalEngine:
    """``generation.single.sample_completions`` behind the engine contract; ``backend`` is "fast", "hf" or "auto"."""

    def __init__(self, model, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.model, self.backend = model, backend

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *,
                 generator: torch.Generator | None = None, prompt_inputs: dict | None = None) -> GenerationOutput:
        return sample_completions(self.model, prompt_ids, params, generator=generator, backend=self.backend,
                                  prompt_inputs=prompt_inputs)

    def load_weights(self, model) -> None:
        self.model = model  # the live model: its weights are the policy's, nothing to copy

    def close(self) -> None:
        pass

    def __enter__(self) -> "LocalEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
