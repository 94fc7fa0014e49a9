"""What GRPO and on-policy distillation share, in rooms: ``trainer`` (``OnPolicyTrainer``), ``config``
(``OnPolicyConfig``), ``data`` (the typed prompts, rollouts, samples, tickets and the generation buffer), ``sampler``
(the one object sampling goes through: synchronous, multi-turn or asynchronous), ``inputs`` (the reward functions,
tokenizer and dataset checked, prompt tokens, seeded generators), ``metrics`` (completion lengths, the step clock,
evaluation sums), ``vision`` (prompts with images), ``producer`` and ``worker`` (asynchronous generation,
``max_staleness``). Import from the rooms inside treadle; this file re-exports the public names."""

from treadle.trainers.onpolicy.config import OnPolicyConfig
from treadle.trainers.onpolicy.data import Rollout, Sample
from treadle.trainers.onpolicy.trainer import OnPolicyTrainer

__all__ = ["OnPolicyConfig", "OnPolicyTrainer", "Rollout", "Sample"]
