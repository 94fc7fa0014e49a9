"""One training run of the resume tests, in a process of its own: ``python tests/_resume_worker.py SPEC.json``.

tests/test_resume.py imports this module for the in-process runs (the uninterrupted references) and runs it as
a script for everything that needs a real, separate process: resuming in a new interpreter, SIGKILL in the
middle of a save, SIGTERM during a step. Both paths build the run from the same ``run(spec)``, so the only
difference between a reference and a resumed run is the interruption.

The spec (a JSON object) holds ``output_dir`` plus any of:

``logging_steps`` ... any TrainingArguments field, overriding ``ARGS``
``resume``          passed to ``train(resume_from_checkpoint=...)`` (true, or a checkpoint path)
``stop_at``         a callback sets ``control.should_training_stop`` at the end of this step (a clean stop)
``hang_in_save_at`` the save of ``checkpoint-<step>`` writes its weights, then touches ``marker`` and sleeps
                    until the test kills the process: a SIGKILL in the middle of a save
``sigterm_at``      between the two micro-batches of this step, touch ``marker`` and wait for ``go`` (the test
                    sends SIGTERM, then creates ``go``): a preemption in the middle of an optimizer step
``result``          at ``on_train_end``: JSON with the log history, the steps this process ran and the step
                    it ended at; after ``train()`` returns, the final weights go to ``output_dir/final``
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from _factories import lm_rows, tiny_llama  # this script's folder, tests/, is on the path

from treadle.callbacks import TrainerCallback

ARGS = dict(
    max_steps=9,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=1e-2,
    weight_decay=0.01,
    warmup_steps=2,
    lr_scheduler_type="linear",
    max_grad_norm=1.0,
    logging_steps=1,
    save_steps=1000,
    disable_tqdm=True,
    seed=7,
)
NUM_ROWS = 22  # 11 micro-batches of 2: 6 optimizer steps per epoch, the last one with a single micro-batch
VOCAB = 64


def make_model(seed: int = 0):
    """The tiny Llama with attention dropout, so that a resumed run must restore the torch RNG to match; the global
    RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        return tiny_llama(seed, VOCAB, dropout=0.2)


def make_rows(n: int = NUM_ROWS, seed: int = 1) -> list[dict]:
    """Variable-length rows whose labels mask a prompt of random length: every window has its own item count."""
    return lm_rows(n, seed, VOCAB)


def make_args(output_dir: str, **overrides):
    from treadle.arguments import TrainingArguments

    return TrainingArguments(output_dir=output_dir, **{**ARGS, **overrides})


def run(spec: dict):
    """Build the trainer the spec describes and train it; returns the Trainer (when train() returns)."""
    from treadle.arguments import TrainingArguments
    from treadle.trainer import Trainer

    torch.set_num_threads(1)  # the same reduction order in every process, whatever the machine has
    fields = TrainingArguments.field_names() - {"output_dir"}
    args = make_args(spec["output_dir"], **{k: v for k, v in spec.items() if k in fields})
    trainer = Trainer(make_model(), args, train_dataset=make_rows(), callbacks=[_SpecCallback(spec)])
    if spec.get("hang_in_save_at") is not None:
        _hang_inside_save(spec["hang_in_save_at"], spec["marker"])
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    return trainer


def _touch(path: str) -> None:
    with open(path, "w") as f:
        f.write(str(os.getpid()))


def _hang_inside_save(step: int, marker: str) -> None:
    """Make the save of checkpoint-<step> stop half-way (weights written, nothing else) until killed."""
    from treadle import checkpoint

    original = checkpoint.save_weights

    def save_weights_then_hang(model, directory, **kwargs):
        original(model, directory, **kwargs)
        if os.path.basename(directory).endswith(f"checkpoint-{step}"):
            _touch(marker)
            time.sleep(600)

    checkpoint.save_weights = save_weights_then_hang


class _SpecCallback(TrainerCallback):
    """Stops, waits for a signal, and records what this process ran."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.steps: list[int] = []

    def on_substep_end(self, args, state, control, **kwargs):
        if self.spec.get("sigterm_at") == state.global_step + 1:  # inside that step, after its 1st micro-batch
            _touch(self.spec["marker"])
            deadline = time.time() + 120
            while not os.path.exists(self.spec["go"]) and time.time() < deadline:
                time.sleep(0.01)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)
        if self.spec.get("stop_at") == state.global_step:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.spec.get("result"):
            with open(self.spec["result"], "w") as f:
                json.dump(
                    {"log_history": state.log_history, "steps": self.steps, "train_end_step": state.global_step}, f
                )


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    trainer = run(spec)
    trainer.save_model(os.path.join(spec["output_dir"], "final"))


if __name__ == "__main__":
    main()
