"""vLLM in-process against vLLM served on the same work, with where each process's CPU time goes: why the in-process
engine can trail the server (issue 57; docs/vllm.md, speed).

    .venv-vllm/bin/python -m benchmarks.lab.vllm_gap --rounds 3                  # the benchmark's settings
    .venv-vllm/bin/python -m benchmarks.lab.vllm_gap --defaults --rounds 3       # the public API's defaults
    python -m benchmarks.lab.vllm_gap --quick       # without vLLM: says why it did not run

One in-process ``VLLMEngine`` and one ``treadle vllm-serve`` subprocess on SmolLM2-135M-Instruct (float32, 8 chat
prompts x 8 x 32 tokens, EOS ignored), taking turns ``--rounds`` times after a warm-up round. Per round: tokens/s, and
for both processes the CPU seconds they used over the round, per thread (``/proc/PID/task``; threads that ended
during it, as the server's handler thread of each request, counted together), so a thread that spins or a pool of
the wrong size shows as CPU time, and tokens per CPU-second compare the engines apart from the load. Before the
rounds, what the in-process worker runs with (torch threads, the thread that calls it). ``--defaults``: the engines as
a user who sets nothing starts them (``VLLMEngine(model)`` and ``treadle vllm-serve FOLDER``: no
``VLLM_CPU_KVCACHE_SPACE``, the model's context window); otherwise ``benchmarks.engines``' settings (1 GiB of KV
cache, 256 tokens of context; ``--kv-mib``: both engines' KV cache in MiB, for a machine short of memory)."""

from __future__ import annotations

import functools
import gc
import os
import statistics
import threading
import time

import torch

from benchmarks import harness
from benchmarks.engines import free_port, stop
from benchmarks.generation import load_real

CLOCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_times(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of process ``pid``, keyed "name/tid", and under "all" the
    process's own total, which keeps the time of threads that have exited (the server's handler thread of each
    request, and its OpenMP pool, end with the request)."""
    times = {"all": _cpu_seconds(f"/proc/{pid}/stat")}
    folder = f"/proc/{pid}/task"
    for tid in os.listdir(folder):
        try:
            with open(f"{folder}/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        times[f"{text[text.index('(') + 1 : text.rindex(')')]}/{tid}"] = _cpu_seconds(text=text)
    return times


def _cpu_seconds(path: str | None = None, text: str | None = None) -> float:
    if text is None:
        with open(path) as f:
            text = f.read()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK


def busy_threads(before: dict, after: dict, wall: float) -> tuple[float, str]:
    """(the process's CPU seconds over wall seconds, its live threads above 3% of the wall: "name xx%", and the
    threads that ended during the round)."""
    spent = {k: after[k] - before.get(k, 0.0) for k in after if k != "all"}
    total = after["all"] - before["all"]
    top = sorted(((v, k) for k, v in spent.items() if v > 0.03 * wall), reverse=True)
    cells = [f"{k.split('/')[0]} {100 * v / wall:.0f}%" for v, k in top]
    ended = total - sum(spent.values())
    if ended > 0.03 * wall:
        cells.append(f"ended threads {100 * ended / wall:.0f}%")
    return total / wall, ", ".join(cells)


def worker_probe(worker) -> dict:
    """What vLLM's worker runs with, on the thread that calls it (through ``collective_rpc``)."""
    return {
        "thread": threading.current_thread().name,
        "torch threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
    }


def fresh(engine):
    """The in-process engine called as the server's handler calls it: vLLM from a new thread per call."""

    def generate(prompts, params, generator):
        result = []
        runner, engine.runner = engine.runner, None
        thread = threading.Thread(target=lambda: result.append(engine.generate(prompts, params, generator=generator)))
        try:
            thread.start()
            thread.join()
        finally:
            engine.runner = runner
        return result[0]

    return generate


# the server's process with vLLM's KV cache set in bytes (``--kv-mib``; VLLM_CPU_KVCACHE_SPACE counts whole GiB)
SERVE_WITH_KV = (
    "import functools, sys, vllm; vllm.LLM = functools.partial(vllm.LLM, kv_cache_memory_bytes=int(sys.argv[1])); "
    "from treadle.cli.command import main; sys.exit(main(sys.argv[2:]))"
)


