"""The addition demo's control: what 200 more SFT steps on the gold answers give from the same warm start, against
what GRPO gives from it (docs/demos.md, the addition demo).

    python -m benchmarks.demos --variants addition --seeds 0,1,2,3,4 --kernels native --threads 1 --out DIR
    python -m benchmarks.lab.demo_control --runs DIR          # a control for every finished addition run in DIR
    python -m benchmarks.lab.demo_control --quick             # one short demo of its own, then its control

For each finished ``addition`` run of ``benchmarks.demos`` (its folder holds the SFT checkpoint), it continues SFT from
that checkpoint for as many steps as GRPO ran, with GRPO's schedule (``grpo_warmup`` warm-up, cosine decay to 0), the
SFT learning rate and batch (64 problems per step, as many as a GRPO step's prompts), in the run's own kernel set and
thread count (a child process), and scores it as the demo scores GRPO: ``evaluate_heldout``, greedy exact match.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.demos import run_recorded


def control(run_dir: Path, out: Path) -> float:
    """Held-out exact match after ``grpo_steps`` more SFT steps from the run's SFT checkpoint (gold answers)."""
    from treadle.cli.loading import load_model
    from treadle.demos import toy
    from treadle.demos.addition import ACCURACY, DemoSettings, evaluate_heldout
    from treadle.trainers.sft import SFTConfig, SFTTrainer

    results = json.loads((run_dir / "results.json").read_text())
    settings = DemoSettings(**{k: v for k, v in results["settings"].items() if k in DemoSettings.__dataclass_fields__})
    sft = {s["stage"]: s for s in results["stages"]}["after SFT"]
    tokenizer = toy.build_tokenizer()
    model, _ = load_model(str(run_dir / "sft" / f"checkpoint-{sft['steps']}"), tokenizer=tokenizer)
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
    data = toy.load_task("addition", "train", seed=settings.seed)
    SFTTrainer(model, args, train_dataset=data, processing_class=tokenizer).train()
    return evaluate_heldout(model, tokenizer, settings, out / "heldout")[ACCURACY]


def main(argv=None) -> None:
    p = harness.parser(__doc__, "a short demo of its own (100 SFT steps, 4 GRPO steps, 50 problems), then its control")
    p.add_argument("--runs", default=None, help="a benchmarks.demos --out folder")
    p.add_argument("--child", default=None, help="(internal) the run folder of one control")
    opts = p.parse_args(argv)
    if opts.child:
        harness.apply_allocator()
        torch.set_num_threads(1)  # as the demo itself; the kernels and threads come from the parent's environment
        harness.child_result(control(Path(opts.child), Path(opts.child) / "control"))
        return
    run = harness.Run("lab.demo_control", opts)
    root = Path(opts.runs) if opts.runs else run.out
    if opts.quick and not opts.runs:
        flags = ["--sft-steps", "100", "--grpo-steps", "4", "--eval-size", "50", "--seed", "0"]
        run_recorded(
            [
                sys.executable,
                "-m",
                "treadle",
                "demo",
                *flags,
                "--output-dir",
                str(root / "addition" / "native-1t-seed0"),
            ],
            root / "addition" / "native-1t-seed0",
            "native",
            1,
        )
    rows = []
    for folder in sorted((root / "addition").glob("*-seed*")):
        if not (folder / "results.json").is_file():
            continue
        record = json.loads((folder / "bench.json").read_text())
        env = harness.allocator_env(
            opts.allocator, treadle_contender=True, env=harness.kernel_env(record["kernels"], record["threads"])
        )
        score = harness.spawn("lab.demo_control", ["--child", str(folder)], env=env)
        stages = {s["stage"]: s["accuracy"] for s in json.loads((folder / "results.json").read_text())["stages"]}
        run.row(run=folder.name, after_sft=stages["after SFT"], after_grpo=stages["after GRPO"], control=score)
        rows.append([folder.name, f"{stages['after SFT']:.1%}", f"{stages['after GRPO']:.1%}", f"{score:.1%}"])
    print("\n" + harness.table(["run", "after SFT", "after GRPO", "control: as many more SFT steps instead"], rows))
    run.finish()


if __name__ == "__main__":
    main()
