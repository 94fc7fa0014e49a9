"""The own sampler against transformers ``generate`` on the real model, SmolLM2-135M-Instruct (float32), at 64 rows,
beside the machine's float32 matmul roof measured in the same run (issue 42, item 1).

Settings (printed with every run): 8 chat prompts x 8 completions = 64 rows, ``--tokens`` new tokens (32), EOS
ignored so every row is exactly that long, temperature 1, no top-k / top-p, one seed. Contenders, interleaved
``--rounds`` times so that load from other processes hits both alike:

- own sampler: ``generation.single.sample_completions(backend="fast")`` of the code checked out (run the script on
  an older commit for the "before" row);
- generate: the same call with ``backend="hf"`` (``model.generate(num_return_sequences=8)``, TRL's non-vLLM path).

Per contender: tokens/s over the whole call (prefill included), ms per decode step (the call with ``--tokens`` new
tokens minus the call with one, over ``--tokens - 1`` steps), the decode step's GFLOP/s (2 x parameters x 64 rows
per step; attention over a short context adds under 1%) and its share of the roof. The roof is the best float32
rate of the model's own matmul shapes at 64 rows (64 x 576 by 576 x {192, 576, 1536, 49152}, 64 x 1536 by 1536 x
576), measured in this run with the same threads.

- ``--vllm`` adds "vLLM colocate (VLLMEngine)", in-process, and "vLLM server (VLLMServerEngine, loopback)", a
  ``treadle vllm-serve`` subprocess on the model's folder (``benchmarks/engines.py``'s ``start_vllm`` and
  ``start_server``), each after one full weight sync (start-up and sync timed apart), called through the engine
  contract (``engine.generate(prompts, params, generator=...)``) in the same interleaved rounds. Their GFLOP/s are
  over the whole call (2 x parameters x tokens / seconds, prefill and the engine's per-call overheads included), not
  per decode step. The server gets ``OMP_NUM_THREADS=--threads``. Without vLLM (the main .venv) the rows print
  "not run: <reason>".

    OMP_NUM_THREADS=1 python benchmarks/real_engines.py [--threads 1] [--tokens 32] [--rounds 3] [--profile]
    PYTHONPATH=src .venv-vllm/bin/python benchmarks/real_engines.py --vllm --threads 2 --rounds 3

``--profile`` prints where one decode step of the own sampler goes, op by op (torch.profiler): the profile of the
whole call minus that of a call with 1 new token (the prefill and first draw cancel out), over ``--tokens - 1`` steps.
``--profile-only`` skips the timed rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _machine import machine_header  # noqa: E402  (this folder is on sys.path when a script in it runs)
from engines import start_server, start_vllm  # noqa: E402  (benchmarks/engines.py: the vLLM rows' start-ups)

from treadle.generation.sampling import SamplingParams  # noqa: E402
from treadle.generation.single import sample_completions  # noqa: E402

N_PARAMS = 134_515_008  # SmolLM2-135M-Instruct, tied embeddings counted once (the head is a matmul, the lookup not)
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "Give me three names for a cat.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "List two uses of a paperclip.",
]
COLOCATE, SERVER = "vLLM colocate (VLLMEngine)", "vLLM server (VLLMServerEngine, loopback)"
ROOF_SHAPES = [(576, 192), (576, 576), (576, 1536), (1536, 576), (576, 49152)]  # (K, N) of the model's matmuls


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per completion (EOS ignored)")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (8 prompts)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-generate", action="store_true", help="leave out transformers generate")
    parser.add_argument("--vllm", action="store_true", help="add vLLM in-process and vLLM server rows")
    parser.add_argument("--profile", action="store_true", help="per-op profile of one own-sampler decode step")
    parser.add_argument("--profile-only", action="store_true", help="the roof and --profile, no timed rounds")
    parser.add_argument("--top", type=int, default=15, help="ops listed by --profile")
    return parser.parse_args(argv)


def matmul_roof(rows: int, repeats: int = 5) -> float:
    """Best float32 GFLOP/s of the model's matmul shapes at ``rows`` rows."""
    best = 0.0
    for k, n in ROOF_SHAPES:
        a, b = torch.randn(rows, k), torch.randn(k, n)
        out = a @ b
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            best = max(best, 2 * rows * k * n / (time.perf_counter() - start) / 1e9)
    return best


