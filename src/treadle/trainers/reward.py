"""Reward modelling: ``RewardConfig`` + ``RewardTrainer``, by overriding ``Trainer.compute_loss``.

A Bradley–Terry model (Ouyang et al. 2022, https://arxiv.org/abs/2203.02155) on preference pairs: a sequence-
classification model with one output scores prompt + chosen (``r_c``) and prompt + rejected (``r_r``); each pair's
loss is ``-logsigmoid(r_c - r_r - margin)``, plus ``center_rewards_coefficient * (r_c + r_r)²`` to keep rewards near 0
(Eisenstein et al. 2023, https://arxiv.org/abs/2312.09244). Data flow::

    rows {prompt, chosen, rejected} (text or chat; or {chosen, rejected} sharing a prompt prefix; optional margin)
      -> prepare_dataset(): tokenised once by DPO's rules (``trainers.pairs.tokenize_row``), too-long pairs dropped
      -> RewardCollator: the B chosen sequences then the B rejected ones (DPOCollator) + ``margin`` (B,)
      -> compute_loss(): ONE forward over the 2B rows -> losses.bradley_terry_loss, summed / pairs of the window

The saved model (``trainer.save_model(path)``) is a GRPO reward function through
``treadle.rewards.from_reward_model(path)`` (docs/reward.md).

Departures from TRL's RewardTrainer:

1. Normalisation: per-pair losses are summed and divided by the pairs of the whole accumulation window on all
   ranks (as DPOTrainer), so accumulation gives exactly the big batch's gradient.
2. Prompt and responses are tokenised separately and text responses get eos (DPOTrainer's rules); TRL tokenises
   ``prompt + chosen`` as one text. Pairs whose chosen or rejected sequence exceeds ``max_length`` are dropped, as
   TRL does.
3. Metrics: ``accuracy``, ``margin`` and ``mean_reward`` as means over the pairs (rows) since the last log;
   TRL's ``min_reward`` / ``max_reward`` are not logged (the metrics window keeps sums, not extremes).
   ``num_tokens`` (TRL's count: every training micro-batch's attention-mask tokens) is a run total that a resumed
   run continues (TRL's restarts at 0), in training logs only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from treadle.arguments import TrainingArguments
from treadle.data import column_names, require_columns
from treadle.losses import bradley_terry_loss
from treadle.metrics import mode_of
from treadle.models import from_name
from treadle.text import pad_token_id
from treadle.trainer import Trainer
from treadle.trainers.dpo import ChosenRejected, DPOCollator, pair_count
from treadle.trainers.pairs import ID_COLUMNS, tokenize_row


@dataclass
class RewardConfig(TrainingArguments):
    """TrainingArguments plus the reward-model fields (names and defaults as TRL's RewardConfig)."""

    learning_rate: float = 1e-4  # a fresh scalar head wants larger steps than RL fine-tuning (TRL's default)
    max_length: int | None = 1024  # pairs with a longer chosen or rejected sequence are dropped; None keeps all
    center_rewards_coefficient: float | None = None  # weight of (r_c + r_r)^2, pulls rewards to mean 0 (0.01)
    dataset_num_proc: int | None = None  # processes for tokenising datasets; None tokenises in this process

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length must be >= 2 or None, got {self.max_length}")
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise ValueError(
                f"center_rewards_coefficient must be >= 0 or None (0.01 is usual), "
                f"got {self.center_rewards_coefficient}"
            )


class RewardCollator(DPOCollator):
    """DPOCollator's batch (``input_ids`` / ``attention_mask`` ``(2B, T)``, chosen rows first) plus ``margin``
    ``(B,)`` float32 when every row has one."""

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        batch = super().__call__(rows)
        if all(row.get("margin") is not None for row in rows):
            batch["margin"] = torch.tensor([float(row["margin"]) for row in rows], dtype=torch.float32)
        return batch


class RewardTrainer(Trainer):
    """Trains a sequence-classification ``model`` with one output (``num_labels=1``; its config needs a
    ``pad_token_id`` to find each row's last token) to score chosen responses above rejected ones."""

    config_class = RewardConfig
    watched_metrics = ("accuracy",)
    logs_num_tokens = True  # TRL's num_tokens: the attention-mask tokens of every training micro-batch
    scored_only = True  # evaluation scores the model (its mean loss per batch), it asks for no predictions

    def __init__(
        self,
        model=None,
        args: RewardConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        args = self.check_args(args)
        if isinstance(model, str):  # a folder or Hub id: a one-score head on it, as TRL's RewardTrainer loads it
            from transformers import AutoModelForSequenceClassification  # transformers' model classes load ~5 s

            model, processing_class = from_name(
                model, processing_class, args, model_class=AutoModelForSequenceClassification, num_labels=1
            )
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "pad_token_id", 0) is None and processing_class is not None:
            config.pad_token_id = pad_token_id(
                processing_class
            )  # the head finds each row's last token by it (TRL too)
        collator = data_collator if data_collator is not None else RewardCollator(pad_token_id(processing_class))
        super().__init__(
            model, args, collator, None, None, processing_class, compute_metrics, callbacks, optimizers, peft_config
        )
        self.train_dataset = None if train_dataset is None else self.prepare_dataset(train_dataset, "train")
        self.eval_dataset = None if eval_dataset is None else self.prepare_dataset(eval_dataset, "eval")

    def prepare_dataset(self, dataset, split: str):
        """Tokenise every pair once (``trainers.pairs.tokenize_row``: text or chat, explicit or implicit prompt, or
        ``*_input_ids`` columns), keep ``margin`` if present, and drop pairs longer than ``max_length``."""
        from datasets import Dataset

        if isinstance(dataset, (list, tuple)):
            dataset = Dataset.from_list(list(dataset))
        names = column_names(dataset) or []
        if not all(c in names for c in ID_COLUMNS):
            require_columns(
                dataset,
                ["chosen", "rejected"],
                what=f"RewardTrainer's {split} dataset",
                fix="Give rows {prompt, chosen, rejected} (text or chat messages), or {chosen, "
                "rejected} that share the prompt as a prefix; an optional 'margin' column.",
            )
        fn = functools.partial(
            tokenize_row,
            tokenizer=self.processing_class,
            max_length=None,
            max_prompt_length=None,
            truncation_mode="keep_end",
        )
        kwargs = (
            dict(num_proc=self.args.dataset_num_proc, desc=f"Tokenizing {split} dataset")
            if isinstance(dataset, Dataset)
            else {}
        )  # a stream (IterableDataset) maps lazily
        dataset = dataset.map(
            fn, with_indices=True, remove_columns=[c for c in names if c != "margin"] or None, **kwargs
        )
        limit = self.args.max_length
        if limit is not None:
            dataset = dataset.filter(
                lambda row: len(row[ID_COLUMNS[0]]) + max(len(row[ID_COLUMNS[1]]), len(row[ID_COLUMNS[2]])) <= limit
            )
        return dataset

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is not None:
            eval_dataset = self.prepare_dataset(eval_dataset, "eval")
        return super().get_eval_dataloader(eval_dataset)

    def signature_columns(self) -> set[str]:
        return set(ID_COLUMNS) | {"margin"}

    def count_items(self, inputs: dict) -> int:
        """A loss item is a pair; ``get_num_items_in_batch`` sums this over the window and the ranks."""
        return pair_count(inputs["input_ids"].shape[0])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Sum of the per-pair Bradley–Terry losses divided by ``num_items_in_batch`` (the pairs of the whole
        window, all ranks), or their mean when it is None. Records accuracy, margin and mean reward."""
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        logits = outputs.logits  # (2B, 1)
        if logits.dim() != 2 or logits.shape[-1] != 1:
            raise ValueError(
                f"RewardTrainer needs a model with one output per sequence (num_labels=1), got logits of "
                f"shape {tuple(logits.shape)}; e.g. AutoModelForSequenceClassification.from_pretrained("
                f"path, num_labels=1)"
            )
        rewards = ChosenRejected.split(logits.squeeze(-1))  # (B,) each
        losses = bradley_terry_loss(
            rewards.chosen,
            rewards.rejected,
            margin=inputs.get("margin"),
            center_rewards_coefficient=self.args.center_rewards_coefficient,
        )
        self.record_metrics(rewards, mode=mode_of(model))
        loss = losses.sum() / (num_items_in_batch if num_items_in_batch is not None else len(losses))
        return (loss, outputs) if return_outputs else loss

    def record_metrics(self, rewards: ChosenRejected, mode: str) -> None:
        chosen, rejected = rewards.chosen.detach(), rewards.rejected.detach()
        pairs = float(chosen.shape[0])
        self.metrics.add_many(
            {
                "accuracy": ((chosen > rejected).sum(), pairs),
                "margin": ((chosen - rejected).sum(), pairs),
                "mean_reward": (chosen.sum() + rejected.sum(), 2 * pairs),
            },
            mode,
        )


__all__ = ["RewardConfig", "RewardTrainer", "RewardCollator"]
