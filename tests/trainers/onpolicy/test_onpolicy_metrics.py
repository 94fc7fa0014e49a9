"""What every on-policy trainer records (trainers/onpolicy/metrics.py): a generation's completion lengths and
``num_tokens`` (TRL's names and meaning) by hand, and ``step_time`` on a fake clock through GRPO and distillation."""

import types

import pytest
import torch
from _factories import grpo_trainer

from treadle.demos import toy
from treadle.generation import GenerationOutput, completion_masks, left_pad
from treadle.trainers.distillation import DistillationConfig, DistillationTrainer
from treadle.trainers.onpolicy import trainer as onpolicy_trainer
from treadle.trainers.onpolicy.data import Rollout
from treadle.trainers.onpolicy.metrics import StepClock, completion_metrics

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


def test_the_step_clock_adds_the_window_s_preparation_and_its_training_steps():
    clock = StepClock()
    clock.start(1.5, micro_steps=3)
    assert [clock.add(s) for s in (0.25, 0.25, 0.5)] == [None, None, 2.5]
    assert clock.add(9.0) is None  # no window open: nothing is timed
    clock.start(0.0, micro_steps=1)
    assert clock.add(1.0) == 1.0  # a new window starts from its own preparation


class FakeClock:
    """``time`` for the on-policy trainer's module: ``perf_counter`` advances one second a call."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def step_times(trainer, monkeypatch) -> list[float]:
    monkeypatch.setattr(onpolicy_trainer, "time", types.SimpleNamespace(perf_counter=FakeClock().perf_counter))
    trainer.train()
    return [h["step_time"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_grpo_step_time_is_the_window_s_sampling_and_training_steps(tmp_path, tok, dataset, monkeypatch, accumulation):
    """On a clock that advances 1 s a reading, prepare_window (sampling, scoring: two readings) takes 1 s and each
    training step 1 s: a step of ``accumulation`` micro-batches takes 1 + accumulation seconds, however many
    steps' windows a generation feeds (TRL's step_time: the optimizer step itself is not timed)."""
    trainer = grpo_trainer(
        tmp_path,
        tok,
        dataset,
        max_steps=4,
        logging_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=2,
    )
    assert step_times(trainer, monkeypatch) == [1.0 + accumulation] * 4


def test_distillation_logs_trl_s_completion_metrics_and_step_time(tmp_path, tok, dataset, monkeypatch):
    """The same rule as GRPO's (``completion_metrics``) on fixed completions: lengths 3, 4, 1, 2, the second without
    EOS; ``step_time`` as GRPO's; ``num_tokens`` the prompts' tokens and the completions' lengths."""
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
    assert step_times(trainer, monkeypatch) == [2.0]
    [log] = [h for h in trainer.state.log_history if "loss" in h]
    assert log["num_tokens"] == sum(map(len, prompts)) + 3 + 4 + 1 + 2
    expected = {"mean_length": 2.5, "min_length": 1, "max_length": 4, "clipped_ratio": 0.25}
    expected |= {"mean_terminated_length": 2.0, "min_terminated_length": 1, "max_terminated_length": 3}
    assert {k: log[f"completions/{k}"] for k in expected} == pytest.approx(expected)
