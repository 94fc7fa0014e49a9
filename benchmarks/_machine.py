"""The machine a benchmark ran on, for the header of every benchmark's output.

The host CPU of this project's VM has changed between runs (AVX-512 with bfloat16 one day, AVX2 the next), and
bfloat16 autocast, matmul kernels and even float32 speed depend on it: a figure without the CPU it was measured
on cannot be compared with another. ``machine_header()`` is one line: CPU model, cores this process may use,
the vector-instruction flags that decide which kernels run (from /proc/cpuinfo, or lscpu when that is missing),
the load average when the benchmark started (other processes only ever add time), torch and its threads.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path

# ``--kernels`` of the demo benchmarks: native leaves torch's pick for this CPU, the others are ATEN_CPU_CAPABILITY
# values (a set above what the CPU has falls back to the best it has)
KERNEL_SETS = ("native", "default", "avx2", "avx512")

# The flags that decide which matmul / bfloat16 kernels torch's CPU backend can use.
SIMD = re.compile(r"^(avx\w*|amx\w*|fma|f16c|sse4_2|neon|asimd\w*|sve\w*)$")


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """(CPU model name, the SIMD-relevant flags), from /proc/cpuinfo, else lscpu, else platform."""
    model, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model name") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.split()
    except OSError:
        pass
    if not model or not flags:
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
            info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
            model = model or info.get("Model name", "").strip()
            flags = flags or info.get("Flags", "").split()
        except (OSError, subprocess.SubprocessError):
            pass
    return model or platform.processor() or platform.machine(), [f for f in flags if SIMD.match(f)]


def machine_header() -> str:
    """One line describing this machine now; print it at the top of a benchmark's output."""
    import torch

    model, flags = cpu_model_and_flags()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = "/".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return (
        f"Machine: {model}, {cores} core(s) usable, flags [{' '.join(flags) or 'none found'}], load average "
        f"{load} (1/5/15 min) at start, torch {torch.__version__} with {torch.get_num_threads()} thread(s)"
    )


def kernel_env(kernels: str, threads: int | None = None) -> dict[str, str]:
    """This process's environment with ``ATEN_CPU_CAPABILITY`` set for ``kernels`` (unset for native) and, when
    ``threads`` is given, ``OMP_NUM_THREADS``: torch reads both when it starts, so they go to a new process."""
    if kernels not in KERNEL_SETS:
        raise ValueError(f"--kernels {kernels!r}: choose from {', '.join(KERNEL_SETS)}")
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if kernels != "native":
        env["ATEN_CPU_CAPABILITY"] = kernels
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_recorded(argv: list[str], folder: Path, kernels: str, threads: int) -> dict:
    """Run ``argv`` (e.g. ``treadle demo ... --output-dir folder``) in a child process with ``kernel_env(kernels,
    threads)``, its output in ``folder``.out; return and keep in ``folder``/bench.json its seed-free record: kernels,
    threads, the 1-minute load average at its start, its wall seconds and exit code. A folder that already holds
    a record is not run again, so an interrupted table resumes with the same command."""
    record_file = folder / "bench.json"
    if record_file.is_file():
        return json.loads(record_file.read_text())
    env = kernel_env(kernels, threads)
    load = os.getloadavg()[0]
    start = time.time()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{folder}.out", "w") as log:
        rc = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    record = {"kernels": kernels, "threads": threads, "load": load, "seconds": round(time.time() - start), "rc": rc}
    folder.mkdir(parents=True, exist_ok=True)
    record_file.write_text(json.dumps(record) + "\n")
    return record
