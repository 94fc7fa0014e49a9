"""Calling the user's code from a rollout -- tools and environments -- so that none can hang or crash training.

- :class:`ToolPool`: the daemon threads calls run in; a call past its deadline is abandoned on its thread.
- :func:`call_with_timeout`: a tool call. It raises :class:`ToolError` (the text the model reads in its tool turn)
  when the call has wrong arguments, raises -- ``SystemExit`` included: a tool calling ``sys.exit()`` is a failed
  call, not the end of training -- or runs past ``timeout`` seconds. ``timeout=None`` means no limit: the rollout
  waits, and after ``SLOW_CALL_WARNING`` seconds a :class:`SlowCallWarning` names the call, so a run that waits
  is never silent.
- :class:`GuardedEnvironment`: an ``env_factory`` environment seen through its contract. ``reset`` and ``step``
  run with a deadline (``env_timeout``; ``None``: no limit, the same warning): a call past it ends that rollout
  unanswered, with a :class:`SlowCallWarning` naming the environment, counted as ``rollouts/env_timeouts``. What
  they return is checked: an observation that is not text, a reward that is not a number, ``done`` given as text,
  or an exception is :class:`EnvironmentContractError`, one line naming the environment and the value.
"""

from __future__ import annotations

import inspect
import queue
import threading
import warnings
from concurrent.futures import Future, TimeoutError as FutureTimeout

from treadle.errors import UserError, shorten

__all__ = [
    "EnvironmentContractError",
    "GuardedEnvironment",
    "SlowCallWarning",
    "ToolError",
    "ToolPool",
    "call_with_timeout",
]

SLOW_CALL_WARNING = 60.0  # seconds a call without a deadline runs before a warning names it


class ToolError(Exception):
    """A call that could not run: its message is what the model reads in the tool turn."""


class EnvironmentContractError(UserError, RuntimeError):
    """An environment raised, or returned what its contract does not allow; the message names it and the value."""


class SlowCallWarning(UserWarning):
    """A tool or environment call ran past its deadline, or long without one."""


class ToolPool:
    """The daemon threads that run tool calls (one per call in flight, reused), owned by whoever closes it: a
    RolloutRunner for its environments, or a ToolEnvironment made on its own.

    A call still running past its timeout is *abandoned*: Python cannot stop a thread, so its thread stays busy
    until the function returns and then exits, while later calls get other threads and never wait behind it.
    Being a daemon, a stuck thread never holds up the interpreter's exit. ``close()`` ends every idle thread (and
    waits for them) and each busy one as soon as its call returns; a pool can be used again after ``close()``."""

    def __init__(self):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a task and not yet promised one
        self._threads: list[threading.Thread] = []
        self._abandoned: set[Future] = set()
        self._running: dict[threading.Thread, Future] = {}

    def submit(self, fn, *args, **kwargs) -> Future:
        future: Future = Future()
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            if self._idle:
                self._idle -= 1  # an idle thread takes it
            else:
                worker = threading.Thread(target=self._work, name=f"treadle-tool-{len(self._threads)}", daemon=True)
                self._threads.append(worker)
                worker.start()
        self._tasks.put((future, fn, args, kwargs))
        return future

    def abandon(self, future: Future) -> None:
        """Give up on ``future`` (timed out): ``close()`` will not wait for its thread."""
        with self._lock:
            self._abandoned.add(future)

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args, kwargs = task
            with self._lock:
                self._running[threading.current_thread()] = future
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # the caller turns it into the model's error turn
                    future.set_exception(e)
            with self._lock:
                del self._running[threading.current_thread()]
                self._abandoned.discard(future)
                self._idle += 1

    def threads(self) -> list[threading.Thread]:
        """The pool's live threads (busy or idle)."""
        with self._lock:
            return [t for t in self._threads if t.is_alive()]

    def close(self) -> None:
        with self._lock:
            stuck = {t for t, f in self._running.items() if f in self._abandoned}
            threads, self._idle = self._threads, 0
            self._threads = [t for t in threads if t in stuck]  # still listed (threads()) until their call returns
        for _ in threads:
            self._tasks.put(None)  # one stop per thread; a busy one reads it when its call returns
        for thread in threads:
            if thread not in stuck:
                thread.join()


