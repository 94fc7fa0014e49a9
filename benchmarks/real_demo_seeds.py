"""docs/demos.md's table for ``treadle demo --model smollm2``: the real-model demo over seeds, kernel sets and thread
counts, each run the whole command in its own process.

    python benchmarks/real_demo_seeds.py --runs 0:native:1,1:native:1,2:native:1,0:default:1,0:native:2 \\
        [--parallel 2] [--out DIR]

A run is ``SEED:KERNELS:THREADS``: KERNELS ``native`` leaves torch's choice for this CPU, anything else is set as
``ATEN_CPU_CAPABILITY`` (``default``, ``avx2``, ``avx512``); THREADS is ``OMP_NUM_THREADS``. ``--parallel N`` runs N
at once (on 2 cores: two 1-thread runs side by side; the wall times then include each other's load, and the table
says so in its load column). Prints one row per run (held-out greedy accuracy before and after GRPO, the gain, the
wall time, the load average when it started) and the gain's spread; writes every row to ``OUT/runs.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _machine import kernel_env  # this script's folder is on sys.path


def run_one(spec: str, folder: Path) -> dict:
    seed, kernels, threads = spec.split(":")
    out = folder / f"seed{seed}-{kernels}-{threads}t"
    env = {**kernel_env(kernels, int(threads)), "TOKENIZERS_PARALLELISM": "false"}
    load = os.getloadavg()[0]
    start = time.time()
    command = [sys.executable, "-m", "treadle", "demo", "--model", "smollm2", "--seed", seed, "--output-dir", str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    (folder / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    record = {"seed": int(seed), "kernels": kernels, "threads": int(threads), "load": round(load, 1)}
    record["wall_s"] = round(time.time() - start)
    if proc.returncode != 0:
        return {**record, "error": (proc.stderr or proc.stdout)[-2000:]}
    results = json.loads((out / "results.json").read_text())
    before, after = (s["accuracy"] for s in results["stages"])
    curve = [round(p["accuracy"], 3) for p in results["grpo_curve"]]
    return {**record, "before": before, "after": after, "gain": 100 * (after - before), "curve": curve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="0:native:1,1:native:1,2:native:1,0:default:1,0:native:2")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary folder)")
    args = parser.parse_args()
    folder = Path(args.out or tempfile.mkdtemp(prefix="real-demo-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"runs: {args.runs}; {args.parallel} at a time; folders in {folder}", flush=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        records = list(pool.map(lambda spec: run_one(spec, folder), args.runs.split(",")))
    with open(folder / "runs.jsonl", "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    print("\n| seed | kernels | threads | pretrained | after GRPO | gain (points) | curve | wall | load at start |")
    print("|---:|---|---:|---:|---:|---:|---|---:|---:|")
    for r in records:
        if "error" in r:
            print(f"| {r['seed']} | {r['kernels']} | {r['threads']} | failed: {r['error'].splitlines()[-1]} |")
            continue
        curve = ", ".join(f"{a:.1%}" for a in r["curve"])
        print(
            f"| {r['seed']} | {r['kernels']} | {r['threads']} | {r['before']:.1%} | {r['after']:.1%} | "
            f"{r['gain']:+.1f} | {curve} | {r['wall_s']} s | {r['load']} |"
        )
    gains = [r["gain"] for r in records if "gain" in r]
    if gains:
        print(f"\ngain: min {min(gains):+.1f}, mean {sum(gains) / len(gains):+.1f}, max {max(gains):+.1f} points")


if __name__ == "__main__":
    main()
