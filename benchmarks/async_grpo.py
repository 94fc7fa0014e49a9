"""Asynchronous GRPO (``max_staleness``, docs/async.md): wall time against the synchronous run, with the own sampler
in a worker, and with the vLLM server.

    python -m benchmarks.async_grpo --parts wall --rounds 3
    .venv-vllm/bin/python -m benchmarks.async_grpo --parts server --completion 64 --own
    python -m benchmarks.async_grpo --quick      # 3 steps of 16 completions, 1 round; server: "not run" without vLLM

Every run: the same GRPO run (``grpo_run``) of a toy model (``--model``, seed 0) on the addition prompts rewarded by
their share of digits (every step has a learning signal), ``--steps`` steps of ``--batch`` completions (G
``--generations``), at most ``--completion`` tokens, learning rate 1e-5 (the policies stay close, so every run samples
about the same tokens: printed), the same seed, no saving, no health checks. Per run: seconds, the synchronous run's
sampling seconds (timed around its engine), the async worker's start and the seconds the trainer waited for a batch,
completion tokens, the CPU seconds of the trainer's process and of the worker's or server's, the load average.

- ``wall``: ``max_staleness`` 0 with 1 torch thread (and with 2, ``--sync-two-threads``), 1 and 2 with a process
  worker (2 threads split: worker 1, trainer 1), 1 with a thread worker (sharing the trainer's 1); the synchronous
  1-thread run first in every round, the ratios to it.
- ``server``: one ``treadle vllm-serve`` subprocess pinned to ``--server-core`` (``taskset``; vLLM binds its OpenMP
  threads within the cores it may use) serves every run; the trainer runs here, pinned to ``--trainer-core`` with 1
  torch thread: the synchronous run with the server, the asynchronous ones (``--staleness``), and with ``--own`` the
  synchronous own sampler on the trainer's core, for scale; the synchronous server run first in every round.

Every process keeps freed memory unless ``--allocator glibc`` (the worker and the server inherit the setting).
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.engines import start_server, stop
from treadle.demos import toy
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

PARTS = ("wall", "server")


def digit_reward(completions, **kwargs) -> list[float]:
    """A reward that an untrained model's completions already spread over (the share of digits), so every step has a
    learning signal (the exact-match reward is 0 for every completion of an untrained model)."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def grpo_run(opts, out: Path, staleness: int, **overrides) -> GRPOTrainer:
    """The GRPO run every contender trains; ``overrides``: more ``GRPOConfig`` fields (the worker, the server)."""
    tok = toy.build_tokenizer()
    args = GRPOConfig(
        output_dir=str(out),
        overwrite_output_dir=True,
        max_steps=opts.steps,
        seed=0,
        per_device_train_batch_size=opts.batch,
        num_generations=opts.generations,
        max_completion_length=opts.completion,
        learning_rate=1e-5,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_staleness=staleness,
        report_to="none",
        health_checks=False,
        **overrides,
    )
    data = toy.load_task("addition", "train", kind="rl", n=2000, seed=0)
    model = toy.build_model(opts.model, tokenizer=tok, seed=0)
    return GRPOTrainer(model, digit_reward, args=args, train_dataset=data, processing_class=tok)


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


def producer_timings(trainer) -> dict:
    """The asynchronous producer's timings (worker start, seconds waited), {} for a synchronous run."""
    producer = getattr(trainer.rollout_sampler, "producer", None)  # an AsyncSampler's
    return dict(producer.timings) if producer is not None else {}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(trainer, staleness: int, other_pid: int | None = None) -> dict:
    """Train; seconds, tokens sampled and where the time went (``other_pid``: the server, whose CPU is counted)."""
    sampling = timed_sampling(trainer) if not staleness else [None]
    other = cpu_seconds(other_pid) if other_pid else children_cpu()
    start, cpu = time.perf_counter(), time.process_time()
    try:
        trainer.train()  # a process worker is joined when it ends: its CPU time is then in RUSAGE_CHILDREN
    finally:
        trainer.close()  # the worker, the server's claim
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    other = (cpu_seconds(other_pid) if other_pid else children_cpu()) - other
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    timings = producer_timings(trainer)
    return {
        "seconds": seconds,
        "tokens": round(sum(h["completions/mean_length"] for h in logs) * trainer.args.per_device_train_batch_size),
        "sampling": sampling[0],
        "worker_start": timings.get("worker_start"),
        "waiting": timings.get("waiting"),
        "cpu": cpu,
        "other_cpu": other,
        "load": harness.machine()["load"],
    }


