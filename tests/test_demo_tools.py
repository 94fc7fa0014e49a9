"""``treadle demo --task tools``: the calculator, the SFT transcripts, the toy task's split and the CLI dispatch (the
whole demo is measured in the README, not run here)."""

import pytest

from treadle import cli, demo_tools, toy
from treadle.rollouts import ToolEnvironment, check_tool


def test_calc_by_hand_and_its_errors():
    assert check_tool(toy.calc) == "calc"
    assert (toy.calc("123+456"), toy.calc("(2-3)*4"), toy.calc("-5+2")) == (579, -4, -3)
    for bad in ('__import__("os")', "2**10", "1/2", "1+"):
        with pytest.raises(ValueError, match="calc"):
            toy.calc(bad)


def test_the_transcripts_call_the_tool_as_the_tool_environment_parses_it():
    rows = toy.tool_transcripts(toy.load_task("tools", kind="rl", n=3))
    assert len(rows) == 6
    call, answer = rows[0], rows[1]
    env = ToolEnvironment([toy.calc])
    observation, reward, done = env.step(call["completion"])
    assert (reward, done) == (None, False) and env.failed_calls == 0
    assert answer["prompt"] == f"{call['prompt']}{call['completion']}</s>{observation}"
    assert observation == f"<result>{answer['completion']}</result>"


def test_the_tools_task_is_three_digit_and_its_splits_are_disjoint():
    train, test = toy.load_task("tools", "train", kind="rl"), toy.load_task("tools", "test", kind="rl")
    assert (len(train), len(test)) == (20000, 1000)
    assert not set(train["prompt"]) & set(test["prompt"])
    a, b = test[0]["prompt"].rstrip("=").split("+")
    assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999 and test[0]["answer"] == str(int(a) + int(b))
    assert {f"{y}+{x}=" for x, y in (p.rstrip("=").split("+") for p in test["prompt"])} == set(test["prompt"])


def test_the_cli_runs_the_tools_demo_and_keeps_the_default(monkeypatch):
    calls = []
    monkeypatch.setattr(demo_tools, "run_tools_demo", lambda settings, out: calls.append(("tools", settings)) or 0)
    from treadle import demo

    monkeypatch.setattr(demo, "run_demo", lambda settings, out: calls.append(("addition", settings)) or 0)
    assert cli.main(["demo", "--task", "tools", "--seed", "3", "--grpo-steps", "7"]) == 0
    assert cli.main(["demo"]) == 0
    (task, settings), (default_task, _) = calls
    assert (task, settings.seed, settings.grpo_steps, default_task) == ("tools", 3, 7, "addition")
    with pytest.raises(ValueError, match="--sft-steps"):
        demo_tools.ToolsDemoSettings(sft_steps=0)
