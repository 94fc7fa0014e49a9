"""GRPO evaluation: pass@k against hand values and Chen et al.'s reference, known policies (always right, random),
greedy decoding against transformers' generate, compute_metrics' arguments, evaluation that does not perturb
training, and best-checkpoint selection by pass@1."""

import functools
import math
import random

import numpy as np
import pytest
import torch
from _factories import grpo_args, grpo_trainer
from datasets import Dataset

from treadle import checkpoint as ckpt
from treadle.demos import toy
from treadle.generation import GenerationOutput, completion_masks, left_pad
from treadle.metrics import pass_at_k, pass_at_k_sums
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

EOS = 2  # the toy tokenizer's eos id


@pytest.fixture(scope="module")
def problems():
    return toy.load_task("addition", "test", kind="rl", n=200, seed=0)


# this module's runs: the shared GRPO run (_factories.grpo_trainer), 8 completions a prompt evaluated 50 prompts a
# batch
EVAL_RUN = dict(
    per_device_train_batch_size=8, max_completion_length=4, per_device_eval_batch_size=50, num_generations_eval=8
)
config = functools.partial(grpo_args, **EVAL_RUN)


def make_trainer(tmp_path, tok, problems, reward=toy.addition_reward, model_seed=0, **overrides):
    """Trains on ``problems`` and evaluates on them."""
    return grpo_trainer(
        tmp_path, tok, problems, reward, model_seed, eval_dataset=problems, **{**EVAL_RUN, **overrides}
    )


def chen_reference(n: int, c: int, k: int) -> float:
    """Chen et al. (2021)'s numerically stable numpy form of the estimator (their Figure 3)."""
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


# ------------------------------------------------------------------------------------------------ pass@k
# n = 8: pass@1 = c / 8; pass@4 = 1 - C(8 - c, 4) / C(8, 4) with C(8, 4) = 70
HAND = {
    1: [0, 1 / 8, 2 / 8, 3 / 8, 4 / 8, 5 / 8, 6 / 8, 7 / 8, 1],
    4: [0, 1 - 35 / 70, 1 - 15 / 70, 1 - 5 / 70, 1 - 1 / 70, 1, 1, 1, 1],
}


@pytest.mark.parametrize("k", [1, 4])
def test_pass_at_k_by_hand_and_against_chen_et_al(k):
    for c in range(9):
        assert pass_at_k(8, c, k) == pytest.approx(HAND[k][c], abs=1e-12)
        assert pass_at_k(8, c, k) == pytest.approx(chen_reference(8, c, k), abs=1e-12)
    assert pass_at_k(200, 13, 100) == pytest.approx(chen_reference(200, 13, 100), rel=1e-9)  # large n


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(8, 1, 9), (8, 9, 1), (8, 1, 0)]:
        with pytest.raises(ValueError, match="1 <= k <= n"):
            pass_at_k(n, c, k)


