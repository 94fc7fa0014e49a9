"""Rollouts per second of GRPO's rollout engines: the own sampler, transformers ``generate``, vLLM colocated and vLLM
served, each through the engine contract (``engine.generate(prompts, params, generator=...)``).

    .venv-vllm/bin/python -m benchmarks.engines --parts toy --model small      # or --model base (33.6M)
    .venv-vllm/bin/python -m benchmarks.engines --parts real --threads 2       # SmolLM2-135M-Instruct
    python -m benchmarks.engines --quick     # 2 prompts x 2 x 8 tokens, 1 round; vLLM rows say why they did not run

Every contender gets the same model, prompts and sampling settings (temperature 1, no top-k / top-p, EOS ignored so
that every completion is exactly ``--tokens`` long and each contender produces the same number of tokens):

- own sampler: ``engines.local.LocalEngine`` (backend "fast"); generate: the same engine with backend "hf"
  (``model.generate(num_return_sequences=G)``, TRL's non-vLLM path);
- vLLM colocate: ``engines.vllm.VLLMEngine``, in-process, after one full weight sync;
- vLLM server: ``engines.vllm_client.VLLMServerEngine`` talking to a ``treadle vllm-serve`` subprocess on loopback
  (``toy:<model>`` or the real model's folder), the same weights pushed to it over HTTP.

The models: ``toy``: the toy Llama (``treadle.demos.toy``; "small" 4.2M parameters, head size 32; "base" 33.6M, head
size 64: vLLM's CPU attention has no kernel for toy "tiny"'s head size 16), B prompts of the addition task; ``real``:
SmolLM2-135M-Instruct float32, 8 chat prompts x G. The contenders run interleaved, ``--rounds`` times after an untimed
round; each vLLM's start-up (once per run) and one weight sync are timed apart. Without vLLM (the main .venv) the vLLM
rows print "not run: <reason>" and the others still run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import torch

from benchmarks import harness
from treadle.demos import toy
from treadle.engines.local import LocalEngine
from treadle.generation.sampling import SamplingParams

PARTS = ("toy", "real")
OWN, HF = "own sampler (LocalEngine, fast)", "transformers generate (LocalEngine, hf)"
COLOCATE, SERVER = "vLLM colocate (VLLMEngine)", "vLLM server (VLLMServerEngine, loopback)"


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ``treadle vllm-serve`` with the process's allocator set first as ``treadle train`` sets it (freed memory kept unless
# TREADLE_KEEP_FREED_MEMORY says no; the command itself leaves glibc's defaults): the server's process then runs under
# the same allocator as the in-process contender's, which ``harness.apply_allocator`` set
SERVE_UNDER_ALLOCATOR = (
    "import sys; from treadle.allocator import keep_freed_memory; keep_freed_memory(); "
    "from treadle.cli.command import main; sys.exit(main(sys.argv[1:]))"
)


def server_command(spec: str, port: int, options=(), prefix=(), *, keep_freed: bool = False) -> list[str]:
    """The command line of a ``treadle vllm-serve SPEC`` server on ``port`` (``keep_freed``: under
    ``SERVE_UNDER_ALLOCATOR``)."""
    launcher = ["-c", SERVE_UNDER_ALLOCATOR] if keep_freed else ["-m", "treadle"]
    serve = ["vllm-serve", spec, "--port", str(port), "--max-model-len", "256", *options]
    return [*prefix, sys.executable, *launcher, *serve]


def start_server(
    model,
    spec: str,
    options=(),
    timeout: float = 900.0,
    prefix=(),
    env: dict | None = None,
    keep_freed: bool = False,
):
    """(engine, start-up seconds, one weight sync's seconds, process) of a ``treadle vllm-serve SPEC`` subprocess
    (``toy:<size>`` or a model folder; ``options``: more of its flags, e.g. ``--dtype``; ``prefix``: a command it
    runs under, e.g. ``taskset -c 0``; ``env``: its environment, this process's by default; ``keep_freed``: its
    allocator set as ``treadle train`` sets it, ``server_command``), or (None, reason, None, None) without vLLM.
    ``timeout``: seconds the engine waits for the server's first answer."""
    try:
        from treadle.engines.vllm import require_vllm  # vLLM is optional: .venv-vllm only

        require_vllm()
        from treadle.engines.vllm_client import VLLMServerEngine
    except ImportError as error:
        return None, str(error), None, None
    port = free_port()
    env = dict(os.environ if env is None else env)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    command = server_command(spec, port, options, prefix, keep_freed=keep_freed)
    start = time.perf_counter()
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


def stop(process) -> None:
    if process is not None:
        process.terminate()
        process.wait(timeout=60)


def engines_for(run: harness.Run, model, spec: str, opts) -> tuple[dict, list, object]:
    """({name: engine}, a line per vLLM row (start-up and sync, or why it did not run), the server's process)."""
    engines = {OWN: LocalEngine(model, backend="fast"), HF: LocalEngine(model, backend="hf")}
    lines, process = [], None
    vllm, started, synced = start_vllm(model)
    if vllm is None:
        lines.append(f"{COLOCATE}: not run: {started}")
    else:
        engines[COLOCATE] = vllm
        lines.append(f"{COLOCATE}: start-up {started:.1f} s, one full weight sync {1000 * synced:.0f} ms")
    if not opts.no_server:
        env = harness.allocator_env(opts.allocator, treadle_contender=True)
        env["OMP_NUM_THREADS"] = str(opts.threads)  # the server's torch threads
        # the server's allocator as this process's (harness.apply_allocator): `treadle vllm-serve` alone leaves
        # glibc's defaults, so the two vLLM rows once ran under different allocators while the record said one
        server, started, synced, process = start_server(model, spec, env=env, keep_freed=True)
        if server is None:
            lines.append(f"{SERVER}: not run: {started}")
        else:
            engines[SERVER] = server
            lines.append(
                f"{SERVER}: start-up {started:.1f} s, one full weight sync over loopback {1000 * synced:.0f} ms"
            )
    for name in engines:
        run.contender(name, threads=opts.threads, allocator=run.record["options"]["allocator"])
    return engines, lines, process


def measure(engines: dict, prompts, params, rounds: int, threads: int) -> dict[str, list[float]]:
    """Seconds of each engine's ``generate`` per round (an untimed round first), interleaved."""
    times = {name: [] for name in engines}
    for round_, name in harness.interleaved(list(engines), rounds + 1):
        torch.set_num_threads(threads)  # vLLM's worker may set the process's threads: the same for all
        start = time.perf_counter()
        out = engines[name].generate(prompts, params, generator=torch.Generator().manual_seed(round_))
        elapsed = time.perf_counter() - start
        assert int(out.completion_mask.sum()) == len(prompts) * params.num_generations * params.max_new_tokens
        if round_:
            times[name].append(elapsed)
    return times


def report(run: harness.Run, part: str, times: dict, prompts, params) -> None:
    rollouts = len(prompts) * params.num_generations
    base, rows = harness.spread(times[OWN])["median"], []
    for name, spent in times.items():
        s = harness.spread(spent)
        run.row(part=part, contender=name, seconds=s, rollouts_per_s=rollouts / s["median"])
        rows.append(
            [name, f"{rollouts / s['median']:.1f}", f"{rollouts / s['max']:.1f} - {rollouts / s['min']:.1f}"]
            + [f"{rollouts * params.max_new_tokens / s['median']:.0f}", f"{base / s['median']:.2f}x"]
        )
    shape = f"{len(prompts)} prompts x {params.num_generations} x {params.max_new_tokens} tokens"
    print(f"\n### {part}: {shape}, temperature 1, EOS ignored\n")
    header = ["engine", "rollouts/s (median)", "range", "tokens/s (median)", "vs own sampler"]
    print(harness.table(header, rows))


def model_and_prompts(part: str, opts):
    """(model, prompt ids, sampling settings, the server's spec) of a part."""
    if part == "toy":
        tok = toy.build_tokenizer()
        model = toy.build_model(opts.model, tokenizer=tok, seed=0).eval()
        prompts = [tok(row["prompt"])["input_ids"] for row in toy.load_task("addition", kind="rl", n=opts.prompts)]
        params = SamplingParams(
            num_generations=opts.generations,
            max_new_tokens=opts.tokens,
            eos_token_ids=(),
            pad_token_id=tok.pad_token_id,
        )
        return model, prompts, params, f"toy:{opts.model}"
    from benchmarks.generation import load_real  # the real model's chat prompts, as the generation benchmark has them
    from treadle.demos import smollm2

    model, prompts, params = load_real(opts.tokens, opts.generations)
    return model, prompts, params, str(smollm2.folder())


def parse_args(argv=None):
    p = harness.parser(__doc__, "2 prompts x 2 x 8 tokens, 1 round, both parts")
    p.add_argument("--parts", default="toy", help=f"comma-separated, of {', '.join(PARTS)} (default toy)")
    p.add_argument("--model", default="small", choices=["small", "base"], help="toy: the toy model")
    p.add_argument("--prompts", type=int, default=16, help="toy: B distinct prompts (real: 8 chats)")
    p.add_argument("--generations", type=int, default=8, help="G completions per prompt")
    p.add_argument("--tokens", type=int, default=64, help="tokens per completion (EOS ignored)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--no-server", action="store_true", help="leave out the vLLM server row (a second start)")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.parts, opts.prompts, opts.generations, opts.tokens, opts.rounds = "toy,real", 2, 2, 8, 1
    return opts


def main(argv=None) -> None:
    opts = parse_args(argv)
    harness.apply_allocator(opts.allocator)
    torch.set_num_threads(opts.threads)
    run = harness.Run("engines", opts)
    for part in opts.parts.split(","):
        model, prompts, params, spec = model_and_prompts(part, opts)
        engines, lines, process = engines_for(run, model, spec, opts)
        try:
            times = measure(engines, prompts, params, opts.rounds, opts.threads)
        finally:
            for name in (COLOCATE, SERVER):
                if name in engines:
                    engines[name].close()
            stop(process)
        report(run, part, times, prompts, params)
        print("\n".join(lines))
    run.finish()


if __name__ == "__main__":
    main()