def load(tokens: int, generations: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treadle.demos import smollm2

    folder = smollm2.folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        for p in PROMPTS
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]  # 5.x returns a dict
    params = SamplingParams(
        num_generations=generations,
        max_new_tokens=tokens,
        eos_token_ids=(),  # EOS ignored: every row is exactly `tokens` long
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
        temperature=1.0,
    )
    return model, prompts, params


def timed(model, prompts, params, backend: str, tokens: int) -> tuple[float, Tensor]:
    from dataclasses import replace

    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    out = sample_completions(
        model, prompts, replace(params, max_new_tokens=tokens), generator=generator, backend=backend
    )
    return time.perf_counter() - start, out.completion_ids


def timed_engine(engine, prompts, params) -> float:
    """Seconds of one ``engine.generate`` call through the engine contract (every row exactly ``max_new_tokens``)."""
    start = time.perf_counter()
    out = engine.generate(prompts, params, generator=torch.Generator().manual_seed(0))
    elapsed = time.perf_counter() - start
    assert int(out.completion_mask.sum()) == len(prompts) * params.num_generations * params.max_new_tokens
    return elapsed


def measure(model, prompts, params, backends: list[str], rounds: int, engines: dict | None = None) -> dict:
    """Per backend: the seconds of whole calls with ``params.max_new_tokens`` and with 1 new token, per round; per
    engine (name -> a ``RolloutEngine``): the seconds of whole calls with ``params.max_new_tokens``. Interleaved."""
    engines = engines or {}
    times = {b: {"full": [], "one": []} for b in backends} | {name: {"full": []} for name in engines}
    for backend in backends:  # warm-up: first-call allocations and lazy imports
        timed(model, prompts, params, backend, 2)
    for engine in engines.values():
        timed_engine(engine, prompts, params)
    for _ in range(rounds):
        for backend in backends:
            times[backend]["full"].append(timed(model, prompts, params, backend, params.max_new_tokens)[0])
            times[backend]["one"].append(timed(model, prompts, params, backend, 1)[0])
        for name, engine in engines.items():
            times[name]["full"].append(timed_engine(engine, prompts, params))
    return times


def report(times: dict, params: SamplingParams, rows: int, roof: float) -> None:
    """A line per contender; the engine rows' GFLOP/s (marked *) are over the whole call, the others' per decode
    step (the full call minus the 1-token call)."""
    steps = params.max_new_tokens - 1
    step_gflop = 2 * N_PARAMS * rows / 1e9
    print(f"{'contender':<42}{'tokens/s':>10}{'ms/step':>10}{'GFLOP/s':>10}{'% roof':>8}{'vs generate':>13}")
    rates = {}
    for backend, t in times.items():
        full = statistics.median(t["full"])
        rates[backend] = rows * params.max_new_tokens / full
        if "one" in t:
            step = (full - statistics.median(t["one"])) / steps
            gflops, ms_step, mark = step_gflop / step, f"{step * 1e3:.1f}", ""
        else:  # an engine: the whole call, prefill included
            gflops, ms_step, mark = step_gflop * params.max_new_tokens / full, "-", "*"
        name = {"fast": "own sampler", "hf": "generate"}.get(backend, backend)
        versus = f"{rates[backend] / rates['hf']:.2f}x" if "hf" in rates else "-"
        cells = f"{rates[backend]:>10.1f}{ms_step:>10}{gflops:>9.1f}{mark:1}{gflops / roof:>8.0%}{versus:>13}"
        print(f"{name:<42}{cells}")
        print(f"{'':<14}rounds (s, {params.max_new_tokens} tokens): {', '.join(f'{x:.2f}' for x in t['full'])}")
    if any("one" not in t for t in times.values()):
        print("* GFLOP/s over the whole call (2 x parameters x tokens / seconds, prefill included), not per step")