def test_pass_at_k_sums_over_problems_skip_unscored_samples():
    nan = math.nan
    rewards = torch.tensor(
        [
            [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0],  # c = 2 of 8
            [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # c = 7 of 8 (0.5 < threshold)
            [nan, nan, nan, nan, nan, 1.0, 0.0, 0.0],
        ]
    )  # 3 scored: too few for k = 4
    sums = pass_at_k_sums(rewards, 1.0, [1, 4])
    assert sums[1] == (pytest.approx(2 / 8 + 7 / 8 + 1 / 3), 3)
    assert sums[4] == (pytest.approx(HAND[4][2] + HAND[4][7]), 2)


# ------------------------------------------------------------------------------------------------ config
def test_evaluation_settings_default_to_trainings_and_are_checked():
    args = GRPOConfig(num_generations=4, temperature=0.7, top_k=5)
    assert (args.num_generations_eval, args.eval_temperature, args.eval_top_k, args.eval_top_p) == (4, 0.7, 5, 1.0)
    assert args.eval_pass_at_k == [1] and args.eval_success_threshold == 1.0 and args.eval_greedy is False
    with pytest.raises(ValueError, match=r"eval_pass_at_k .* 1..num_generations_eval=4"):
        GRPOConfig(num_generations=4, eval_pass_at_k=[1, 8])
    with pytest.raises(ValueError, match="num_generations_eval must be an integer >= 1"):
        GRPOConfig(num_generations_eval=0)
    with pytest.raises(ValueError, match="eval_temperature >= 0"):
        GRPOConfig(eval_temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        GRPOConfig(eval_top_p=0.0)
    for metric, fix in (("pass@4", "eval_pass_at_k"), ("eval_greedy/accuracy", "eval_greedy=True")):
        with pytest.raises(ValueError, match=f"metric_for_best_model='{metric}' is not evaluated.*{fix}"):
            GRPOConfig(num_generations=4, metric_for_best_model=metric)
    assert GRPOConfig(num_generations=4, eval_pass_at_k=[1, 4], metric_for_best_model="eval_pass@4").greater_is_better
    with pytest.raises(ValueError, match="no loss: set metric_for_best_model='pass@1'"):
        GRPOConfig(load_best_model_at_end=True, eval_strategy="steps", eval_steps=5, save_steps=5)


# ------------------------------------------------------------------------------------------ known policies
def policy(tok, right):
    """A sampling engine (GRPOTrainer.generate's contract) that answers ``a+b=`` with the sum when ``right(row,
    generator, mode)`` says so, else with a random digit: the metrics' plumbing with a known success rate."""

    def generate(prompt_ids, *, num_generations, generator=None, mode="train"):
        rows, answers = [], []
        for ids in prompt_ids:
            a, b = tok.decode(ids).rstrip("=").split("+")
            for _ in range(num_generations):
                rows.append(ids)
                digit = int(torch.randint(10, (1,), generator=generator)) if generator is not None else 0
                text = str(int(a) + int(b)) if right(len(answers), generator, mode) else str(digit)
                answers.append(tok(text)["input_ids"] + [EOS])
        width = max(len(a) for a in answers)
        raw = torch.tensor([a + [0] * (width - len(a)) for a in answers])
        ids, mask = left_pad(rows, 0)
        return GenerationOutput(ids, mask, *completion_masks(raw, (EOS,), 0))

    return generate


def last_digit_reward(completions, answer, **kwargs):
    """1 when the completion ends with the answer's last digit: a random digit passes 1 time in 10."""
    return [float(c.strip()[-1:] == a[-1]) for c, a in zip(completions, answer)]


def test_a_policy_that_always_answers_right_scores_one(tmp_path, tok, problems):
    trainer = make_trainer(tmp_path, tok, problems, eval_pass_at_k=[1, 4, 8], eval_greedy=True)
    trainer.generate = policy(tok, lambda *a: True)
    metrics = trainer.evaluate()
    for key in (
        "reward",
        "pass@1",
        "pass@4",
        "pass@8",
        "greedy/accuracy",
        "greedy/reward",
        "rewards/addition_reward/mean",
        "rewards/addition_reward/pass@8",
    ):
        assert metrics[f"eval_{key}"] == 1.0, key
    # one reward function of weight 1: its greedy keys would repeat the total's, so only the total is logged
    assert not [key for key in metrics if key.startswith("eval_greedy/rewards/")]


def test_greedy_keys_per_function_appear_only_when_they_can_differ_from_the_total(tmp_path, tok, problems):
    """Two functions: each has its greedy keys (a right answer passes both); the total is their sum."""
    trainer = make_trainer(tmp_path, tok, problems, reward=[toy.addition_reward, last_digit_reward], eval_greedy=True)
    trainer.generate = policy(tok, lambda *a: True)
    metrics = trainer.evaluate()
    assert metrics["eval_greedy/rewards/addition_reward/accuracy"] == 1.0
    assert metrics["eval_greedy/rewards/last_digit_reward/mean"] == 1.0 and metrics["eval_greedy/reward"] == 2.0


def test_a_random_policy_scores_the_tasks_chance(tmp_path, tok, problems):
    trainer = make_trainer(
        tmp_path,
        tok,
        problems,
        reward=last_digit_reward,
        eval_pass_at_k=[1, 4, 8],
        eval_greedy=True,
        num_generations_eval=32,
        per_device_eval_batch_size=200,
    )
    trainer.generate = policy(tok, lambda *a: False)  # one random digit: right 1 time in 10
    metrics = trainer.evaluate()
    # 6,400 samples: pass@1 has a std of 0.004; pass@k estimates 1 - 0.9^k (iid samples)
    assert metrics["eval_pass@1"] == pytest.approx(0.1, abs=0.015)
    assert metrics["eval_pass@4"] == pytest.approx(1 - 0.9**4, abs=0.04)
    assert metrics["eval_pass@8"] == pytest.approx(1 - 0.9**8, abs=0.05)
    assert metrics["eval_pass@1"] == pytest.approx(
        metrics["eval_reward"]
    )  # 0/1 rewards at threshold 1: pass@1 is the mean
    zeros = sum(a.endswith("0") for a in problems["answer"]) / len(problems)  # greedy answers "0" every time
    assert metrics["eval_greedy/accuracy"] == pytest.approx(zeros)


def test_greedy_evaluation_matches_transformers_generate(tmp_path, tok, problems):
    """eval_temperature=0 and the eval_greedy pass decode greedily: the texts of transformers' generate."""
    seen = {}

    def capture(prompts, completions, completion_ids, rewards, reward, **columns):
        seen.update(prompts=prompts, completions=completions)
        return {}

    def length_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    some = problems.select(range(40))
    trainer = make_trainer(
        tmp_path,
        tok,
        some,
        reward=length_reward,
        eval_temperature=0.0,
        num_generations_eval=2,
        eval_greedy=True,
        compute_metrics=capture,
        model_seed=3,
    )
    metrics = trainer.evaluate()
    expected = toy.greedy_completions(trainer.model, tok, some["prompt"], batch_size=40, max_new_tokens=4)
    assert seen["prompts"] == [p for p in some["prompt"] for _ in range(2)]
    assert seen["completions"] == [c for c in expected for _ in range(2)]
    mean_length = sum(len(c) for c in expected) / len(expected)
    assert metrics["eval_greedy/reward"] == pytest.approx(mean_length)
    assert metrics["eval_reward"] == pytest.approx(mean_length)


# -------------------------------------------------------------------------------------- compute_metrics
def test_compute_metrics_receives_what_the_docs_say(tmp_path, tok, problems):
    received = []

    def half_reward(completions, **kwargs):  # no opinion on every other completion
        return [None if i % 2 else 0.5 for i in range(len(completions))]

    def compute_metrics(prompts, completions, completion_ids, rewards, reward, answer, source, **kwargs):
        received.append(
            dict(
                prompts=prompts,
                completions=completions,
                completion_ids=completion_ids,
                rewards=rewards,
                reward=reward,
                answer=answer,
                source=source,
                kwargs=kwargs,
            )
        )
        return {
            "answer_in_completion": sum(a in c for a, c in zip(answer, completions)) / len(answer),
            "as_tensor": torch.tensor(2.0),
        }

    rows = problems.select(range(6)).add_column("source", [f"s{i}" for i in range(6)])
    model = toy.build_model("tiny", tokenizer=tok)
    args = config(tmp_path, num_generations_eval=3, per_device_eval_batch_size=4, reward_weights=[1.0, 2.0])
    trainer = GRPOTrainer(
        model,
        [toy.addition_reward, half_reward],
        args=args,
        train_dataset=rows,
        eval_dataset=rows,
        processing_class=tok,
        compute_metrics=compute_metrics,
    )
    metrics = trainer.evaluate()
    (got,) = received  # once, over the whole evaluation set (two batches)
    assert got["prompts"] == [p for p in rows["prompt"] for _ in range(3)]
    assert got["answer"] == [a for a in rows["answer"] for _ in range(3)]
    assert got["source"] == [s for s in rows["source"] for _ in range(3)] and got["kwargs"] == {}
    assert [tok.decode(ids, skip_special_tokens=True) for ids in got["completion_ids"]] == got["completions"]
    assert set(got["rewards"]) == {"addition_reward", "half_reward"}
    assert got["rewards"]["half_reward"] == [0.5, None] * 9  # each batch's call: 0.5, None, 0.5, ...
    exact = got["rewards"]["addition_reward"]
    assert exact == toy.addition_reward(got["prompts"], got["completions"], got["answer"])
    assert got["reward"] == pytest.approx(
        [e + (2 * h if h is not None else 0.0) for e, h in zip(exact, got["rewards"]["half_reward"])]
    )
    assert metrics["eval_answer_in_completion"] == pytest.approx(
        sum(a in c for a, c in zip(got["answer"], got["completions"])) / 18
    )
    assert metrics["eval_as_tensor"] == 2.0
    assert metrics["eval_rewards/half_reward/mean"] == 0.5  # the mean over the scored completions only


def test_compute_metrics_is_checked_at_construction_and_when_called(tmp_path, tok, problems):
    def no_columns(prompts, completions, completion_ids, rewards, reward):
        return {}

    with pytest.raises(TypeError, match=r"cannot be called as fn\(prompts, .*answer\).*\*\*kwargs"):
        make_trainer(tmp_path, tok, problems, compute_metrics=no_columns)
    with pytest.raises(TypeError, match="is not callable"):
        make_trainer(tmp_path, tok, problems, compute_metrics="accuracy")
    trainer = make_trainer(tmp_path, tok, problems.select(range(4)), compute_metrics=lambda **kw: {"x": "high"})
    with pytest.raises(TypeError, match="returned 'x': 'high', which is not a number"):
        trainer.evaluate()


# ---------------------------------------------------------------------------------------- determinism
def noisy_reward(completion_ids, **kwargs):
    """Draws from the global torch and Python RNGs: if evaluation moved them, training would see other rewards."""
    return [float(sum(ids) % 5) + float(torch.rand(())) + random.random() for ids in completion_ids]


def train_weights(tmp_path, tok, problems, **overrides) -> dict:
    ckpt.set_seed(0)
    trainer = make_trainer(
        tmp_path,
        tok,
        problems,
        reward=noisy_reward,
        max_steps=2,
        num_generations_eval=2,
        compute_metrics=lambda **kw: {"noise": float(torch.rand(())) + random.random()},
        **overrides,
    )
    trainer.eval_dataset = problems.select(range(4))
    trainer.train()
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def test_evaluating_during_training_does_not_change_the_weights(tmp_path, tok, problems, monkeypatch):
    plain = train_weights(tmp_path / "a", tok, problems)
    evaluated = train_weights(tmp_path / "b", tok, problems, eval_strategy="steps", eval_steps=1, eval_greedy=True)
    assert all(torch.equal(plain[name], evaluated[name]) for name in plain)  # bit for bit
    monkeypatch.setattr(ckpt, "set_rng_state", lambda state: None)  # without the restore the test would fail
    unrestored = train_weights(tmp_path / "c", tok, problems, eval_strategy="steps", eval_steps=1)
    assert not all(torch.equal(plain[name], unrestored[name]) for name in plain)


# ------------------------------------------------------------------------------------ best checkpoint
@pytest.mark.parametrize("metric", ["pass@1", "eval_rewards/addition_reward/pass@1"])
def test_load_best_model_at_end_keeps_the_policy_that_solved_most(tmp_path, tok, problems, metric):
    """Evaluations at steps 1, 2, 3 solve 50%, 100%, 25% of the problems: the weights of step 2 are kept."""
    trainer = make_trainer(
        tmp_path,
        tok,
        problems.select(range(40)),
        max_steps=3,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model=metric,
        per_device_eval_batch_size=40,
    )
    share = {1: 0.5, 2: 1.0, 3: 0.25}
    # training samples half right (the groups' advantages move the weights); evaluations solve share[step]
    trainer.generate = policy(
        tok, lambda i, g, mode: i % 2 == 0 if mode == "train" else i < share[trainer.state.global_step] * 320
    )
    trainer.train()
    evals = [h["eval_pass@1"] for h in trainer.state.log_history if "eval_pass@1" in h]
    assert evals == [0.5, 1.0, 0.25]
    assert trainer.state.best_metric == 1.0 and trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    best = toy.build_model("tiny", tokenizer=tok, seed=9)
    ckpt.load_weights(best, trainer.state.best_model_checkpoint)
    last = toy.build_model("tiny", tokenizer=tok, seed=9)
    ckpt.load_weights(last, str(tmp_path / "run" / "checkpoint-3"))
    final = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, final[name]) for name, p in best.named_parameters())
    assert not all(torch.equal(p, final[name]) for name, p in last.named_parameters())


def test_an_evaluation_column_named_like_an_argument_is_refused(tmp_path, tok):
    rows = Dataset.from_list([{"prompt": "1+2=", "answer": "3", "reward": 1.0}] * 4)
    model = toy.build_model("tiny", tokenizer=tok)
    trainer = GRPOTrainer(
        model,
        toy.addition_reward,
        args=config(tmp_path, num_generations_eval=2),
        train_dataset=rows,
        processing_class=tok,
        compute_metrics=lambda **kw: {},
    )
    with pytest.raises(ValueError, match=r"column\(s\) \['reward'\] clash"):
        trainer.evaluate(rows)
