"""The guarded calls of tools and environments (treadle.rollouts.calls): a tool that raises SystemExit is a failed
call, a call without a deadline that runs long is named in a SlowCallWarning, an environment that never answers ends
its rollout at env_timeout, and one that breaks its contract is one line naming it. The rollouts themselves:
tests/rollouts/test_rollouts.py; docs/runs.md lists the trial cases."""

from types import SimpleNamespace

import pytest


def test_a_tool_calling_sys_exit_is_a_failed_call_not_the_end_of_training():
    from treadle.rollouts.tools import ToolEnvironment

    def quit_(x: int) -> int:
        """Exits."""
        raise SystemExit(3)

    env = ToolEnvironment([quit_], tool_timeout=None)
    try:
        assert env.step("<call>quit_(1)</call>")[0] == "<result>error: quit_ raised SystemExit: 3</result>"
        env.timeout = 5.0
        assert env.step("<call>quit_(1)</call>")[0] == "<result>error: quit_ raised SystemExit: 3</result>"
        assert env.failed_calls == 2
    finally:
        env.close()


def test_a_tool_without_a_deadline_that_runs_long_is_named_in_a_warning(monkeypatch):
    import threading

    from treadle.rollouts import calls as usercalls
    from treadle.rollouts.tools import ToolEnvironment

    released, seen = threading.Event(), []

    def slow(x: int) -> int:
        """Waits until the warning is out."""
        released.wait()
        return x

    def warn(message, category, stacklevel=1):
        seen.append((message, category))
        released.set()

    monkeypatch.setattr(usercalls, "SLOW_CALL_WARNING", 0.01)
    monkeypatch.setattr(usercalls, "warnings", SimpleNamespace(warn=warn))
    env = ToolEnvironment([slow], tool_timeout=None)
    try:
        assert env.step("<call>slow(7)</call>")[0] == "<result>7</result>"  # no limit: it waited, and said so
    finally:
        env.close()
    [(message, category)] = seen
    assert category is usercalls.SlowCallWarning
    assert "tool 'slow' has run for 0.01 s with tool_timeout=None (no limit)" in message


class Hangs:
    def __init__(self):
        self.release = __import__("threading").Event()

    def reset(self, row):
        return " go:"

    def step(self, text):
        self.release.wait()
        return "late", 1.0, False


def test_an_environment_that_never_answers_ends_its_rollout_at_env_timeout(recwarn):
    from treadle.demos import toy
    from treadle.rollouts.calls import GuardedEnvironment, SlowCallWarning
    from treadle.rollouts.runner import RolloutRunner, rollout_metrics

    with pytest.raises(ValueError, match="env_timeout must be > 0 seconds"):
        RolloutRunner(toy.build_tokenizer(), env_factory=Hangs, env_timeout=0)
    runner = RolloutRunner(toy.build_tokenizer(), env_factory=Hangs, env_timeout=0.05)
    try:
        env = runner.new_environment()
        assert isinstance(env, GuardedEnvironment) and env.timeout == 0.05
        assert env.reset({}) == " go:"
        assert env.step("7") == ("", None, True) and env.timed_out  # ended, unanswered
        assert env.step("8") == ("", None, True)  # never called again
        [warning] = [w for w in recwarn if w.category is SlowCallWarning]
        assert "environment Hangs.step ran past env_timeout=0.05 s: its rollout ends there" in str(warning.message)
        fine = GuardedEnvironment(Hangs(), 0.05, runner.tool_pool)
        metrics = rollout_metrics([[{"role": "assistant", "content": "x"}]] * 2, [False, False], [env, fine])
        assert metrics["rollouts/env_timeouts"] == (1, 2)
    finally:
        env.env.release.set()
        runner.close()


class Wrong:
    def __init__(self, first="", answer=("", None, False), error=None):
        self.first, self.answer, self.error = first, answer, error

    def reset(self, row):
        return self.first

    def step(self, text):
        if self.error:
            raise self.error
        return self.answer


@pytest.mark.parametrize(
    "env, method, needle",
    [
        (
            Wrong(first=5),
            "reset",
            "environment Wrong.reset returned the first observation 5 (int); its contract is reset",
        ),
        (Wrong(answer=(5, None, False)), "step", "environment Wrong.step returned observation 5 (int)"),
        (Wrong(answer=("ok", "1.0", False)), "step", "environment Wrong.step returned reward '1.0' (str)"),
        (Wrong(answer=("ok", None, "False")), "step", "environment Wrong.step returned done 'False' (str)"),
        (Wrong(answer="ok"), "step", "environment Wrong.step returned 'ok' (str); its contract is step(text) -> ("),
        (Wrong(error=SystemExit(1)), "step", "environment Wrong.step raised SystemExit: 1 on 'turn'"),
    ],
)
def test_an_environment_breaking_its_contract_is_one_line_naming_it(env, method, needle):
    from treadle.errors import is_user_error, one_line
    from treadle.rollouts.calls import EnvironmentContractError, GuardedEnvironment, ToolPool

    pool = ToolPool()
    try:
        guarded = GuardedEnvironment(env, 5.0, pool)
        with pytest.raises(EnvironmentContractError) as error:
            guarded.reset({}) if method == "reset" else guarded.step("turn")
        assert GuardedEnvironment(Wrong(answer=("ok", 1, 1)), 5.0, pool).step("t") == ("ok", 1, True)
    finally:
        pool.close()
    assert is_user_error(error.value) and needle in one_line(error.value)
