"""The tools-demo table of docs/demos.md: ``treadle demo --task tools`` over several seeds and two sets of CPU kernels.

Each run is the whole demo (untrained score, SFT warm start, GRPO with the ``calc`` tool, the no-tool control; see
``treadle.demos.tools``) in a child process, one at a time: once with the kernels torch picks on this CPU and once
with ``ATEN_CPU_CAPABILITY=default`` standing in for another CPU (other kernels, other rounding; the variable is
read when torch starts, hence the child processes). The 1-minute load average at each run's start, its wall time
and exit code are kept in the run's folder (``bench.json``); a run whose folder already holds them is not run again,
so an interrupted table resumes with the same command.

    nice python benchmarks/tools_seeds.py --seeds 0,1,2,3,4 --out /tmp/tools-seeds    # 2-7 min a run, quiet 2 cores

Prints a markdown table (seed and kernels, after SFT with its steps, right calls and the attempt kept when not the
first, after GRPO, gain over SFT, the control, gain over the control, whole demo, load), the spread of both gains
per kernel set, and whether every run met the demo's claim (both gains >= 15 points).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from _machine import KERNEL_SETS, machine_header, run_recorded  # this script's folder is on sys.path

CLAIM = 15.0  # points over SFT and over the no-tool control, on every run


def run_one(seed: int, kernels: str, folder: Path, threads: int = 1) -> dict:
    """One demo in a child process (kept output in ``folder``.out); returns and stores its load, time and exit."""
    argv = [
        sys.executable,
        "-m",
        "treadle",
        "demo",
        "--task",
        "tools",
        "--seed",
        str(seed),
        "--output-dir",
        str(folder),
    ]
    return {"seed": seed, **run_recorded(argv, folder, kernels, threads)}


def row(record: dict, folder: Path) -> tuple[str, float | None, float | None]:
    """A markdown row of one run, and its gains over SFT and over the control (None when it did not finish)."""
    name = f"| {record['seed']}, {record['kernels']} "
    tail = f"| {record['seconds']} s | {record['load']:.1f} |"
    if record["rc"] != 0 or not (folder / "results.json").is_file():
        return f"{name}| failed: exit {record['rc']} (see {folder}.out) | | | | | {tail}", None, None
    results = json.loads((folder / "results.json").read_text())
    stages = {s["stage"]: s for s in results["stages"]}
    attempt = f"attempt {results['sft_attempts']}, " if results.get("sft_attempts", 1) > 1 else ""
    sft, grpo, ctrl = stages["after SFT"], stages["GRPO + tool"], stages["no-tool ctrl"]
    over_sft, over_ctrl = 100 * (grpo["accuracy"] - sft["accuracy"]), 100 * (grpo["accuracy"] - ctrl["accuracy"])
    return (
        (
            f"{name}| {sft['accuracy']:.1%} ({attempt}{sft['steps']}; right call {sft['right_call']:.0%}) "
            f"| {grpo['accuracy']:.1%} (right call {grpo['right_call']:.0%}) | {over_sft:+.1f} "
            f"| {ctrl['accuracy']:.1%} | {over_ctrl:+.1f} {tail}"
        ),
        over_sft,
        over_ctrl,
    )


def spread(gains: list[float | None]) -> str:
    done = [g for g in gains if g is not None]
    if not done:
        return "no finished run"
    return (
        f"min {min(done):+.1f}, mean {sum(done) / len(done):+.1f}, max {max(done):+.1f} points over "
        f"{len(done)} finished run(s) of {len(gains)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated demo seeds")
    parser.add_argument(
        "--kernels",
        default="native,default",
        help="comma-separated: native (torch's pick for this CPU), default, avx2, avx512 (ATEN_CPU_CAPABILITY)",
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each demo (the demo's own: 1)")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary folder)")
    parser.add_argument(
        "--table-only",
        action="store_true",
        help="run nothing: print the table of the runs already in --out (a run not there reads 'not run')",
    )
    options = parser.parse_args()
    kernel_sets = options.kernels.split(",")
    unknown = sorted(set(kernel_sets) - set(KERNEL_SETS))
    if unknown:
        parser.error(f"--kernels {unknown}: choose from {sorted(KERNEL_SETS)}")

    header = machine_header()  # before the runs: its load average is the one they started under
    root = Path(options.out or tempfile.mkdtemp(prefix="tools-seeds-"))
    root.mkdir(parents=True, exist_ok=True)
    rows = {kernels: [] for kernels in kernel_sets}
    for kernels in kernel_sets:
        for seed in [int(s) for s in options.seeds.split(",")]:
            folder = root / (f"{kernels}-seed{seed}" + (f"-{options.threads}t" if options.threads != 1 else ""))
            if options.table_only and not (folder / "bench.json").is_file():
                rows[kernels].append((f"| {seed}, {kernels} | not run | | | | | | |", None, None))
                continue
            rows[kernels].append(row(run_one(seed, kernels, folder, options.threads), folder))
            print(rows[kernels][-1][0], flush=True)
    print(
        f"\n{header}\nruns in {root}; native = the kernels torch picks on this CPU, default = "
        f"ATEN_CPU_CAPABILITY=default; load = 1-minute load average at the run's start\n"
    )
    print(
        "| seed, CPU kernels | after SFT (steps; right call) | GRPO + tool (right call) | gain over SFT "
        "| no-tool control | gain over control | whole demo | load |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kernels in kernel_sets:
        print("\n".join(line for line, _, _ in rows[kernels]))
    every = [r for kernels in kernel_sets for r in rows[kernels]]
    for kernels in kernel_sets:
        print(
            f"\n{kernels}: gain over SFT {spread([r[1] for r in rows[kernels]])}; "
            f"over the control {spread([r[2] for r in rows[kernels]])}"
        )
    met = sum(r[1] is not None and min(r[1], r[2]) >= CLAIM for r in every)
    print(f"\nclaim (both gains >= {CLAIM:.0f} points): met on {met} of {len(every)} runs")


if __name__ == "__main__":
    main()
