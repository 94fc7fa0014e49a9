"""treadle.allocator: glibc keeps what a training process frees, when its owner asks (the ``treadle`` command,
``Trainer.train`` on CPU, an explicit call), and a user's own settings win.

The probe asks glibc itself (``mallinfo2``) where one 64 MiB block came from and where it went: glibc's defaults map a
block that large afresh (``hblkhd``) and unmap it when it is freed; kept memory takes it from the heap and keeps it
free there (``fordblks``) for the next allocation. One block, counted by the allocator: the answer does not depend on
how earlier blocks happen to lie. (``kept``: what the free made free in the heap, less the few small blocks Python
takes meanwhile.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MiB = 2**20
PROBE_INFO = """
FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]
"""
PROBE = """
import ctypes, json
{setup}
libc = ctypes.CDLL("libc.so.6")
{info}libc.mallinfo2.restype = Info
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
size = 64 << 20
before = libc.mallinfo2()
block = libc.malloc(size)
during = libc.mallinfo2()
ctypes.memset(block, 1, size)
libc.free(block)
after = libc.mallinfo2()
print(json.dumps({{"mapped": during.hblkhd - before.hblkhd, "kept": after.fordblks - during.fordblks}}))
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator (Linux)")


def probe(setup: str, **env: str) -> dict:
    """Where a 64 MiB block came from and went (bytes: ``mapped`` afresh, ``kept`` free in the heap after it was
    freed), in a new process that first runs ``setup``; ``env`` adds to a clean environment. Its stderr too."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TREADLE_KEEP", "MALLOC_", "GLIBC_TUNABLES"))}
    code = PROBE.format(setup=setup, info=PROBE_INFO)
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return {**json.loads(out.stdout.splitlines()[-1]), "stderr": out.stderr}


KEEP = "from treadle.allocator import keep_freed_memory\nprint('kept', keep_freed_memory(), keep_freed_memory())"


def test_kept_memory_takes_a_large_block_from_the_heap_and_keeps_it_free_there():
    kept, default = probe(KEEP), probe("")
    assert default["mapped"] >= 64 * MiB and default["kept"] < MiB  # mapped afresh, handed back
    assert kept["mapped"] == 0 and kept["kept"] > 63 * MiB  # from the heap, kept for the next step


@pytest.mark.parametrize("off", ["0", "false", "False", "no", "off"])
def test_treadle_keep_freed_memory_says_no_in_any_usual_spelling(off):
    block = probe(KEEP, TREADLE_KEEP_FREED_MEMORY=off)
    assert block["mapped"] >= 64 * MiB and block["kept"] < MiB


@pytest.mark.parametrize(
    "name, value",
    [
        ("MALLOC_TRIM_THRESHOLD_", "1000000"),
        ("MALLOC_MMAP_THRESHOLD_", "131072"),
        ("GLIBC_TUNABLES", "glibc.malloc.mmap_max=4"),
    ],
)
def test_a_users_own_malloc_settings_win_with_one_line(name, value):
    block = probe(KEEP, **{name: value})
    assert block["mapped"] >= 64 * MiB  # glibc as the user set it, not treadle's
    lines = [line for line in block["stderr"].splitlines() if line.startswith("treadle:")]
    assert len(lines) == 1 and name in lines[0] and "keeps your settings" in lines[0], block["stderr"]


TRAIN = """
from treadle import Trainer, TrainerCallback, TrainingArguments
from treadle.demos import toy

class During(TrainerCallback):  # the same probe inside the run, at its step's end
    def on_step_end(self, args, state, control, **kwargs):
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        libc.mallinfo2.restype = Info
        before = libc.mallinfo2()
        block = libc.malloc(64 << 20)
        mapped = libc.mallinfo2().hblkhd - before.hblkhd
        libc.free(block)
        open({during!r}, "w").write(json.dumps({{"mapped": mapped}}))

tok = toy.build_tokenizer()
rows = [{{"input_ids": ids, "labels": ids}} for ids in (tok.encode("12+34=46"),) * 8]
args = TrainingArguments(output_dir={out!r}, max_steps=1, per_device_train_batch_size=4, save_strategy="no",
                         disable_tqdm=True, keep_freed_memory={keep})
trainer = Trainer(toy.build_model("tiny", seed=0, tokenizer=tok), args, train_dataset=rows, processing_class=tok)
trainer.add_callback(During())
trainer.train()
"""


@pytest.mark.parametrize("keep", [True, False])
def test_train_keeps_freed_memory_on_cpu_for_its_run_only_unless_told_not_to(tmp_path, keep):
    """Inside the run a large block comes from the heap (kept) unless told not to; once train() returns, the
    program around it has glibc's defaults again: the block is mapped afresh and handed back."""
    during = tmp_path / "during.json"
    setup = (
        "import ctypes, json\n" + PROBE_INFO + TRAIN.format(out=str(tmp_path / "run"), keep=keep, during=str(during))
    )
    block = probe(setup)
    assert (json.loads(during.read_text())["mapped"] == 0) is keep
    assert block["mapped"] >= 64 * MiB and block["kept"] < MiB


def test_train_leaves_the_owners_kept_memory_kept(tmp_path):
    block = probe(
        KEEP + "\n" + PROBE_INFO + TRAIN.format(out=str(tmp_path / "run"), keep=True, during=str(tmp_path / "d"))
    )
    assert block["mapped"] == 0 and block["kept"] > 63 * MiB  # the process's owner asked: train() leaves it so


def test_the_treadle_command_keeps_freed_memory_for_train_as_its_config_says(tmp_path, monkeypatch):
    from treadle.cli import command

    calls = []
    monkeypatch.setattr(command, "keep_freed_memory", lambda: calls.append(1) or True)
    config = tmp_path / "run.yaml"
    config.write_text("trainer: nope\nmodel: toy:tiny\ndataset: toy:addition\n")
    assert command.main(["train", str(config)]) == 2 and calls == [1]  # applied before the config's first check
    config.write_text("trainer: nope\nmodel: toy:tiny\ndataset: toy:addition\nkeep_freed_memory: false\n")
    assert command.main(["train", str(config)]) == 2 and calls == [1]
    assert command.main(["report", str(tmp_path / "absent")]) == 2 and calls == [1]  # not a training process
