"""Asynchronous GRPO (``max_staleness``, docs/async.md): wall time and held-out accuracy against the synchronous run.

``--part wall``: the same GRPO run (same steps, prompts, sampling settings and seed) of the toy ``small`` model on
the addition prompts (rewarded by the share of digits) with ``max_staleness`` 0, 1 and 2 (the own sampler in a
worker process), and 1 with a thread worker, ``--rounds`` rounds each, interleaved. The synchronous run runs with 1
and with 2 torch threads (the machine's 2 cores); a process-worker async run splits 2 threads (worker 1, trainer 1:
``worker_threads``), a thread worker shares the trainer's 1. Each row prints its settings, the completion tokens it
sampled (equal work: the learning rate is small, so the policies stay close), the load average, and where the time
went: the synchronous run's sampling seconds (timed around the engine), the async run's worker start and the seconds
the trainer waited for the worker, and the CPU seconds of the trainer's process (a thread worker's included) and of
a worker process.

``--part demo``: the addition demo's SFT warm start once per seed, then GRPO from that checkpoint with
``max_staleness`` 0 and 1 for the same number of steps; held-out greedy exact match on 1,000 problems.

    nice python benchmarks/async_grpo.py --part wall --rounds 3
    nice python benchmarks/async_grpo.py --part demo --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_header  # noqa: E402  (this folder is on sys.path when a script in it runs)


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def digit_reward(completions, **kwargs) -> list[float]:
    """A reward that an untrained model's completions already spread over (the share of digits), so every step
    has a learning signal (the exact-match reward is 0 for every completion of an untrained model)."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def timed_sampling(trainer) -> list[float]:
    """A one-element list that the seconds spent inside ``trainer.engine.generate`` add up in from now on."""
    sampling, generate = [0.0], trainer.engine.generate

    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            sampling[0] += time.perf_counter() - start

    trainer.engine.generate = timed
    return sampling


def grpo_run(options, out: Path, staleness: int, generations: int = 8, **overrides):
    """The GRPO run both async benchmarks time: the toy ``options.model`` (seed 0) on the addition prompts rewarded by
    their share of digits, ``options.steps`` steps of ``options.batch`` completions (G ``generations``), at most
    ``options.completion`` tokens, learning rate 1e-5, seed 0, no saving, no health checks; ``overrides``: more
    ``GRPOConfig`` fields (the worker's kind, the vLLM server)."""
    from treadle.demos import toy
    from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

    tok = toy.build_tokenizer()
    args = GRPOConfig(
        output_dir=str(out),
        overwrite_output_dir=True,
        max_steps=options.steps,
        seed=0,
        per_device_train_batch_size=options.batch,
        num_generations=generations,
        max_completion_length=options.completion,
        learning_rate=1e-5,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_staleness=staleness,
        report_to="none",
        health_checks=False,
        **overrides,
    )
    return GRPOTrainer(
        toy.build_model(options.model, tokenizer=tok, seed=0),
        digit_reward,
        args=args,
        train_dataset=toy.load_task("addition", "train", kind="rl", n=2000, seed=0),
        processing_class=tok,
    )


def wall_run(out: Path, options, staleness: int, worker: str, threads: int) -> dict:
    """One GRPO run with ``threads`` torch threads in this process (an async process worker takes half);
    returns its seconds, the completion tokens sampled and where the time went."""
    import torch

    torch.set_num_threads(threads)

    threads = torch.get_num_threads()
    trainer = grpo_run(options, out, staleness, async_worker=worker if staleness else "process")
    sampling = timed_sampling(trainer) if not staleness else [0.0]
    start, cpu, children = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    trainer.train()  # a process worker is joined when it ends: its CPU time is then in RUSAGE_CHILDREN
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    worker_cpu = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    tokens = sum(h["completions/mean_length"] for h in logs) * options.batch
    timings = trainer.producer.timings if trainer.producer is not None else {}
    return {
        "seconds": seconds,
        "tokens": round(tokens),
        "sampling": sampling[0] if not staleness else None,
        "worker_start": timings.get("worker_start"),
        "waiting": timings.get("waiting"),
        "staleness": [h.get("async/staleness") for h in logs],
        "cpu": cpu,
        "worker_cpu": worker_cpu if staleness and worker == "process" else None,
    }


