"""``import treadle``: large CPU tensors on transparent huge pages unless the user says otherwise."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

PROBE = """
import os, resource, sys
import treadle
import torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    x = torch.ones(16_000_000)  # 64 MB, freed and allocated again as a training step's activations are
    del x
print(os.environ["THP_MEM_ALLOC_ENABLE"], resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(setting: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    value, count = out.stdout.split()
    return value, int(count)


def test_import_turns_huge_pages_on_and_keeps_the_user_s_setting():
    (on, on_faults), (off, off_faults) = faults(None), faults("0")
    assert (on, off) == ("1", "0")
    mode = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if mode.exists() and "[never]" not in mode.read_text():  # the kernel grants huge pages to torch's madvise
        assert on_faults * 10 < off_faults, (on_faults, off_faults)  # 4 x 64 MB: ~65,000 faults on 4 KiB pages
