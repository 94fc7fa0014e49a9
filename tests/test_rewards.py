"""treadle.rewards: the reward-function contract, its error messages, and the ready rewards."""

import doctest
import functools
import json
import math

import numpy as np
import pytest
import torch

from treadle import rewards
from treadle.rewards import (
    RewardFunctionError,
    call_reward_function,
    completion_text,
    exact_match,
    overlong_penalty,
    regex_format,
    reward_name,
    score_completions,
    weighted_rewards,
)

PROMPTS = ["1+1=", "2+2="]
COMPLETIONS = ["2", "5"]
IDS = [[9, 2], [12, 2]]
COLUMNS = {"answer": ["2", "4"]}


def call(fn, step=3):
    return call_reward_function(
        fn, prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS, columns=COLUMNS, step=step
    )


def test_docstring_examples():
    assert doctest.testmod(rewards).failed == 0


# ------------------------------------------------------------------------------------------- the contract
def test_called_with_keywords_and_every_column():
    seen = {}

    def spy(prompts, completions, completion_ids, **columns):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        return [0.5, 1]

    assert call(spy) == [0.5, 1.0]
    assert seen == {"prompts": PROMPTS, "completions": COMPLETIONS, "completion_ids": IDS, "answer": ["2", "4"]}


@pytest.mark.parametrize(
    "values", [torch.tensor([1.0, 0.0]), np.array([1.0, 0.0]), (True, 0), [np.float32(1.0), torch.tensor(0.0)]]
)
def test_accepted_return_types(values):
    assert call(lambda **kw: values) == [1.0, 0.0]


def test_none_means_no_opinion_and_comes_back_as_nan():
    out = call(lambda **kw: [None, 2.0])
    assert math.isnan(out[0]) and out[1] == 2.0


def test_a_reward_function_that_edits_its_arguments_changes_nothing_for_the_next_or_the_record():
    from treadle.rewards import score_completions

    seen = {}

    def vandal(prompts, completions, completion_ids, answer, **kw):
        completions[0], prompts[0], answer[0] = "MUTATED", "MUTATED", "MUTATED"
        completion_ids[0].append(99)
        completions[1][0]["content"] = "MUTATED"
        return [0.0, 0.0]

    def judge(prompts, completions, completion_ids, answer, **kw):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer)
        return [1.0, 1.0]

    prompts, completions = ["p0", "p1"], ["c0", [{"role": "assistant", "content": "c1"}]]
    ids, columns = [[1, 2], [3]], {"answer": ["a0", "a1"]}
    original = json.dumps([prompts, completions, ids, columns])
    score_completions(
        [vandal, judge],
        [1.0, 1.0],
        prompts=prompts,
        completions=completions,
        completion_ids=ids,
        columns=columns,
        step=1,
    )
    assert json.dumps([prompts, completions, ids, columns]) == original  # what completions.jsonl logs
    assert (
        json.dumps([seen["prompts"], seen["completions"], seen["completion_ids"], {"answer": seen["answer"]}])
        == original
    )


# ------------------------------------------------------------------------------------------ error messages
def test_a_raising_function_is_named_with_step_and_sample():
    def correctness(prompts, completions, **kw):
        raise KeyError("solution")

    with pytest.raises(RewardFunctionError) as err:
        call(correctness, step=7)
    message = str(err.value)
    assert "'correctness'" in message and "KeyError" in message and "step 7" in message
    assert "prompt='1+1='" in message and "completion='2'" in message and "answer='2'" in message
    assert isinstance(err.value.__cause__, KeyError)  # the original traceback is kept


def test_wrong_length_is_reported():
    def too_short(**kw):
        return [1.0]

    with pytest.raises(RewardFunctionError, match=r"'too_short' returned 1 values for 2 completions at step 3"):
        call(too_short)


