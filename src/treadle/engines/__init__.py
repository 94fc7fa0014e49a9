"""Rollout engines: what GRPO and its evaluation ask for completions (``engines.base``: the contract;
``engines.local``: the own KV-cached sampler, the first implementation)."""

from treadle.engines.base import RolloutEngine
from treadle.engines.local import LocalEngine

__all__ = ["LocalEngine", "RolloutEngine"]
