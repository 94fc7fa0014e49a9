"""Run every benchmark in this folder, one after the other, and print all their tables at the end.

    python benchmarks/run_all.py            # the full runs (about 80 minutes on 2 quiet CPU cores)
    python benchmarks/run_all.py --quick    # each benchmark's quick mode: checks that everything runs
    python benchmarks/run_all.py --only trainers,startup

Each benchmark runs in its own interpreter (so import times and memory do not leak from one to the next), with
its progress shown as it goes; its standard output -- the tables -- is collected and printed again, all
together, once every benchmark has finished, with the command that produced it. A benchmark that fails is
reported with its exit status and the end of its error output; the others still run. A script added to this
folder is picked up automatically: it is run with ``--quick`` in quick mode when its ``--help`` offers it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# Arguments of the benchmarks whose quick mode is not spelt --quick, or that need a GPU. Others: no arguments,
# plus --quick in quick mode when they accept it.
SPECIAL = {
    "trainers": {"full": ["--twin"], "quick": ["--quick"]},  # --twin: the table in docs/performance.md
    "logprob_memory": {"full": [], "quick": ["--small"]},
    "gpu_check": {"full": [], "quick": [], "cpu": ["--cpu-smoke"]},  # on a machine without CUDA: a smoke run
}
ORDER = [
    "startup",
    "overhead",
    "trainers",
    "packing",
    "generation",
    "logprob_memory",
    "gpu_check",
]  # others come after


def discover() -> list[str]:
    """Benchmark names (file stems) in run order."""
    names = [
        f[:-3]
        for f in os.listdir(HERE)
        if f.endswith(".py") and not f.startswith("_") and f != os.path.basename(__file__)
    ]
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def accepts_quick(path: str) -> bool:
    proc = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, timeout=120)
    return proc.returncode == 0 and "--quick" in proc.stdout


def arguments(name: str, path: str, quick: bool, cuda: bool) -> tuple[list[str], str]:
    """(command-line arguments, a note for the report) for one benchmark."""
    special = SPECIAL.get(name)
    if special is not None:
        if "cpu" in special and not cuda:
            return special["cpu"], "no CUDA device here: CPU smoke run only"
        return special["quick" if quick else "full"], ""
    return (["--quick"] if quick and accepts_quick(path) else []), ""


def run(name: str, args: list[str], timeout: float | None) -> tuple[int, str, str, float]:
    """(exit status, stdout, the last lines of stderr, seconds); stderr is echoed as it comes, as progress."""
    command = [sys.executable, os.path.join(HERE, f"{name}.py"), *args]
    start = time.time()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(HERE)
    )
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        proc.kill()

    timer = threading.Timer(timeout, kill) if timeout else None
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's quick mode")
    parser.add_argument("--only", default=None, help="comma-separated benchmark names (file stems)")
    parser.add_argument("--skip", default="", help="comma-separated benchmark names to leave out")
    parser.add_argument("--timeout", type=float, default=None, help="seconds allowed per benchmark")
    opts = parser.parse_args(argv)
    names = discover()
    if opts.only:
        wanted = [n.strip() for n in opts.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"unknown benchmarks {unknown}; this folder has {names}")
        names = [n for n in names if n in wanted]
    names = [n for n in names if n not in set(opts.skip.split(","))]
    cuda = has_cuda()
    reports, failed = [], []
    started = time.time()
    for name in names:
        args, note = arguments(name, os.path.join(HERE, f"{name}.py"), opts.quick, cuda)
        shown = " ".join(["python", f"benchmarks/{name}.py", *args])
        print(f"==> {shown}", file=sys.stderr, flush=True)
        status, out, err_tail, seconds = run(name, args, opts.timeout)
        if status != 0:
            failed.append(name)
        reports.append((name, shown, note, status, out, err_tail, seconds))
    print(
        f"\n# Benchmarks ({time.strftime('%Y-%m-%d %H:%M')}, {'quick' if opts.quick else 'full'} runs, "
        f"{time.time() - started:.0f} s in all)\n"
    )
    for name, shown, note, status, out, err_tail, seconds in reports:
        print(f"## {name}\n\n`{shown}` ({seconds:.0f} s{'; ' + note if note else ''})\n")
        print(out.strip() or "(no output)")
        if status != 0:
            print(f"\nFAILED with exit status {status}; end of its error output:\n\n```\n{err_tail}\n```")
        print()
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
