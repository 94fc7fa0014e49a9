"""One asynchronous GRPO run for tests/test_async_grpo.py, in this process or its own: ``python
tests/_async_run.py SPEC.json``. The test imports ``run`` for the uninterrupted references and runs this file as a
script for the run that is killed with SIGKILL, so both build the run from the same code.

The spec (a JSON object) holds ``output_dir`` plus any of: GRPOConfig fields (overriding ``ARGS``); ``resume``
(passed to ``train``); ``kill_at`` (SIGKILL this process at the end of that step, after the checkpoints before it
were written); ``final`` (save the final weights there with ``torch.save``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys

import torch
from _factories import digit_sum_reward  # tests/ is on the path: pytest's, passed on to the script's process

from treadle.callbacks import TrainerCallback
from treadle.demos import toy
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

ARGS = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=3,
    max_steps=4,
    learning_rate=1e-2,
    disable_tqdm=True,
    save_strategy="no",
    logging_steps=1,
    seed=3,
)


class _KillAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def weights(trainer) -> dict:
    """A copy of the trained model's weights."""
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    """Bit for bit the same weights."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def build(spec: dict, callbacks=(), trainer_class=GRPOTrainer, **trainer_kwargs) -> GRPOTrainer:
    """The run of ``spec`` (a ``trainer_class``, default GRPOTrainer; ``trainer_kwargs``: more of its arguments)."""
    fields = GRPOConfig.field_names() - {"output_dir"}
    args = GRPOConfig(output_dir=spec["output_dir"], **{**ARGS, **{k: v for k, v in spec.items() if k in fields}})
    tok = toy.build_tokenizer()
    callbacks = list(callbacks) + ([_KillAt(spec["kill_at"])] if spec.get("kill_at") else [])
    return trainer_class(
        toy.build_model("tiny", tokenizer=tok, seed=0),
        digit_sum_reward,
        args=args,
        train_dataset=toy.load_task("addition", kind="rl", n=32),
        processing_class=tok,
        callbacks=callbacks,
        **trainer_kwargs,
    )


@contextlib.contextmanager
def one_thread():
    """One torch thread, as in every process of these tests (the thread count is given back after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run(spec: dict, callbacks=()) -> GRPOTrainer:
    """Build the run the spec describes and train it, on one torch thread."""
    with one_thread():
        trainer = build(spec, callbacks)
        trainer.train(resume_from_checkpoint=spec.get("resume"))
    if spec.get("final"):
        torch.save(trainer.model.state_dict(), spec["final"])
    return trainer


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        run(json.load(f))
