"""Every ``treadle demo`` variant over seeds x CPU kernel sets x thread counts, each run against its claim.

    python -m benchmarks.demos --variants addition,count,tools,distill --seeds 0,1,2,3,4 \\
        --kernels native,avx2,default --threads 1 --out DIR          # 1-7 min a run on 2 quiet cores
    python -m benchmarks.demos --variants addition --seeds 0 --kernels native,avx2,default --threads 1,2 --out DIR
    python -m benchmarks.demos --variants smollm2 --seeds 0,1,2 --threads 2 --parallel 1 --out DIR   # ~15 min a run
    python -m benchmarks.demos --variants gym,gym-lora --seeds 0,1,2 --threads 2 --out DIR          # reasoning-gym
    .venv-vllm/bin/python -m benchmarks.demos --variants vllm --seeds 0,1,2 --out DIR
    python -m benchmarks.demos --table-only --out DIR                # the table of the runs already in DIR
    python -m benchmarks.demos --quick                               # addition and count, a few steps: it runs

A run is the whole ``treadle demo VARIANT'S FLAGS --seed N`` in a child process with ``ATEN_CPU_CAPABILITY`` (the
kernel set; ``native`` leaves torch's pick for this CPU) and ``OMP_NUM_THREADS``; ``--parallel N`` runs N at once
(their wall times then include each other's load: each row keeps the load average at its start). The distill runs of
one kernel set and thread count share one teacher, trained by the first of them. A run's folder keeps its record
(``bench.json``: kernels, threads, load, wall seconds, exit code), so an interrupted matrix resumes with the same
command. Prints one row per run (where it started and ended, the gain its claim is about, whether the claim held, the
wall time and the load), per variant, kernels and threads the gain's spread and the claim's count, whether runs that
differ only in their thread count ended with the same numbers, and for ``async`` the difference to the ``addition``
run of the same seed, kernels and threads.

The claims, each on every run: ``addition``, ``count``, ``async`` and ``vllm``: GRPO gains >= 10 points over the SFT
warm start; ``tools``: >= 15 points over SFT and over the no-tool control; ``distill``: distillation reaches GRPO's
final accuracy in less training time than GRPO took; ``smollm2``, ``gemma3``: GRPO gains >= 10 points over the
pretrained model; ``gym`` and ``gym-lora`` (a LoRA policy of rank 16): from the warm start, the mean held-out strict
score gains >= 15 points, the lenient >= 5, and at least 3 of the 5 tasks >= 5 strict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness

GYM_CLAIM = "GRPO >= +15 strict, >= +5 lenient, 3 tasks >= +5 strict, from the warm start"
GYM_QUICK = ("--grpo-steps", "1", "--eval-size", "2")


@dataclass(frozen=True)
class Variant:
    flags: tuple[str, ...]  # treadle demo's flags
    claim: str
    quick: tuple[str, ...] = ("--sft-steps", "100", "--grpo-steps", "4", "--eval-size", "50")


VARIANTS = {
    "addition": Variant(("--task", "addition"), "GRPO >= +10 points over SFT"),
    "count": Variant(("--task", "count"), "GRPO >= +10 points over SFT"),
    "tools": Variant(("--task", "tools"), "GRPO + tool >= +15 points over SFT and over the no-tool control"),
    "distill": Variant(("--task", "distill"), "distillation reaches GRPO's final accuracy in less training time"),
    "async": Variant(("--task", "addition", "--max-staleness", "1"), "GRPO >= +10 points over SFT"),
    "vllm": Variant(("--task", "addition", "--use-vllm"), "GRPO >= +10 points over SFT"),
    "smollm2": Variant(("--model", "smollm2"), "GRPO >= +10 points over the pretrained model", ("--grpo-steps", "2")),
    "gemma3": Variant(("--model", "gemma3"), "GRPO >= +10 points over the pretrained model", ("--grpo-steps", "2")),
    "gym": Variant(("--model", "smollm2", "--task", "gym"), GYM_CLAIM, GYM_QUICK),
    "gym-lora": Variant(("--model", "smollm2", "--task", "gym", "--lora-rank", "16"), GYM_CLAIM, GYM_QUICK),
}
REAL_MODEL_VARIANTS = ("smollm2", "gemma3")  # GRPO from the pretrained model, no SFT stage


def run_recorded(argv: list[str], folder: Path, kernels: str, threads: int) -> dict:
    """Run ``argv`` in a child process with ``kernel_env(kernels, threads)``, its output in ``folder``.out; return and
    keep in ``folder``/bench.json its record (kernels, threads, the 1-minute load average at its start, its wall
    seconds and exit code). A folder that already holds a record is not run again."""
    record_file = folder / "bench.json"
    if record_file.is_file():
        return json.loads(record_file.read_text())
    env = dict(harness.kernel_env(kernels, threads), TOKENIZERS_PARALLELISM="false")
    load, start = os.getloadavg()[0], time.time()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{folder}.out", "w") as log:
        rc = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    record = {"kernels": kernels, "threads": threads, "load": load, "seconds": round(time.time() - start), "rc": rc}
    folder.mkdir(parents=True, exist_ok=True)
    record_file.write_text(json.dumps(record) + "\n")
    return record


def folder_of(root: Path, variant: str, kernels: str, threads: int, seed: int) -> Path:
    return root / variant / f"{kernels}-{threads}t-seed{seed}"


def run_one(root: Path, cell: tuple, quick: bool) -> dict:
    """One demo run (or its record, when its folder has one)."""
    variant, kernels, threads, seed = cell
    folder = folder_of(root, variant, kernels, threads, seed)
    argv = [sys.executable, "-m", "treadle", "demo", *VARIANTS[variant].flags, "--seed", str(seed)]
    argv += ["--output-dir", str(folder), *(VARIANTS[variant].quick if quick else ())]
    if variant == "distill":
        argv += ["--teacher-dir", str(root / variant / f"teacher-{kernels}-{threads}t")]
    return {"variant": variant, "seed": seed, **run_recorded(argv, folder, kernels, threads), "folder": str(folder)}


# ---------------------------------------------------------------------------------------------------------
# What a finished run's results.json says
# ---------------------------------------------------------------------------------------------------------
def outcome(variant: str, folder: Path) -> dict:
    """start, end, gain (points; distill: distillation's time to GRPO's final over GRPO's), claim met, and the
    variant's details, from a finished run's results.json."""
    results = json.loads((folder / "results.json").read_text())
    if variant == "distill":
        return distill_outcome(results)
    stages = {s["stage"]: s for s in results["stages"]}
    if variant.startswith("gym"):
        return gym_outcome(results["stages"])
    if variant == "tools":
        sft, grpo, control = stages["after SFT"], stages["GRPO + tool"], stages["no-tool ctrl"]
        gain = 100 * min(grpo["accuracy"] - sft["accuracy"], grpo["accuracy"] - control["accuracy"])
        detail = (
            f"SFT {sft['steps']} steps (attempt {results.get('sft_attempts', 1)}), right call {sft['right_call']:.0%}"
            f" -> {grpo['right_call']:.0%}; control {control['accuracy']:.1%}"
        )
        return {"start": sft["accuracy"], "end": grpo["accuracy"], "gain": gain, "met": gain >= 15, "detail": detail}
    start = stages["pretrained" if variant in REAL_MODEL_VARIANTS else "after SFT"]
    end = stages["after GRPO"]
    gain = 100 * (end["accuracy"] - start["accuracy"])
    return {
        "start": start["accuracy"],
        "end": end["accuracy"],
        "gain": gain,
        "met": gain >= 10,
        "detail": detail_of(variant, folder, results, start),
    }


def gym_outcome(stages: list[dict]) -> dict:
    """The gym demo's claim, from the stage GRPO starts from (the one before "after GRPO") to its end: the mean
    strict score gains >= 15 points, the mean lenient >= 5, and at least 3 tasks gain >= 5 strict."""
    start, end = stages[-2], stages[-1]
    strict = 100 * (end["mean"]["strict"] - start["mean"]["strict"])
    lenient = 100 * (end["mean"]["lenient"] - start["mean"]["lenient"])
    per_task = {n: 100 * (end["per_task"][n]["strict"] - t["strict"]) for n, t in start["per_task"].items()}
    improved = sum(gain >= 5 for gain in per_task.values())
    detail = f"lenient {lenient:+.1f}; " + ", ".join(f"{n} {g:+.0f}" for n, g in per_task.items())
    met = strict >= 15 and lenient >= 5 and improved >= 3
    return {
        "start": start["mean"]["strict"],
        "end": end["mean"]["strict"],
        "gain": strict,
        "met": met,
        "detail": detail,
    }


def detail_of(variant: str, folder: Path, results: dict, start: dict) -> str:
    """The curve of the real model's demo; the sampled pass@1 / pass@4 after GRPO of the toy ones; SFT's steps."""
    if variant in REAL_MODEL_VARIANTS:
        return "curve " + ", ".join(f"{p['accuracy']:.1%}" for p in results.get("grpo_curve", []))
    metrics = folder / "grpo" / "metrics.jsonl"
    events = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    )
    last = [e for e in events if "eval_pass@1" in e]
    passes = [
        f"{k.removeprefix('eval_')} {last[-1][k]:.1%}"
        for k in ("eval_pass@1", "eval_pass@4")
        if last and k in last[-1]
    ]
    return f"SFT {start.get('steps')} steps" + "".join(f"; {p}" for p in passes)


def distill_outcome(results: dict) -> dict:
    grpo, distill = results["methods"]["GRPO"], results["methods"]["distillation"]
    sft = results["methods"].get("SFT on teacher answers", {})
    at = distill["seconds_to_grpo_final"]
    ratio = float("nan") if at is None else at / max(grpo["train_seconds"], 1e-9)
    detail = (
        f"GRPO {grpo['final_accuracy']:.1%} in {grpo['train_seconds']:.0f} s; distillation "
        f"{distill['final_accuracy']:.1%}, at GRPO's final "
        + ("never" if at is None else f"in {at:.1f} s")
        + (f"; SFT on teacher answers {sft['final_accuracy']:.1%}" if sft else "")
    )
    met = at is not None and at < grpo["train_seconds"]
    return {
        "start": results["warm_start"]["accuracy"],
        "end": distill["final_accuracy"],
        "gain": ratio,
        "met": met,
        "detail": detail,
    }


def row_of(record: dict) -> tuple[list, dict | None]:
    """A table row of one run and its outcome (None when it did not finish)."""
    head = [record["variant"], record["seed"], record["kernels"], record["threads"]]
    tail = [f"{record['seconds']} s", f"{record['load']:.1f}"]
    folder = Path(record["folder"])
    if record["rc"] != 0 or not (folder / "results.json").is_file():
        return head + [f"failed: exit {record['rc']} (see {folder}.out)", "", "", "", "", *tail], None
    o = outcome(record["variant"], folder)
    gain = f"{o['gain']:.2f}x GRPO's time" if record["variant"] == "distill" else f"{o['gain']:+.1f}"
    gain = "never" if o["gain"] != o["gain"] else gain
    return head + [
        f"{o['start']:.1%}",
        f"{o['end']:.1%}",
        gain,
        "yes" if o["met"] else "**no**",
        o["detail"],
        *tail,
    ], o


# ---------------------------------------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------------------------------------
def cells(opts) -> list[tuple]:
    return [
        (variant, kernels, threads, seed)
        for variant in opts.variants
        for kernels in opts.kernels
        for seed in opts.seeds
        for threads in opts.threads
    ]


def summaries(records: list[dict], outcomes: list) -> list[str]:
    """Per variant, kernels and threads: the gain's spread and the claim's count; the thread-count checks; async's
    difference to addition."""
    lines, groups = [], {}
    for record, o in zip(records, outcomes):
        groups.setdefault((record["variant"], record["kernels"], record["threads"]), []).append(o)
    for (variant, kernels, threads), found in groups.items():
        done = [o["gain"] for o in found if o is not None and o["gain"] == o["gain"]]
        spread = f"min {min(done):.2f}, max {max(done):.2f}" if done else "no finished run"
        met = sum(bool(o and o["met"]) for o in found)
        lines.append(f"{variant}, {kernels}, {threads} thread(s): {spread}; claim met on {met} of {len(found)}")
    by_cell = {(r["variant"], r["kernels"], r["seed"], r["threads"]): o for r, o in zip(records, outcomes) if o}
    for (variant, kernels, seed, threads), o in by_cell.items():
        others = {
            t: p for (v, k, s, t), p in by_cell.items() if (v, k, s) == (variant, kernels, seed) and t != threads
        }
        if others and threads == min([threads, *others]):
            same = all((p["start"], p["end"]) == (o["start"], o["end"]) for p in others.values())
            lines.append(
                f"{variant} seed {seed}, {kernels}: threads {threads}, {', '.join(map(str, others))} -> "
                + ("the same accuracies" if same else "DIFFERENT")
            )
        sync = by_cell.get(("addition", kernels, seed, threads)) if variant == "async" else None
        if sync:
            lines.append(
                f"async seed {seed}, {kernels}, {threads}t: {100 * (o['end'] - sync['end']):+.1f} points "
                "against max_staleness 0"
            )
    return lines


def whole_numbers(text: str) -> list[int]:
    """A comma-separated list of whole numbers >= 0 (argparse's ``type``: a bad one is argparse's own error line)."""
    try:
        numbers = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of whole numbers, e.g. 0,1,2"
        ) from None
    if any(n < 0 for n in numbers):
        raise argparse.ArgumentTypeError(f"{text!r} holds a negative number; seeds and thread counts are >= 0")
    return numbers


def parse_args(argv=None):
    p = harness.parser(__doc__, "addition and count, seed 0, native kernels, 1 thread, a few steps", allocator=False)
    p.add_argument("--variants", default="addition,count,tools,distill", help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--seeds", type=whole_numbers, default="0,1,2,3,4", help="comma-separated demo seeds")
    p.add_argument("--kernels", default="native,default", help=f"comma-separated, of {', '.join(harness.KERNEL_SETS)}")
    p.add_argument("--threads", type=whole_numbers, default="1,2", help="comma-separated OMP_NUM_THREADS values")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (not with distill: its runs share a teacher)")
    p.add_argument("--table-only", action="store_true", help="run nothing: the table of the runs already in --out")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.variants, opts.seeds, opts.kernels, opts.threads = "addition,count", [0], "native", [1]
    opts.variants, opts.kernels = opts.variants.split(","), opts.kernels.split(",")
    for name, given, known in (
        ("--variants", opts.variants, VARIANTS),
        ("--kernels", opts.kernels, harness.KERNEL_SETS),
    ):
        if set(given) - set(known):
            p.error(f"{name} {sorted(set(given) - set(known))}: choose from {', '.join(known)}")
    opts.no_log = opts.no_log or opts.table_only  # a table of runs already logged is no new run
    if opts.parallel > 1 and "distill" in opts.variants:
        p.error("--parallel with distill: its runs of one kernel set and thread count share one teacher")
    return opts


def main(argv=None) -> None:
    opts = parse_args(argv)
    run = harness.Run("demos", opts)  # before the runs: its load average is the one they started under
    for variant in opts.variants:
        run.contender(
            variant, command=f"treadle demo {' '.join(VARIANTS[variant].flags)}", claim=VARIANTS[variant].claim
        )
    todo = cells(opts)
    if opts.table_only:
        todo = [c for c in todo if (folder_of(run.out, *c) / "bench.json").is_file()]
    with ThreadPoolExecutor(opts.parallel) as pool:
        records = list(pool.map(lambda cell: run_one(run.out, cell, opts.quick), todo))
    rows, outcomes = zip(*(row_of(r) for r in records)) if records else ((), ())
    for record, o in zip(records, outcomes):
        run.row(**record, **(o or {}))
    print(f"\nruns in {run.out}; native = the kernels torch picks on this CPU; load = at the run's start\n")
    header = ["variant", "seed", "kernels", "threads", "start", "end", "gain (points)", "claim", "details", "wall"]
    print(harness.table(header + ["load"], list(rows)))
    print("\n" + "\n".join(summaries(records, list(outcomes))))
    if opts.quick:
        print("(--quick: a few steps per stage, so the claims are not judged)")
    run.finish()


if __name__ == "__main__":
    main()
