"""Health checks (trainers/grpo/health.py) and dynamic sampling (trainers/grpo/dynamic.py): the pure checks by
hand, each check firing on a crafted run and silent on a normal one, the stop's checkpoint and message, a learning
run whose every completion is truncated warned and not stopped, and a dynamic-sampling run that never trains on a
group of equal rewards."""

import functools
import json
import math
import os
import warnings

import pytest
import torch
from _factories import digit_sum_reward, grpo_args, grpo_trainer

from treadle.callbacks import TrainerCallback
from treadle.demos import toy
from treadle.engines.base import RolloutEngine
from treadle.engines.local import LocalEngine
from treadle.engines.vllm import weight_sync_unchanged
from treadle.errors import is_user_error
from treadle.generation import GenerationOutput
from treadle.metrics import MetricWindow
from treadle.record.plots import collect_series, health_markers, panel_layout, plot_run, read_events
from treadle.state import TrainerControl, TrainerState
from treadle.trainers.grpo.config import HEALTH_CHECKS, resolve_health_checks
from treadle.trainers.grpo.health import (
    HealthCallback,
    HealthWarning,
    TrainingStalled,
    constant_values,
    generation_health,
    log_warnings,
    reward_rose,
    rl_summary,
)
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from treadle.trainers.onpolicy.data import Rollout, join_rows

pytestmark = pytest.mark.usefixtures("one_thread")


# this module's runs: the shared GRPO run (_factories.grpo_trainer) long enough for the checks' streaks
HEALTH_RUN = dict(max_completion_length=32, max_steps=4, logging_steps=1, health_checks={"patience": 2})
config = functools.partial(grpo_args, **HEALTH_RUN)
trainer_for = functools.partial(grpo_trainer, **HEALTH_RUN)


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


def logged(tmp_path):
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------------------------------ settings
def test_settings_default_override_switch_off_and_refuse():
    assert GRPOConfig().health_checks == HEALTH_CHECKS
    assert resolve_health_checks({"patience": 3, "min_entropy": None}) == {
        **HEALTH_CHECKS,
        "patience": 3,
        "min_entropy": None,
    }
    off = resolve_health_checks(False)
    assert not any(off[k] for k in ("no_learning_signal", "all_truncated", "constant_reward", "weight_sync"))
    assert off["min_entropy"] is None and off["max_clip_ratio"] is None and off["importance_ratio_bounds"] is None
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['no_signal'\]; valid: \['patience'"):
        GRPOConfig(health_checks={"no_signal": False})
    with pytest.raises(ValueError, match=r"patience'\] must be an integer >= 1"):
        GRPOConfig(health_checks={"patience": 0})
    with pytest.raises(ValueError, match=r"importance_ratio_bounds'\] must be \[low, high\]"):
        GRPOConfig(health_checks={"importance_ratio_bounds": [1.5, 2.0]})
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds must be an integer >= 0"):
        GRPOConfig(dynamic_sampling_max_rounds=-1)


# ------------------------------------------------------------------------------------------------ pure checks
def test_generation_health_by_hand():
    nan = float("nan")
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, nan], [1.0, 3.0]])  # 2 functions, 2 groups of 2
    total = torch.tensor([1.0, 2.0, 1.0, 1.0])  # group 0 differs, group 1 is all equal
    health = generation_health(rewards, total, torch.tensor([True, False, True, True]), 2, ["a", "b"])
    assert health.zero_spread_fraction == 0.5
    assert health.truncated_fraction == 0.75
    assert health.constant_rewards == {"a": 1.0, "b": None}
    assert constant_values(torch.tensor([[nan], [nan]]), ["c"]) == {"c": None}  # scored nothing: not constant


