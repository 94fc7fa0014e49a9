"""Asynchronous GRPO through the vLLM server against the synchronous run with the same server (issue 42, item 3;
docs/async.md): the server on one core, the trainer on the other.

One ``treadle vllm-serve`` subprocess (``taskset -c SERVER_CORE``: vLLM binds its OpenMP threads within the cores
it is allowed) serves every run; the trainer runs in this process, pinned to ``--trainer-core`` with 1 torch
thread. Contenders, interleaved ``--rounds`` times (the synchronous one first in each round, the ratios are to it):

- sync server: ``use_vllm`` with ``vllm_mode: server``, ``max_staleness`` 0 (the trainer waits while the server
  samples, the server waits while the trainer trains);
- async server N: the same with ``max_staleness`` N (a thread of the trainer drives the server, the trainer trains
  on the batch sampled one step earlier);
- sync own sampler (``--own``): the own sampler on the trainer's core, for scale.

Every run: the same toy model (``--model``, seed 0), the addition prompts rewarded by their share of digits, the same
seed, ``--steps`` steps of ``--batch`` completions (G ``--generations``), at most ``--completion`` tokens, learning
rate 1e-5 (the policies stay close, so every run samples about the same tokens: printed), no health checks. Per run:
seconds, the synchronous run's sampling seconds (timed around the engine), the seconds the async trainer waited for a
batch, completion tokens, the CPU seconds of the trainer's process and of the server's, and the load average.

    .venv-vllm/bin/python benchmarks/async_server.py [--model small] [--steps 12] [--batch 32] [--completion 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine_header  # noqa: E402  (this folder is on sys.path when a script in it runs)
from async_grpo import grpo_run, loadavg, timed_sampling  # noqa: E402
from engines import start_server  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="toy size (head size 32 or more: small, base)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32, help="completions per step")
    parser.add_argument("--generations", type=int, default=8, help="G")
    parser.add_argument("--completion", type=int, default=64, help="max_completion_length")
    parser.add_argument("--staleness", default="1", help="comma-separated max_staleness values of the async rows")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--own", action="store_true", help="also the synchronous own sampler on the trainer's core")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far (/proc)."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(options, out: Path, url: str | None, staleness: int, server_pid: int | None) -> dict:
    served = {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": url} if url else {}
    trainer = grpo_run(options, out, staleness, options.generations, **served)
    sampling = timed_sampling(trainer) if not staleness else [0.0]  # the synchronous run's, around its engine
    server_cpu = cpu_seconds(server_pid) if server_pid else 0.0
    start, cpu = time.perf_counter(), time.process_time()
    try:
        trainer.train()
    finally:
        trainer.close()  # releases the server for the next run
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    return {
        "seconds": seconds,
        "tokens": round(sum(h["completions/mean_length"] for h in logs) * options.batch),
        "sampling": sampling[0] if not staleness else None,
        "waiting": trainer.producer.timings["waiting"] if trainer.producer is not None else None,
        "cpu": cpu,
        "server_cpu": cpu_seconds(server_pid) - server_cpu if server_pid and url else None,
        "load": loadavg(),
    }


def fmt(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv=None) -> None:
    options = parse_args(argv)
    import torch

    from treadle.demos import toy

    root = Path(options.out or tempfile.mkdtemp(prefix="async-server-"))
    print(machine_header())  # before the pinning: the machine's cores
    os.sched_setaffinity(0, {options.trainer_core})
    torch.set_num_threads(1)
    print(f"settings: {vars(options)}; trainer: core {options.trainer_core}, 1 torch thread\n")
    model = toy.build_model(options.model, tokenizer=toy.build_tokenizer(), seed=0)
    engine, started, _, process = start_server(
        model, f"toy:{options.model}", prefix=("taskset", "-c", str(options.server_core))
    )
    if engine is None:
        sys.exit(f"not run: {started}")
    engine.close()  # the runs claim it one at a time
    url = engine.url
    print(f"server: pid {process.pid}, core {options.server_core}, start {started:.1f} s, {url}\n")
    contenders = [("sync server", 0, url)] + [
        (f"async server N={n}", int(n), url) for n in options.staleness.split(",")
    ]
    contenders += [("sync own sampler", 0, None)] if options.own else []
    print(
        "| round | contender | seconds | ratio to sync server | sync: sampling s | async: waited s | tokens | "
        "trainer CPU s | server CPU s | load average |"
    )
    print("|" + "---|" * 10)
    results = {name: [] for name, _, _ in contenders}
    try:
        for round_ in range(options.rounds):
            for name, staleness, address in contenders:
                r = one_run(options, root / f"r{round_}-{staleness}-{bool(address)}", address, staleness, process.pid)
                results[name].append(r)
                base = results["sync server"][-1]["seconds"]
                print(
                    f"| {round_} | {name} | {r['seconds']:.1f} | {r['seconds'] / base:.3f} | {fmt(r['sampling'])} | "
                    f"{fmt(r['waiting'])} | {r['tokens']} | {r['cpu']:.1f} | {fmt(r['server_cpu'])} | {r['load']} |",
                    flush=True,
                )
    finally:
        process.terminate()
        process.wait(timeout=60)
    sync = statistics.median(r["seconds"] for r in results["sync server"])
    print("\nmedians over rounds:")
    for name, rows in results.items():
        median = statistics.median(r["seconds"] for r in rows)
        print(f"  {name}: {median:.1f} s, {median / sync:.3f}x the synchronous run with the server")


if __name__ == "__main__":
    main()
