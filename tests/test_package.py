"""``import treadle``: glibc keeps the memory a program frees for its next allocations, unless the user says not to."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, resource, torch
import treadle  # after torch, as a script may: glibc's settings apply from here on
torch.ones(1)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(10):  # ten 'steps', each allocating 188 MB in four tensors and freeing them
    before = faults()
    step = [torch.ones(n) for n in (16_000_000, 9_000_000, 12_000_000, 10_000_000)]
    del step
    counts.append(faults() - before)
print(json.dumps(counts))
"""


def page_faults(keep: str | None) -> list[int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TREADLE_KEEP", "MALLOC_"))}
    if keep is not None:
        env["TREADLE_KEEP_FREED_MEMORY"] = keep
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_freed_memory_is_reused_without_page_faults_unless_turned_off():
    """glibc's default maps each large block afresh: 188 MB of 4 KiB pages, about 46,000 faults, at every step.
    Kept, the freed blocks serve the next steps (a few steps to coalesce, then none: in 30 runs of this probe the
    last fault came at the fourth step in most, at the seventh in four, as glibc's free blocks happened to lie)."""
    kept, default = page_faults(None), page_faults("0")
    assert min(default) > 40_000, default
    assert max(kept[-2:]) < 1_000, kept
