"""The demo table of docs/demos.md: ``treadle demo`` over several seeds, with a continued-SFT control.

For each seed it runs the demo (SFT warm start, then GRPO from the SFT checkpoint; see ``treadle.demos.addition``) and,
as a control, continues SFT from the same SFT checkpoint for as many steps as GRPO ran, with GRPO's schedule
(``grpo_warmup`` warm-up, cosine decay to 0), the SFT learning rate and batch (64 problems per step, as many
as a GRPO step's prompts). Every score is ``GRPOTrainer.evaluate()`` on the same 1,000 held-out problems (the
demo's ``evaluate_heldout``): greedy exact match, and after GRPO also pass@1 and pass@4 of 4 samples per problem.

    python benchmarks/demo_seeds.py --seeds 0,1,2,3,4,5 [--kernels avx2] [--threads 2]     # a few minutes per seed

Prints a markdown table (seed, after SFT, after GRPO, GRPO gain, sampled pass@1 / pass@4 after GRPO, control),
the gain's minimum, mean and maximum over the seeds, and the settings it used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from _machine import kernel_env, machine_header  # this script's folder is on sys.path


def control(settings, sft_checkpoint: str, out: Path) -> float:
    """Held-out exact match after ``grpo_steps`` more SFT steps from the SFT checkpoint (gold answers)."""
    from treadle.cli.loading import load_model
    from treadle.demos import toy
    from treadle.demos.addition import ACCURACY, evaluate_heldout
    from treadle.trainers.sft import SFTConfig, SFTTrainer

    tokenizer = toy.build_tokenizer()
    model, _ = load_model(sft_checkpoint, tokenizer=tokenizer)
    args = SFTConfig(
        output_dir=str(out),
        max_steps=settings.grpo_steps,
        seed=settings.seed,
        learning_rate=settings.sft_learning_rate,
        per_device_train_batch_size=settings.sft_batch_size,
        lr_scheduler_type="cosine",
        warmup_steps=settings.grpo_warmup,
        save_strategy="no",
        logging_steps=50,
        max_length=32,
        disable_tqdm=True,
    )
    SFTTrainer(
        model, args, train_dataset=toy.load_task("addition", "train", seed=settings.seed), processing_class=tokenizer
    ).train()
    return evaluate_heldout(model, tokenizer, settings, out / "heldout")[ACCURACY]


def last_eval(run: Path) -> dict:
    """The last evaluation event of a run's metrics.jsonl (the final model's held-out metrics)."""
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [e for e in events if "eval_pass@1" in e][-1]


def reexec_with(kernels: str, threads: int | None) -> None:
    """Start this script again with ``ATEN_CPU_CAPABILITY`` / ``OMP_NUM_THREADS`` set as asked: torch reads both when
    it starts, so they cannot change inside a running interpreter."""
    try:
        env = kernel_env(kernels, threads)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    keys = ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")
    if any(env.get(k) != os.environ.get(k) for k in keys):
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated demo seeds")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary folder)")
    parser.add_argument(
        "--kernels", default="native", help="native (torch's pick for this CPU), default, avx2 or avx512"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS, or 1)")
    options = parser.parse_args()
    reexec_with(options.kernels, options.threads)
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)  # as the demo itself
    from treadle.demos.addition import DemoSettings, run_demo

    header = machine_header()  # before the runs: its load average is the one they started under
    root = Path(options.out or tempfile.mkdtemp(prefix="demo-seeds-"))
    rows = []
    for seed in [int(s) for s in options.seeds.split(",")]:
        settings = DemoSettings(seed=seed)
        run_demo(settings, str(root / f"seed{seed}"))
        stages = {s["stage"]: s for s in json.loads((root / f"seed{seed}" / "results.json").read_text())["stages"]}
        sft, grpo = stages["after SFT"], stages["after GRPO"]
        checkpoint = str(root / f"seed{seed}" / "sft" / f"checkpoint-{sft['steps']}")
        final = last_eval(root / f"seed{seed}" / "grpo")
        rows.append(
            (
                seed,
                sft["accuracy"],
                grpo["accuracy"],
                final["eval_pass@1"],
                final["eval_pass@4"],
                control(settings, checkpoint, root / f"control{seed}"),
            )
        )
    import torch

    threads = torch.get_num_threads()
    print(f"\n{header}\nkernels {options.kernels}, {threads} thread(s); settings: {DemoSettings()} (seed varies)")
    print(f"runs in {root}\n")
    print(
        "| seed | after SFT | after GRPO | GRPO gain (points) | after GRPO, sampled pass@1 / pass@4 "
        "| control: 200 more SFT steps instead |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for seed, sft, grpo, pass1, pass4, ctrl in rows:
        print(
            f"| {seed} | {sft:.1%} | {grpo:.1%} | {100 * (grpo - sft):+.1f} | {pass1:.1%} / {pass4:.1%} | {ctrl:.1%} |"
        )
    gains = [100 * (grpo - sft) for _, sft, grpo, *_ in rows]
    print(
        f"\nGRPO gain over {len(gains)} seeds: min {min(gains):+.1f}, mean {sum(gains) / len(gains):+.1f}, "
        f"max {max(gains):+.1f} points"
    )


if __name__ == "__main__":
    main()
