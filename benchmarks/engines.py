"""Rollouts per second of GRPO's rollout engines: the own sampler, vLLM colocated, vLLM server and transformers
``generate``.

Every contender gets the same randomly initialised toy Llama (``treadle.toy``: "small" 4.2M parameters, head size
32; "base" 33.6M, head size 64 -- vLLM's CPU attention has no kernel for toy "tiny"'s head size 16), the same B
distinct prompts from the toy addition task, G completions per prompt and the same sampling settings
(temperature 1, no top-k / top-p, EOS ignored so that every completion is exactly ``--tokens`` long and each
contender produces the same number of tokens). The own sampler is ``engines.LocalEngine`` (backend "fast"),
``generate`` is the same engine with backend "hf" (``model.generate(num_return_sequences=G)``, TRL's non-vLLM
path), vLLM is ``engines.vllm.VLLMEngine`` (in-process, float32) after one weight sync, and the vLLM server is
``engines.vllm_server.VLLMServerEngine`` talking to a ``treadle vllm-serve toy:<model>`` subprocess on loopback
(the same weights pushed to it over HTTP; its answers cross the loopback as bytes). The contenders run
interleaved, ``--rounds`` times, so that noise from other processes hits all alike; each vLLM's start-up (once
per run) and one weight sync are timed apart.

    .venv-vllm/bin/python benchmarks/engines.py [--model small|base] [--quick] [--no-server]  # make test-vllm

Without vLLM installed (the main .venv) the vLLM row says so and the other two still run. One model per run:
vLLM's in-process engine is started once per process. Figures: docs/vllm.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _machine import machine_header  # noqa: E402  (this folder is on sys.path when a script in it runs)

from treadle.demos import toy  # noqa: E402
from treadle.engines.local import LocalEngine  # noqa: E402
from treadle.generation.sampling import SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=["small", "base"])
    parser.add_argument("--prompts", type=int, default=16, help="B distinct prompts")
    parser.add_argument("--generations", type=int, default=8, help="G completions per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion (EOS ignored)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-server", action="store_true", help="leave out the vLLM server row (a second start)")
    parser.add_argument("--quick", action="store_true", help="2 prompts x 2 x 8 tokens, 1 round: checks it runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.generations, args.tokens, args.rounds = 2, 2, 8, 1
    return args


def start_vllm(model):
    """(engine, start-up seconds, one weight sync's seconds), or (None, reason, None) without vLLM."""
    try:
        from treadle.engines.vllm import VLLMEngine, require_vllm  # vLLM is optional: .venv-vllm only

        require_vllm()
    except ImportError as error:
        return None, str(error), None
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    start = time.perf_counter()
    engine = VLLMEngine(model, max_model_length=256)
    started = time.perf_counter() - start
    start = time.perf_counter()
    engine.load_weights(model)
    return engine, started, time.perf_counter() - start


def start_server(
    model, spec: str, options: tuple[str, ...] = (), timeout: float = 900.0, prefix: tuple[str, ...] = ()
):
    """(engine, start-up seconds, one weight sync's seconds, process) of a ``treadle vllm-serve SPEC`` subprocess
    (``toy:<size>`` or a model folder; ``options``: more of its flags, e.g. ``--dtype``), or (None, reason, None,
    None) without vLLM. ``timeout``: seconds the engine waits for the server's first answer; ``prefix``: a command
    the server runs under (e.g. ``taskset -c 0``)."""
    try:
        from treadle.engines.vllm import require_vllm  # vLLM is optional: .venv-vllm only
        from treadle.engines.vllm_server import VLLMServerEngine

        require_vllm()
    except ImportError as error:
        return None, str(error), None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"),
    }
    start = time.perf_counter()
    command = [
        *prefix,
        sys.executable,
        "-m",
        "treadle",
        "vllm-serve",
        spec,
        "--port",
        str(port),
        "--max-model-len",
        "256",
        *options,
    ]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        engine = VLLMServerEngine(model, f"http://127.0.0.1:{port}", timeout=timeout)
    except BaseException:  # a server that never answers (or a row's time running out) leaves no process behind
        process.terminate()
        process.wait(timeout=60)
        raise
    started = time.perf_counter() - start
    start = time.perf_counter()
    engine.load_weights(model)
    return engine, started, time.perf_counter() - start, process


def main(argv=None) -> None:
    args = parse_args(argv)
    tok = toy.build_tokenizer()
    model = toy.build_model(args.model, tokenizer=tok, seed=0).eval()
    prompts = [tok(row["prompt"])["input_ids"] for row in toy.load_task("addition", kind="rl", n=args.prompts)]
    params = SamplingParams(
        num_generations=args.generations,
        max_new_tokens=args.tokens,
        eos_token_ids=(),
        pad_token_id=tok.pad_token_id,
        temperature=1.0,
    )
    vllm, vllm_start, vllm_sync = start_vllm(model)
    contenders = {
        "own sampler (LocalEngine, fast)": LocalEngine(model, backend="fast"),
        "transformers generate (LocalEngine, hf)": LocalEngine(model, backend="hf"),
    }
    if vllm is not None:
        contenders["vLLM colocate (VLLMEngine)"] = vllm
    server = server_start = server_sync = process = None
    if not args.no_server:
        server, server_start, server_sync, process = start_server(model, f"toy:{args.model}")
    if server is not None:
        contenders["vLLM server (VLLMServerEngine, loopback)"] = server
    times = {name: [] for name in contenders}
    for round_ in range(args.rounds + 1):  # round 0 warms every contender up and is not counted
        for name, engine in contenders.items():
            torch.set_num_threads(args.threads)  # vLLM's worker may set the process's threads: same for all
            start = time.perf_counter()
            out = engine.generate(prompts, params, generator=torch.Generator().manual_seed(round_))
            elapsed = time.perf_counter() - start
            assert int(out.completion_mask.sum()) == len(prompts) * args.generations * args.tokens
            if round_:
                times[name].append(elapsed)
    rollouts = len(prompts) * args.generations
    print(machine_header())
    print(
        f"\nmodel: toy {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, float32); "
        f"{len(prompts)} prompts x {args.generations} completions x {args.tokens} tokens, temperature 1, EOS "
        f"ignored; {args.rounds} rounds, {args.threads} torch threads\n"
    )
    print("| engine | model | B x G x tokens | rollouts/s (median) | best | tokens/s (median) | vs own sampler |")
    print("|---|---|---|---|---|---|---|")
    base = statistics.median(times["own sampler (LocalEngine, fast)"])
    for name, spent in times.items():
        median = statistics.median(spent)
        print(
            f"| {name} | toy {args.model} | {len(prompts)} x {args.generations} x {args.tokens} | "
            f"{rollouts / median:.1f} | {rollouts / min(spent):.1f} | {rollouts * args.tokens / median:.0f} | "
            f"{base / median:.2f}x |"
        )
    if vllm is None:
        print(f"| vLLM colocate | toy {args.model} | - | not run: {vllm_start} | | | |")
    else:
        print(f"\nvLLM start-up (once per run): {vllm_start:.1f} s; one full weight sync: {vllm_sync * 1000:.0f} ms")
        vllm.close()
    if process is not None:
        mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        print(
            f"vLLM server start-up (to its first answer): {server_start:.1f} s; one full weight sync over loopback: "
            f"{server_sync * 1000:.0f} ms ({mib:.0f} MiB of weights)"
        )
        process.terminate()
        process.wait(timeout=60)


if __name__ == "__main__":
    main()
