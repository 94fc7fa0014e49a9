"""Seconds per step and peak memory of SFT, DPO and GRPO on the real model, SmolLM2-135M-Instruct (134.5M, float32),
for docs/models.md: what a user should expect on a small CPU machine.

Each trainer runs in its own process (peak RSS is a process's high-water mark): the model loaded from its cached
HF folder (``treadle.demos.smollm2``), ``--steps`` optimizer steps (AdamW, lr 1e-5, no eval, no saving), the time of
each step taken by a callback. It prints each run's settings, the median step after the first (the first pays
the optimizer's state allocation) and the peak RSS after loading and after training.

    python benchmarks/real_steps.py [--steps 4] [--threads 2] [--only sft,dpo,grpo]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

QUESTIONS = [f"What is {a} + {b}? Explain briefly, then give the number." for a, b in [(17, 25), (38, 44), (9, 73)]]
ANSWER = "Adding the tens and then the ones gives the total. The answer is {}."


def rows(kind: str, n: int) -> list[dict]:
    pairs = [(17 + 3 * i, 25 + 5 * i) for i in range(n)]
    user = [
        [{"role": "user", "content": f"What is {a} + {b}? Explain briefly, then give the number."}] for a, b in pairs
    ]
    if kind == "sft":
        return [
            {"prompt": u, "completion": [{"role": "assistant", "content": ANSWER.format(a + b)}]}
            for u, (a, b) in zip(user, pairs)
        ]
    if kind == "dpo":
        return [
            {
                "prompt": u,
                "chosen": [{"role": "assistant", "content": ANSWER.format(a + b)}],
                "rejected": [{"role": "assistant", "content": ANSWER.format(a + b + 10)}],
            }
            for u, (a, b) in zip(user, pairs)
        ]
    return [{"prompt": u, "answer": str(a + b)} for u, (a, b) in zip(user, pairs)]


def contains_answer(completions, answer, **_):
    return [float(a in (c if isinstance(c, str) else c[-1]["content"])) for c, a in zip(completions, answer)]


def run_one(kind: str, steps: int) -> dict:
    """One trainer's run in this process: settings, step times, peak RSS (MiB)."""
    from treadle import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer, TrainerCallback
    from treadle.demos import smollm2
    from treadle.models import load_pretrained

    model, tokenizer = load_pretrained(smollm2.folder())
    loaded_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    common = dict(
        output_dir=tempfile.mkdtemp(prefix=f"real-{kind}-"),
        max_steps=steps,
        learning_rate=1e-5,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
    )
    if kind == "sft":
        args = SFTConfig(**common, per_device_train_batch_size=8, max_length=256)
        trainer = SFTTrainer(model, args, train_dataset=rows("sft", 8 * steps), processing_class=tokenizer)
        settings = "8 chat prompt/completion rows per step, full fine-tuning"
    elif kind == "dpo":
        args = DPOConfig(**common, per_device_train_batch_size=4, max_length=256)
        trainer = DPOTrainer(model, args=args, train_dataset=rows("dpo", 4 * steps), processing_class=tokenizer)
        settings = "4 chat pairs per step (8 sequences), a frozen reference copy"
    else:
        args = GRPOConfig(
            **common,
            per_device_train_batch_size=16,
            num_generations=8,
            max_completion_length=32,
            temperature=1.0,
            beta=0.0,
        )
        trainer = GRPOTrainer(
            model,
            reward_funcs=contains_answer,
            args=args,
            train_dataset=rows("grpo", 2 * steps),
            processing_class=tokenizer,
        )
        settings = "2 chat prompts x 8 completions x 32 new tokens per step (own sampler), beta 0"
    trainer.add_callback(Clock())
    trainer.train()
    tokens = [h.get("num_tokens") for h in trainer.state.log_history if "num_tokens" in h]
    return {
        "kind": kind,
        "settings": settings,
        "step_s": times,
        "loaded_rss_mib": loaded_rss,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tokens_per_step": (tokens[-1] / len(tokens)) if tokens and tokens[-1] else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="sft,dpo,grpo")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(run_one(args.child, args.steps)))
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from _machine import machine_header

    print(machine_header())
    print(f"each trainer in its own process with {args.threads} torch thread(s) (OMP_NUM_THREADS={args.threads})")
    print(f"| trainer | settings | s/step (median of steps 2..{args.steps}) | all steps (s) | RSS loaded | peak RSS |")
    print("|---|---|---|---|---|---|")
    for kind in args.only.split(","):
        command = [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
        out = subprocess.run(command, capture_output=True, text=True, env=env)
        if out.returncode:
            print(f"| {kind} | failed: {out.stderr.strip().splitlines()[-1]} |")
            continue
        result = json.loads(out.stdout.strip().splitlines()[-1])
        steps = result["step_s"]
        median = statistics.median(steps[1:] or steps)
        print(
            f"| {kind} | {result['settings']} | {median:.2f} | {' '.join(f'{t:.2f}' for t in steps)} | "
            f"{result['loaded_rss_mib']:.0f} MiB | {result['peak_rss_mib']:.0f} MiB |"
        )
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
