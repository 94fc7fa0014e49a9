"""What every on-policy trainer records (trainers/onpolicy/records.py): a generation's completion lengths and
``num_tokens`` (TRL's names and meaning) by hand."""

import pytest
import torch

from treadle.demos import toy
from treadle.generation import GenerationOutput, completion_masks, left_pad
from treadle.trainers.distillation import DistillationConfig, DistillationTrainer
from treadle.trainers.onpolicy.data import Rollout
from treadle.trainers.onpolicy.records import completion_metrics

EOS = 2  # the toy tokenizer's eos id


def rollout(prompts: list[list[int]], raw: list[list[int]], loss_mask: list[list[int]] | None = None) -> Rollout:
    """A rollout of one completion per prompt: ``raw`` cut after its first EOS (the sampler's rule)."""
    prompt_ids, prompt_mask = left_pad(prompts, 0)
    completion_ids, completion_mask, truncated = completion_masks(torch.tensor(raw), (EOS,), 0)
    out = GenerationOutput(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated)
    extra = {} if loss_mask is None else {"loss_mask": torch.tensor(loss_mask)}
    rows = [{"prompt": "p"} for _ in prompts]
    return Rollout.of(rows, out, ["c"] * len(prompts), completion_ids.tolist(), **extra)


def test_lengths_of_all_and_of_the_terminated_completions():
    """Lengths 2, 3, 1, 3 (EOS counted); the second hit the limit without EOS: the terminated ones are 2, 1, 3.
    num_tokens: 3 + 2 + 3 + 1 prompt tokens and 9 completion tokens, a total (count 0), not a mean."""
    got = completion_metrics(
        rollout([[7, 8, 9], [7, 8], [7, 8, 9], [7]], [[10, EOS, 0], [10, 11, 12], [EOS, 0, 0], [13, 14, EOS]])
    )
    assert got == {
        "num_tokens": (18.0, 0),
        "completions/mean_length": (2.25, 1),
        "completions/min_length": (1.0, 1),
        "completions/max_length": (3.0, 1),
        "completions/clipped_ratio": (0.25, 1),
        "completions/mean_terminated_length": (2.0, 1),
        "completions/min_terminated_length": (1.0, 1),
        "completions/max_terminated_length": (3.0, 1),
    }


def test_no_completion_ended_with_eos_gives_terminated_lengths_of_zero():
    """As TRL: with no terminated completion, the terminated lengths are those of one completion of length 0."""
    got = completion_metrics(rollout([[7], [7]], [[10, 11], [12, 13]]))
    assert got["completions/clipped_ratio"] == (1.0, 1)
    assert got["completions/mean_length"] == (2.0, 1)
    for stat in ("mean", "min", "max"):
        assert got[f"completions/{stat}_terminated_length"] == (0.0, 1)


def test_multi_turn_lengths_count_the_sampled_tokens_only():
    """A multi-turn rollout's completion holds fed tokens (a tool's result): as TRL's ``tool_mask``, a completion's
    length and num_tokens count what the model sampled (the rollout's loss mask), not what was fed."""
    # row 0: a sampled turn (10, EOS), a fed result (30, 31), a sampled turn (12, EOS); row 1: one turn (11, EOS)
    raw = [[10, 30, 31, 12, EOS], [11, EOS, 0, 0, 0]]
    sampled = [[1, 0, 0, 1, 1], [1, 1, 0, 0, 0]]
    got = completion_metrics(rollout([[7, 8], [7, 8]], raw, loss_mask=sampled))
    assert got["completions/mean_length"] == (2.5, 1) and got["completions/max_length"] == (3.0, 1)
    assert got["completions/min_terminated_length"] == (2.0, 1)
    assert got["num_tokens"] == (4.0 + 5.0, 0)


def test_distillation_logs_trl_s_completion_metrics(tmp_path, tok, dataset):
    """The same rule as GRPO's (``completion_metrics``) on fixed completions: lengths 3, 4, 1, 2, the second without
    EOS; ``num_tokens`` the prompts' tokens and the completions' lengths."""
    fixed = [[5, 6, EOS, 0], [7, 8, 9, 10], [EOS, 0, 0, 0], [11, EOS, 0, 0]]
    prompts = []

    def generate(prompt_ids, *, num_generations, generator=None):
        prompts.extend(p for p in prompt_ids for _ in range(num_generations))
        ids, mask = left_pad([p for p in prompt_ids for _ in range(num_generations)], 0)
        completion_ids, completion_mask, truncated = completion_masks(torch.tensor(fixed[: len(ids)]), (EOS,), 0)
        return GenerationOutput(ids, mask, completion_ids, completion_mask, truncated)

    student = toy.build_model("tiny", tokenizer=tok, seed=0)
    teacher = toy.build_model("tiny", tokenizer=tok, seed=1)
    args = DistillationConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        max_completion_length=4,
        max_steps=1,
        logging_steps=1,
        disable_tqdm=True,
        save_strategy="no",
    )
    trainer = DistillationTrainer(student, teacher, args=args, train_dataset=dataset, processing_class=tok)
    trainer.generate = generate
    trainer.train()
    [log] = [h for h in trainer.state.log_history if "loss" in h]
    assert log["num_tokens"] == sum(map(len, prompts)) + 3 + 4 + 1 + 2
    expected = {"mean_length": 2.5, "min_length": 1, "max_length": 4, "clipped_ratio": 0.25}
    expected |= {"mean_terminated_length": 2.0, "min_terminated_length": 1, "max_terminated_length": 3}
    assert {k: log[f"completions/{k}"] for k in expected} == pytest.approx(expected)
