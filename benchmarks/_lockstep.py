"""Contenders in lockstep, for the toy trainers' benchmarks (``benchmarks.trainers``, ``benchmarks.packing``): the
contenders of one run are built in threads of one process that take turns one optimizer step at a time (a baton
passed at the end of every step; only its holder runs), because this machine's speed wanders by tens of percent over
tens of seconds and a slow spell must hit every contender alike. A step is timed from the moment its contender gets
the baton to the end of the step, so data loading, generation, callbacks and every hook are included.

Two settings keep the threads as comparable as separate single-threaded scripts would be, and were needed: all
contenders run on one CPU core (else a contender whose thread the system put on the core that another process kept
busy ran 40% slower than its twin for a whole run), and glibc serves every thread from one malloc arena
(``single_malloc_arena``; with an arena per thread, the memory given back to the system and faulted in again differed
between contenders: the same MLP took 70% longer in one than in the other).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "sft", "dpo" or "grpo"
    warmup: int  # untimed optimizer steps
    timed: int  # timed optimizer steps (a multiple of spg)
    completion_length: int = 0  # GRPO: L, most tokens sampled per completion
    spg: int = 1  # GRPO: steps_per_generation

    @property
    def steps(self) -> int:
        return self.warmup + self.timed


def fastest_half(steps: list[float], work: Workload) -> float:
    """Mean step time over the fastest half of the timed units: single steps for SFT and DPO (every step does the
    same work), whole generation cycles for GRPO with spg > 1. Other processes only ever add time, so the fastest
    half measures the work itself; the slower half is where they happened to run."""
    timed = steps[work.warmup : work.steps]
    units = sorted(statistics.fmean(timed[i : i + work.spg]) for i in range(0, len(timed), work.spg))
    return statistics.fmean(units[: max(1, len(units) // 2)])


def timed_mean(steps: list[float], work: Workload) -> float:
    """Mean over every timed step: for workloads whose steps differ (in the same order for every contender)."""
    return statistics.fmean(steps[work.warmup : work.steps])


class Baton:
    """Contenders take turns, one optimizer step each, passing the baton at the end of every step: only the holder
    runs, and whatever slows this machine down for seconds at a time slows every contender alike."""

    def __init__(self, players: int):
        self.condition = threading.Condition()
        self.order = list(range(players))  # who is still playing, in turn order
        self.holder = 0

    def wait(self, player: int) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.holder == player)

    def pass_on(self, player: int, leave: bool = False) -> None:
        with self.condition:
            at = self.order.index(player)
            if leave:
                self.order.pop(at)
            else:
                at += 1
            self.holder = self.order[at % len(self.order)] if self.order else -1
            self.condition.notify_all()


class Stopwatch:
    """One contender's clock: the seconds of each optimizer step, from getting the baton to passing it on."""

    def __init__(self, baton: Baton, player: int):
        self.baton, self.player = baton, player
        self.steps: list[float] = []
        self.resumed = 0.0
        self.settings: dict = {}  # what the contender reports it did (compared across contenders by the caller)

    def start(self) -> None:
        self.baton.wait(self.player)
        self.resumed = time.perf_counter()

    def tick(self) -> None:
        self.steps.append(time.perf_counter() - self.resumed)
        self.baton.pass_on(self.player)
        self.baton.wait(self.player)
        self.resumed = time.perf_counter()


@contextlib.contextmanager
def quiet():
    """Silence the trainers' own printing (warnings, progress lines) during a timed run."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
        warnings.simplefilter("ignore")
        yield


def run_lockstep(runners: list[tuple[str, Callable]], work: Workload, size: str, cpu: int | None, summary: Callable):
    """Run ``fn(work, size, steps, stopwatch, output_dir)`` of every (name, fn) in threads that take turns step by
    step, all on CPU ``cpu`` (None: wherever the system puts them). Returns ({name: ``summary(steps, work)``, NaN
    for a contender that failed: its error is printed and the others go on}, {name: the settings it reported})."""
    baton = Baton(len(runners))
    watches = [Stopwatch(baton, i) for i in range(len(runners))]
    errors: dict[str, str] = {}

    def play(i: int, name: str, fn: Callable) -> None:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})  # 0 = this thread (Linux); see the module's docstring
        try:
            watches[i].start()
            with tempfile.TemporaryDirectory(prefix="treadle-bench-") as output_dir:
                torch.manual_seed(0)
                fn(work, size, work.steps, watches[i], output_dir)
        except Exception as e:  # a peer that cannot run this configuration: reported, not fatal
            errors[name] = f"{type(e).__name__}: {e}"
        finally:
            baton.pass_on(i, leave=True)

    threads = [threading.Thread(target=play, args=(i, n, fn), daemon=True) for i, (n, fn) in enumerate(runners)]
    with quiet():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    gc.collect()
    out = {}
    for (name, _), watch in zip(runners, watches):
        if name not in errors and len(watch.steps) < work.steps:
            errors[name] = f"made {len(watch.steps)} optimizer steps, expected {work.steps}"
        out[name] = float("nan") if name in errors else summary(watch.steps, work)
    for name, error in errors.items():
        print(f"  {name} failed on {size} {work.name}: {error}", file=sys.stderr)
    return out, {name: watch.settings for (name, _), watch in zip(runners, watches) if name not in errors}


def measure(sizes, works, rounds: int, contenders: Callable, check: Callable, summary: Callable, cpu: int | None):
    """Every workload on every model size, ``rounds`` times, the contenders (``contenders(work)``: an ordered
    {name: fn}) in lockstep with the first to step rotated each round; ``check(size, work, settings)`` raises when
    two contenders did different work. Returns ({(size, workload): {name: [figure per round]}}, {same key: {name:
    settings}})."""
    results: dict = {}
    settings: dict = {}
    for r in range(rounds):
        for size in sizes:
            for work in works:
                runners = list(contenders(work).items())
                cell = results.setdefault((size, work.name), {name: [] for name, _ in runners})
                shift = r % len(runners)
                seconds, reported = run_lockstep(runners[shift:] + runners[:shift], work, size, cpu, summary)
                check(size, work, reported)
                settings.setdefault((size, work.name), {}).update(reported)
                for name, value in seconds.items():
                    cell[name].append(value)
                line = "  ".join(f"{n} {1000 * v[-1]:.1f}" for n, v in cell.items())
                print(f"round {r + 1}/{rounds} {size:5s} {work.name:14s} ms/step: {line}", file=sys.stderr, flush=True)
    return results, settings


def single_malloc_arena() -> bool:
    """Ask glibc to serve every thread from one malloc arena, as in a single-threaded training script (see the
    module's docstring); True if set. Call it before any thread allocates."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").mallopt(-8, 1) == 1  # M_ARENA_MAX = 1
    except (OSError, AttributeError):  # not glibc: nothing to do
        return False


def pinned_cpu(cpu: int | None) -> int | None:
    """The CPU every contender runs on: ``cpu``, else the lowest this process may use; None for -1 (no pinning)."""
    if cpu is None and hasattr(os, "sched_getaffinity"):
        cpu = min(os.sched_getaffinity(0))
    return None if cpu is None or cpu < 0 else cpu