def start_engines(model, threads: int) -> tuple[dict, list[str], object]:
    """The vLLM rows: (name -> engine after one full weight sync, a line per row with its start-up and sync or
    "not run: <reason>", the server's process or None)."""
    from treadle.demos import smollm2

    engines, lines = {}, []
    engine, started, synced = start_vllm(model)
    if engine is None:
        lines.append(f"{COLOCATE}: not run: {started}")
    else:
        engines[COLOCATE] = engine
        lines.append(f"{COLOCATE}: start-up {started:.1f} s, one full weight sync {synced * 1e3:.0f} ms")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the server's torch threads (read by the subprocess only)
    server, started, synced, process = start_server(model, str(smollm2.folder()))
    if server is None:
        lines.append(f"{SERVER}: not run: {started}")
    else:
        engines[SERVER] = server
        lines.append(f"{SERVER}: start-up {started:.1f} s, one full weight sync over loopback {synced * 1e3:.0f} ms")
    return engines, lines, process


def close_engines(engines: dict, process) -> None:
    if COLOCATE in engines:
        engines[COLOCATE].close()
    if process is not None:
        process.terminate()
        process.wait(timeout=60)


def profile_step(model, prompts, params, top: int) -> None:
    """Per-op self time of one decode step: (profile of the whole call - profile of a 1-token call) / (tokens - 1),
    so that the prefill (about 4 decode steps of work here, and its noise) cancels out."""
    from torch.profiler import ProfilerActivity, profile

    def ops(tokens: int) -> dict:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            timed(model, prompts, params, "fast", tokens)
        return {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}

    steps = params.max_new_tokens - 1
    one, full = ops(1), ops(params.max_new_tokens)
    diff = {
        k: ((ms - one.get(k, (0.0, 0))[0]) / steps, (n - one.get(k, (0.0, 0))[1]) / steps)
        for k, (ms, n) in full.items()
    }
    total = sum(ms for ms, _ in diff.values())
    print(
        f"\nOne decode step, per op (self ms; calls; the {params.max_new_tokens}-token call minus the 1-token call, "
        f"over {steps} steps): total {total:.1f} ms"
    )
    for name, (ms, n) in sorted(diff.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {name:<50}{ms:>8.1f}{n:>7.0f}{ms / total:>7.0%}")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(machine_header())
    model, prompts, params = load(args.tokens, args.generations)
    rows = len(prompts) * args.generations
    print(
        f"SmolLM2-135M-Instruct float32, {len(prompts)} prompts x {args.generations} = {rows} rows, prompt lengths "
        f"{min(map(len, prompts))}-{max(map(len, prompts))}, {args.tokens} new tokens (EOS ignored), temperature "
        f"{params.temperature}, top_k {params.top_k}, top_p {params.top_p}, threads {args.threads}, rounds "
        f"{args.rounds}, seed 0\n"
        f"  own sampler: sample_completions(backend='fast'); generate: backend='hf' "
        f"(model.generate, num_return_sequences={args.generations}, the same SamplingParams)"
    )
    roof = matmul_roof(rows)
    print(f"float32 matmul roof at {rows} rows (the model's shapes, this run): {roof:.1f} GFLOP/s")
    if not args.profile_only:
        backends = ["fast"] if args.no_generate else ["fast", "hf"]
        engines, lines, process = start_engines(model, args.threads) if args.vllm else ({}, [], None)
        try:
            times = measure(model, prompts, params, backends, args.rounds, engines)
        finally:
            close_engines(engines, process)
        after = matmul_roof(rows)
        print(
            f"roof after the runs: {after:.1f} GFLOP/s; % roof below is of the higher of the two (a roof measured "
            f"while another process holds a core reads low)"
        )
        report(times, params, rows, max(roof, after))
        print("\n".join(lines))
    if args.profile or args.profile_only:
        timed(model, prompts, params, "fast", 2)  # warm
        profile_step(model, prompts, params, args.top)


if __name__ == "__main__":
    main()
