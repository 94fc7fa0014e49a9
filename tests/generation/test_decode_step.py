"""Tests for the decode step's cheaper parts: the multinomial draw against ``torch.multinomial`` bit for bit, the
sliced LM head against the model's own head, in-place logits processing, and the whole fast path against the path
it replaced (the model's own forward, ``torch.multinomial``, out-of-place processing) for the same seed.

Every kernel set must pass: ``ATEN_CPU_CAPABILITY=default``, ``avx2`` and ``avx512`` pick different log1p, softmax
and matmul kernels."""

from __future__ import annotations

import pytest
import torch
from test_generation import PAD, PROMPTS, tiny_llama  # this folder is on sys.path (no __init__.py)

from treadle.generation import SamplingParams, generate_completions, process_logits, sampling as sampling_module
from treadle.generation.head import plain_head, sliced_head
from treadle.generation.sampling import multinomial_draw, reused, sample_next_tokens, sampled_logps

transformers = pytest.importorskip("transformers")


def peaked_probs(rows: int, vocab: int, seed: int, scale: float) -> torch.Tensor:
    """Softmax of random logits; ``scale`` sets how peaked (large: near-one-hot rows, small: near-uniform)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=generator) * scale).softmax(dim=-1)


@pytest.mark.parametrize("vocab", [1, 2, 17, 1000, 49152])
@pytest.mark.parametrize("scale", [0.0, 1.0, 8.0])
def test_multinomial_draw_is_torch_multinomial_bit_for_bit(vocab, scale):
    rows = 64 if vocab < 49152 else 16
    buffers = {}
    for seed in range(6):  # several generator states, and buffers reused across calls
        probs = peaked_probs(rows, vocab, seed, scale)
        ours, theirs = torch.Generator().manual_seed(1000 + seed), torch.Generator().manual_seed(1000 + seed)
        for _ in range(3):  # successive draws from the advanced state
            expected = torch.multinomial(probs, 1, generator=theirs).squeeze(1)
            assert torch.equal(multinomial_draw(probs, ours, buffers), expected)
            assert torch.equal(ours.get_state(), theirs.get_state())


def test_multinomial_draw_with_zero_probabilities_and_ties():
    probs = torch.zeros(64, 300)
    probs[:, ::7] = 1.0  # equal probabilities; most tokens impossible
    probs[::2, 5] = 3.0
    probs = probs / probs.sum(dim=-1, keepdim=True)
    for seed in range(20):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        assert torch.equal(multinomial_draw(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(1))


def test_near_ties_are_settled_with_torch_s_own_noise(monkeypatch):
    """With the tolerance widened to 1, every token of a row is a candidate and the exact path picks each winner."""
    monkeypatch.setattr(sampling_module, "NEAR_TIE", 1.0)
    probs = peaked_probs(8, 50, 0, 1.0)
    ours, theirs = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(multinomial_draw(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(1))


def test_multinomial_draw_refuses_nan():
    probs = torch.full((2, 5), 0.2)
    probs[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match="nan"):
        multinomial_draw(probs, torch.Generator().manual_seed(0))


def test_sampling_with_buffers_matches_sampling_without():
    scores = torch.randn(32, 500, generator=torch.Generator().manual_seed(0)) * 3
    scores[:, :10] = float("-inf")  # filtered tokens (top-k / top-p)
    buffers = {}
    ours, theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(3):
        tokens = sample_next_tokens(scores, True, ours, buffers)
        assert torch.equal(tokens, sample_next_tokens(scores, True, theirs))
        assert torch.equal(sampled_logps(scores, tokens, buffers), sampled_logps(scores, tokens))
    assert {"probs", "uniform", "shifted"} <= buffers.keys()


def test_reused_keeps_a_buffer_until_the_shape_changes():
    buffers = {}
    first = reused(buffers, "x", (4, 8), torch.float32, torch.device("cpu"))
    assert reused(buffers, "x", (4, 8), torch.float32, torch.device("cpu")) is first
    assert reused(buffers, "x", (3, 8), torch.float32, torch.device("cpu")).shape == (3, 8)
    assert reused(None, "x", (3, 8), torch.float32, torch.device("cpu")) is not buffers["x"]


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 5},
        {"top_p": 0.8, "min_p": 0.05},
        {"repetition_penalty": 1.4, "suppress_token_ids": (3, 4)},
        {"repetition_penalty": 1.4, "do_sample": False},
    ],
)
def test_in_place_processing_gives_the_same_scores(settings):
    params = SamplingParams(num_generations=1, max_new_tokens=1, eos_token_ids=(), pad_token_id=0, **settings)
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 2
    seen = torch.rand(6, 40, generator=torch.Generator().manual_seed(2)) < 0.2
    expected = process_logits(logits, params, seen)
    edited = logits.clone()
    assert process_logits(edited, params, seen, inplace=True) is edited
    assert torch.equal(edited, expected)


@pytest.mark.parametrize("vocab, hidden", [(64, 32), (49152, 576), (3000, 48)])
def test_sliced_head_equals_the_plain_head(vocab, hidden):
    """Bit for bit on every kernel set tried (default, avx2, avx512): the K reduction is not split by the slicing."""
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    head.weight.data = torch.randn(vocab, hidden, generator=generator) * 0.05
    for rows in (64, 7, 1):
        states = torch.randn(rows, 1, hidden, generator=generator)
        out = torch.empty(rows, vocab)
        with torch.no_grad():  # as the decode loop runs: out= takes no autograd
            assert torch.equal(sliced_head(states[:, -1], head.weight, out), head(states)[:, -1])


def test_plain_head_only_for_models_whose_logits_are_the_head_product():
    model = tiny_llama()
    assert plain_head(model)
    model.lm_head = torch.nn.Linear(32, 64, bias=True)
    assert not plain_head(model)
    assert not plain_head(torch.nn.Linear(2, 2))


def old_path(monkeypatch, model):
    """The decode step as it was: the model's own forward, out-of-place processing, ``torch.multinomial`` and
    ``logsumexp`` (``sample_next_tokens`` and ``sampled_logps`` without buffers)."""
    import treadle.generation.single as single

    monkeypatch.setattr(single, "plain_head", lambda m: False)
    unbuffered_sample = single.sample_next_tokens
    unbuffered_logps = single.sampled_logps
    monkeypatch.setattr(single, "sample_next_tokens", lambda s, d, g, b=None: unbuffered_sample(s, d, g))
    monkeypatch.setattr(single, "sampled_logps", lambda s, t, b=None: unbuffered_logps(s, t))
    original = single.process_logits
    monkeypatch.setattr(single, "process_logits", lambda lg, p, seen, inplace=False: original(lg, p, seen))


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"temperature": 0.8, "top_k": 20},
        {"top_p": 0.9, "repetition_penalty": 1.3},
        {"eos_token_id": 2},  # rows finish and are dropped: buffers change shape
    ],
)
def test_same_seed_same_tokens_and_logps_as_the_old_path(monkeypatch, settings):
    model = tiny_llama()
    kwargs = {"eos_token_id": None, **settings}

    def run():
        return generate_completions(
            model,
            PROMPTS,
            num_generations=4,
            max_new_tokens=12,
            pad_token_id=PAD,
            generator=torch.Generator().manual_seed(11),
            backend="fast",
            **kwargs,
        )

    new = run()
    with monkeypatch.context() as patch:
        old_path(patch, model)
        old = run()
    assert torch.equal(new.completion_ids, old.completion_ids)
    assert torch.equal(new.completion_mask, old.completion_mask)
    assert torch.equal(new.sampling_logps, old.sampling_logps)
