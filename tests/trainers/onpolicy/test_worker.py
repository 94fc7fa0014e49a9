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
