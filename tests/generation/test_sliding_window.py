"""Sliding-window attention (Gemma 3's: a window on most layers, full attention on the rest), on a tiny Gemma 3 built
in code with a window of 8 tokens, so that every prompt and completion here crosses it:

- the own sampler's fast path (the prompt prefilled once, sliding layers kept in transformers' own sliding cache
  layer, full ones preallocated) gives ``generate``'s greedy tokens on a left-padded batch, and its sampled tokens'
  log-probs are a plain forward's over each row alone;
- multi-turn sampling cannot keep a sliding layer's cache across turns (its ragged writes assume whole rows): the
  fast path refuses the model, and ``LocalEngine`` says so in a warning and re-prefills each turn, whose greedy
  tokens are ``generate``'s on each row's transcript;
- the log-prob forwards that skip work (padding-free, shared-prefix) give the padded forward's log-probs.

The real Gemma 3 270M (a 512-token window) is checked the same way in tests/real/test_real_gemma.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from _factories import grpo_trainer

from treadle.demos import toy
from treadle.engines.local import LocalEngine
from treadle.generation import SamplingParams, left_pad
from treadle.generation.turns import sample_turns
from treadle.logprobs.prefix import shared_prefix_logps
from treadle.logprobs.tokens import token_logps
from treadle.packing import position_ids

transformers = pytest.importorskip("transformers")

WINDOW, VOCAB, PAD = 8, 96, 0
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36]]


def tiny_gemma3(seed: int = 0, *, vocab: int = VOCAB, window: int = WINDOW, pad: int = PAD) -> torch.nn.Module:
    """Three layers: two sliding (window 8) and one full, as Gemma 3's pattern; tied embeddings scaled by
    sqrt(hidden); initializer_range=0.3 makes the next-token distributions peaked, so greedy has no near-ties."""
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=window,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=128,
        initializer_range=0.3,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=pad,
        attn_implementation="sdpa",
    )
    return transformers.Gemma3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_gemma3()


def test_the_tiny_model_s_window_changes_what_it_predicts(model):
    """The set-up has teeth: the same model with a window wider than every row predicts otherwise."""
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])
    wide = tiny_gemma3()
    wide.config.sliding_window = 64
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits[:, -1], wide(input_ids=ids).logits[:, -1], atol=1e-3)


@pytest.mark.parametrize("group", [1, 2])
def test_greedy_fast_sampler_is_generate_across_the_window(model, group):
    params = SamplingParams(
        num_generations=group, max_new_tokens=20, eos_token_ids=(), pad_token_id=PAD, do_sample=False
    )
    ours = LocalEngine(model, backend="fast").generate(PROMPTS, params)
    ids, mask = left_pad(PROMPTS, PAD)
    with torch.no_grad():
        theirs = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=PAD, eos_token_id=None
        )[:, ids.shape[1] :]
    assert torch.equal(ours.completion_ids, theirs.repeat_interleave(group, dim=0))
    assert ours.completion_ids.shape == (len(PROMPTS) * group, 20)  # 12 + 20 tokens: the window passed many times


def test_sampled_log_probs_are_a_plain_forward_over_each_row_alone(model):
    params = SamplingParams(num_generations=2, max_new_tokens=16, eos_token_ids=(1,), pad_token_id=PAD)
    out = LocalEngine(model, backend="fast").generate(PROMPTS, params, generator=torch.Generator().manual_seed(0))
    recomputed = torch.zeros_like(out.sampling_logps)
    with torch.no_grad():
        for row in range(out.completion_ids.shape[0]):
            prompt, n = PROMPTS[row // 2], int(out.completion_mask[row].sum())
            completion = out.completion_ids[row, :n]
            logits = model(input_ids=torch.cat([torch.tensor(prompt), completion])[None]).logits
            logps = logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            recomputed[row, :n] = logps.gather(1, completion[:, None]).squeeze(1)
    assert int(out.completion_mask.sum()) > 3 * WINDOW  # tokens past the window, sampled
    torch.testing.assert_close(out.sampling_logps, recomputed, rtol=0, atol=1e-5)


FED = [40, 41, 42, 43, 44]


def respond_once(row: int, turn_ids: list[int]):
    """Feeds five tokens after a row's first turn, ends the rollout after its second."""
    respond_once.calls[row] = respond_once.calls.get(row, 0) + 1
    return FED if respond_once.calls[row] == 1 else None


