"""The health checks' false-alarm rate on healthy short-completion runs, and their hit rate on broken ones
(docs/grpo.md, health checks; docs/runs.md).

    python -m benchmarks.lab.health_false_alarms --seeds 0,1,2,3,4,5,6,7,8,9,10,11    # about 8 s a run
    python -m benchmarks.lab.health_false_alarms --quick                               # 1 seed, 12 steps

A healthy run: GRPO from the random tiny toy model on the addition prompts, answers of exactly 4 tokens (the end token
suppressed, so every completion is truncated: a fixed-length task), reward = the share of digits in the answer, which
the policy learns within 30 steps; asynchronous (``max_staleness=1``, thread worker) and synchronous, at two learning
rates. A broken run is the same with a reward it cannot learn: seeded noise that ignores the completion. Every run
keeps the default health checks (``patience`` 10). Per run: whether a check stopped it, which, at which step.
"""

from __future__ import annotations

import contextlib
import io
import random
import tempfile
import warnings

import torch

from benchmarks import harness
from treadle import GRPOConfig, GRPOTrainer
from treadle.demos import toy


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
    tok = toy.build_tokenizer()
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="treadle-health-"),
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
    model, data = toy.build_model("tiny", tokenizer=tok, seed=seed), toy.load_task("addition", kind="rl", n=64)
    trainer = GRPOTrainer(model, reward, args=args, train_dataset=data, processing_class=tok)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the table only
        warnings.simplefilter("ignore")
        try:
            trainer.train()
        except Exception as err:  # TrainingStalled: matched by name, its module moved between releases
            if type(err).__name__ != "TrainingStalled":
                raise
            return str(err).split("'")[1], trainer.state.global_step
    return "", trainer.state.global_step


KINDS = [
    ("healthy", "digit share, N=1, lr 1e-2", lambda s: digit_share, 1, 1e-2),
    ("healthy", "digit share, N=1, lr 3e-3", lambda s: digit_share, 1, 3e-3),
    ("healthy", "digit share, N=0, lr 3e-3", lambda s: digit_share, 0, 3e-3),
    ("broken", "noise reward, N=1, lr 1e-2", noise_reward, 1, 1e-2),
]


def main(argv=None) -> None:
    p = harness.parser(__doc__, "seed 0, 12 steps")
    p.add_argument("--seeds", default="0,1,2,3,4,5,6,7")
    p.add_argument("--steps", type=int, default=30)
    opts = p.parse_args(argv)
    seeds, steps = ([0], 12) if opts.quick else ([int(s) for s in opts.seeds.split(",")], opts.steps)
    allocator = harness.apply_allocator(opts.allocator)
    torch.set_num_threads(1)
    run = harness.Run("lab.health_false_alarms", opts)
    rows = []
    for kind, label, reward, staleness, lr in KINDS:
        run.contender(label, kind=kind, steps=steps, seeds=len(seeds), allocator=allocator)
        ends = [one_run(s, reward(s), staleness=staleness, learning_rate=lr, steps=steps) for s in seeds]
        stops = [f"{check} ({step})" for check, step in ends if check]
        run.row(kind=kind, settings=label, runs=len(ends), stopped=stops)
        rows.append([kind, label, len(ends), len(stops), ", ".join(stops) or "-"])
        print(rows[-1], flush=True)
    print("\n" + harness.table(["run", "settings", "runs", "stopped", "checks (step)"], rows))
    run.finish()


if __name__ == "__main__":
    main()