def test_log_warnings_by_hand():
    checks = dict(HEALTH_CHECKS)
    assert log_warnings({"loss": 0.1, "entropy": 0.5, "clip_ratio/region_mean": 0.1}, checks) == {}
    found = log_warnings(
        {"entropy": 0.001, "clip_ratio/region_mean": 0.3, "sampling/importance_sampling_ratio/mean": 2.5}, checks
    )
    assert set(found) == {"min_entropy", "max_clip_ratio", "importance_ratio_bounds"}
    assert "0.001 nats per token, below min_entropy=0.01" in found["min_entropy"]
    assert "0.3 of the tokens" in found["max_clip_ratio"]
    assert log_warnings({"cispo_clip_ratio": 0.9}, checks).keys() == {"max_clip_ratio"}
    assert log_warnings({"entropy": 0.0}, {**checks, "min_entropy": None}) == {}


def test_reward_rose_by_hand():
    assert reward_rose([0.1, 0.2], [0.3, 0.4]) and not reward_rose([0.3, 0.2], [0.25, 0.25])
    assert not reward_rose([0.5], [0.5])  # equal: not moving


def test_weight_sync_hook_stops_at_the_step_end(tmp_path):
    before = torch.tensor([[-1.0, -2.0]])
    assert weight_sync_unchanged(before, before.clone())
    assert not weight_sync_unchanged(before, before + 1e-3)
    args = config(tmp_path)
    callback = HealthCallback(args.health_checks, MetricWindow(), num_generations=4, max_completion_length=32)
    state, control = TrainerState(global_step=5), TrainerControl()
    callback.on_train_begin(args, state, control)
    callback.record_weight_sync(True)
    callback.on_step_end(args, state, control)
    assert control.should_training_stop and control.should_save
    with pytest.raises(TrainingStalled, match=r"'weight_sync' stopped the run at step 5.*checkpoint-5"):
        callback.raise_if_stopped(args, state)
    off = HealthCallback(
        {**args.health_checks, "weight_sync": False}, MetricWindow(), num_generations=4, max_completion_length=32
    )
    control = TrainerControl()
    off.on_train_begin(args, state, control)
    off.record_weight_sync(True)
    off.on_step_end(args, state, control)
    assert not control.should_training_stop
    off.raise_if_stopped(args, state)


