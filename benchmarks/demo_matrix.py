"""The toy demos' matrix of docs/demos.md: each demo over seeds x CPU kernel sets x thread counts, against its claim.

Every run is the whole ``treadle demo --task TASK --seed N`` in a child process with ``ATEN_CPU_CAPABILITY`` (the
kernel set; ``native`` leaves torch's pick for this CPU) and ``OMP_NUM_THREADS``, one run at a time; the distill
runs of one kernel set and thread count share one teacher (``--teacher-dir``), trained by the first of them. A
run's folder keeps its load, wall time and exit code (``bench.json``), so an interrupted matrix resumes with the
same command.

    python benchmarks/demo_matrix.py --tasks addition,count,tools,distill --seeds 0,1,2,3,4 \\
        --kernels native,default --threads 1,2 --out DIR                        # 1-7 min a run on 2 quiet cores

Prints one row per run (where the demo started and ended, the gain its claim is about, whether the claim held, the
wall time and the 1-minute load average at the start), then per task and kernel set the gain's spread and the
claim's count, and whether the runs that differ only in their thread count ended with the same numbers.

The claims, each on every run: ``addition`` and ``count``: GRPO gains >= 10 points over the SFT warm start;
``tools``: >= 15 points over SFT and over the no-tool control; ``distill``: distillation reaches GRPO's final
accuracy in less training time than GRPO took.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from _machine import KERNEL_SETS, machine_header, run_recorded  # this script's folder is on sys.path

TASKS = ("addition", "count", "tools", "distill")


def run(task: str, seed: int, kernels: str, threads: int, root: Path) -> tuple[dict, Path]:
    """One demo run (or its record, when its folder has one): (record, run folder)."""
    folder = root / task / f"{kernels}-{threads}t-seed{seed}"
    argv = [sys.executable, "-m", "treadle", "demo", "--task", task, "--seed", str(seed), "--output-dir", str(folder)]
    if task == "distill":
        argv += ["--teacher-dir", str(root / task / f"teacher-{kernels}-{threads}t")]
    return {"task": task, "seed": seed, **run_recorded(argv, folder, kernels, threads)}, folder


def outcome(task: str, results: dict) -> tuple[str, str, float, bool]:
    """(start, end, gain in points, claim met) of one finished run's results.json."""
    if task == "distill":
        grpo, distill = results["methods"]["GRPO"], results["methods"]["distillation"]
        at = distill["seconds_to_grpo_final"]
        start = f"{results['warm_start']['accuracy']:.1%}"
        end = f"GRPO {grpo['final_accuracy']:.1%} in {grpo['train_seconds']:.0f} s; distillation there " + (
            "never" if at is None else f"in {at:.0f} s"
        )
        ratio = float("nan") if at is None else at / max(grpo["train_seconds"], 1e-9)
        return start, end, ratio, at is not None and at < grpo["train_seconds"]
    stages = {s["stage"]: s["accuracy"] for s in results["stages"]}
    sft = stages["after SFT"]
    if task == "tools":
        grpo, control = stages["GRPO + tool"], stages["no-tool ctrl"]
        gain = 100 * min(grpo - sft, grpo - control)
        return f"{sft:.1%}", f"{grpo:.1%} (control {control:.1%})", gain, gain >= 15
    gain = 100 * (stages["after GRPO"] - sft)
    return f"{sft:.1%}", f"{stages['after GRPO']:.1%}", gain, gain >= 10


def row(record: dict, folder: Path) -> tuple[str, float | None, bool]:
    """A markdown row of one run, its gain (None when it did not finish; for distill the time ratio) and claim."""
    head = f"| {record['task']} | {record['seed']} | {record['kernels']} | {record['threads']} "
    tail = f"| {record['seconds']} s | {record['load']:.1f} |"
    if record["rc"] != 0 or not (folder / "results.json").is_file():
        return f"{head}| failed: exit {record['rc']} (see {folder}.out) | | | | {tail}", None, False
    start, end, gain, met = outcome(record["task"], json.loads((folder / "results.json").read_text()))
    shown = f"{gain:.2f}x GRPO's time" if record["task"] == "distill" else f"{gain:+.1f}"
    if gain != gain:  # NaN: distillation never reached GRPO's final accuracy
        shown = "never"
    return f"{head}| {start} | {end} | {shown} | {'yes' if met else '**no**'} {tail}", gain, met


