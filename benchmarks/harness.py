"""The benchmarks' one harness: the machine a run measured, the allocator every contender runs in, contenders taking
turns in interleaved rounds, the float32 matmul roof measured in the same run, peak memory, contenders in child
processes, and the run's record: printed as it goes, written as JSON and appended to the results log.

A benchmark is a module of this package run as ``python -m benchmarks.NAME``. It builds its parser with
``parser(...)`` (``--quick``, ``--out``, ``--json``, ``--log``, ``--no-log``, ``--allocator``), opens a ``Run`` (which
prints the machine), declares each contender's settings with ``Run.contender`` (printed), adds its figures with
``Run.row`` and ``Run.figure``, and ends with ``Run.finish``: the record goes to ``--json`` (default
``OUT/NAME.json``) and, for a full run, one line to ``benchmarks/results.jsonl`` (docs/results-log.md).

Only ratios measured in one run mean anything on a shared machine: the host's speed wanders by tens of percent over
tens of seconds, so contenders take turns (``interleaved``), every round's figures are kept and the spread is
printed beside the median (``spread``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
RESULTS_LOG = ROOT / "benchmarks" / "results.jsonl"
MiB = 2**20
# --kernels of the benchmarks that start processes: native leaves torch's pick for this CPU, the others are
# ATEN_CPU_CAPABILITY values (a set above what the CPU has falls back to the best it has)
KERNEL_SETS = ("native", "default", "avx2", "avx512")
# The flags that decide which matmul / bfloat16 kernels torch's CPU backend can use.
SIMD = re.compile(r"^(avx\w*|amx\w*|fma|f16c|sse4_2|neon|asimd\w*|sve\w*)$")
# kept: every contender's process keeps freed memory (treadle.allocator.keep_freed_memory), the setting treadle's
# train() applies on CPU; glibc: glibc's defaults for every contender; as-shipped: treadle's contenders kept, the
# others (TRL, the bare loop) in glibc's defaults, a comparison of what ships rather than of the work
ALLOCATORS = ("kept", "glibc", "as-shipped")


# ---------------------------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------------------------
def cpu_model_and_flags() -> tuple[str, list[str]]:
    """(CPU model name, the SIMD-relevant flags), from /proc/cpuinfo, else lscpu, else platform."""
    model, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model name") and not model:
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = value.split()
    except OSError:
        pass
    if not model or not flags:
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
            info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
            model, flags = model or info.get("Model name", "").strip(), flags or info.get("Flags", "").split()
        except (OSError, subprocess.SubprocessError):
            pass
    return model or platform.processor() or platform.machine(), [f for f in flags if SIMD.match(f)]


def machine() -> dict:
    """This machine now: CPU, SIMD flags, usable cores, load average, torch, its threads and kernel set."""
    model, flags = cpu_model_and_flags()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": model,
        "flags": flags,
        "cores": cores,
        "load": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "kernels": os.environ.get("ATEN_CPU_CAPABILITY", "native"),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
    }


def machine_line(m: dict) -> str:
    """``machine()`` as the one line at the top of every benchmark's output."""
    load = "/".join(f"{x:.2f}" for x in m["load"]) if m["load"] else "?"
    return (
        f"Machine: {m['cpu']}, {m['cores']} core(s) usable, flags [{' '.join(m['flags']) or 'none found'}], load "
        f"average {load} (1/5/15 min), torch {m['torch']} with {m['threads']} thread(s), kernels {m['kernels']} "
        f"({m['capability']})"
    )


def kernel_env(kernels: str, threads: int | None = None) -> dict[str, str]:
    """This process's environment with ``ATEN_CPU_CAPABILITY`` set for ``kernels`` (unset for native) and, when
    ``threads`` is given, ``OMP_NUM_THREADS``: torch reads both when it starts, so they go to a new process."""
    if kernels not in KERNEL_SETS:
        raise ValueError(f"kernels {kernels!r}: choose from {', '.join(KERNEL_SETS)}")
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if kernels != "native":
        env["ATEN_CPU_CAPABILITY"] = kernels
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


