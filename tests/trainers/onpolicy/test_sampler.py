"""The rollout sampler (trainers/onpolicy/sampler.py): the one object an on-policy trainer samples through. Which kind
the trainer builds, that it calls the interface without asking which kind it holds (a sampler of the user's own
trains as the built-in one does), and the refusals."""

import pytest
import torch
from _factories import grpo_trainer

from treadle.errors import PreflightError
from treadle.trainers.onpolicy.sampler import AsyncSampler, MultiTurnSampler, SyncSampler

pytestmark = pytest.mark.usefixtures("one_thread")


def calc(x: str) -> str:
    """A calculator.

    Args:
        x: an expression
    """
    return x


def test_the_trainer_builds_the_sampler_its_settings_ask_for(tmp_path, tok, dataset):
    plain = grpo_trainer(tmp_path / "a", tok, dataset)
    assert type(plain.rollout_sampler) is SyncSampler and plain.engine is plain.rollout_sampler.engine
    assert plain.rollout_sampler.exact_logps  # the own sampler samples from the live policy
    tools = grpo_trainer(tmp_path / "b", tok, dataset, tools=[calc])
    assert type(tools.rollout_sampler) is MultiTurnSampler and tools.rollout_sampler.runner.tools == [calc]
    ahead = grpo_trainer(tmp_path / "c", tok, dataset, max_staleness=1, async_worker="thread")
    assert type(ahead.rollout_sampler) is AsyncSampler and ahead.rollout_sampler.producer.staleness == 1
    assert not ahead.rollout_sampler.exact_logps and ahead.corrects_sampling  # batches sampled from older weights
    for built in (plain, tools, ahead):
        built.close()


def test_asynchronous_multi_turn_rollouts_are_refused_in_one_line(tmp_path, tok, dataset):
    with pytest.raises(PreflightError, match="max_staleness > 0 samples single-turn completions only"):
        grpo_trainer(tmp_path, tok, dataset, tools=[calc], max_staleness=1)


class Counting(SyncSampler):
    """A sampler of the user's own: the built-in single-turn one, counting what the trainer asks of it."""

    def __init__(self, engine):
        super().__init__(engine)
        self.calls = {"windows": 0, "training_rollout": 0, "sample": 0, "state_dict": 0, "end": 0}

    def windows(self, windows):
        self.calls["windows"] += 1
        return super().windows(windows)

    def training_rollout(self, trainer, rows, generation):
        self.calls["training_rollout"] += 1
        return super().training_rollout(trainer, rows, generation)

    def sample(self, trainer, rows, generator, mode="train"):
        self.calls["sample"] += 1
        return super().sample(trainer, rows, generator, mode)

    def state_dict(self):
        self.calls["state_dict"] += 1
        return {"counted": torch.tensor(self.calls["sample"])}

    def end(self):
        self.calls["end"] += 1


def test_a_sampler_of_ones_own_trains_exactly_as_the_built_in_one(tmp_path, tok, dataset):
    """The trainer calls the interface and nothing else: the same weights, every call through the sampler, its state in
    the checkpoint's extra state, its run ended when training ends."""
    reference = grpo_trainer(tmp_path / "ref", tok, dataset)
    reference.train()
    counted = grpo_trainer(tmp_path / "own", tok, dataset, save_strategy="steps", save_steps=2)
    counted.rollout_sampler = Counting(counted.engine)  # as an override of build_rollout_sampler returns it
    counted.train()
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(tensor, counted.model.state_dict()[name]), name
    calls = counted.rollout_sampler.calls
    assert calls["windows"] == 1 and calls["training_rollout"] == 2 and calls["sample"] == 2 and calls["end"] == 1
    assert calls["state_dict"] == 1  # the one checkpoint, at step 2
    extra = torch.load(str(tmp_path / "own" / "run" / "checkpoint-2" / "extra_state_0.pt"), weights_only=True)
    assert int(extra["trainer"]["counted"]) == 2
