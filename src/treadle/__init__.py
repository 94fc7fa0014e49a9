"""treadle: a short training loop of overridable methods, plus SFT, DPO and GRPO trainers built on it.

Public names are imported lazily (PEP 562) so that ``import treadle`` costs little more than
``import torch``; a trainer module and its dependencies load the first time its name is used.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
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


def keep_freed_memory() -> bool:
    """Have glibc keep the memory a program frees for its next allocations (``mallopt``: large blocks from the heap,
    never trimmed); True where it did. A training step frees its activations and allocates them again; by default
    glibc hands each block over 32 MB back to the kernel, which faults it in again, zeroed, at the next step: about
    a million page faults and 4-19 s of kernel time in a 35-50 s GRPO step of the real model (docs/performance.md).
    Called once at ``import treadle``; ``TREADLE_KEEP_FREED_MEMORY=0`` leaves glibc's defaults. The cost: the
    process keeps its peak memory until it exits."""
    if os.environ.get("TREADLE_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, -1))  # -1: never trim


keep_freed_memory()


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