# ---------------------------------------------------------------------------------------------------------
# The allocator
# ---------------------------------------------------------------------------------------------------------
def allocator_env(setting: str, treadle_contender: bool, env: dict | None = None) -> dict[str, str]:
    """The environment of one contender's process under allocator ``setting`` (see ALLOCATORS): glibc's defaults
    are asked for with ``TREADLE_KEEP_FREED_MEMORY=0``, which ``treadle.allocator`` and treadle's train() honour."""
    env = dict(os.environ if env is None else env)
    keep = setting == "kept" or (setting == "as-shipped" and treadle_contender)
    if keep:
        env.pop("TREADLE_KEEP_FREED_MEMORY", None)
    else:
        env["TREADLE_KEEP_FREED_MEMORY"] = "0"
    return env


def apply_allocator(setting: str | None = None) -> str:
    """Put this process in its allocator setting before any contender's work, and return the label its rows print.
    ``setting`` "kept" or "glibc" sets the environment first (one process holding every contender); None reads it
    as ``allocator_env`` left it (a contender's own process)."""
    if setting == "as-shipped":
        raise SystemExit("--allocator as-shipped compares processes: this benchmark runs its contenders in one")
    if setting == "glibc":
        os.environ["TREADLE_KEEP_FREED_MEMORY"] = "0"
    elif setting == "kept":
        os.environ.pop("TREADLE_KEEP_FREED_MEMORY", None)
    from treadle.allocator import keep_freed_memory  # treadle only once the setting is in the environment

    return "freed memory kept" if keep_freed_memory() else "the allocator's defaults"


