"""GRPO, in rooms: ``trainer`` (``GRPOTrainer``), ``config`` (``GRPOConfig``), ``data`` (the typed rollouts,
samples, tickets and the generation buffer), ``vision`` (prompts with images), ``dynamic`` (DAPO's dynamic
sampling), ``correction`` (the sampler correction), ``records`` (what a generation records), ``asynchronous`` and
``worker`` (``max_staleness``). Import from the rooms inside treadle; this file re-exports the public names."""

from treadle.trainers.grpo.config import GRPOConfig
from treadle.trainers.onpolicy.data import Sample
from treadle.trainers.grpo.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "Sample"]
