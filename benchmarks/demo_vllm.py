"""``treadle demo --use-vllm`` against the own sampler: the same SFT warm start, GRPO twice (own sampler, then vLLM).

vLLM's CPU attention has no kernel for toy tiny's head size 16, so the demo with vLLM trains "tiny32" (tiny with
2 heads of 32; ``DemoSettings.use_vllm`` picks it). For a fair comparison both GRPO runs here train tiny32 from one
SFT checkpoint (``treadle.demos.addition.demo_sft``, run once per seed) with the demo's settings, differing only in
``use_vllm``; each is scored by the demo's held-out evaluation (greedy exact match on 1,000 problems; the vLLM run's
evaluations also sample through vLLM). Printed per run: held-out accuracy after SFT and after GRPO, GRPO's
training time (evaluations included), vLLM's start-up apart, and the load average before and after.

    .venv-vllm/bin/python benchmarks/demo_vllm.py --seeds 0 [--grpo-steps N]   # make test-vllm builds the venv

The own-sampler run goes first: an in-process vLLM engine binds the process's OpenMP threads for good, so the
order keeps the own sampler on the demo's one thread (for the first seed only: run one seed per process for
comparable times).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _machine import machine_header  # noqa: E402  (this folder is on sys.path when a script in it runs)


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if os.path.exists("/proc/loadavg") else "?"


def grpo_run(settings, checkpoint: str, out: Path) -> dict:
    """The demo's GRPO stage from ``checkpoint``: held-out accuracy before and after, seconds, load average."""
    from treadle.demos import toy
    from treadle.demos.addition import demo_grpo

    before, start = load(), time.time()
    _, curve, steps, seconds = demo_grpo(checkpoint, toy.build_tokenizer(), settings, out)
    return dict(
        sft=curve[0][1],
        grpo=curve[-1][1],
        steps=steps,
        train_s=seconds,
        total_s=time.time() - start,
        load=f"{before} -> {load()}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0", help="comma-separated demo seeds")
    parser.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps (default: the demo's)")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary folder)")
    options = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import dataclasses

    from treadle.demos import toy
    from treadle.demos.addition import DemoSettings, demo_sft, start_demo

    root = start_demo("", options.out or tempfile.mkdtemp(prefix="demo-vllm-"))  # the demo's one torch thread
    header = machine_header()
    rows = []
    for seed in [int(s) for s in options.seeds.split(",")]:
        extra = {} if options.grpo_steps is None else {"grpo_steps": options.grpo_steps}
        settings = DemoSettings(seed=seed, use_vllm=True, **extra)  # tiny32
        model = toy.build_model(settings.model_size, seed=seed, tokenizer=toy.build_tokenizer())
        checkpoint, sft_steps, sft_s = demo_sft(model, toy.build_tokenizer(), settings, root / f"seed{seed}" / "sft")
        for use_vllm in (False, True):
            run = grpo_run(
                dataclasses.replace(settings, use_vllm=use_vllm),
                checkpoint,
                root / f"seed{seed}" / ("grpo-vllm" if use_vllm else "grpo-own"),
            )
            rows.append((seed, "vLLM colocate" if use_vllm else "own sampler", sft_steps, sft_s, run))
            print(rows[-1], flush=True)
    print(f"\n{header}\nsettings: {settings} (seed and use_vllm vary); runs in {root}\n")
    print("| seed | GRPO sampler | SFT steps (s) | after SFT | after GRPO | GRPO train s | GRPO stage s | load |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for seed, sampler, sft_steps, sft_s, run in rows:
        print(
            f"| {seed} | {sampler} | {sft_steps} ({sft_s:.0f}) | {run['sft']:.1%} | {run['grpo']:.1%} "
            f"| {run['train_s']:.0f} | {run['total_s']:.0f} | {run['load']} |"
        )


if __name__ == "__main__":
    main()
