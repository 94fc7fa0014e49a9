"""The health checks' false-alarm rate on healthy short-completion runs, and their hit rate on broken ones.

A healthy run here is issue 44's: GRPO from the random tiny toy model on the addition prompts, answers of exactly 4
tokens (the end-of-sequence token suppressed, so every completion is truncated: a fixed-length task), reward = the
share of digits in the answer, which the policy learns within 30 steps; asynchronous (``max_staleness=1``, thread
worker) and synchronous, at two learning rates. A broken run is the same with a reward it cannot learn: seeded noise
that ignores the completion (every completion truncated, the groups differ, the reward does not move). Every run
keeps the default health checks (``patience`` 10). For each run: whether a check stopped it, which, at which step.

    nice python benchmarks/health_false_alarms.py --seeds 0,1,2,3,4,5,6,7     # about 8 s per run on 2 busy cores

Prints a markdown table (kind, settings, runs, stopped, which checks at which steps) and the load average. Runs
against any checkout: ``PYTHONPATH=<checkout>/src``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import tempfile
import time
import warnings


def digit_share(completions, **kwargs):
    """The share of digits in each completion: a reward a random policy can learn in a few dozen steps."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def noise_reward(seed: int):
    """Seeded noise that ignores the completion: groups differ, nothing can be learnt."""
    draw = random.Random(seed)

    def noise(completions, **kwargs):
        return [draw.random() for _ in completions]

    return noise


def one_run(seed: int, reward, *, staleness: int, learning_rate: float, steps: int) -> tuple[str, int]:
    """(the check that stopped the run or "", the step it ended at)."""
    import torch

    from treadle import GRPOConfig, GRPOTrainer, toy

    torch.set_num_threads(1)
    tok = toy.build_tokenizer()
    args = GRPOConfig(
        output_dir=os.path.join(tempfile.mkdtemp(prefix="treadle-health-"), "run"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        generation_kwargs={"suppress_tokens": [tok.eos_token_id]},  # answers of exactly 4 tokens
        max_steps=steps,
        learning_rate=learning_rate,
        max_staleness=staleness,
        async_worker="thread",
        seed=seed,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = GRPOTrainer(
        toy.build_model("tiny", tokenizer=tok, seed=seed),
        reward,
        args=args,
        train_dataset=toy.load_task("addition", kind="rl", n=64),
        processing_class=tok,
    )
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the table only
        warnings.simplefilter("ignore")
        try:
            trainer.train()
        except Exception as err:  # noqa: BLE001 -- TrainingStalled (the module path moved between releases)
            if type(err).__name__ != "TrainingStalled":
                raise
            return str(err).split("'")[1], trainer.state.global_step
    return "", trainer.state.global_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7")
    parser.add_argument("--steps", type=int, default=30)
    cli = parser.parse_args()
    seeds = [int(s) for s in cli.seeds.split(",")]
    kinds = [
        ("healthy", "digit share, N=1, lr 1e-2", lambda s: digit_share, 1, 1e-2),
        ("healthy", "digit share, N=1, lr 3e-3", lambda s: digit_share, 1, 3e-3),
        ("healthy", "digit share, N=0, lr 3e-3", lambda s: digit_share, 0, 3e-3),
        ("broken", "noise reward, N=1, lr 1e-2", noise_reward, 1, 1e-2),
    ]
    started = time.time()
    print("| run | settings | runs | stopped | checks (step) |\n|---|---|---|---|---|")
    for kind, label, reward, staleness, lr in kinds:
        ends = [one_run(s, reward(s), staleness=staleness, learning_rate=lr, steps=cli.steps) for s in seeds]
        stops = [f"{check} ({step})" for check, step in ends if check]
        print(f"| {kind} | {label} | {len(ends)} | {len(stops)} | {', '.join(stops) or '-'} |", flush=True)
    print(f"\n{time.time() - started:.0f} s; load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
