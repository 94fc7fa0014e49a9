"""treadle: a short training loop of overridable methods, plus SFT, DPO and GRPO trainers built on it.

Public names are imported lazily (PEP 562) so that ``import treadle`` costs little more than
``import torch``; a trainer module and its dependencies load the first time its name is used.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

# Large CPU tensors on transparent huge pages (torch's own switch, read at its first tensor allocation). A training
# step frees its activations and allocates them again; on 4 KiB pages the kernel faults every page in afresh, about a
# million faults a step on the real model's GRPO step, where huge pages cut the step by a tenth (docs/performance.md).
# THP_MEM_ALLOC_ENABLE=0 keeps torch's default; it changes nothing once torch has allocated a tensor.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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