def part_wall(options, root: Path) -> None:
    contenders = [(0, "none", 1), (0, "none", 2), (1, "process", 2), (2, "process", 2), (1, "thread", 1)]
    if not options.sync_two_threads:  # on a loaded 2-core machine it took 15x the 1-thread time: left out by default
        contenders.remove((0, "none", 2))
    # the synchronous contenders run first in every round: each row's ratios are to that round's baselines
    results = {c: [] for c in contenders}
    print(
        "| round | max_staleness | worker | model | steps | completions/step | max tokens | torch threads "
        "(trainer / worker) | seconds | ratio to sync 1 thread | ratio to sync 2 threads | tokens sampled | "
        "sync: sampling s | async: worker start s | async: trainer waited s | trainer CPU s | worker process CPU s "
        "| load average |"
    )
    print("|" + "---|" * 18)
    for round_ in range(options.rounds):
        for staleness, worker, threads in contenders:
            r = wall_run(root / f"r{round_}-{staleness}-{worker}-{threads}", options, staleness, worker, threads)
            results[(staleness, worker, threads)].append(r)
            bases = [results[(0, "none", t)][-1]["seconds"] if results.get((0, "none", t)) else None for t in (1, 2)]
            print_row(round_, (staleness, worker, threads), r, bases, options)
    print("\nmedians over rounds (ratio of medians to the synchronous medians):")
    sync = statistics.median(r["seconds"] for r in results[(0, "none", 1)])
    for (staleness, worker, threads), rows in results.items():
        median = statistics.median(r["seconds"] for r in rows)
        print(
            f"  max_staleness={staleness} worker={worker} threads={threads}: {median:.1f} s, ratio to sync "
            f"1 thread {median / sync:.3f}"
        )


def print_row(round_: int, contender: tuple, r: dict, bases: list[float], options) -> None:
    staleness, worker, threads = contender
    split = (
        f"{threads}"
        if not staleness
        else f"{threads} / shared"
        if worker == "thread"
        else f"{max(1, threads - max(1, threads // 2))} / {max(1, threads // 2)}"
    )

    def ratio(seconds: float, base: float | None) -> str:
        return "-" if base is None else f"{seconds / base:.3f}"

    def fmt(value) -> str:
        return "-" if value is None else f"{value:.1f}"

    print(
        f"| {round_} | {staleness} | {worker} | {options.model} | {options.steps} | {options.batch} | "
        f"{options.completion} | {split} | {r['seconds']:.1f} | {ratio(r['seconds'], bases[0])} | "
        f"{ratio(r['seconds'], bases[1])} | {r['tokens']} | {fmt(r['sampling'])} | {fmt(r['worker_start'])} | "
        f"{fmt(r['waiting'])} | {fmt(r['cpu'])} | {fmt(r['worker_cpu'])} | {loadavg()} |",
        flush=True,
    )


def demo_run(checkpoint: str, settings, out: Path, staleness: int) -> dict:
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
        disable_tqdm=True,
        max_staleness=staleness,
    )
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    return {"after": trainer.evaluate()[ACCURACY], "seconds": seconds, "steps": trainer.state.global_step}


def part_demo(options, root: Path) -> None:
    import torch

    from treadle.demos import toy
    from treadle.demos.addition import DemoSettings, demo_sft

    torch.set_num_threads(1)  # as the demo
    print(
        "| seed | after SFT (steps) | GRPO max_staleness=0 | max_staleness=1 | difference | seconds 0 / 1 | "
        "load average |"
    )
    print("|---|---|---|---|---|---|---|")
    for seed in [int(s) for s in options.seeds.split(",")]:
        settings = DemoSettings(seed=seed, **({"grpo_steps": options.grpo_steps} if options.grpo_steps else {}))
        model = toy.build_model(settings.model_size, seed=seed, tokenizer=toy.build_tokenizer())
        checkpoint, sft_steps, _ = demo_sft(model, toy.build_tokenizer(), settings, root / f"seed{seed}" / "sft")
        sync = demo_run(checkpoint, settings, root / f"seed{seed}" / "sync", 0)
        stale = demo_run(checkpoint, settings, root / f"seed{seed}" / "async", 1)
        from treadle.demos.addition import evaluate_heldout  # noqa: F401  (the SFT score: the same evaluation)

        print(
            f"| {seed} | ({sft_steps}) | {sync['after']:.1%} | {stale['after']:.1%} | "
            f"{100 * (stale['after'] - sync['after']):+.1f} | {sync['seconds']:.0f} / {stale['seconds']:.0f} | "
            f"{loadavg()} |",
            flush=True,
        )
        (root / f"seed{seed}.json").write_text(json.dumps({"sync": sync, "async": stale, "sft_steps": sft_steps}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("wall", "demo"), default="wall")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="small")
    parser.add_argument("--sync-two-threads", action="store_true", help="also the synchronous run on 2 threads")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32, help="completions per step (G = 8)")
    parser.add_argument("--completion", type=int, default=16, help="max_completion_length")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--grpo-steps", type=int, default=None)
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    root = Path(options.out or tempfile.mkdtemp(prefix="async-grpo-"))
    print(machine_header() + "\n")
    print(f"settings: {vars(options)}\n")
    (part_wall if options.part == "wall" else part_demo)(options, root)


if __name__ == "__main__":
    main()