@pytest.mark.parametrize("bad, shown", [(float("nan"), "nan"), (float("inf"), "inf")])
def test_nan_and_inf_name_the_offending_sample(bad, shown):
    def unstable(**kw):
        return [0.0, bad]

    with pytest.raises(RewardFunctionError) as err:
        call(unstable, step=5)
    message = str(err.value)
    assert f"'unstable' returned {shown} for sample 1 at step 5" in message
    assert "prompt='2+2='" in message and "completion='5'" in message  # sample 1, not sample 0


def test_non_numbers_are_rejected():
    def wordy(**kw):
        return [1.0, "good"]

    with pytest.raises(RewardFunctionError, match=r"'wordy' returned 'good' \(str\) for sample 1 at step 3"):
        call(wordy)
    with pytest.raises(RewardFunctionError, match="returned a float"):
        call(lambda **kw: 1.0)


def test_a_completion_no_function_scores_is_an_error():
    def only_first(**kw):
        return [1.0, None]

    def never(**kw):
        return [None, None]

    with pytest.raises(RewardFunctionError, match=r"no reward function scored sample 1 at step 2"):
        score_completions(
            [only_first, never],
            [1.0, 1.0],
            prompts=PROMPTS,
            completions=COMPLETIONS,
            completion_ids=IDS,
            columns=COLUMNS,
            step=2,
        )


# ----------------------------------------------------------------------------------------- combination
def test_score_matrix_and_weighted_sum_skip_no_opinion():
    def a(**kw):
        return [1.0, None]

    def b(**kw):
        return [0.5, 2.0]

    matrix = score_completions(
        [a, b], [2.0, -1.0], prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS, columns=COLUMNS, step=0
    )
    assert matrix.shape == (2, 2)
    assert matrix[0].tolist() == [1.0, 0.5] and math.isnan(matrix[1, 0]) and matrix[1, 1] == 2.0
    # row 0: 2*1 - 1*0.5 = 1.5; row 1: a has no opinion, -1*2 = -2
    assert weighted_rewards(matrix, [2.0, -1.0]).tolist() == [1.5, -2.0]


def test_reward_names():
    def correctness(**kw):
        return []

    class Judge:
        def __call__(self, **kw):
            return []

    assert reward_name(correctness) == "correctness"
    assert reward_name(functools.partial(correctness, scale=2)) == "correctness"
    assert reward_name(Judge()) == "Judge"
    assert reward_name(regex_format("x", name="fmt")) == "fmt"


# ------------------------------------------------------------------------------------------ ready rewards
def test_exact_match_plain_and_chat():
    completions = ["46", " 46 \nmore", "47", [{"role": "assistant", "content": "46"}]]
    assert exact_match(completions=completions, answer=["46", "46", "46", 46]) == [1.0, 1.0, 0.0, 1.0]


def test_completion_text():
    assert completion_text("abc") == "abc"
    assert completion_text([{"role": "assistant", "content": "x"}]) == "x"
    assert completion_text([]) == ""


def test_regex_format_needs_a_full_match():
    fmt = regex_format(r"<answer>\d+</answer>")
    assert fmt(
        completions=[
            "<answer>12</answer>",
            "<answer>12</answer> extra",
            "<answer>x</answer>",
            [{"role": "assistant", "content": "<answer>3</answer>"}],
        ]
    ) == [1.0, 0.0, 0.0, 1.0]
    assert fmt.__name__ == "regex_format"


def test_overlong_penalty_hand_values():
    penalty = overlong_penalty(max_length=20, soft_cache=5)  # free up to 15 tokens, -1 at 20
    lengths = [10, 15, 16, 18, 20, 25]
    expected = [0.0, 0.0, -0.2, -0.6, -1.0, -1.0]  # (15 - n) / 5, clipped to [-1, 0]
    got = penalty(completion_ids=[[0] * n for n in lengths])
    assert got == pytest.approx(expected)
    assert reward_name(penalty) == "overlong_penalty"
    with pytest.raises(ValueError, match="soft_cache"):
        overlong_penalty(max_length=4, soft_cache=5)