def start(model, opts):
    """(in-process engine, server engine, server process): the server is launched first and starts while the
    in-process engine does (two start-ups of minutes each on a loaded machine)."""
    import subprocess
    import sys

    import vllm

    from treadle.demos import smollm2
    from treadle.engines.vllm import VLLMEngine
    from treadle.engines.vllm_client import VLLMServerEngine

    kv = opts.kv_mib * 2**20 if opts.kv_mib else None
    if kv:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        vllm.LLM = functools.partial(vllm.LLM, kv_cache_memory_bytes=kv)
    elif not opts.defaults:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(opts.threads))
    serve = ["vllm-serve", str(smollm2.folder()), "--port", str(port)]
    serve += [] if opts.defaults else ["--max-model-len", "256"]
    command = [sys.executable, *(["-c", SERVE_WITH_KV, str(kv)] if kv else ["-m", "treadle"]), *serve]
    began = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        engine = VLLMEngine(model, max_model_length=None if opts.defaults else 256)
        engine.load_weights(model)
        print(f"in-process start {time.perf_counter() - began:.0f} s", flush=True)
        server = VLLMServerEngine(model, f"http://127.0.0.1:{port}", timeout=1800)
        server.load_weights(model)
    except BaseException:
        stop(process)
        raise
    print(f"server start {time.perf_counter() - began:.0f} s (launched before the in-process one)", flush=True)
    return engine, server, process


def main(argv=None) -> None:
    p = harness.parser(__doc__, "4 tokens, 1 round (without vLLM: says why it did not run)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--defaults", action="store_true", help="the engines as a user who sets nothing starts them")
    p.add_argument("--kv-mib", type=int, default=0, help="both engines' KV cache in MiB (default 1 GiB)")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.tokens, opts.rounds = 4, 1
    try:
        from treadle.engines.vllm import require_vllm

        require_vllm()
    except ImportError as error:
        print(f"not run: {error}")
        return
    harness.apply_allocator(opts.allocator)
    torch.set_num_threads(opts.threads)
    run = harness.Run("lab.vllm_gap", opts)
    model, prompts, params = load_real(opts.tokens, 8)
    engine, server, process = start(model, opts)
    del model  # the engines hold their own copies: the policy's is not needed again (memory on a shared machine)
    gc.collect()
    try:
        probe = engine.call(engine.llm.collective_rpc, worker_probe)[0]
        print(f"in-process worker: {probe}; caller's torch threads {torch.get_num_threads()}", flush=True)
        pids = {"in-process": os.getpid(), "served": process.pid}
        calls = {"in-process": engine.generate, "served": server.generate, "in-process, fresh thread": fresh(engine)}
        rates = {name: [] for name in calls}
        for round_, name in harness.interleaved(list(calls), opts.rounds + 1):
            before = {who: thread_times(pid) for who, pid in pids.items()}
            load, began = os.getloadavg()[0], time.perf_counter()
            out = calls[name](prompts, params, generator=torch.Generator().manual_seed(round_))
            wall = time.perf_counter() - began
            rate = int(out.completion_mask.sum()) / wall
            cpu = {who: busy_threads(before[who], thread_times(pid), wall) for who, pid in pids.items()}
            own = rate / max(cpu["served" if name == "served" else "in-process"][0], 1e-9)  # per CPU-second
            if round_:
                rates[name].append(rate)
            print(
                f"round {round_} {name}: {rate:.0f} tok/s, {own:.0f} per CPU-second, load {load:.2f}; "
                + "; ".join(f"{who} CPU {c:.2f} cores [{top}]" for who, (c, top) in cpu.items()),
                flush=True,
            )
            run.row(round=round_, contender=name, tokens_per_s=rate, per_cpu_second=own, load=load, cpu=cpu)
        medians = {name: statistics.median(r) for name, r in rates.items()}
        ratio = medians["in-process"] / medians["served"]
        print(f"median tok/s: {medians}; in-process / served {ratio:.3f}; load now {os.getloadavg()[0]:.2f}")
        run.figure(medians=medians, ratio=ratio, probe=probe)
    finally:
        engine.close()
        server.close()
        stop(process)
    run.finish()


if __name__ == "__main__":
    main()