def run_with_deadline(pool: ToolPool, fn, args: tuple, timeout: float | None, what: str, setting: str):
    """``fn(*args)`` on a thread of ``pool``: its result or exception; ``FutureTimeout`` after ``timeout`` seconds
    (the call abandoned). ``timeout=None`` waits for ever, warning after ``SLOW_CALL_WARNING`` seconds."""
    future = pool.submit(fn, *args)
    try:
        if timeout is not None:
            return future.result(timeout)
        try:
            return future.result(SLOW_CALL_WARNING)
        except FutureTimeout:
            warnings.warn(
                f"treadle: {what} has run for {SLOW_CALL_WARNING:g} s with {setting}=None (no limit); the "
                f"rollout waits for it: set {setting} to cut such calls off",
                SlowCallWarning,
                stacklevel=2,
            )
            return future.result()
    except FutureTimeout:
        pool.abandon(future)
        raise


def call_with_timeout(fn, args: list, kwargs: dict, timeout: float | None, pool: ToolPool):
    """``fn(*args, **kwargs)`` on a thread of ``pool``, or ToolError when it raises (``SystemExit`` included) or is
    still running after ``timeout`` seconds (it is then abandoned, see :class:`ToolPool`; ``None``: no limit)."""
    name = getattr(fn, "__name__", "tool")
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise ToolError(f"wrong arguments for {name}: {e}") from None
    try:
        return run_with_deadline(pool, lambda: fn(*args, **kwargs), (), timeout, f"tool {name!r}", "tool_timeout")
    except FutureTimeout:
        raise ToolError(f"{name} timed out after {timeout:g} s") from None
    except (Exception, SystemExit) as e:  # the model reads the error; training goes on
        raise ToolError(f"{name} raised {type(e).__name__}: {e}") from None


class GuardedEnvironment:
    """An ``env_factory`` environment called through its contract (module docstring); ``timed_out`` says whether
    one of its calls ran past ``timeout`` (the rollout then ended there)."""

    def __init__(self, env, timeout: float | None, pool: ToolPool):
        self.env, self.timeout, self.pool, self.timed_out = env, timeout, pool, False
        self.name = type(env).__name__
        self.role = getattr(env, "role", "user")

    def _call(self, method: str, argument):
        what = f"environment {self.name}.{method}"
        try:
            return run_with_deadline(
                self.pool, getattr(self.env, method), (argument,), self.timeout, what, "env_timeout"
            )
        except FutureTimeout:
            self.timed_out = True
            warnings.warn(
                f"treadle: {what} ran past env_timeout={self.timeout:g} s: its rollout ends there, "
                f"unanswered (counted in rollouts/env_timeouts); raise env_timeout or make it faster",
                SlowCallWarning,
                stacklevel=3,
            )
            return None
        except (Exception, SystemExit) as e:
            raise EnvironmentContractError(
                f"{what} raised {type(e).__name__}: {shorten(e)} on {shorten(repr(argument), 100)}; an environment "
                f"should answer bad input with an observation (--debug shows the traceback)"
            ) from e

    def reset(self, row: dict) -> str:
        observation = self._call("reset", row)
        if self.timed_out:
            return ""
        if not isinstance(observation, str):
            raise self._wrong("reset", "the first observation", observation, "reset(row) -> str")
        return observation

    def step(self, text: str) -> tuple[str, float | None, bool]:
        if self.timed_out:
            return "", None, True
        answer = self._call("step", text)
        if self.timed_out:
            return "", None, True
        if not isinstance(answer, tuple) or len(answer) != 3:
            raise self._wrong("step", "", answer, STEP_CONTRACT)
        observation, reward, done = answer
        if not isinstance(observation, str):
            raise self._wrong("step", "observation", observation, STEP_CONTRACT)
        if reward is not None and (isinstance(reward, (str, bytes)) or not hasattr(reward, "__float__")):
            raise self._wrong("step", "reward", reward, STEP_CONTRACT)
        if isinstance(done, (str, bytes)) or done is None:
            raise self._wrong("step", "done", done, STEP_CONTRACT)
        return observation, reward, bool(done)

    def _wrong(self, method: str, part: str, value, contract: str) -> EnvironmentContractError:
        return EnvironmentContractError(
            f"environment {self.name}.{method} returned {(part + ' ') if part else ''}{shorten(repr(value), 100)} "
            f"({type(value).__name__}); its contract is {contract}"
        )


STEP_CONTRACT = "step(text) -> (observation: str, reward: float | None, done: bool)"