# ---------------------------------------------------------------------------------------------------------
# Rounds, figures, the roof, memory
# ---------------------------------------------------------------------------------------------------------
def interleaved(names: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, contender) for every contender in every round, the order rotated each round: whatever slows the
    machine for a while hits every contender alike, and none always runs first."""
    for round_ in range(rounds):
        shift = round_ % max(1, len(names))
        for name in names[shift:] + names[:shift]:
            yield round_, name


def spread(values: list[float]) -> dict:
    """Median, best, worst and every value (NaN, a failed run, left out of the first three)."""
    ok = sorted(v for v in values if v == v)
    if not ok:
        return {"median": None, "min": None, "max": None, "runs": values}
    return {"median": statistics.median(ok), "min": ok[0], "max": ok[-1], "runs": values}


def ratio_per_round(values: list[float], bases: list[float] | None) -> float | None:
    """Median over rounds of each round's ratio to the base's figure in the same round."""
    ratios = [v / b for v, b in zip(values, bases or []) if v == v and b == b and b]
    return statistics.median(ratios) if ratios else None


def matmul_roof(rows: int, shapes, dtype: str = "float32", repeats: int = 3) -> float:
    """Best GFLOP/s of ``rows x K`` by ``K x N`` products for the (K, N) ``shapes`` a model runs, with this process's
    threads: the most a step of those matmuls could reach on this machine now."""
    best = 0.0
    for k, n in shapes:
        a, b = torch.randn(rows, k, dtype=getattr(torch, dtype)), torch.randn(k, n, dtype=getattr(torch, dtype))
        out = a @ b
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            best = max(best, 2 * rows * k * n / (time.perf_counter() - start) / 1e9)
    return best


def matmul_replay(model, rows: int, repeats: int = 3) -> float:
    """Best GFLOP/s of one decode step's matmuls and nothing else: every ``nn.Linear`` of ``model`` in module order,
    each on a ``(rows, in_features)`` input with the model's own weights, as ``F.linear`` runs it.

    Unlike :func:`matmul_roof` (one small weight multiplied again and again, so it stays in the core's cache), a step
    reads every weight of the model once (SmolLM2-135M's 540 MB against a 32 MB L3): this is the rate the step's
    matmuls reach where they run, the most a decode step made of them could reach."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in linears}
    flops = sum(2 * rows * m.in_features * m.out_features for m in linears)
    best = 0.0
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first pass pays the output allocations
            start = time.perf_counter()
            for m in linears:
                torch.nn.functional.linear(inputs[m.in_features], m.weight, m.bias)
            best = max(best, flops / (time.perf_counter() - start) / 1e9)
    return best


def peak_memory(fn: Callable[[], Any], device: str = "cpu") -> tuple[Any, float]:
    """``(fn(), peak MiB of tensor memory allocated while it ran, above what was allocated before)``: CUDA's peak
    allocator figure, or on CPU the running sum of every allocation and free that torch's profiler records."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        return result, (torch.cuda.max_memory_allocated() - before) / MiB
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()) == "DeviceType.CPU"
    ]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return result, peak / MiB


def peak_rss_mib() -> float:
    """This process's resident-memory high-water mark (MiB): /proc's VmHWM, which a new program starts afresh;
    ``ru_maxrss`` keeps the parent's high-water mark across fork and exec, so a child started by a benchmark that had
    grown would report the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------------------------------------
# Contenders in child processes
# ---------------------------------------------------------------------------------------------------------
def spawn(module: str, args: list[str], env: dict | None = None, timeout: float | None = None) -> dict:
    """Run ``python -m benchmarks.MODULE ARGS`` (a contender in a process of its own: its peak RSS, imports and
    allocator are its own) and return the value its ``child_result`` printed; raises with its error output."""
    command = [sys.executable, "-m", f"benchmarks.{module}", *args]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{shlex.join(command[1:])} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def child_result(value: Any) -> None:
    """A child contender's answer to ``spawn``: one line of JSON on standard output."""
    print("RESULT " + json.dumps(value), flush=True)


# ---------------------------------------------------------------------------------------------------------
# The run's record
# ---------------------------------------------------------------------------------------------------------
def parser(doc: str, quick: str, allocator: bool = True) -> argparse.ArgumentParser:
    """A benchmark's parser with the options every one has; ``quick`` says what ``--quick`` runs."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"a check that it runs, not a measurement: {quick}")
    p.add_argument("--out", default=None, help="folder for this run's files (default: a new temporary one)")
    p.add_argument("--json", default=None, help="write the run's record here (default: OUT/NAME.json)")
    p.add_argument("--log", default=None, help=f"append the record here (default: {RESULTS_LOG.name}, full runs)")
    p.add_argument("--no-log", action="store_true", help="append the record to no log")
    if allocator:
        p.add_argument("--allocator", choices=ALLOCATORS, default="kept", help="the contenders' allocator setting")
    return p


def git_commit() -> str:
    """The checkout's commit, with "+changes" when its working tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return head.stdout.strip()[:12] + ("+changes" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Run:
    """One run of one benchmark: its command, machine, options, contenders' settings, rows and figures."""

    def __init__(self, name: str, opts: argparse.Namespace):
        self.name, self.opts, self.start = name, opts, time.time()
        self.out = Path(opts.out or tempfile.mkdtemp(prefix=f"treadle-bench-{name}-"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.record = record_head(name, quick=bool(getattr(opts, "quick", False)))
        self.record.update(
            options={k: v for k, v in vars(opts).items() if k not in ("out", "json", "log", "no_log")},
            contenders={},
            rows=[],
            figures={},
        )
        print(machine_line(self.record["machine"]), flush=True)

    def contender(self, name: str, **settings) -> None:
        """Record and print what contender ``name`` runs: every setting that makes its work what it is."""
        self.record["contenders"][name] = settings
        print(f"contender {name}: " + ", ".join(f"{k} {v}" for k, v in settings.items()), flush=True)

    def row(self, **cells) -> dict:
        self.record["rows"].append(cells)
        return cells

    def figure(self, **figures) -> None:
        """The run's headline figures (what the docs quote), kept apart from the rows."""
        self.record["figures"].update(figures)

    def finish(self) -> Path:
        """Write the record as JSON and append it to the results log (a full run, or ``--log``); return the JSON."""
        self.record["seconds"] = round(time.time() - self.start)
        self.record["load_at_end"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
        path = Path(self.opts.json or self.out / f"{self.name}.json")
        path.write_text(json.dumps(self.record, indent=1, default=str) + "\n")
        log = log_path(self.opts, self.record["quick"])
        if log:
            append_log(log, self.record)
        print(f"\nrecord: {path}" + (f"; appended to {log}" if log else ""), flush=True)
        return path


def record_head(name: str, quick: bool) -> dict:
    """The first fields of a run's record: what ran, when, on which commit and machine."""
    return {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": git_commit(),
        "command": shlex.join(["python", "-m", f"benchmarks.{name}", *sys.argv[1:]]),
        "quick": quick,
        "machine": machine(),
    }


def log_path(opts: argparse.Namespace, check: bool) -> Path | None:
    """Where a run's record goes: ``--log``, else the results log for a measurement (not a ``check``: --quick)."""
    if opts.no_log:
        return None
    return Path(opts.log) if opts.log else (None if check else RESULTS_LOG)


def append_log(path: Path, record: dict) -> None:
    """One line of JSON per run, appended: the results log is the benchmarks' dated history."""
    with open(path, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table (numbers right-aligned by the reader's renderer, not here)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
