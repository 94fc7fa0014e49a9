"""vLLM in-process against vLLM served under a load this script makes itself: why the in-process engine was once
measured 9x slower than the server on a loaded machine (docs/vllm.md, speed).

    .venv-vllm/bin/python -m benchmarks.lab.vllm_load [--model small|real] [--busy 0,1,2] [--rounds 3]
    TREADLE_VLLM_ENGINE_THREAD=0 .venv-vllm/bin/python -m benchmarks.lab.vllm_load     # vLLM on the caller's thread
    python -m benchmarks.lab.vllm_load --quick       # without vLLM: says why it did not run

One in-process ``VLLMEngine`` and one ``treadle vllm-serve`` subprocess (``benchmarks.engines.start_server``) on the
same model (toy ``small``, or ``real``: SmolLM2-135M-Instruct); then for each ``--busy`` count N, N busy-loop processes
(``python -c "while True: pass"``, default priority) run while the two take turns, ``--rounds`` times: ``in-process``
(``VLLMEngine.generate`` from this process's main thread; the engine calls vLLM on a thread of its own, or from the
main thread itself under ``TREADLE_VLLM_ENGINE_THREAD=0``: libgomp's spin count is decided by how many OpenMP threads
the whole process has, so the two settings cannot share a process) and ``served`` (``VLLMServerEngine.generate`` over
loopback). Prints tokens/s (median and every round) per contender and condition, with the load average before and
after each condition.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from benchmarks import harness
from benchmarks.engines import start_server, start_vllm, stop
from treadle.generation.sampling import SamplingParams

BUSY = [sys.executable, "-c", "while True: pass"]


def build(opts):
    """(model, prompt ids, SamplingParams, the server's spec)."""
    if opts.model == "small":
        from treadle.demos import toy

        tok = toy.build_tokenizer()
        model = toy.build_model("small", tokenizer=tok, seed=0).eval()
        prompts = [tok(r["prompt"])["input_ids"] for r in toy.load_task("addition", kind="rl", n=opts.prompts)]
        spec, pad = "toy:small", tok.pad_token_id
    else:
        from benchmarks.generation import load_real
        from treadle.demos import smollm2

        model, prompts, params = load_real(opts.tokens, opts.generations)
        prompts, spec, pad = (prompts * 4)[: opts.prompts], str(smollm2.folder()), params.pad_token_id
    params = SamplingParams(
        num_generations=opts.generations, max_new_tokens=opts.tokens, eos_token_ids=(), pad_token_id=pad
    )
    return model, prompts, params, spec


def condition(contenders: dict, prompts, params, busy: int, rounds: int) -> dict:
    """Per contender: tokens/s of each round, with ``busy`` busy-loop processes running; and the loads."""
    hogs = [subprocess.Popen(BUSY) for _ in range(busy)]
    try:
        time.sleep(5 if busy else 0)
        before, rates = os.getloadavg()[0], {name: [] for name in contenders}
        for round_, name in harness.interleaved(list(contenders), rounds):
            start = time.perf_counter()
            out = contenders[name](prompts, params, torch.Generator().manual_seed(round_))
            rates[name].append(int(out.completion_mask.sum()) / (time.perf_counter() - start))
        return {"rates": rates, "load": (before, os.getloadavg()[0])}
    finally:
        for hog in hogs:
            hog.terminate()
            hog.wait()


def main(argv=None) -> None:
    p = harness.parser(__doc__, "toy small, 2 prompts x 2 x 8 tokens, busy 0, 1 round")
    p.add_argument("--model", default="small", choices=["small", "real"])
    p.add_argument("--busy", default="0,1,2", help="busy-loop process counts, one condition each")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    opts = p.parse_args(argv)
    if opts.quick:
        opts.model, opts.busy, opts.rounds, opts.prompts, opts.generations, opts.tokens = "small", "0", 1, 2, 2, 8
    harness.apply_allocator(opts.allocator)
    run = harness.Run("lab.vllm_load", opts)
    model, prompts, params, spec = build(opts)
    engine, started, _ = start_vllm(model)
    if engine is None:
        print(f"not run: {started}")
        run.finish()
        return
    server, server_started, _, process = start_server(model, spec, timeout=900)
    try:
        measure(
            run,
            opts,
            engine,
            server,
            prompts,
            params,
            f"in-process start {started:.0f} s; server {server_started:.0f} s",
        )
    finally:
        engine.close()
        stop(process)
    run.finish()


def measure(run: harness.Run, opts, engine, server, prompts, params, starts: str) -> None:
    thread = "the caller thread" if engine.runner is None else "the engine thread"
    contenders = {
        "in-process": lambda p, s, g: engine.generate(p, s, generator=g),
        "served": lambda p, s, g: server.generate(p, s, generator=g),
    }
    for name in contenders:
        run.contender(name, model=opts.model, vllm_called_from=thread if name == "in-process" else "the server")
    for call in contenders.values():  # warm-up
        call(prompts, params, torch.Generator().manual_seed(0))
    print(
        f"{starts}; torch threads {torch.get_num_threads()}; {len(prompts)} prompts x {params.num_generations} x "
        f"{params.max_new_tokens} tokens"
    )
    rows = []
    for busy in map(int, opts.busy.split(",")):
        result = condition(contenders, prompts, params, busy, opts.rounds)
        run.row(busy=busy, **result)
        cells = [
            f"{harness.spread(r)['median']:.0f} ({', '.join(f'{x:.0f}' for x in r)})" for r in result["rates"].values()
        ]
        rows.append([busy, "{:.2f} -> {:.2f}".format(*result["load"]), *cells])
    print(harness.table(["busy processes", "load before -> after", *contenders], rows))


if __name__ == "__main__":
    main()