# ------------------------------------------------------------------------------------------------ crafted runs
def test_constant_reward_stops_for_no_signal_and_warns_by_name(tmp_path, tok, dataset):
    trainer = trainer_for(tmp_path, tok, dataset, reward=constant_reward, max_steps=6)
    with pytest.warns(
        HealthWarning,
        match=r"step 2: reward function 'constant_reward' returned 1 for every sample "
        r"since step 1 \(2 steps\)",
    ):
        with pytest.raises(TrainingStalled) as stop:
            trainer.train()
    message = str(stop.value)
    assert is_user_error(stop.value) and "\n" not in message
    assert message.startswith("health check 'no_learning_signal' stopped the run at step 2: no learning signal")
    assert "since step 1" in message and "dynamic_sampling=True" in message and "--resume" in message
    assert trainer.state.global_step == 2
    assert os.path.isdir(tmp_path / "run" / "checkpoint-2")  # saved although save_strategy="no", as a preemption
    records = [r for r in logged(tmp_path) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    assert [r["health/no_signal"] for r in records] == [1.0, 1.0]
    assert records[-1]["health/stop/no_learning_signal"] == 1.0
    assert records[-1]["health/warning/constant_reward"] == 1.0


def test_report_marks_the_health_events_on_the_panels_and_the_summary_lists_them(tmp_path, tok, dataset):
    trainer = trainer_for(tmp_path, tok, dataset, reward=constant_reward, max_steps=6)
    with pytest.warns(HealthWarning), pytest.raises(TrainingStalled):
        trainer.train()
    series = collect_series(read_events(tmp_path / "run"))
    assert health_markers(series) == [(2, "stop: no_learning_signal"), (2, "warning: constant_reward")]
    panels = [key for figure in panel_layout(series).values() for keys in figure.values() for key in keys]
    assert "reward" in panels and not any(key.startswith("health/warning/") for key in panels)
    assert {p.name for p in plot_run(tmp_path / "run")} >= {"rewards.png"}
    lines = rl_summary(trainer.state.log_history, trainer.state.stateful_callbacks["HealthCallback"])
    assert trainer.summary_lines() == lines  # what the end summary prints after the loop's own line
    assert lines[0].startswith("reward 1 -> 1; entropy ")
    assert "learning signal in 0% of 2 steps" in lines[1]
    assert lines[2:] == [
        "health stop at step 2: no_learning_signal",
        "health warning at step 2: constant_reward:constant_reward",
    ]


def test_rl_summary_by_hand():
    history = [
        {"reward": 0.2, "entropy": 1.5, "completions/clipped_ratio": 0.5, "step": 1},
        {"eval_greedy/accuracy": 0.1, "eval_reward": 0.3, "step": 1},
        {"reward": 0.6, "entropy": 0.9, "completions/clipped_ratio": 0.25, "step": 2},
        {"eval_greedy/accuracy": 0.4, "eval_reward": 0.5, "step": 2},
    ]
    health = {"steps": 4, "signal_steps": 3, "warnings": [{"step": 2, "check": "min_entropy", "stop": False}]}
    assert rl_summary(history, health) == [
        "reward 0.2 -> 0.6; eval_greedy/accuracy 0.1 -> 0.4; entropy 1.5 -> 0.9",
        "truncated 37.5% of completions; learning signal in 75% of 4 steps",
        "health warning at step 2: min_entropy",
    ]
    assert rl_summary([{"loss": 1.0, "step": 1}], None) == []  # not an RL run


def test_the_stop_resumes_from_its_checkpoint_and_stops_again_while_nothing_changed(tmp_path, tok, dataset):
    trainer = trainer_for(tmp_path, tok, dataset, reward=constant_reward, max_steps=6)
    with pytest.warns(HealthWarning), pytest.raises(TrainingStalled):
        trainer.train()
    again = trainer_for(tmp_path, tok, dataset, reward=constant_reward, max_steps=6)
    with pytest.raises(TrainingStalled, match="stopped the run at step 3.*since step 1"):
        again.train(resume_from_checkpoint=True)  # the streak survives the resume


def test_a_completion_length_of_one_stops_naming_max_completion_length(tmp_path, tok, dataset):
    # truncated from step 1, the reward not rising (2.5 at step 1, 1.75 at step 4): a stop after 2 x patience steps
    trainer = trainer_for(tmp_path, tok, dataset, max_completion_length=1, max_steps=6)
    with pytest.raises(
        TrainingStalled,
        match=r"'all_truncated' stopped the run at step 4: every completion hit "
        r"max_completion_length=1 .* and the mean reward did not rise",
    ):
        trainer.train()
    assert [r["health/all_truncated"] for r in logged(tmp_path) if "loss" in r] == [1.0] * 4


def test_a_frozen_policy_warns_once_that_its_entropy_collapsed(tmp_path, tok, dataset):
    # temperature 0.01: the policy samples (and trains) as if frozen onto its argmax completion
    trainer = trainer_for(
        tmp_path,
        tok,
        dataset,
        temperature=0.01,
        max_steps=3,
        health_checks={"patience": 2, "no_learning_signal": False, "constant_reward": False, "all_truncated": False},
    )
    with pytest.warns(HealthWarning, match=r"step 1: the policy's entropy is .* below min_entropy=0.01") as caught:
        trainer.train()
    assert len([w for w in caught if issubclass(w.category, HealthWarning)]) == 1  # once, not every log
    records = [r for r in logged(tmp_path) if "loss" in r]
    assert records[0]["entropy"] < 0.01  # warned at this log; marked in the next (a log check's marker)
    assert [r["step"] for r in records if "health/warning/min_entropy" in r] == [2]
    saved = trainer.state.stateful_callbacks["HealthCallback"]["warnings"]
    assert saved == [{"step": 1, "check": "min_entropy", "stop": False}]


def digit_share(completions, **kwargs):
    """The share of digits in each answer: a random policy learns it within a few dozen steps."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def noise(completions, **kwargs):
    """A reward nothing can learn: seeded noise that ignores the completion (the groups differ)."""
    draw = torch.Generator().manual_seed(len(completions) + sum(map(len, completions)))
    return torch.rand(len(completions), generator=draw).tolist()


# issue 44's run, shrunk: answers of exactly 4 tokens (EOS never sampled, every completion truncated), async N=1
FIXED_LENGTH = dict(
    per_device_train_batch_size=8,
    max_completion_length=4,
    learning_rate=1e-2,
    max_staleness=1,
    async_worker="thread",
    logging_steps=1,
    seed=0,
)


fixed_length_run = functools.partial(grpo_trainer, **FIXED_LENGTH)


def test_a_learning_run_whose_every_completion_is_truncated_is_warned_not_stopped(tmp_path, tok, dataset):
    trainer = fixed_length_run(
        tmp_path,
        tok,
        dataset,
        reward=digit_share,
        max_steps=8,
        generation_kwargs={"suppress_tokens": [tok.eos_token_id]},
        health_checks={"patience": 3},
    )
    with pytest.warns(
        HealthWarning,
        match=r"step 3: every completion hit max_completion_length=4 .* fine for "
        r"answers of a fixed length while the reward rises",
    ) as caught:
        trainer.train()  # 2a6f17d: TrainingStalled, 'all_truncated' stopped the run at step 3
    assert trainer.state.global_step == 8
    assert len([w for w in caught if "max_completion_length" in str(w.message)]) == 1  # once
    records = [r for r in logged(tmp_path) if "loss" in r]
    assert all(r["completions/clipped_ratio"] == 1.0 for r in records)
    assert records[-1]["reward"] > records[0]["reward"]  # it learns
    assert not any(k.startswith("health/stop/") for r in records for k in r)
    assert [r["step"] for r in records if "health/warning/all_truncated" in r] == [3]


def test_a_truncated_run_whose_reward_does_not_rise_still_stops(tmp_path, tok, dataset):
    trainer = fixed_length_run(
        tmp_path,
        tok,
        dataset,
        reward=noise,
        max_steps=12,
        generation_kwargs={"suppress_tokens": [tok.eos_token_id]},
        health_checks={"patience": 2, "constant_reward": False},
    )
    with pytest.warns(HealthWarning), pytest.raises(TrainingStalled) as stop:
        trainer.train()
    message = str(stop.value)
    assert "\n" not in message and "'all_truncated' stopped the run at step" in message
    assert "and the mean reward did not rise" in message and "since step 1" in message
    assert trainer.state.global_step >= 4  # 2 x patience steps at least
    assert HEALTH_CHECKS["patience"] == 10  # the default the false-alarm benchmark measured


class StaleEngine(RolloutEngine):
    """A rollout engine (not the own sampler: no ``exact_logps``) that drifted from the trained policy: it samples
    through the own sampler but reports each token's log-prob 1 nat lower than the policy's, as an engine with stale
    weights would."""

    def __init__(self, model):
        self.local = LocalEngine(model)

    def generate(self, prompt_ids, params, *, generator=None):
        out = self.local.generate(prompt_ids, params, generator=generator)
        out.sampling_logps = out.sampling_logps - out.completion_mask
        return out

    def load_weights(self, model, version=None):
        self.local.load_weights(model, version)

    def close(self):
        self.local.close()


class StaleTrainer(GRPOTrainer):
    def build_engine(self):
        return StaleEngine(self.model)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_a_drifted_engine_warns_once_that_the_importance_ratio_left_its_bounds(tmp_path, tok, dataset, mode):
    # token_truncate: every ratio is e = 2.72, clamped at 3; sequence_mask: e^length > 3, every sequence masked to 0
    args = config(
        tmp_path,
        max_steps=3,
        vllm_importance_sampling_mode=mode,
        health_checks={
            "patience": 2,
            "no_learning_signal": False,
            "constant_reward": False,
            "all_truncated": False,
            "max_clip_ratio": None,
        },
    )
    trainer = StaleTrainer(
        toy.build_model("tiny", tokenizer=tok, seed=0),
        digit_sum_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
    )
    assert trainer.corrects_sampling  # not the own LocalEngine: the correction applies
    with pytest.warns(
        HealthWarning,
        match=r"step 1: the mean sampler importance ratio .* is (2\.718|0), outside "
        r"importance_ratio_bounds=\[0.5, 2.0\]",
    ) as caught:
        trainer.train()
    assert len([w for w in caught if issubclass(w.category, HealthWarning)]) == 1  # once, not every log
    records = [r for r in logged(tmp_path) if "loss" in r]
    means = [r["sampling/importance_sampling_ratio/mean"] for r in records]
    assert means == pytest.approx([math.e] * 3 if mode == "token_truncate" else [0.0] * 3, abs=1e-3)
    assert [r["sampling/sampling_logp_difference/mean"] for r in records] == pytest.approx([1.0] * 3, abs=1e-3)
    assert [r["step"] for r in records if "health/warning/importance_ratio_bounds" in r] == [2]


class UnsyncedEngine(StaleEngine):
    """An engine whose weight sync did nothing: after the first optimizer step its check reports that its
    log-probs did not move (what treadle.engines.vllm sets from a probe completion scored around the push)."""

    def __init__(self, model):
        super().__init__(model)
        self.sync_unchanged, self.syncs = None, 0

    def load_weights(self, model, version=None):
        super().load_weights(model, version)
        self.syncs += 1
        self.sync_unchanged = True if self.syncs > 1 else None  # the first sync precedes any step: nothing to check


class UnsyncedTrainer(GRPOTrainer):
    def build_engine(self):
        return UnsyncedEngine(self.model)


def test_an_engine_whose_sync_changed_nothing_stops_the_run(tmp_path, tok, dataset):
    args = config(
        tmp_path,
        max_steps=4,
        save_strategy="steps",
        save_steps=1,
        health_checks={"no_learning_signal": False, "constant_reward": False, "all_truncated": False},
    )
    trainer = UnsyncedTrainer(
        toy.build_model("tiny", tokenizer=tok, seed=0),
        digit_sum_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
    )
    with pytest.raises(TrainingStalled, match=r"'weight_sync' stopped the run at step 2"):
        trainer.train()
    assert trainer.state.global_step == 2  # the second generation's sync was the first one checked


def test_the_own_sampler_never_reports_a_weight_sync_or_an_importance_ratio(tmp_path, tok, dataset):
    trainer = trainer_for(tmp_path, tok, dataset, max_steps=2)
    calls = []
    trainer.health.record_weight_sync = calls.append  # the hook is for engines that hold their own weights
    trainer.train()
    assert calls == [] and not trainer.corrects_sampling
    assert not any(k.startswith("sampling/") for r in logged(tmp_path) for k in r)


def test_checks_switched_off_let_the_crafted_run_finish(tmp_path, tok, dataset):
    trainer = trainer_for(tmp_path, tok, dataset, reward=constant_reward, max_steps=3, health_checks=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HealthWarning)
        trainer.train()
    assert trainer.state.global_step == 3


def test_a_normal_run_is_silent(tmp_path, tok, dataset):
    trainer = trainer_for(tmp_path, tok, dataset, max_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HealthWarning)
        trainer.train()
    assert trainer.state.global_step == 4
    records = [r for r in logged(tmp_path) if "loss" in r]
    assert all(r["health/no_signal"] == 0.0 for r in records)
    assert [r["health/all_truncated"] for r in records] != [1.0] * 4
    assert not any(k.startswith(("health/warning/", "health/stop/")) for r in records for k in r)
    saved = trainer.state.stateful_callbacks["HealthCallback"]
    assert saved["steps"] == saved["signal_steps"] == 4 and saved["warnings"] == []


# ------------------------------------------------------------------------------------------------ dynamic sampling
def half_constant_reward(prompts, completion_ids, **kwargs):
    """Equal rewards for prompts whose first operand is even (no signal), varied ones for the others."""
    return [0.0 if int(p.split("+")[0]) % 2 == 0 else float(sum(ids) % 5) for p, ids in zip(prompts, completion_ids)]


class SampleSpy(TrainerCallback):
    def __init__(self, trainer):
        self.samples = []
        original = trainer.compute_loss

        def spy(model, inputs, *args, **kwargs):
            self.samples.append(inputs)
            return original(model, inputs, *args, **kwargs)

        trainer.compute_loss = spy


def trained_groups(samples, group):
    """(advantages of the group, whether any of its tokens carry loss) for each group of each micro-batch."""
    out = []
    for s in samples:
        for g in range(0, len(s.advantages), group):
            out.append((s.advantages[g : g + group], bool(s.completion_mask[g : g + group].sum() > 0)))
    return out


@pytest.mark.parametrize("dynamic", [False, True])
def test_dynamic_sampling_never_trains_on_a_group_of_equal_rewards(tmp_path, tok, dataset, dynamic):
    trainer = trainer_for(
        tmp_path,
        tok,
        dataset,
        reward=half_constant_reward,
        per_device_train_batch_size=8,
        max_steps=4,
        dynamic_sampling=dynamic,
        dynamic_sampling_max_rounds=8,
        seed=1,
        health_checks={"patience": 100},
    )
    spy = SampleSpy(trainer)
    trainer.train()
    groups = trained_groups(spy.samples, 4)
    assert len(groups) == 4 * 2  # every step trains on the same number of groups
    zero_trained = [bool((adv == 0).all()) and trained for adv, trained in groups]
    records = [r for r in logged(tmp_path) if "loss" in r]
    if dynamic:
        assert not any(zero_trained)
        assert all(bool((adv != 0).any()) for adv, _ in groups)  # 8 rounds were enough: the batch is full
        assert sum(r["dynamic_sampling/dropped_fraction"] for r in records) > 0
        assert all(r["dynamic_sampling/unfilled_fraction"] == 0 for r in records)
        assert all(r["frac_reward_zero_std"] == 0 for r in records)
    else:
        assert any(zero_trained)  # the control: without it such groups are trained on
        assert not any(k.startswith("dynamic_sampling/") for r in records for k in r)


def test_dynamic_sampling_is_exact_under_gradient_accumulation(tmp_path, tok, dataset):
    """One generation of 8 completions trained as one micro-batch, or as 2 accumulated micro-batches of 4: the same
    groups are kept (the draws are keyed by generation and round, not by micro-batch), the dapo normaliser counts the
    whole window, so the loss, the gradient norm and the weights after 2 SGD steps are the same."""
    runs = []
    for batch, accum in ((8, 1), (4, 2)):
        out = tmp_path / f"b{batch}"
        trainer = trainer_for(
            out,
            tok,
            dataset,
            reward=half_constant_reward,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accum,
            max_steps=2,
            dynamic_sampling=True,
            dynamic_sampling_max_rounds=8,
            seed=1,
            optim="sgd",
            learning_rate=0.5,
            health_checks={"patience": 100},
        )
        assert trainer.args.generation_batch_size == 8
        trainer.train()
        runs.append((trainer, [r for r in logged(out) if "loss" in r]))
    (big, big_logs), (small, small_logs) = runs
    for key in ("loss", "grad_norm", "dynamic_sampling/dropped_fraction", "reward"):
        assert [r[key] for r in small_logs] == pytest.approx([r[key] for r in big_logs], rel=1e-5, abs=1e-7), key
    assert sum(r["dynamic_sampling/dropped_fraction"] for r in big_logs) > 0  # groups were dropped and replaced
    for name, value in big.model.state_dict().items():
        torch.testing.assert_close(small.model.state_dict()[name], value, atol=1e-5, rtol=1e-5, msg=name)


def test_dynamic_sampling_masks_what_its_rounds_could_not_fill(tmp_path, tok, dataset):
    trainer = trainer_for(
        tmp_path,
        tok,
        dataset,
        reward=constant_reward,
        max_steps=2,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=2,
        health_checks={"patience": 3},
    )
    calls = []
    original = trainer.sample_rows  # every draw of a generation samples through it: the first and each round's
    trainer.sample_rows = lambda rows, generator, **kw: calls.append(len(rows)) or original(rows, generator, **kw)
    spy = SampleSpy(trainer)
    with pytest.warns(HealthWarning):  # the constant reward
        trainer.train()
    assert calls == [4, 4, 4] * 2  # the first draw and 2 extra rounds, each generation
    assert all(int(s.completion_mask.sum()) == 0 for s in spy.samples)  # nothing trained on
    records = [r for r in logged(tmp_path) if "loss" in r]
    assert [
        (r["dynamic_sampling/rounds"], r["dynamic_sampling/dropped_fraction"], r["dynamic_sampling/unfilled_fraction"])
        for r in records
    ] == [(2.0, 1.0, 1.0)] * 2


def test_join_rows_pads_prompts_left_and_completions_right():
    def rollout(prompt_width, completion_width, value):
        n = 2
        out = GenerationOutput(
            prompt_ids=torch.full((n, prompt_width), value),
            prompt_mask=torch.ones(n, prompt_width),
            completion_ids=torch.full((n, completion_width), value),
            completion_mask=torch.ones(n, completion_width),
            is_truncated=torch.tensor([True, False]),
            sampling_logps=None,
        )
        return Rollout.of(
            [{"prompt": f"p{value}", "answer": value}] * n, out, [f"c{value}"] * n, [[value] * completion_width] * n
        )

    joined = join_rows([(rollout(1, 3, 7), [1]), (rollout(2, 1, 8), [0, 1])], pad_token_id=0)
    assert joined.generation.prompt_ids.tolist() == [[0, 7], [8, 8], [8, 8]]
    assert joined.generation.prompt_mask.tolist() == [[0, 1], [1, 1], [1, 1]]
    assert joined.generation.completion_ids.tolist() == [[7, 7, 7], [8, 0, 0], [8, 0, 0]]
    assert joined.loss_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 0, 0]]
    assert joined.generation.is_truncated.tolist() == [False, True, False]
    assert joined.generation.sampling_logps is None
    assert joined.prompts == ["p7", "p8", "p8"] and joined.columns == {"answer": [7, 8, 8]}


def test_a_reward_of_weight_zero_is_left_out_of_the_constant_reward_check():
    # the gym demo records reasoning-gym's lenient score and the tag rate at weight 0: once the tag is always
    # written, the tag column is constant, which says nothing about the advantages (weight 0 by design)
    rewards = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.5, 1.0, 1.0], [1.0, 1.0, 1.0]])
    total = rewards[:, 0] + rewards[:, 1]
    truncated = torch.zeros(4, dtype=torch.bool)
    names = ["strict", "format", "tag"]
    weighted = generation_health(rewards, total, truncated, 2, names, torch.tensor([1.0, 1.0, 0.0]))
    assert weighted.constant_rewards == {"strict": None, "format": 1.0}
    unweighted = generation_health(rewards, total, truncated, 2, names)
    assert unweighted.constant_rewards == {"strict": None, "format": 1.0, "tag": 1.0}
