"""The rollout worker's watch (trainers/onpolicy/worker.py): every forward pass of its copy counts and meets the stop
flag, the own sampler's decode steps included (they call the backbone, not the model)."""

import threading

import pytest

from treadle.demos import toy
from treadle.engines.local import LocalEngine
from treadle.generation.sampling import SamplingParams
from treadle.trainers.onpolicy.worker import _Counter, _Stopped, _watch


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_every_decode_step_counts_and_a_stop_ends_the_generation_at_the_next(backend):
    tok = toy.build_tokenizer()
    model = toy.build_model("tiny", seed=0, tokenizer=tok).eval()
    progress, stop = _Counter(), threading.Event()
    _watch(model, progress, stop)
    engine = LocalEngine(model, backend=backend)
    params = SamplingParams(num_generations=2, max_new_tokens=6, eos_token_ids=(), pad_token_id=0)
    engine.generate([tok.encode("12+3=")], params)
    assert progress.value >= 6  # the prefill and every decode step (the hook saw only the prefill: 1)
    stop.set()
    with pytest.raises(_Stopped):
        engine.generate([tok.encode("12+3=")], params)


# ---- the thread worker at the interpreter's exit (issue 59, still open from the third trial) ------------------------
CLOSED_INSIDE_TORCH = """\
import sys, threading, time, torch
from treadle.demos import toy
from treadle.generation.sampling import SamplingParams
from treadle.trainers.onpolicy.worker import RolloutWorker, SampleRequest

tok = toy.build_tokenizer()
model = toy.build_model("tiny", tokenizer=tok)
big = torch.randn(1500, 1500)

def heavy(module, args):  # every forward pass spends a while inside torch's C++ (the GIL released), as under load
    for _ in range(4):
        big @ big

model.get_input_embeddings().register_forward_pre_hook(heavy)
worker = RolloutWorker(model, kind="thread", timeout=60)
params = SamplingParams(num_generations=2, max_new_tokens=50, eos_token_ids=(), pad_token_id=0)
worker.sample(SampleRequest(0, [tok("1+1=")["input_ids"]], params, 0))
time.sleep(0.3)
worker.close(timeout=0.01)  # as a timeout's close: the thread is still inside a forward pass
alive = [t for t in threading.enumerate() if t.name == "treadle-rollout-worker" and t.is_alive()]
print("still running after close:", bool(alive), flush=True)
sys.exit(2)  # the run's own exit status, as the CLI's after a RolloutWorkerError
"""


@pytest.mark.slow
def test_a_thread_worker_inside_torch_at_exit_ends_before_the_interpreter_not_an_abort(tmp_path):
    """6ffdd54 (and the third trial's fix): "terminate called without an active exception", exit -6, every time this
    runs: the interpreter finalised while the closed thread was still inside torch, and the thread, made to exit as
    it took the GIL back, unwound through C++. Now the exit waits for it (it ends at its next forward pass). A CPU
    hog beside it, as in the suite where it aborted."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[3] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        done = subprocess.run(
            [sys.executable, "-c", CLOSED_INSIDE_TORCH], capture_output=True, text=True, env=env, timeout=300
        )
    finally:
        hog.kill()
        hog.wait()
    assert "still running after close: True" in done.stdout  # the case: close() returned with the thread in torch
    assert done.returncode == 2, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
