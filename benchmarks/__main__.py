"""Run every benchmark, one after the other, and print all their tables at the end (``make bench``).

    python -m benchmarks                          # the full runs (hours: the demos matrix alone is most of it)
    python -m benchmarks --quick                  # each benchmark's quick mode: checks that everything runs
    python -m benchmarks --only trainers,startup
    python -m benchmarks --quick --skip real,demos --lab

Each benchmark runs in its own interpreter (``python -m benchmarks.NAME``: import times and memory do not leak from one
to the next), its progress shown as it goes; its standard output -- the tables -- is collected and printed again, all
together, once every benchmark has finished, with the command that produced it. A benchmark that fails is reported
with its exit status and the end of its error output; the others still run. Full runs append their records to the
results log (benchmarks/results.jsonl); quick runs append nowhere. ``--lab`` adds the investigations of
``benchmarks.lab`` (their quick modes with ``--quick``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import torch

from benchmarks.harness import ROOT

SUITE = [
    "startup",
    "overhead",
    "trainers",
    "packing",
    "generation",
    "engines",
    "memory",
    "async_grpo",
    "real",
    "demos",
    "gpu_check",
]
LAB = [
    "lab.shared_prefix",
    "lab.dynamic_sampling",
    "lab.health_false_alarms",
    "lab.peft_generation",
    "lab.profile",
    "lab.vllm_load",
    "lab.vllm_gap",
    "lab.demo_control",
    "lab.vocab_memory",
]
FULL = {"trainers": ["--twin"]}  # --twin: the table in docs/performance.md


def arguments(name: str, quick: bool, cuda: bool) -> tuple[list[str], str]:
    """(command-line arguments, a note for the report) for one benchmark."""
    if name == "gpu_check" and not cuda:
        return ["--cpu-smoke", "--steps", "2"], "no CUDA device here: the CPU smoke run only"
    if quick:
        return (["--cpu-smoke", "--steps", "2"] if name == "gpu_check" else ["--quick"]), ""
    return FULL.get(name, []), ""


def run(name: str, args: list[str], timeout: float | None) -> tuple[int, str, str, float]:
    """(exit status, stdout, the last lines of stderr, seconds); stderr is echoed as it comes, as progress."""
    command = [sys.executable, "-m", f"benchmarks.{name}", *args]
    start = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    killed = threading.Event()
    timer = threading.Timer(timeout, lambda: (killed.set(), proc.kill())) if timeout else None
    if timer is not None:
        timer.start()
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()  # stdout on its own thread: a full pipe must not block the benchmark
    err_lines: list[str] = []
    for line in proc.stderr:
        err_lines.append(line.rstrip("\n"))
        print(f"    {line.rstrip()}", file=sys.stderr, flush=True)
    status = proc.wait()
    reader.join()
    if timer is not None:
        timer.cancel()
    if killed.is_set():
        status = 124
        err_lines.append(f"killed after {timeout:.0f} s (--timeout)")
    return status, "".join(out), "\n".join(err_lines[-15:]), time.time() - start


def chosen(opts, parser) -> list[str]:
    names = SUITE + (LAB if opts.lab else [])
    if opts.only:
        wanted = [n.strip() for n in opts.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(SUITE + LAB))
        if unknown:
            parser.error(f"unknown benchmarks {unknown}; the suite: {SUITE}; the lab: {LAB}")
        names = [n for n in SUITE + LAB if n in wanted]
    return [n for n in names if n not in set(opts.skip.split(","))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's quick mode")
    parser.add_argument("--only", default=None, help="comma-separated benchmark names (e.g. trainers,lab.profile)")
    parser.add_argument("--skip", default="", help="comma-separated benchmark names to leave out")
    parser.add_argument("--lab", action="store_true", help="also the investigations of benchmarks.lab")
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per benchmark")
    opts = parser.parse_args(argv)
    cuda, reports, started = torch.cuda.is_available(), [], time.time()
    for name in chosen(opts, parser):
        args, note = arguments(name, opts.quick, cuda)
        shown = " ".join(["python -m", f"benchmarks.{name}", *args])
        print(f"==> {shown}", file=sys.stderr, flush=True)
        reports.append((name, shown, note, *run(name, args, opts.timeout)))
    kind = "quick" if opts.quick else "full"
    print(f"\n# Benchmarks ({time.strftime('%Y-%m-%d %H:%M')}, {kind} runs, {time.time() - started:.0f} s in all)\n")
    for name, shown, note, status, out, err_tail, seconds in reports:
        print(f"## {name}\n\n`{shown}` ({seconds:.0f} s{'; ' + note if note else ''})\n")
        print(out.strip() or "(no output)")
        if status != 0:
            print(f"\nFAILED with exit status {status}; end of its error output:\n\n```\n{err_tail}\n```")
        print()
    failed = [name for name, _, _, status, *_ in reports if status != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
