"""treadle: a short training loop of overridable methods, plus SFT, DPO and GRPO trainers built on it.

Public names are imported lazily (PEP 562) so that ``import treadle`` costs little more than
``import torch``; a trainer module and its dependencies load the first time its name is used. Importing treadle, or
any module of it, changes nothing of the process (allocator, threads, logging, signals): the process's policy is
its owner's (the ``treadle`` command, ``Trainer.train``; treadle.allocator).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_LAZY = {
    "TrainingArguments": "treadle.arguments",
    "TrainerCallback": "treadle.callbacks",
    "TrainerState": "treadle.state",
    "TrainerControl": "treadle.state",
    "EarlyStoppingCallback": "treadle.callbacks",
    "Trainer": "treadle.trainer",
    "EvalPrediction": "treadle.metrics",
    "SFTTrainer": "treadle.trainers.sft",
    "SFTConfig": "treadle.trainers.sft",
    "DPOTrainer": "treadle.trainers.dpo",
    "DPOConfig": "treadle.trainers.dpo",
    "GRPOTrainer": "treadle.trainers.grpo",
    "GRPOConfig": "treadle.trainers.grpo",
    "RewardTrainer": "treadle.trainers.reward",
    "RewardConfig": "treadle.trainers.reward",
    "KTOTrainer": "treadle.trainers.kto",
    "KTOConfig": "treadle.trainers.kto",
    "DistillationTrainer": "treadle.trainers.distillation",
    "DistillationConfig": "treadle.trainers.distillation",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'treadle' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from treadle.arguments import TrainingArguments
    from treadle.callbacks import EarlyStoppingCallback, TrainerCallback
    from treadle.metrics import EvalPrediction
    from treadle.state import TrainerControl, TrainerState
    from treadle.trainer import Trainer
    from treadle.trainers.distillation import DistillationConfig, DistillationTrainer
    from treadle.trainers.dpo import DPOConfig, DPOTrainer
    from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer
    from treadle.trainers.kto import KTOConfig, KTOTrainer
    from treadle.trainers.reward import RewardConfig, RewardTrainer
    from treadle.trainers.sft import SFTConfig, SFTTrainer
