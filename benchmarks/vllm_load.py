"""vLLM in-process against vLLM served under a load this script makes itself (issue 42, item 2): why the in-process
engine was measured 9x slower than the server on a loaded machine.

One in-process ``VLLMEngine`` and one ``treadle vllm-serve`` subprocess (``engines.start_server``) on the same model
(toy ``small``, or ``real``: SmolLM2-135M-Instruct); then for each ``--busy`` count N, N busy-loop processes
(``python -c "while True: pass"``, default priority) run while the contenders take turns, ``--rounds`` times:

- ``in-process``: ``VLLMEngine.generate`` from this process's main thread; the engine calls vLLM on a thread of
  its own (its default), or from the main thread itself under ``TREADLE_VLLM_ENGINE_THREAD=0``. libgomp's spin
  count is decided by how many OpenMP threads the whole process has, so the two cannot share a process: run the
  script once with each setting (the header says which);
- ``served``: ``VLLMServerEngine.generate`` over loopback.

Prints tokens/s (median) per contender and condition with the load average before and after each condition.

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vllm_load.py [--model small|real] [--busy 0,1,2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _machine import machine_header  # noqa: E402  (this folder is on sys.path when a script in it runs)
from engines import start_server, start_vllm  # noqa: E402

from treadle.generation.sampling import SamplingParams  # noqa: E402

BUSY = [sys.executable, "-c", "while True: pass"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=["small", "real"])
    parser.add_argument("--busy", default="0,1,2", help="busy-loop process counts, one condition each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    return parser.parse_args(argv)


def build(args):
    """(model, prompt ids, SamplingParams, the server's spec)."""
    if args.model == "small":
        from treadle.demos import toy

        tok = toy.build_tokenizer()
        model = toy.build_model("small", tokenizer=tok, seed=0).eval()
        prompts = [tok(r["prompt"])["input_ids"] for r in toy.load_task("addition", kind="rl", n=args.prompts)]
        spec, pad = "toy:small", tok.pad_token_id
    else:
        from real_engines import load

        from treadle.demos import smollm2

        model, prompts, params = load(args.tokens, args.generations)
        prompts, spec, pad = (prompts * 4)[: args.prompts], str(smollm2.folder()), params.pad_token_id
    params = SamplingParams(
        num_generations=args.generations,
        max_new_tokens=args.tokens,
        eos_token_ids=(),
        pad_token_id=pad,
        temperature=1.0,
    )
    return model, prompts, params, spec


def condition(contenders: dict, prompts, params, busy: int, rounds: int) -> dict:
    """Per contender: tokens/s of each round, with ``busy`` busy-loop processes running; and the loads."""
    hogs = [subprocess.Popen(BUSY) for _ in range(busy)]
    try:
        time.sleep(5 if busy else 0)
        before = os.getloadavg()[0]
        rates = {name: [] for name in contenders}
        for round_ in range(rounds):
            for name, call in contenders.items():
                start = time.perf_counter()
                out = call(prompts, params, torch.Generator().manual_seed(round_))
                rates[name].append(int(out.completion_mask.sum()) / (time.perf_counter() - start))
        return {"rates": rates, "load": (before, os.getloadavg()[0])}
    finally:
        for hog in hogs:
            hog.terminate()
            hog.wait()


def main(argv=None) -> None:
    args = parse_args(argv)
    print(machine_header())
    model, prompts, params, spec = build(args)
    engine, started, _ = start_vllm(model)
    server, server_started, _, process = start_server(model, spec, timeout=900)
    print(
        f"in-process start {started:.0f} s; server start {server_started:.0f} s; "
        f"torch threads {torch.get_num_threads()}; in-process vLLM called from "
        f"{'the caller thread' if engine.runner is None else 'the engine thread'}"
    )
    contenders = {
        "in-process": lambda p, s, g: engine.generate(p, s, generator=g),
        "served": lambda p, s, g: server.generate(p, s, generator=g),
    }
    for call in contenders.values():  # warm-up
        call(prompts, params, torch.Generator().manual_seed(0))
    print(f"{args.model}: {len(prompts)} prompts x {params.num_generations} x {params.max_new_tokens} tokens")
    print("| busy processes | load before -> after | " + " | ".join(contenders) + " |")
    try:
        for busy in map(int, args.busy.split(",")):
            result = condition(contenders, prompts, params, busy, args.rounds)
            cells = [
                f"{statistics.median(r):.0f} ({', '.join(f'{x:.0f}' for x in r)})" for r in result["rates"].values()
            ]
            load = "{:.2f} -> {:.2f}".format(*result["load"])
            print(f"| {busy} | {load} | " + " | ".join(cells) + " |", flush=True)
    finally:
        engine.close()
        process.terminate()
        process.wait(timeout=60)


if __name__ == "__main__":
    main()
