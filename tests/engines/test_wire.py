"""engines/wire.py: the one byte format that crosses a process boundary (safetensors), exact to the bit, and the
rollout worker's messages built of it."""

import dataclasses

import pytest
import torch
from safetensors.torch import load as safetensors_load

from treadle.engines.wire import pack_output, pack_tensors, unpack_output, unpack_tensors
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import GenerationOutput
from treadle.trainers.onpolicy.worker import RolloutWorker, SampleRequest, WeightPush


def output(**fields) -> GenerationOutput:
    generator = torch.Generator().manual_seed(0)
    return GenerationOutput(
        prompt_ids=torch.randint(0, 50, (4, 3), generator=generator),
        prompt_mask=torch.ones(4, 3, dtype=torch.long),
        completion_ids=torch.randint(0, 50, (4, 5), generator=generator),
        completion_mask=torch.tensor([[1, 1, 1, 0, 0]] * 4),
        is_truncated=torch.tensor([False, True, False, True]),
        **fields,
    )


@pytest.mark.parametrize("logps", [None, torch.randn(4, 5, dtype=torch.float32)])
def test_a_batch_crosses_whole_bit_for_bit_with_its_dtypes(logps):
    sent = output(sampling_logps=logps)
    data = pack_output(sent)
    assert isinstance(data, bytes) and set(safetensors_load(data)) == {
        f.name for f in dataclasses.fields(sent) if getattr(sent, f.name) is not None
    }  # plain safetensors: readable by anyone, no pickle
    got = unpack_output(data)
    for f in dataclasses.fields(sent):
        a, b = getattr(sent, f.name), getattr(got, f.name)
        assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype), f.name


def test_tied_weights_travel_once_each_and_bfloat16_stays_bfloat16():
    shared = torch.randn(6, 4).to(torch.bfloat16)
    weights = {"embed.weight": shared, "lm_head.weight": shared, "bias": torch.zeros(3, dtype=torch.float64)}
    got = unpack_tensors(pack_tensors(weights))
    assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights)
    assert got["lm_head.weight"].dtype == torch.bfloat16 and got["bias"].dtype == torch.float64


def test_the_rollout_workers_messages_are_safetensors_bytes():
    """A weight push and a reply, as a thread worker exchanges them: bytes that safetensors reads (no torch.save)."""
    from treadle.demos import toy

    tok = toy.build_tokenizer()
    model = toy.build_model("tiny", seed=0, tokenizer=tok)
    worker = RolloutWorker(model, kind="thread", timeout=60)
    sent, put = [], worker.requests.put
    worker.requests.put = lambda message: sent.append(message) or put(message)
    try:
        worker.load_weights(1, {name: p.detach() for name, p in model.named_parameters()})
        push = sent[-1]
        assert isinstance(push, WeightPush) and set(safetensors_load(push.weights)) == {
            n for n, _ in model.named_parameters()
        }
        params = SamplingParams(num_generations=2, max_new_tokens=3, eos_token_ids=(tok.eos_token_id,), pad_token_id=0)
        worker.sample(SampleRequest(0, [tok.encode("12+3=")], params, seed=5))
        generation, version, out = worker.wait("a batch")
        assert (generation, version) == (0, 1) and out.completion_ids.shape == (2, 3)
    finally:
        worker.close()


# ---- the vLLM server's identity (the fourth hostile trial, issue 59) -------------------------------------------
@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("max_model_len", "4096", 'its max_model_len is "4096", not a positive whole number'),
        ("max_model_len", True, "its max_model_len is true"),
        ("weights", [["lm_head.weight", [8, 4]]], "its weights are a list, not a mapping"),
        ("weights", {"lm_head.weight": "8x4"}, 'the shape of its weight lm_head.weight is "8x4"'),
        ("config", "llama", 'its config is "llama", not a dict'),
    ],
)
def test_an_identity_that_does_not_read_is_named(field, value, needle):
    from treadle.engines.wire import identity_problem

    identity = {"model": "toy:tiny", "dtype": "float32", "config": {}, "max_model_len": 4096, "weights": {"w": [2, 3]}}
    assert identity_problem(identity) is None and identity_problem({**identity, "max_model_len": None}) is None
    assert needle in identity_problem({**identity, field: value})