def test_multi_turn_refuses_to_keep_a_sliding_cache_and_says_it_re_prefills(model):
    ends = tuple(range(3, 40))  # most tokens end a turn: short turns, so the rollouts hold several
    params = SamplingParams(
        num_generations=1, max_new_tokens=24, eos_token_ids=ends, pad_token_id=PAD, do_sample=False
    )
    with pytest.raises(ValueError, match="needs plain full-attention layers"):
        sample_turns(model, PROMPTS, lambda row, ids: None, params)
    respond_once.calls = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = LocalEngine(model, backend="auto").generate_turns(PROMPTS, respond_once, params)
    assert any("re-prefills each turn" in str(w.message) for w in caught), [str(w.message) for w in caught]
    fed = 0
    for row, prompt in enumerate(PROMPTS):  # generate on each row's own transcript, turn by turn
        transcript, expected = list(prompt), []
        for turn in range(2):
            with torch.no_grad():
                new = model.generate(
                    input_ids=torch.tensor([transcript]),
                    do_sample=False,
                    max_new_tokens=24 - len(expected),
                    eos_token_id=list(ends),
                    pad_token_id=PAD,
                )[0, len(transcript) :].tolist()
            new = new[: next((i + 1 for i, t in enumerate(new) if t in ends), len(new))]
            expected, transcript = expected + new, transcript + new
            if not new or new[-1] not in ends or turn == 1 or len(expected) + 5 >= 24:
                break  # cut by the budget, or the rollout is over
            expected, transcript, fed = expected + FED, transcript + FED, fed + 1
        n = int(out.completion_mask[row].sum())
        assert out.completion_ids[row, :n].tolist() == expected
        assert len(prompt) + n > WINDOW
    assert fed >= 2  # rows that took a second turn after the fed tokens


def grpo_batch():
    """GRPO's layout: each prompt four times, left-padded in the first columns, completions right-padded after (short:
    sharing the prompts must save enough to be taken)."""
    prompts = [p + list(range(60, 72)) for p in PROMPTS for _ in range(4)]  # 15-24 tokens: past the window
    completions = [[50 + i] * (1 + i % 4) for i in range(len(prompts))]
    prompt_ids, prompt_mask = left_pad(prompts, PAD)
    width = max(map(len, completions))
    completion_ids = torch.tensor([c + [PAD] * (width - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    return (
        torch.cat([prompt_ids, completion_ids], 1),
        torch.cat([prompt_mask, completion_mask], 1),
        prompt_ids.shape[1],
    )


def test_padding_free_and_shared_prefix_forwards_are_the_padded_one(model):
    input_ids, attention_mask, width = grpo_batch()
    positions = position_ids(attention_mask)
    with torch.no_grad():
        padded = token_logps(model, input_ids, attention_mask, start=width - 1, position_ids=positions).logps
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback ("does not reproduce", "unshared") would warn
            packed = token_logps(
                model, input_ids, attention_mask, start=width - 1, position_ids=positions, padding_free=True
            ).logps
            shared = shared_prefix_logps(model, input_ids, attention_mask, prompt_width=width)
    assert shared is not None
    real = attention_mask[:, width:].bool()
    assert int(attention_mask.sum(1).min()) > WINDOW  # every row crosses the window
    torch.testing.assert_close(packed[real], padded[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared.logps[real], padded[real], rtol=0, atol=1e-5)


def test_greedy_evaluation_across_the_window_is_generate(tmp_path, tok):
    """GRPO's evaluation (the own sampler, greedy) on prompts of 6-7 tokens with 6 new ones, a window of 4: the
    completions of transformers' generate on the same left-padded prompts."""
    problems = toy.load_task("addition", "test", kind="rl", n=24, seed=0)
    model = tiny_gemma3(vocab=len(tok), window=4, pad=tok.pad_token_id)
    seen = {}

    def capture(prompts, completions, **_):
        seen.update(completions=completions)
        return {}

    trainer = grpo_trainer(
        tmp_path,
        tok,
        problems,
        reward=lambda completions, **_: [0.0] * len(completions),
        model=model,
        eval_dataset=problems,
        per_device_eval_batch_size=24,
        num_generations_eval=1,
        eval_temperature=0.0,
        max_completion_length=6,
        compute_metrics=capture,
    )
    trainer.evaluate()
    expected = toy.greedy_completions(trainer.model, tok, problems["prompt"], batch_size=24, max_new_tokens=6)
    assert seen["completions"] == expected and len(set(expected)) > 1
