"""Rollout engines: the own sampler behind the engine contract returns the log-probs of the distribution it drew
from (against a plain-PyTorch recomputation: one full forward, temperature, top-k and top-p written out here),
and GRPO samples through whatever engine ``build_engine`` returns."""

from __future__ import annotations

import pytest
import torch

from treadle.demos import toy
from treadle.engines import LocalEngine, RolloutEngine
from treadle.generation import GenerationOutput, SamplingParams, completion_masks, left_pad
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

EOS = 2  # the toy tokenizer's eos id
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23, 24]]  # different lengths: left padding


def plain_sampling_logps(model, out: GenerationOutput, temperature: float, top_k: int, top_p: float,
                         min_p: float = 0.0):
    """(N, C) log-probs of the sampled tokens under the processed distribution, from one forward of prompt +
    completion: logits / temperature, then the k best kept, then the smallest set of mass >= top_p kept, then the
    tokens of at least min_p x the top token's probability kept."""
    ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], dim=1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.double()
    width_p = out.prompt_ids.shape[1]
    scores = logits[:, width_p - 1:-1] / temperature  # (N, C, V): the scores each completion token was drawn from
    kth = scores.topk(top_k, dim=-1).values[..., -1:]
    scores = scores.masked_fill(scores < kth, float("-inf"))
    probs, order = scores.softmax(-1).sort(dim=-1, descending=True)
    before = probs.cumsum(-1) - probs  # mass of the more likely tokens
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before >= top_p)
    scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(-1)
    scores = scores.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    picked = scores.log_softmax(-1).gather(-1, out.completion_ids[..., None]).squeeze(-1)
    return torch.where(out.completion_mask.bool(), picked, 0.0).float()  # padding may be filtered out: -inf


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_local_engine_returns_the_log_probs_of_the_distribution_it_sampled_from(tok, backend):
    model = toy.build_model("tiny", tokenizer=tok, seed=0).eval()
    engine = LocalEngine(model, backend=backend)
    assert isinstance(engine, RolloutEngine)
    params = SamplingParams(num_generations=4, max_new_tokens=12, eos_token_ids=(EOS,), pad_token_id=0,
                            temperature=0.7, top_k=20, top_p=0.9)
    out = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(0))
    want = plain_sampling_logps(model, out, temperature=0.7, top_k=20, top_p=0.9)
    assert out.sampling_logps.shape == out.completion_mask.shape
    torch.testing.assert_close(out.sampling_logps, want, atol=1e-4, rtol=1e-4)
    sampled = out.completion_mask.bool()
    assert (out.sampling_logps[sampled] < 0).any() and (out.sampling_logps[~sampled] == 0).all()
    # the raw model's log-probs differ: the engine reports the processed distribution, not the model's
    raw = plain_sampling_logps(model, out, temperature=1.0, top_k=model.config.vocab_size, top_p=1.0)
    assert not torch.allclose(out.sampling_logps, raw, atol=1e-3)
    engine.load_weights(model)  # the live model: a no-op that keeps sampling from it
    again = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.completion_ids, out.completion_ids)
    engine.close()


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_min_p_sampling_log_probs_are_those_of_the_min_p_distribution(tok, backend):
    """min_p after temperature and top-p (transformers' order): the engine's sampling log-probs equal the plain
    recomputation's, and differ from the same settings without min_p (it removed mass the sampler never drew)."""
    model = toy.build_model("tiny", tokenizer=tok, seed=0).eval()
    params = SamplingParams(num_generations=4, max_new_tokens=12, eos_token_ids=(EOS,), pad_token_id=0,
                            temperature=0.7, top_p=0.95, min_p=0.3)
    out = LocalEngine(model, backend=backend).generate(PROMPTS, params, generator=torch.Generator().manual_seed(0))
    want = plain_sampling_logps(model, out, temperature=0.7, top_k=model.config.vocab_size, top_p=0.95, min_p=0.3)
    torch.testing.assert_close(out.sampling_logps, want, atol=1e-4, rtol=1e-4)
    sampled = out.completion_mask.bool()
    assert torch.isfinite(want[sampled]).all()  # no token below min_p x the top one was drawn
    without = plain_sampling_logps(model, out, temperature=0.7, top_k=model.config.vocab_size, top_p=0.95)
    assert (out.sampling_logps[sampled] > without[sampled] + 1e-3).all()


class FixedEngine:
    """An engine that samples nothing: every completion is [10, EOS]; it records what GRPO asked of it."""

    def __init__(self):
        self.calls, self.loaded, self.closed = [], 0, False

    def generate(self, prompt_ids, params, *, generator=None):
        self.calls.append((len(prompt_ids), params))
        rows = [p for p in prompt_ids for _ in range(params.num_generations)]
        ids, mask = left_pad(rows, params.pad_token_id)
        raw = torch.tensor([[10, EOS]] * len(rows))
        completion_ids, completion_mask, truncated = completion_masks(raw, params.eos_token_ids, params.pad_token_id)
        return GenerationOutput(ids, mask, completion_ids, completion_mask, truncated,
                                sampling_logps=torch.full(completion_ids.shape, -0.5))

    def load_weights(self, model):
        self.loaded += 1

    def close(self):
        self.closed = True


def test_grpo_trains_and_evaluates_through_the_engine_build_engine_returns(tmp_path, tok):
    class WithFixedEngine(GRPOTrainer):
        def build_engine(self):
            return FixedEngine()

    rows = toy.load_task("addition", kind="rl", n=8)
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=2, disable_tqdm=True, save_strategy="no", report_to="none",
                      eval_temperature=0.5, num_generations_eval=2)
    always_right = lambda completions, **kw: [1.0] * len(completions)  # noqa: E731
    trainer = WithFixedEngine(toy.build_model("tiny", tokenizer=tok), always_right, args=args, train_dataset=rows,
                              eval_dataset=rows.select(range(2)), processing_class=tok)
    engine = trainer.engine
    try:
        trainer.train()
        assert len(engine.calls) == 2 and engine.loaded == 2  # one generation per step, the policy handed over
        assert [(n, p.num_generations, p.temperature) for n, p in engine.calls] == [(1, 4, 1.0)] * 2
        metrics = trainer.evaluate()
        assert engine.calls[-1][0] == 2 and engine.calls[-1][1].num_generations == 2
        assert engine.calls[-1][1].temperature == 0.5 and metrics["eval_reward"] == 1.0
    finally:
        trainer.close()
    assert engine.closed
