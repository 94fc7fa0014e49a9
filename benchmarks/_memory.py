"""Peak tensor memory of a call, on CUDA or on the CPU, for the memory benchmarks.

CUDA: ``torch.cuda.max_memory_allocated`` above what was allocated before the call. CPU: torch's profiler
records every allocation and free (events named ``[memory]``, a signed size); the running sum's maximum is the
peak above the start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

MiB = 2**20


def peak_memory(fn: Callable[[], Any], device: str = "cpu") -> tuple[Any, float]:
    """``(fn(), peak MiB of tensor memory allocated while it ran, above what was allocated before)``."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        return result, (torch.cuda.max_memory_allocated() - before) / MiB
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()) == "DeviceType.CPU"
    ]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return result, peak / MiB
