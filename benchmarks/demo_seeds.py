"""The README's demo table: ``treadle demo`` over several seeds, with a continued-SFT control.

For each seed it runs the demo (SFT warm start, then GRPO from the SFT checkpoint; see ``treadle.demo``) and,
as a control, continues SFT from the same SFT checkpoint for as many steps as GRPO ran, with GRPO's schedule
(``grpo_warmup`` warm-up, cosine decay to 0), the SFT learning rate and batch (64 problems per step, as many
as a GRPO step's prompts). All three are greedy exact match on the same 1,000 held-out problems.

    python benchmarks/demo_seeds.py --seeds 0,1,2      # ~1 minute per seed on one core

Prints a markdown table (seed, after SFT, after GRPO, GRPO gain, control) and the settings it used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def control(settings, sft_checkpoint: str, out: Path) -> float:
    """Held-out exact match after ``grpo_steps`` more SFT steps from the SFT checkpoint (gold answers)."""
    from treadle import toy
    from treadle.demo import score_heldout
    from treadle.models import load_model
    from treadle.trainers.sft import SFTConfig, SFTTrainer

    tokenizer = toy.build_tokenizer()
    model, _ = load_model(sft_checkpoint, tokenizer=tokenizer)
    args = SFTConfig(output_dir=str(out), max_steps=settings.grpo_steps, seed=settings.seed,
                     learning_rate=settings.sft_learning_rate, per_device_train_batch_size=settings.sft_batch_size,
                     lr_scheduler_type="cosine", warmup_steps=settings.grpo_warmup, save_strategy="no",
                     logging_steps=50, max_length=32, disable_tqdm=True)
    SFTTrainer(model, args, train_dataset=toy.load_task("addition", "train", seed=settings.seed),
               processing_class=tokenizer).train()
    test = toy.load_task("addition", "test", kind="rl", n=min(settings.eval_size, 1000), seed=settings.seed)
    return score_heldout(model, tokenizer, test, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated demo seeds")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary folder)")
    options = parser.parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)  # as the demo itself
    from treadle.demo import DemoSettings, run_demo

    root = Path(options.out or tempfile.mkdtemp(prefix="demo-seeds-"))
    rows = []
    for seed in [int(s) for s in options.seeds.split(",")]:
        settings = DemoSettings(seed=seed)
        run_demo(settings, str(root / f"seed{seed}"))
        stages = {s["stage"]: s for s in json.loads((root / f"seed{seed}" / "results.json").read_text())["stages"]}
        sft, grpo = stages["after SFT"], stages["after GRPO"]
        checkpoint = str(root / f"seed{seed}" / "sft" / f"checkpoint-{sft['steps']}")
        rows.append((seed, sft["accuracy"], grpo["accuracy"], control(settings, checkpoint, root / f"control{seed}")))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _machine import machine_header

    print(f"\n{machine_header()}\nsettings: {DemoSettings()} (seed varies); runs in {root}\n")
    print("| seed | after SFT | after GRPO | GRPO gain | control: 200 more SFT steps instead |")
    print("|---:|---:|---:|---:|---:|")
    for seed, sft, grpo, ctrl in rows:
        print(f"| {seed} | {sft:.1%} | {grpo:.1%} | {100 * (grpo - sft):+.1f} | {ctrl:.1%} |")


if __name__ == "__main__":
    main()
