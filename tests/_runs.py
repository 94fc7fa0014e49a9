"""Run folders as the tests make them: the metrics of an SFT-like run as the report and plot tests write them (five
training events, two evaluations and an end summary, with values the readers must skip: a string, a bool, a list),
and a run folder's lock held by another process."""

import contextlib
import json
import os
import subprocess
import sys

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# An SFT-like run: five training events, two evaluations (steps 2 and 4), a final summary event,
# and values the report must skip (a string, a bool, a list).
LOSS = [2.5, 1.75, 1.0, 0.625, 0.5]
LR = [1e-3, 8e-4, 6e-4, 4e-4, 2e-4]
GRAD_NORM = [3.0, 2.0, 4.0, 1.5, 1.0]
EVAL_LOSS = [1.5, 0.75]


def sft_events():
    events = []
    for i in range(5):
        step = i + 1
        events.append(
            {
                "step": step,
                "epoch": step / 5,
                "loss": LOSS[i],
                "learning_rate": LR[i],
                "grad_norm": GRAD_NORM[i],
                "note": "warmup",
                "is_best": True,
                "hist": [1, 2],
            }
        )
        if step in (2, 4):
            events.append({"step": step, "epoch": step / 5, "eval_loss": EVAL_LOSS[step // 2 - 1]})
    events.append(
        {"step": 5, "epoch": 1.0, "train_loss": 1.275, "train_runtime": 3.5, "train_samples_per_second": 91.4}
    )
    return events


def write_run(run_dir, events, *, extra_lines=()):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(e) for e in events] + list(extra_lines)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return run_dir


def assert_png(path):
    from matplotlib.image import imread

    assert path.is_file()
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width = imread(path).shape[:2]
    assert width > 300 and height > 200


HOLDER = """
import sys, time
from treadle.record import runs
lock = runs.acquire_lock(sys.argv[1])  # kept: a lock that is garbage-collected is let go of
print("held", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def lock_held_by_another_process(folder, env=None):
    """``folder``'s run lock, held by a child process for the block (its pid yielded); killed afterwards with SIGKILL,
    as a crashed run ends: the OS lets go of the lock and its file stays behind, naming the dead holder."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True, env=env or os.environ.copy()
    )
    try:
        assert child.stdout.readline().strip() == "held"
        yield child.pid
    finally:
        child.kill()
        child.wait()