def same_across_threads(task: str, seed: int, kernels: str, folders: dict) -> str | None:
    """Whether the runs of (task, seed, kernels) at every thread count wrote the same accuracies; None when fewer
    than two of them finished."""
    found = []
    for threads, folder in folders.items():
        if (folder / "results.json").is_file():
            results = json.loads((folder / "results.json").read_text())
            found.append((threads, json.dumps(accuracies(results), sort_keys=True)))
    if len(found) < 2:
        return None
    same = len({numbers for _, numbers in found}) == 1
    threads = ", ".join(str(t) for t, _ in found)
    return f"{task} seed {seed}, {kernels}: threads {threads} -> {'the same accuracies' if same else 'DIFFERENT'}"


def accuracies(results: dict):
    """Every held-out accuracy a run's results.json holds (the stages, or each method's curve)."""
    if "stages" in results:
        return [s["accuracy"] for s in results["stages"]]
    return {name: [p["accuracy"] for p in m["curve"]] for name, m in results["methods"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated demo seeds")
    parser.add_argument("--kernels", default="native,default", help=f"comma-separated, of {', '.join(KERNEL_SETS)}")
    parser.add_argument("--threads", default="1,2", help="comma-separated OMP_NUM_THREADS values")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary folder)")
    parser.add_argument("--table-only", action="store_true", help="run nothing: print the runs already in --out")
    options = parser.parse_args()
    tasks, kernel_sets = options.tasks.split(","), options.kernels.split(",")
    for name, given, known in (("--tasks", tasks, TASKS), ("--kernels", kernel_sets, KERNEL_SETS)):
        if set(given) - set(known):
            parser.error(f"{name} {sorted(set(given) - set(known))}: choose from {', '.join(known)}")
    seeds, thread_counts = [int(s) for s in options.seeds.split(",")], [int(t) for t in options.threads.split(",")]
    header = machine_header()  # before the runs: its load average is the one they started under
    root = Path(options.out or tempfile.mkdtemp(prefix="demo-matrix-"))
    lines, gains, checks = run_matrix(tasks, seeds, kernel_sets, thread_counts, root, options.table_only)
    print(f"\n{header}\nruns in {root}; native = the kernels torch picks on this CPU; load = at the run's start\n")
    print("| task | seed | kernels | threads | after SFT | end | gain (points) | claim | whole demo | load |")
    print("|---|---:|---|---:|---:|---|---:|---|---:|---:|")
    print("\n".join(lines))
    for (task, kernels, threads), runs in gains.items():
        done = [g for g, _ in runs if g is not None and g == g]  # finished, and (distill) reached GRPO's final
        spread = f"min {min(done):.2f}, max {max(done):.2f}" if done else "no finished run"
        met = sum(m for _, m in runs)
        print(f"{task}, {kernels}, {threads} thread(s): {spread}; claim met on {met} of {len(runs)}")
    print("\n".join(check for check in checks if check))


def run_matrix(tasks, seeds, kernel_sets, thread_counts, root: Path, table_only: bool):
    """Run (or read, with ``table_only``) every cell: (markdown rows, {(task, kernels, threads): [(gain, met)]},
    the thread-count checks)."""
    lines, gains, checks = [], {}, []
    for task in tasks:
        for kernels in kernel_sets:
            for seed in seeds:
                folders = {}
                for threads in thread_counts:
                    folder = root / task / f"{kernels}-{threads}t-seed{seed}"
                    if table_only and not (folder / "bench.json").is_file():
                        continue
                    record, folders[threads] = run(task, seed, kernels, threads, root)
                    line, gain, met = row(record, folder)
                    lines.append(line)
                    gains.setdefault((task, kernels, threads), []).append((gain, met))
                    print(line, flush=True)
                checks.append(same_across_threads(task, seed, kernels, folders))
    return lines, gains, checks


if __name__ == "__main__":
    main()