def rounds_table(run: harness.Run, part: str, contenders: list[str], results: dict, base: str) -> None:
    """Every run (round by round, its ratio to the base's run of that round), then the medians."""
    rows = []
    for round_ in range(len(results[base])):
        for name in contenders:
            r = results[name][round_]
            cells = [r[k] for k in ("sampling", "worker_start", "waiting", "cpu", "other_cpu")]
            rows.append(
                [round_, name, f"{r['seconds']:.1f}", f"{r['seconds'] / results[base][round_]['seconds']:.3f}"]
            )
            rows[-1] += [r["tokens"], *("-" if c is None else f"{c:.1f}" for c in cells), r["load"]]
    header = ["round", "contender", "seconds", f"ratio to {base}", "tokens", "sync: sampling s", "worker start s"]
    print(
        f"\n### {part}\n\n"
        + harness.table(header + ["waited s", "trainer CPU s", "worker/server CPU s", "load"], rows)
    )
    sync = statistics.median(r["seconds"] for r in results[base])
    print("\nmedians over rounds:")
    for name in contenders:
        s = harness.spread([r["seconds"] for r in results[name]])
        run.row(part=part, contender=name, seconds=s, ratio=s["median"] / sync, runs=results[name])
        print(f"  {name}: {s['median']:.1f} s (range {s['min']:.1f} - {s['max']:.1f}), {s['median'] / sync:.3f}x")


def part_wall(run: harness.Run, opts) -> None:
    contenders = {"sync, 1 thread": (0, "process", 1), "N=1 process": (1, "process", 2)}
    contenders |= {"N=2 process": (2, "process", 2), "N=1 thread": (1, "thread", 1)}
    if opts.sync_two_threads:  # on a loaded 2-core machine it took 15x the 1-thread time: left out by default
        contenders["sync, 2 threads"] = (0, "process", 2)
    for name, (staleness, worker, threads) in contenders.items():
        run.contender(name, part="wall", max_staleness=staleness, worker=worker if staleness else "-", threads=threads)
    results = {name: [] for name in contenders}
    for round_ in range(opts.rounds):
        for name, (staleness, worker, threads) in contenders.items():  # the synchronous run first: the ratios' base
            torch.set_num_threads(threads)
            trainer = grpo_run(opts, run.out / f"r{round_}-{name}", staleness, async_worker=worker)
            results[name].append(one_run(trainer, staleness))
            print(f"round {round_} {name}: {results[name][-1]['seconds']:.1f} s", flush=True)
    rounds_table(run, "wall", list(contenders), results, "sync, 1 thread")


def part_server(run: harness.Run, opts) -> None:
    os.sched_setaffinity(0, {opts.trainer_core})
    torch.set_num_threads(1)
    model = toy.build_model(opts.model, tokenizer=toy.build_tokenizer(), seed=0)
    env = harness.allocator_env(opts.allocator, treadle_contender=True)
    prefix = ("taskset", "-c", str(opts.server_core))
    engine, started, _, process = start_server(model, f"toy:{opts.model}", prefix=prefix, env=env)
    if engine is None:
        print(f"\n### server\n\nnot run: {started}")
        return
    engine.close()  # the runs claim it one at a time
    served = {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": engine.url}
    contenders = {"sync server": (0, served)} | {f"async server N={n}": (int(n), served) for n in opts.staleness}
    contenders |= {"sync own sampler": (0, {})} if opts.own else {}
    for name, (staleness, settings) in contenders.items():
        run.contender(
            name, part="server", max_staleness=staleness, server=bool(settings), trainer_core=opts.trainer_core
        )
    results = {name: [] for name in contenders}
    try:
        for round_ in range(opts.rounds):
            for name, (staleness, settings) in contenders.items():
                trainer = grpo_run(opts, run.out / f"r{round_}-{name}", staleness, **settings)
                results[name].append(one_run(trainer, staleness, process.pid if settings else None))
    finally:
        stop(process)
    rounds_table(
        run, f"server (start-up {started:.1f} s, core {opts.server_core})", list(contenders), results, "sync server"
    )


def parse_args(argv=None):
    p = harness.parser(__doc__, "3 steps of 16 completions x 8 tokens, 1 round")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="small", help="toy size (the server needs head size 32 or more: small, base)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=32, help="completions per step")
    p.add_argument("--generations", type=int, default=8, help="G")
    p.add_argument("--completion", type=int, default=16, help="max_completion_length (the server runs: 64)")
    p.add_argument("--sync-two-threads", action="store_true", help="wall: also the synchronous run on 2 threads")
    p.add_argument("--staleness", default="1", help="server: comma-separated max_staleness values of the async rows")
    p.add_argument("--server-core", type=int, default=0)
    p.add_argument("--trainer-core", type=int, default=1)
    p.add_argument("--own", action="store_true", help="server: also the synchronous own sampler on the trainer's core")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.rounds, opts.steps, opts.batch, opts.completion = 1, 3, 16, 8
    opts.staleness = opts.staleness.split(",")
    return opts


def main(argv=None) -> None:
    opts = parse_args(argv)
    harness.apply_allocator(opts.allocator)
    run = harness.Run("async_grpo", opts)
    for part in opts.parts.split(","):
        {"wall": part_wall, "server": part_server}[part](run, opts)
    run.finish()


if __name__ == "__main__":
    main()
