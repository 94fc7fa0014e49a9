"""treadle.tasks: reasoning-gym's tasks as rows (its own generators and mixtures), its own verifiers as rewards, the
train / evaluation seed rule, and the per-task figures of an evaluation (``TaskMetrics``)."""

import json
import sys

import pytest
import reasoning_gym
from reasoning_gym.utils import SYSTEM_PROMPTS

from treadle import tasks
from treadle.metrics import pass_at_k

EASY_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def rows_of(name="chain_sum", config=EASY_SUM, n=4, seed=3, system_prompt=None):
    task = tasks.GymTask(name, config)
    return tasks.gym_rows(tasks.task_items(task, n, seed), [task], system_prompt)


def columns(rows):
    return {key: [row[key] for row in rows] for key in ("task", "entry", "task_config")}


def test_tasks_read_from_a_mapping_a_list_or_names():
    spec = {"chain_sum": {"weight": 2, **EASY_SUM}, "leg_counting": {}}
    assert tasks.gym_tasks(spec) == [tasks.GymTask("chain_sum", EASY_SUM, 2.0), tasks.GymTask("leg_counting", {})]
    assert [t.name for t in tasks.gym_tasks("chain_sum, leg_counting")] == ["chain_sum", "leg_counting"]
    assert tasks.gym_tasks(["gcd"])[0].describe() == {"name": "gcd", "config": {}, "weight": 1.0}


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("chain_sums", ["no task 'chain_sums'", "close names: chain_sum"]),
        ({"chain_sum": {"max_term": 3}}, ["no config key 'max_term'", "max_terms"]),
        ({"leg_counting": {"max_animals": 1}}, ["refuses its config", "max_animals must be >= min_animals"]),
        ({"simple_equations": {"operators": ["+"]}}, ["refuses its config"]),  # fails only when an item is drawn
        ({"gcd": {"weight": 0}}, ["weight must be a number > 0"]),
        ("", ["no reasoning-gym task named"]),
    ],
)
def test_a_wrong_task_or_config_is_one_line_that_names_the_fix(spec, needles):
    with pytest.raises(tasks.GymError) as error:
        tasks.gym_tasks(spec)
    message = str(error.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    with pytest.raises(tasks.GymError, match=r"pip install 'treadle\[gym\]'"):
        tasks.gym_tasks("chain_sum")


def test_items_are_create_dataset_in_order():
    expected = reasoning_gym.create_dataset("chain_sum", size=5, seed=7, **EASY_SUM)
    items = tasks.task_items(tasks.GymTask("chain_sum", EASY_SUM), 5, 7)
    assert items == [expected[i] for i in range(5)]


def test_rows_hold_the_chat_the_gold_answer_and_the_entry():
    rows = rows_of()
    items = tasks.task_items(tasks.GymTask("chain_sum", EASY_SUM), 4, 3)
    for row, item in zip(rows, items):
        assert row["prompt"] == [
            {"role": "system", "content": tasks.ANSWER_PROMPT},
            {"role": "user", "content": item["question"]},
        ]
        assert row["answer"] == item["answer"] and row["task"] == "chain_sum"
        assert json.loads(row["entry"])["metadata"]["expression"] == item["metadata"]["expression"]
        assert json.loads(row["task_config"]) == EASY_SUM
    assert rows_of(system_prompt="simple")[0]["prompt"][0]["content"] == SYSTEM_PROMPTS["simple"]
    assert rows_of(system_prompt="Be brief.")[0]["prompt"][0]["content"] == "Be brief."
    assert len(tasks.gym_rows(items, [tasks.GymTask("chain_sum", EASY_SUM)], exclude=[items[0]["question"]])) < 4


def test_the_strict_reward_is_the_tasks_own_verifier_on_the_last_tag(monkeypatch):
    rows = rows_of(n=3)
    gold = [row["answer"] for row in rows]
    completions = [
        f"<answer>0</answer> then <answer>{gold[0]}</answer>",  # the last tag counts
        f"it is {gold[1]}",  # no tag: 0 strict, right on the last number
        [{"role": "assistant", "content": f"<answer> {gold[2]} </answer>"}],  # a chat completion, stripped
    ]
    assert tasks.reasoning_gym_score(completions, **columns(rows)) == [1.0, 0.0, 1.0]
    assert tasks.reasoning_gym_lenient(completions, **columns(rows)) == [1.0, 1.0, 1.0]
    assert tasks.answer_tag(completions) == [1.0, 0.0, 1.0]
    calls = []
    verifier = tasks._task_dataset("chain_sum", json.dumps(EASY_SUM, sort_keys=True))
    monkeypatch.setattr(verifier, "score_answer", lambda answer, entry: calls.append((answer, entry)) or 0.5)
    assert tasks.reasoning_gym_score(completions, **columns(rows)) == [0.5, 0.0, 0.5]
    items = tasks.task_items(tasks.GymTask("chain_sum", EASY_SUM), 3, 3)
    assert calls == [(gold[0], json.loads(json.dumps(items[0]))), (gold[2], json.loads(json.dumps(items[2])))]


def test_a_partial_answer_gets_the_verifiers_partial_score():
    rows = rows_of("number_sorting", {"min_numbers": 3, "max_numbers": 3, "max_decimals": 0}, n=1)
    entry = json.loads(rows[0]["entry"])
    own = reasoning_gym.create_dataset("number_sorting", size=1, seed=0).score_answer("[1, 2]", entry)
    assert tasks.reasoning_gym_score(["<answer>[1, 2]</answer>"], **columns(rows)) == [own]


def test_the_format_reward_gives_partial_credit():
    replies = ["x <answer>3</answer>", "<answer>3</answer> so", "<answer></answer>", "<answer>3", "3"]
    assert tasks.answer_format(replies) == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_a_mixture_is_reasoning_gyms_composite_and_evaluation_draws_other_seeds():
    spec = {"tasks": {"chain_sum": {"weight": 3, **EASY_SUM}, "leg_counting": {}}, "size": 40, "seed": 5}
    train = tasks.gym_dataset(spec)
    composite = reasoning_gym.create_dataset(
        "composite",
        size=40,
        seed=5,
        datasets=[
            reasoning_gym.composite.DatasetSpec("chain_sum", 3, dict(EASY_SUM)),
            reasoning_gym.composite.DatasetSpec("leg_counting", 1, {}),
        ],
    )
    assert [p[-1]["content"] for p in train["prompt"]] == [composite[i]["question"] for i in range(40)]
    assert set(train["task"]) == {"chain_sum", "leg_counting"}
    held_out = tasks.gym_dataset({k: v for k, v in spec.items() if k != "seed"}, "test", train_seed=5)
    assert held_out["entry"] != train["entry"]
    assert tasks.mixture_seeds(spec, "train") == {("chain_sum", 6), ("leg_counting", 7)}
    assert tasks.mixture_seeds({"tasks": spec["tasks"]}, "test", 5) == {("chain_sum", 10006), ("leg_counting", 10007)}


def test_an_evaluation_that_draws_the_training_seeds_warns_in_one_line():
    train = {"tasks": {"chain_sum": {}}, "seed": 0}
    assert tasks.overlap_warning(train, {"tasks": {"chain_sum": {}}}) is None
    warning = tasks.overlap_warning(train, {"tasks": {"chain_sum": {}}, "seed": 0})
    assert "chain_sum (seed 1)" in warning and "\n" not in warning
    assert tasks.overlap_warning(train, {"tasks": {"leg_counting": {}}, "seed": 0}) is None


def test_task_metrics_score_each_task_apart():
    metrics = tasks.TaskMetrics(num_samples=2, max_new_tokens=3, eos_token_ids=[9])
    out = metrics(
        prompts=[None] * 6,
        completions=[None] * 6,
        completion_ids=[[1, 9], [1, 2, 3], [1, 2, 9], [4], [5, 9], [1, 2, 3]],
        rewards={
            "reasoning_gym_score": [1.0, 0.0, 0.0, 0.0, 0.5, None],
            "reasoning_gym_lenient": [1.0, 1.0, 0.0, 0.0, 1.0, 1.0],
            "answer_tag": [1.0, 0.0, 1.0, 0.0, 1.0, 0.0],
        },
        reward=[0.0] * 6,
        task=["a", "a", "a", "a", "b", "b"],
    )
    assert out["a/items"] == 2 and out["b/items"] == 1
    assert out["a/strict"] == 0.25 and out["b/strict"] == 0.25  # None scores 0
    assert out["a/pass@2"] == pass_at_k(2, 1, 2) / 2 and out["b/pass@2"] == 0.0  # 0.5 is below the threshold 1
    assert out["a/lenient"] == 0.5 and out["b/lenient"] == 1.0 and out["a/tag_rate"] == 0.5
    assert out["a/mean_length"] == 9 / 4 and out["a/truncated"] == 0.25 and out["b/truncated"] == 0.5
    assert out["mean/strict"] == 0.25 and out["mean/lenient"] == 0.75
