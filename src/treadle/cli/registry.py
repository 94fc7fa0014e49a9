"""The trainers a config can name (``trainer: grpo``), typed: what each builds, the rows it reads and what it takes;
and the config classes of their runs by name, for the report (``run.json`` names the config a run was built with).
The trainers are imported when first asked for (torch and transformers: seconds), so ``treadle report`` on a run
without a config and a config that fails its first checks never pay for them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainerKind", "config_classes", "trainer_kinds"]


@dataclass(frozen=True)
class TrainerKind:
    """What ``trainer: <name>`` in a config builds: the trainer class (its ``config_class`` holds the fields) and
    the rows it reads (the kind of a ``toy:`` dataset)."""

    trainer: type
    rows: str  # "sft", "preference" or "rl"
    takes_reward_funcs: bool = False
    reward_head: bool = False  # the model is a sequence classifier with one label (RewardTrainer)
    takes_teacher: bool = False  # the config names a teacher: (DistillationTrainer)


def trainer_kinds() -> dict[str, TrainerKind]:
    """The trainers a config can name. Imports them (torch, transformers: seconds), so ``treadle report`` and a
    config that fails its first checks never pay for it."""
    from treadle.trainers.distillation import DistillationTrainer  # heavy, as above
    from treadle.trainers.dpo import DPOTrainer  # heavy: torch and transformers, only for `treadle train`
    from treadle.trainers.grpo.trainer import GRPOTrainer  # heavy, as above
    from treadle.trainers.kto import KTOTrainer  # heavy, as above
    from treadle.trainers.reward import RewardTrainer  # heavy, as above
    from treadle.trainers.sft import SFTTrainer  # heavy, as above

    return {
        "sft": TrainerKind(SFTTrainer, "sft"),
        "dpo": TrainerKind(DPOTrainer, "preference"),
        "reward": TrainerKind(RewardTrainer, "preference", reward_head=True),
        "grpo": TrainerKind(GRPOTrainer, "rl", takes_reward_funcs=True),
        "kto": TrainerKind(KTOTrainer, "preference"),  # paired rows are split into unpaired ones
        "distillation": TrainerKind(DistillationTrainer, "rl", takes_teacher=True),
    }


def config_classes() -> dict[str, type]:
    """Every config class a treadle run can be built with, by its name (``TrainingArguments`` for a plain
    ``Trainer``): what ``run.json``'s ``config`` names."""
    from treadle.arguments import TrainingArguments  # heavy, as trainer_kinds

    configs = [TrainingArguments] + [kind.trainer.config_class for kind in trainer_kinds().values()]
    return {config.__name__: config for config in configs}
