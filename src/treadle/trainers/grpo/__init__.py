"""GRPO, in rooms: ``trainer`` (``GRPOTrainer``), ``config`` (``GRPOConfig``), ``dynamic`` (DAPO's dynamic sampling),
``correction`` (the sampler correction), ``metrics`` (what a generation records), ``health`` (the health checks);
what it shares with on-policy distillation is in trainers/onpolicy/. Import from the rooms inside treadle; this file
re-exports the public names."""

from treadle.trainers.grpo.config import GRPOConfig
from treadle.trainers.grpo.trainer import GRPOTrainer
from treadle.trainers.onpolicy.data import Sample

__all__ = ["GRPOConfig", "GRPOTrainer", "Sample"]
