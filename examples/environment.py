"""GRPO on a multi-turn environment, complete: ``python examples/environment.py [max_steps] [output_dir]``.

The model answers an addition prompt (``33+88=``) and the environment says "higher" or "lower" until it names
the sum or has used its five guesses; the reward is 1 / guesses for a right answer, plus a little for each
near miss (the rewards of a rollout's steps are summed). ``env_factory`` makes one
environment per rollout; ``environment_reward`` trains on the environment's own reward (0.0 for a rollout that
never earned one, the usual case for an untrained model). docs/agents.md "Environments" shows this file, and
tests/test_rollouts.py runs it for two steps.
"""

import sys
import tempfile

from treadle import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer, toy
from treadle.rollouts import environment_reward


class GuessTheNumber:
    """Higher/lower feedback until the model names the secret (a row's `answer`)."""

    role = "user"  # how its turns appear in transcripts and chat templates (default "user")

    def reset(self, row: dict) -> str:
        self.secret, self.guesses = int(row["answer"]), 0
        return " Guess:"  # the first observation, appended to the prompt

    def step(self, text: str) -> tuple[str, float | None, bool]:
        self.guesses += 1
        guess = int(text) if text.strip().isdigit() else -1
        if guess == self.secret:
            return "", 1.0 / self.guesses, True  # (observation, reward or None, done)
        near = 0.1 * max(0.0, 1 - abs(guess - self.secret) / 100) if guess >= 0 else None  # a near miss: a little
        return (" higher" if guess < self.secret else " lower"), near, self.guesses >= 5


def main(max_steps: int = 20, output_dir: str | None = None, sft_steps: int = 60) -> GRPOTrainer:
    output_dir = output_dir or tempfile.mkdtemp()
    tokenizer, model = toy.build_tokenizer(), toy.build_model("tiny")
    # A short SFT warm start teaches the format (digits, then EOS): an untrained model rarely ends a turn, so
    # every rollout would run out of tokens with no reward and GRPO would have nothing to learn from.
    sft = SFTConfig(
        output_dir=f"{output_dir}/sft",
        max_steps=sft_steps,
        per_device_train_batch_size=32,
        learning_rate=2e-3,
        logging_steps=sft_steps,
        save_strategy="no",
        disable_tqdm=True,
    )
    SFTTrainer(model, args=sft, train_dataset=toy.load_task("addition", n=2048), processing_class=tokenizer).train()
    args = GRPOConfig(
        output_dir=f"{output_dir}/grpo",
        max_steps=max_steps,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=48,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        rollout_workers=0,
    )  # a fast environment: step it in the sampling loop, bit-reproducible
    trainer = GRPOTrainer(
        model,
        environment_reward,
        args=args,
        train_dataset=toy.load_task("addition", kind="rl"),
        processing_class=tokenizer,
        env_factory=GuessTheNumber,
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main(*(int(a) if i == 0 else a for i, a in enumerate(sys.argv[1:3])))
