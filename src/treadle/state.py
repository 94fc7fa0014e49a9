"""The loop's state: ``TrainerState`` (saved in every checkpoint as ``trainer_state.json``), ``TrainerControl``
(the one channel through which callbacks steer the loop) and ``LoopState`` (the step in progress; not saved).
Fields and names follow ``transformers.TrainerState`` / ``TrainerControl``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from treadle import distributed as dist, streaming
from treadle.record import fingerprints


@dataclass
class TrainerState:
    """What the loop knows about the run; saved as ``trainer_state.json`` in every checkpoint."""

    epoch: float = 0.0  # fractional epoch reached (2.5 = halfway through the third epoch)
    global_step: int = 0  # optimizer steps done
    max_steps: int = 0  # optimizer steps this run will do
    num_train_epochs: int = 0  # epochs this run will start
    steps_per_epoch: int = 0  # optimizer steps in one pass over the training dataloader
    logging_steps: int = 10
    eval_steps: int = 10
    save_steps: int = 500
    train_batch_size: int = 0  # per-device micro-batch rows
    gradient_accumulation_steps: int = 1
    world_size: int = 1
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    total_loss_sum: float = 0.0  # item-weighted loss summed over the whole run (survives resumes)
    total_loss_items: float = 0.0
    num_input_tokens_seen: int = 0  # counted when args.include_num_input_tokens_seen is not "no"
    num_tokens: int = 0  # TRL's num_tokens: tokens trained on, as of the last log (metrics.record_num_tokens)
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)  # callback name -> its saved state
    trainer_class: str | None = None  # the Trainer class of the run (resuming with another one is refused)
    config_fingerprint: str | None = None  # of the settings that shape the run (fingerprints.config_fingerprint)
    nonfinite_steps_skipped: int = 0  # steps skipped for a NaN / inf loss (args.skip_nonfinite_steps)
    dataset_fingerprint: str | None = None  # of the training rows (streaming): a resume into other rows is refused

    # --- read by transformers' tracker callbacks (treadle.trackers); treadle runs no hyper-parameter search
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None

    @classmethod
    def for_run(cls, args, *, trainer=None, **plan) -> TrainerState:
        """The state at the start of a run with ``args``: its cadence, batch shape and process layout, and the
        ``plan`` (``steps_per_epoch``, ``max_steps``, ``num_train_epochs``); with ``trainer``, its class name and
        the fingerprint of its training dataset (a resume into another dataset is refused by it)."""
        if trainer is not None:
            plan.update(
                trainer_class=type(trainer).__name__,
                dataset_fingerprint=streaming.sampled_dataset_fingerprint(trainer.train_dataset)
                or streaming.head_fingerprint(trainer.train_dataset),
            )
        return cls(
            logging_steps=args.logging_steps,
            eval_steps=args.eval_steps,
            save_steps=args.save_steps,
            config_fingerprint=fingerprints.config_fingerprint(args),
            train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            world_size=dist.get_world_size(),
            is_world_process_zero=dist.is_main_process(),
            is_local_process_zero=args.local_process_index == 0,
            **plan,
        )

    def save_to_json(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load_from_json(cls, path: str) -> TrainerState:
        with open(path) as f:
            data = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class LoopState:
    """The loop's bookkeeping that is not ``TrainerState`` (not saved: a step never spans a checkpoint).
    Created in ``__init__``; outside ``train()`` it describes one lone micro-batch, so that ``training_step``
    can be called on its own."""

    window_size: int = 1  # micro-batches in the accumulation window of the step in progress
    micro_batch: Any = None  # the raw micro-batch in training_step: compute_loss counts its items there if needed
    grad_norm: Any = None  # of the last optimizer step, before clipping
    learning_rate: float | None = None  # the learning rate the last optimizer step used
    last_saved_step: int | None = None
    last_eval: tuple[int | None, dict | None] = (None, None)  # (step, metrics) of the latest evaluation


@dataclass
class TrainerControl:
    """The one channel through which callbacks steer the loop."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False
