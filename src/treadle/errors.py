"""What a run can end with besides its result, and how the ``treadle`` command prints it.

A leaf module (standard library only), so that every other module may import it.

- :class:`UserError` -- a mistake in a config, a path, the data or the command line. The CLI prints it as one
  line, ``treadle: error: <what is wrong>; <how to fix it>``, and exits 2. :class:`PreflightError` is one that
  ``train()`` finds before its first step (it is also a ``ValueError``, which Python callers already catch).
- :class:`NonFiniteLossError` -- the logged loss became NaN or infinite: the run stops, naming the step.
- :class:`Preempted` -- SIGTERM: the run saved a checkpoint and stopped. A ``SystemExit`` with code 143, so a
  script that does not catch it exits 143 (128 + SIGTERM) without a traceback, as a preempted job should.
- :class:`Interrupted` -- Ctrl-C: the run saved a checkpoint, then raises this ``KeyboardInterrupt`` (a
  notebook keeps its kernel; the CLI exits 130).

:func:`is_user_error` says which exceptions the CLI reports as a user error (others are bugs and keep
their traceback); :func:`one_line` is how it prints one.
"""

from __future__ import annotations

import contextlib
import signal


class UserError(Exception):
    """A mistake in the command line, a config, a path or the data: reported as one line, exit status 2."""


class PreflightError(UserError, ValueError):
    """A problem ``train()`` finds before its first step (and before anything is written)."""


class NonFiniteLossError(UserError, FloatingPointError):
    """The loss became NaN or infinite; the message names the step and what to change."""


class NothingTrainedError(UserError):
    """The run took steps but no batch held a loss item: it trained on nothing (``metrics.speed_metrics``)."""


class _Stopped:
    """What a run stopped by a signal left: the signal, the step it finished, its newest checkpoint."""

    def _record(self, signum: int, step: int, checkpoint: str | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's convention for "killed by this signal": 143, 130

    def describe(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name} after step {self.step}; checkpoint: {self.checkpoint}"


class Preempted(_Stopped, SystemExit):
    """SIGTERM stopped ``train()`` after a checkpoint; exit status 143 when not caught."""

    def __init__(self, step: int, checkpoint: str | None):
        super().__init__(128 + signal.SIGTERM)
        self._record(signal.SIGTERM, step, checkpoint)


class Interrupted(_Stopped, KeyboardInterrupt):
    """Ctrl-C stopped ``train()`` after a checkpoint (a KeyboardInterrupt: catch it like one)."""

    def __init__(self, step: int, checkpoint: str | None):
        super().__init__(f"stopped after step {step}; checkpoint: {checkpoint}")
        self._record(signal.SIGINT, step, checkpoint)


def stopped_by(signum: int, step: int, checkpoint: str | None) -> BaseException:
    """The exception ``train()`` raises after a signal stopped it at ``step`` and saved ``checkpoint``."""
    return Interrupted(step, checkpoint) if signum == signal.SIGINT else Preempted(step, checkpoint)


RESUME_HINT = "resume with trainer.train(resume_from_checkpoint=True) (or `treadle train CONFIG --resume`)"
_resume_hints = [RESUME_HINT]


def resume_hint() -> str:
    """How the process's owner resumes a stopped run, for the messages that say so (SIGTERM's line, a full disk's,
    a stalled run's): ``RESUME_HINT``, unless a ``resuming_as`` block says otherwise."""
    return _resume_hints[-1]


@contextlib.contextmanager
def resuming_as(hint: str):
    """Inside the block, ``resume_hint()`` is ``hint``: a program whose runs are resumed otherwise, or not at all
    (``treadle demo``: run it again), names what it has rather than ``resume_from_checkpoint``."""
    _resume_hints.append(hint)
    try:
        yield
    finally:
        _resume_hints.pop()


def is_user_error(error: BaseException) -> bool:
    """Whether the CLI prints ``error`` as one line (exit 2): a ``UserError`` (the classes that report a user's
    mistake subclass it: ``PreflightError``, ``checkpoint.CheckpointError``, ``rewards.RewardFunctionError`` ...).
    Anything else is a bug and keeps its traceback."""
    return isinstance(error, UserError)


def shorten(text, most: int = 200) -> str:
    """``text`` cut to ``most`` characters for a message (a path or value built by YAML aliases, or pasted by
    mistake, can be megabytes: a message names it, it does not reprint it)."""
    text = str(text)
    return text if len(text) <= most else f"{text[:most]}... ({len(text):,} characters)"


def first_rows(indices, most: int = 5) -> str:
    """The first ``most`` row indices for a message, ``"3, 8, 12 ..."`` when there are more.

    >>> first_rows([3, 8, 12, 20, 31, 40])
    '3, 8, 12, 20, 31 ...'
    """
    return ", ".join(str(i) for i in indices[:most]) + (" ..." if len(indices) > most else "")


def one_line(error: BaseException) -> str:
    """``treadle: error: <message>`` on one line (a message's later lines are joined to the first)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"treadle: error: {text or type(error).__name__}"
