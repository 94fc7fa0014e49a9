"""glibc's allocator for a training process: a policy of whoever owns the process, never of an import.

A training step frees its activations and allocates them again. By default glibc hands every block over its mmap
threshold back to the kernel when it is freed, and the kernel faults it in again, zeroed, at the next step: about a
million page faults and 4-19 s of kernel time in a 35-50 s GRPO step of the real model (docs/performance.md).
:func:`keep_freed_memory` has glibc keep what the process frees for its next allocations (``mallopt``: large blocks
come from the heap, which is never trimmed). The cost: the process keeps its peak memory until it exits.

Who calls it (``import treadle`` never does):

- the ``treadle`` command, for the process it owns, before ``train`` and ``demo``;
- ``Trainer.train`` on a CPU while ``TrainingArguments.keep_freed_memory`` is True (the default; transformers'
  Trainer leaves the allocator alone: docs/coming-from-transformers-and-trl.md lists the departure), for the run
  only (:func:`freed_memory_kept`): when ``train()`` returns, glibc's defaults are back and what it kept is handed
  back (``malloc_trim``), so the program around it keeps nothing;
- anyone, explicitly: ``treadle.allocator.keep_freed_memory()``.

It stands aside, returning False, where glibc is not the allocator, where ``TREADLE_KEEP_FREED_MEMORY`` says no
(``0``, ``false``, ``no``, ``off``), and where the user set glibc's own malloc variables (``MALLOC_*`` or
``glibc.malloc`` tunables): theirs win, and one line on stderr says so.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

__all__ = ["ENV", "freed_memory_kept", "keep_freed_memory", "users_settings"]

ENV = "TREADLE_KEEP_FREED_MEMORY"
OFF = ("0", "false", "no", "off")
# glibc's own malloc settings (mallopt(3)): a process started with any of them chose its allocator itself
GLIBC_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
GLIBC_DEFAULTS = {M_MMAP_MAX: 65536, M_TRIM_THRESHOLD: 128 * 1024}  # mallopt(3)'s defaults for the two

_said: list[bool] = []  # the user's settings were named on stderr
_kept: bool | None = None  # this process's answer, once asked: mallopt's settings last as long as the process


def users_settings() -> list[str]:
    """The user's own glibc malloc settings in this process's environment (their names), [] when none."""
    named = [name for name in GLIBC_VARIABLES if name in os.environ]
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        named.append("GLIBC_TUNABLES")
    return named


def keep_freed_memory() -> bool:
    """Have glibc keep the memory this process frees for its next allocations; True where it is kept (now or by an
    earlier call: the setting lasts as long as the process), False where it stands aside (module docstring)."""
    global _kept
    if _kept is None:
        _kept = _apply()
    return _kept


@contextlib.contextmanager
def freed_memory_kept():
    """Keep freed memory inside the block (``Trainer.train``'s run), then put glibc's defaults back and hand what
    was kept back to the system. Where the process's owner kept it already (:func:`keep_freed_memory`), its setting
    stands, before and after. Yields whether memory is kept inside."""
    if _kept:
        yield True
        return
    kept = _apply()
    try:
        yield kept
    finally:
        if kept:
            libc = ctypes.CDLL("libc.so.6")
            for option, value in GLIBC_DEFAULTS.items():
                libc.mallopt(option, value)
            libc.malloc_trim(0)


def _apply() -> bool:
    if os.environ.get(ENV, "1").strip().lower() in OFF or not sys.platform.startswith("linux"):
        return False
    theirs = users_settings()
    if theirs:
        if _said:
            return False
        _said.append(True)  # one line a process, however many runs ask
        print(
            f"treadle: {', '.join(theirs)} set: glibc's allocator keeps your settings, not treadle's kept freed "
            f"memory ({ENV}=0 silences this)",
            file=sys.stderr,
        )
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, ...)
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))  # -1: never trim
