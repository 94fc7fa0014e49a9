"""Dynamic sampling (DAPO) on the addition demo: held-out accuracy at equal optimizer steps, with and without it
(docs/grpo.md, dynamic sampling).

    python -m benchmarks.lab.dynamic_sampling --seeds 0,1,2      # about 5 minutes per seed on 2 busy cores
    python -m benchmarks.lab.dynamic_sampling --quick            # seed 0, 4 GRPO steps, 100 held-out problems

For each seed: the demo's SFT warm start once (``treadle.demos.addition.demo_sft``), then GRPO from that one checkpoint
twice with the demo's settings (``grpo_steps`` steps, same seed, same data order), once plain and once with
``dynamic_sampling=True`` (groups whose rewards are all equal are replaced by groups of extra prompts, at most
``dynamic_sampling_max_rounds`` extra rounds per generation). Every score is ``GRPOTrainer.evaluate()`` on the same
held-out problems: greedy exact match (the demo's score) and pass@1 of 4 samples. One torch thread, as the demo.
"""

from __future__ import annotations

import time

import torch

from benchmarks import harness
from treadle.cli.loading import load_model
from treadle.demos import toy
from treadle.demos.addition import ACCURACY, DemoSettings, demo_sft, heldout_trainer


def grpo_run(checkpoint: str, settings: DemoSettings, out, dynamic: bool) -> dict:
    """GRPO from ``checkpoint`` as the demo runs it, with or without dynamic sampling: held-out scores before and
    after, the dynamic-sampling metrics' means, seconds."""
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
    before, start = trainer.evaluate()[ACCURACY], time.time()
    trainer.train()
    seconds, final = time.time() - start, trainer.evaluate()
    logs = [h for h in trainer.state.log_history if "loss" in h]

    def mean(key: str) -> float | None:
        values = [h[key] for h in logs if key in h]
        return sum(values) / len(values) if values else None

    return {
        "before": before,
        "after": final[ACCURACY],
        "pass@1": final["eval_pass@1"],
        "seconds": seconds,
        "rounds": mean("dynamic_sampling/rounds"),
        "dropped": mean("dynamic_sampling/dropped_fraction"),
        "zero_std": mean("frac_reward_zero_std"),
    }


def cells(seed: int, p: dict, d: dict) -> list:
    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    rounds = "-" if d["rounds"] is None else f"{d['rounds']:.2f}"
    return [
        seed,
        pct(p["before"]),
        f"{p['after']:.1%} ({p['pass@1']:.1%})",
        f"{d['after']:.1%} ({d['pass@1']:.1%})",
    ] + [
        f"{100 * (d['after'] - p['after']):+.1f}",
        rounds,
        pct(d["dropped"]),
        pct(p["zero_std"]),
        f"{p['seconds']:.0f} / {d['seconds']:.0f}",
    ]


def main(argv=None) -> None:
    p = harness.parser(__doc__, "seed 0, 4 GRPO steps, 100 held-out problems")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated demo seeds")
    p.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps (default: the demo's)")
    opts = p.parse_args(argv)
    extra = {"grpo_steps": 4, "eval_size": 100, "sft_steps": 200} if opts.quick else {}
    extra |= {"grpo_steps": opts.grpo_steps} if opts.grpo_steps else {}
    seeds = [0] if opts.quick else [int(s) for s in opts.seeds.split(",")]
    allocator = harness.apply_allocator(opts.allocator)
    torch.set_num_threads(1)  # as the demo itself
    run = harness.Run("lab.dynamic_sampling", opts)
    for name in ("GRPO", "GRPO + dynamic sampling"):
        run.contender(name, settings=f"the demo's ({DemoSettings(**extra)})", allocator=allocator)
    rows = []
    for seed in seeds:
        settings = DemoSettings(seed=seed, **extra)
        model = toy.build_model(settings.model_size, seed=seed, tokenizer=toy.build_tokenizer())
        checkpoint, _, _ = demo_sft(model, toy.build_tokenizer(), settings, run.out / f"seed{seed}" / "sft")
        plain = grpo_run(checkpoint, settings, run.out / f"seed{seed}" / "plain", dynamic=False)
        dynamic = grpo_run(checkpoint, settings, run.out / f"seed{seed}" / "dynamic", dynamic=True)
        run.row(seed=seed, plain=plain, dynamic=dynamic, load=harness.machine()["load"])
        rows.append(cells(seed, plain, dynamic))
        print(rows[-1], flush=True)
    header = ["seed", "after SFT", "GRPO (pass@1)", "GRPO + dynamic sampling (pass@1)", "difference"]
    header += ["extra rounds / generation", "groups dropped", "zero-spread groups (plain)", "seconds plain / dynamic"]
    print("\n" + harness.table(header, rows))
    run.finish()


if __name__ == "__main__":
    main()
