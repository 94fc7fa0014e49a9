"""Sampling for online RL, in five rooms (import from the submodules inside treadle; this file only re-exports
the public names for users, tests and benchmarks):

- ``generation.sampling``: :class:`SamplingParams` (the settings of one call, passed down whole) and the logits
  processors (what distribution a token is drawn from);
- ``generation.cache``: every transformers KV-cache internal (the preallocated and ragged cache layers);
- ``generation.single``: single-turn sampling, the fast KV-cached backend and the transformers fallback;
- ``generation.static``: the static decode step (``DecodeSettings(cache_implementation="static")``), compiled once
  per bucket of rows and cache capacity;
- ``generation.turns``: multi-turn sampling with one KV cache kept across turns, and the re-prefilling baseline.

GRPO and evaluation reach the sampler through a rollout engine (``treadle.engines``), not directly.
"""

from treadle.generation.sampling import (
    SamplingParams,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    process_logits,
    sample_next_tokens,
    sampled_logps,
    sampler_options,
    token_presence,
)
from treadle.generation.single import (
    BACKENDS,
    GenerationOutput,
    completion_masks,
    distinct_prompts,
    fast_path_problem,
    generate_completions,
    left_pad,
    sample_completions,
)
from treadle.generation.static import DecodeSettings
from treadle.generation.turns import (
    MultiTurnOutput,
    Respond,
    generate_turns,
    pack_turns,
    reprefill_turns,
    sample_turns,
)

__all__ = [
    "BACKENDS",
    "DecodeSettings",
    "GenerationOutput",
    "MultiTurnOutput",
    "Respond",
    "SamplingParams",
    "apply_min_p",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "completion_masks",
    "distinct_prompts",
    "fast_path_problem",
    "generate_completions",
    "generate_turns",
    "left_pad",
    "pack_turns",
    "process_logits",
    "reprefill_turns",
    "sample_completions",
    "sample_next_tokens",
    "sample_turns",
    "sampled_logps",
    "sampler_options",
    "token_presence",
]
