"""treadle.demos.real (``treadle demo --model smollm2``): the held-out split, the reward, the settings' and the
command line's refusals. The demo end to end, on the real model, is in tests/real/test_real_demo.py."""

import pytest

from treadle.cli import command as cli
from treadle.demos import real as demo


def pairs(rows):
    return {tuple(int(x) for x in r["prompt"][0]["content"][8:].split("?")[0].split(" + ")) for r in rows}


def test_the_held_out_chats_are_never_trained_on_and_every_answer_is_the_sum():
    train = demo.chats("train", 8100 - demo.HELD_OUT, seed=3)
    test = demo.chats("test", demo.HELD_OUT, seed=0)
    assert len(pairs(test)) == demo.HELD_OUT and len(pairs(train)) == 8100 - demo.HELD_OUT  # every pair, once
    assert not pairs(train) & pairs(test)
    for row in train[:50] + test[:50]:
        a, b = next(iter(pairs([row])))
        assert row["answer"] == str(a + b) and row["prompt"][0]["role"] == "user"
    assert demo.chats("train", 20, seed=0) != demo.chats("train", 20, seed=1)  # the seed orders the training chats
    assert demo.chats("train", 20, seed=1) == demo.chats("train", 20, seed=1)


@pytest.mark.parametrize("split", ["validation", "Test", "eval"])
def test_an_unknown_split_is_refused_not_taken_as_training_chats(split):
    """Regression (issue 59): chats("validation" | "Test" | "eval", ...) returned the training pairs, an evaluation
    set the model trains on."""
    with pytest.raises(
        ValueError, match=f"unknown split {split!r}; the real demo's chats have the splits train and test"
    ):
        demo.chats(split, 4, seed=0)


@pytest.mark.parametrize(
    "text, reward",
    [
        ("38", 1.0),
        ("17 + 21 = 38", 1.0),
        ("The answer is 38.", 1.0),
        ("1,038", 0.0),  # a thousands separator is read as one number
        ("38 + 1 = 39", 0.0),  # the last number counts
        ("thirty-eight", 0.0),
        ("", 0.0),
    ],
)
def test_the_reward_is_whether_the_last_number_is_the_sum(text, reward):
    assert demo.last_number_is_sum([text], ["38"]) == [reward]
    assert demo.last_number_is_sum([[{"role": "assistant", "content": text}]], ["38"]) == [reward]


def test_settings_refuse_what_cannot_run():
    for field in ("grpo_steps", "eval_size"):
        with pytest.raises(ValueError, match="--grpo-steps and --eval-size must be >= 1"):
            demo.RealDemoSettings(**{field: 0})
    with pytest.raises(ValueError, match="--eval-size is at most 1620"):
        demo.RealDemoSettings(eval_size=1621)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--model", "smollm2", "--task", "tools"], "--model smollm2 runs the addition demo, not --task tools"),
        (["--model", "smollm2", "--sft-steps", "3"], "--sft-steps has no use in --model smollm2; leave it out"),
        (["--model", "smollm2", "--use-vllm"], "--use-vllm is for the addition demo's GRPO in --model smollm2"),
        (["--model", "smollm2", "--eval-size", "0"], "--grpo-steps and --eval-size must be >= 1"),
    ],
)
def test_the_command_line_refuses_in_one_line(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr(demo, "run_real_demo", lambda *a: pytest.fail("the demo must not start"))
    assert cli.main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_the_command_line_hands_its_flags_to_the_real_demo(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the command claims the folder (x) before the demo
    calls = []
    monkeypatch.setattr(demo, "run_real_demo", lambda settings, out: calls.append((settings, out)) or 0)
    assert cli.main(["demo", "--model", "smollm2", "--seed", "2", "--grpo-steps", "7", "--output-dir", "x"]) == 0
    assert calls == [(demo.RealDemoSettings(seed=2, grpo_steps=7), "x")]
