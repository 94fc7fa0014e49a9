"""The distillation demo's table: ``treadle demo --task distill`` over several seeds, one teacher for all.

For each seed it runs ``treadle.demos.distill.run_distill_demo`` (the GRPO demo's SFT warm start, then GRPO,
on-policy distillation and SFT on the teacher's answers, ``grpo_steps`` steps each from that one checkpoint) with
the teacher trained once, by the first seed's run, into ``<out>/teacher`` and reused by the others. Every score
is greedy exact match on the same held-out problems; train times leave the evaluations out.

    python benchmarks/distill_seeds.py --seeds 0,1,2          # a few minutes per seed on 2 busy cores

Prints a markdown table per seed (start, each method's final accuracy and train time, the step at which
distillation and SFT-on-teacher first reach GRPO's final accuracy, and whether distillation did so within a
quarter of GRPO's steps), the settings, and the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path


def row(seed: int, results: dict) -> str:
    methods = results["methods"]
    grpo, distill, sft = (methods[name] for name in ("GRPO", "distillation", "SFT on teacher answers"))

    def reached(method: dict) -> str:
        step = method["steps_to_grpo_final"]
        return (
            "never"
            if step is None
            else (f"{step} ({method['fraction_of_grpo_steps']:.2f}), {method['seconds_to_grpo_final']:.0f} s")
        )

    within = distill["fraction_of_grpo_steps"] is not None and distill["fraction_of_grpo_steps"] <= 0.25
    cells = [seed, f"{results['warm_start']['accuracy']:.1%} ({results['warm_start']['steps']})"]
    for method in (grpo, distill, sft):
        cells.append(f"{method['final_accuracy']:.1%} / {method['train_seconds']:.0f} s")
    cells += [reached(distill), reached(sft), "yes" if within else "no"]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated demo seeds")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=None, help="steps of every method (default: the demo's)")
    options = parser.parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)  # as the demo itself
    from treadle.demos.distill import DistillDemoSettings, run_distill_demo

    root = Path(options.out or tempfile.mkdtemp(prefix="distill-seeds-"))
    load_before = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    rows, settings = [], None
    for seed in (int(s) for s in options.seeds.split(",")):
        extra = {} if options.steps is None else {"grpo_steps": options.steps}
        settings = DistillDemoSettings(seed=seed, teacher_dir=str(root / "teacher"), **extra)
        run_distill_demo(settings, str(root / f"seed{seed}"))
        rows.append(row(seed, json.loads((root / f"seed{seed}" / "results.json").read_text())))
    teacher = json.loads((root / "teacher" / "teacher.json").read_text())
    print(
        f"\nteacher: {teacher['heldout_accuracy']:.1%} held-out after {teacher['steps']} SFT steps "
        f"(seed {teacher['seed']}); runs in {root}"
    )
    print(
        "| seed | SFT warm start (steps) | GRPO: final / train time | distillation | SFT on teacher answers | "
        "distillation reaches GRPO's final at: step (fraction), train time | SFT on teacher answers: the same | "
        "distillation within 1/4 of GRPO's steps |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|:---:|")
    print("\n".join(rows))
    load_after = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    print(f"settings: {settings}")
    print(f"load average before: {' '.join(load_before)}; after: {' '.join(load_after)}")


if __name__ == "__main__":
    main()
