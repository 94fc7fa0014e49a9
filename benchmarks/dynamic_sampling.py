"""Dynamic sampling (DAPO) on the demo: held-out accuracy at equal optimizer steps, with and without it.

For each seed: the demo's SFT warm start once (``treadle.demos.addition.demo_sft``), then GRPO from that one SFT
checkpoint twice with the demo's settings (``grpo_steps`` optimizer steps, same seed, same data order), once plain and
once with ``dynamic_sampling=True`` (groups whose rewards are all equal are replaced by groups of extra prompts, at
most ``dynamic_sampling_max_rounds`` extra rounds per generation). Every score is ``GRPOTrainer.evaluate()`` on the
same 1,000 held-out problems: greedy exact match (the demo's score), and pass@1 of 4 samples.

    nice python benchmarks/dynamic_sampling.py --seeds 0,1,2      # about 5 minutes per seed on 2 busy cores

Prints a markdown table (seed, after SFT, after GRPO without / with dynamic sampling at the same step, the
difference, the mean extra rounds and dropped-group fraction, and each run's seconds) and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def grpo_run(checkpoint: str, settings, out: Path, dynamic: bool) -> dict:
    """GRPO from ``checkpoint`` as the demo runs it (``demo.demo_grpo``'s settings), with or without dynamic
    sampling; returns its held-out scores before and after, the dynamic-sampling metrics' means and its seconds."""
    from treadle.cli.loading import load_model
    from treadle.demos import toy
    from treadle.demos.addition import ACCURACY, heldout_trainer

    tokenizer = toy.build_tokenizer()
    model, _ = load_model(checkpoint, tokenizer=tokenizer)
    trainer = heldout_trainer(
        model,
        tokenizer,
        settings,
        out,
        max_steps=settings.grpo_steps,
        learning_rate=settings.grpo_learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=settings.grpo_warmup,
        logging_steps=max(1, settings.grpo_steps // 40),
        save_strategy="no",
        eval_strategy="no",
        dynamic_sampling=dynamic,
        disable_tqdm=True,
    )
    before = trainer.evaluate()[ACCURACY]
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    final = trainer.evaluate()
    logs = [h for h in trainer.state.log_history if "loss" in h]

    def mean(key: str) -> float | None:
        values = [h[key] for h in logs if key in h]
        return sum(values) / len(values) if values else None

    return {
        "before": before,
        "after": final[ACCURACY],
        "pass@1": final["eval_pass@1"],
        "seconds": seconds,
        "steps": trainer.state.global_step,
        "rounds": mean("dynamic_sampling/rounds"),
        "dropped": mean("dynamic_sampling/dropped_fraction"),
        "zero_std": mean("frac_reward_zero_std"),
        "unfilled": mean("dynamic_sampling/unfilled_fraction"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated demo seeds")
    parser.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps (default: the demo's)")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary folder)")
    options = parser.parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)  # as the demo itself
    from treadle.demos import toy
    from treadle.demos.addition import DemoSettings, demo_sft

    root = Path(options.out or tempfile.mkdtemp(prefix="dynamic-sampling-"))
    rows = []
    for seed in [int(s) for s in options.seeds.split(",")]:
        settings = DemoSettings(seed=seed, **({"grpo_steps": options.grpo_steps} if options.grpo_steps else {}))
        model = toy.build_model(settings.model_size, seed=seed, tokenizer=toy.build_tokenizer())
        checkpoint, sft_steps, _ = demo_sft(model, toy.build_tokenizer(), settings, root / f"seed{seed}" / "sft")
        plain = grpo_run(checkpoint, settings, root / f"seed{seed}" / "plain", dynamic=False)
        dynamic = grpo_run(checkpoint, settings, root / f"seed{seed}" / "dynamic", dynamic=True)
        rows.append(
            {
                "seed": seed,
                "sft_steps": sft_steps,
                "plain": plain,
                "dynamic": dynamic,
                "loadavg": open("/proc/loadavg").read().split()[:3],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    print(
        f"\nGRPO {settings.grpo_steps} optimizer steps from the same SFT checkpoint; held-out greedy exact match "
        f"on {min(settings.eval_size, 1000)} problems (pass@1 of {settings.num_generations_eval} samples)\n"
    )
    print(
        "| seed | after SFT | GRPO | GRPO + dynamic sampling | difference | extra rounds / generation | "
        "groups dropped | zero-spread groups (plain) | seconds plain / dynamic | load average |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p, d = r["plain"], r["dynamic"]
        print(
            f"| {r['seed']} | {p['before']:.1%} | {p['after']:.1%} ({p['pass@1']:.1%}) | {d['after']:.1%} "
            f"({d['pass@1']:.1%}) | {100 * (d['after'] - p['after']):+.1f} | {d['rounds']:.2f} | "
            f"{d['dropped']:.1%} | {p['zero_std']:.1%} | {p['seconds']:.0f} / {d['seconds']:.0f} | "
            f"{' '.join(r['loadavg'])} |"
        )
    (root / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\nruns in {root}")


if __name__ == "__main__":
    main()
