"""The elastic-restart job of tests/test_elastic.py, run by ``torchrun --max-restarts 1 --nproc-per-node 2``::

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 tests/_elastic_worker.py OUT

Attempt 0 (``TORCHELASTIC_RESTART_COUNT=0``) first trains the uninterrupted reference (6 steps, checkpoints
every 2) into ``OUT/reference``, then starts the same run into ``OUT/elastic`` with
``resume_from_checkpoint="auto"``; rank 0 SIGKILLs itself in the middle of writing checkpoint-4 (its weights
written into ``.tmp-checkpoint-4``, nothing else), after touching ``OUT/attempt-0-killed``. torchrun stops rank
1 and restarts both; attempt 1 runs the same command, which must find checkpoint-2 and finish the run. Rank 0
of attempt 1 writes ``OUT/attempt-1`` (the step it resumed at and the steps it trained).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import _dist_worker as builders
import torch

from treadle import Trainer, checkpoint, distributed as dist
from treadle.callbacks import TrainerCallback

STEPS, KILL_IN_SAVE_OF = 6, 4


class _Record(TrainerCallback):
    def __init__(self):
        self.resumed_at, self.steps = None, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.resumed_at = state.global_step

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def train(output_dir: str, resume=None) -> _Record:
    record = _Record()
    args = builders.trainer_args(output_dir, 2, max_steps=STEPS, save_steps=2)
    trainer = Trainer(builders.tiny_llama(), args, train_dataset=builders.lm_rows(32, seed=1), callbacks=[record])
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(output_dir, "final"))
    return record


def _die_inside_save(marker: str) -> None:
    original = checkpoint.save_weights

    def save_weights_then_die(model, directory, **kwargs):
        original(model, directory, **kwargs)
        if os.path.basename(directory) == f"{checkpoint.TMP_PREFIX}{KILL_IN_SAVE_OF}":
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.save_weights = save_weights_then_die


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_distributed(torch.device("cpu"))
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0:
        train(os.path.join(out, "reference"))
        if dist.is_main_process():
            _die_inside_save(os.path.join(out, "attempt-0-killed"))
    record = train(os.path.join(out, "elastic"), resume="auto")
    if dist.is_main_process():
        with open(os.path.join(out, f"attempt-{attempt}"), "w") as f:
            json.dump({"resumed_at": record.resumed_at, "steps": record.steps}, f)
    dist.finish()  # frees the trainers' reference cycles that hold the group first (pytorch/pytorch#190489)


if __name__ == "__main__":
    main(sys.argv[1])
