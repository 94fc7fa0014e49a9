"""Rollout engines: the own sampler behind the engine contract returns the log-probs of the distribution it drew
from (against a plain-PyTorch recomputation: one full forward, temperature, top-k and top-p written out here), the
contract's reports (exact log-probs, the policy version, multi-turn or not) for every engine that runs here, the
asynchronous producer's batches tagged with their policy version, and GRPO samples through whatever engine
``build_engine`` returns."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from _factories import chatty_model

from treadle.demos import toy
from treadle.engines import LocalEngine, RolloutEngine, VLLMEngine, VLLMServerEngine
from treadle.engines.vllm import SINGLE_TURN_ONLY, engine_thread
from treadle.generation import (
    GenerationOutput,
    SamplingParams,
    completion_masks,
    left_pad,
    reprefill_turns,
    sample_turns,
)
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from treadle.trainers.onpolicy.data import Prompts
from treadle.trainers.onpolicy.inputs import generator_seed
from treadle.trainers.onpolicy.producer import RolloutProducer

EOS = 2  # the toy tokenizer's eos id
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23, 24]]  # different lengths: left padding


def plain_sampling_logps(
    model, out: GenerationOutput, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
):
    """(N, C) log-probs of the sampled tokens under the processed distribution, from one forward of prompt +
    completion: logits / temperature, then the k best kept, then the smallest set of mass >= top_p kept, then the
    tokens of at least min_p x the top token's probability kept."""
    ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], dim=1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.double()
    width_p = out.prompt_ids.shape[1]
    scores = logits[:, width_p - 1 : -1] / temperature  # (N, C, V): the scores each completion token was drawn from
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
    params = SamplingParams(
        num_generations=4,
        max_new_tokens=12,
        eos_token_ids=(EOS,),
        pad_token_id=0,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
    )
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
    params = SamplingParams(
        num_generations=4,
        max_new_tokens=12,
        eos_token_ids=(EOS,),
        pad_token_id=0,
        temperature=0.7,
        top_p=0.95,
        min_p=0.3,
    )
    out = LocalEngine(model, backend=backend).generate(PROMPTS, params, generator=torch.Generator().manual_seed(0))
    want = plain_sampling_logps(model, out, temperature=0.7, top_k=model.config.vocab_size, top_p=0.95, min_p=0.3)
    torch.testing.assert_close(out.sampling_logps, want, atol=1e-4, rtol=1e-4)
    sampled = out.completion_mask.bool()
    assert torch.isfinite(want[sampled]).all()  # no token below min_p x the top one was drawn
    without = plain_sampling_logps(model, out, temperature=0.7, top_k=model.config.vocab_size, top_p=0.95)
    assert (out.sampling_logps[sampled] > without[sampled] + 1e-3).all()


class FixedEngine(RolloutEngine):
    """An engine that samples nothing: every completion is [10, EOS]; it records what GRPO asked of it. It states
    nothing beyond the contract's defaults (log-probs not exact, single-turn only)."""

    def __init__(self):
        self.calls, self.loaded, self.versions, self.closed = [], 0, [], False

    def generate(self, prompt_ids, params, *, generator=None):
        self.calls.append((len(prompt_ids), params))
        rows = [p for p in prompt_ids for _ in range(params.num_generations)]
        ids, mask = left_pad(rows, params.pad_token_id)
        raw = torch.tensor([[10, EOS]] * len(rows))
        completion_ids, completion_mask, truncated = completion_masks(raw, params.eos_token_ids, params.pad_token_id)
        return GenerationOutput(
            ids,
            mask,
            completion_ids,
            completion_mask,
            truncated,
            sampling_logps=torch.full(completion_ids.shape, -0.5),
        )

    def load_weights(self, model, version=None):
        self.loaded, self.policy_version = self.loaded + 1, version
        self.versions.append(version)

    def close(self):
        self.closed = True


def test_grpo_trains_and_evaluates_through_the_engine_build_engine_returns(tmp_path, tok):
    class WithFixedEngine(GRPOTrainer):
        def build_engine(self):
            return FixedEngine()

    rows = toy.load_task("addition", kind="rl", n=8)
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        disable_tqdm=True,
        save_strategy="no",
        report_to="none",
        eval_temperature=0.5,
        num_generations_eval=2,
    )
    always_right = lambda completions, **kw: [1.0] * len(completions)  # noqa: E731
    trainer = WithFixedEngine(
        toy.build_model("tiny", tokenizer=tok),
        always_right,
        args=args,
        train_dataset=rows,
        eval_dataset=rows.select(range(2)),
        processing_class=tok,
    )
    engine = trainer.engine
    try:
        trainer.train()
        assert len(engine.calls) == 2 and engine.loaded == 2  # one generation per step, the policy handed over
        assert engine.versions == [0, 1]  # each push names the weights' version: the optimizer steps they took
        assert [(n, p.num_generations, p.temperature) for n, p in engine.calls] == [(1, 4, 1.0)] * 2
        assert trainer.corrects_sampling  # the contract's default: its log-probs are not exact
        metrics = trainer.evaluate()
        assert engine.policy_version == 2
        assert engine.calls[-1][0] == 2 and engine.calls[-1][1].num_generations == 2
        assert engine.calls[-1][1].temperature == 0.5 and metrics["eval_reward"] == 1.0
    finally:
        trainer.close()
    assert engine.closed


# ------------------------------------------------------------------------------------------ the contract's reports
def echo_twice():
    """A multi-turn ``respond``: after each of a row's first two turns, feed the turn's first token back twice; its
    third turn ends the rollout."""
    turns = {}

    def respond(row, turn_ids):
        turns[row] = turns.get(row, 0) + 1
        return None if turns[row] > 2 else [turn_ids[0], turn_ids[0]]

    return respond


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_the_own_sampler_reports_exact_log_probs_its_version_and_samples_multi_turn_rollouts(tok, backend):
    """LocalEngine: exact log-probs (the live policy, the trainer's kernels), the version its last push named, and
    multi-turn rollouts that are the multi-turn sampler's own, bit for bit (the KV cache kept across turns; "hf":
    every transcript re-prefilled each turn)."""
    model = chatty_model(tok, eos_bias=4.0).eval()  # its turns end after a few tokens
    params = SamplingParams(
        num_generations=2, max_new_tokens=24, eos_token_ids=(EOS,), pad_token_id=0, temperature=0.9
    )
    with LocalEngine(model, backend=backend) as engine:
        assert engine.exact_logps and engine.policy_version is None
        engine.load_weights(model, version=3)
        assert engine.policy_version == 3 and engine.model is model
        out = engine.generate_turns(PROMPTS, echo_twice(), params, generator=torch.Generator().manual_seed(1))
    sampler = sample_turns if backend == "fast" else reprefill_turns
    options = {} if backend == "fast" else {"backend": backend}
    want = sampler(model, PROMPTS, echo_twice(), params, generator=torch.Generator().manual_seed(1), **options)
    for name in ("prompt_ids", "completion_ids", "completion_mask", "sampled_mask", "is_truncated", "sampling_logps"):
        assert torch.equal(getattr(out, name), getattr(want, name)), name
    assert (out.completion_mask.bool() & ~out.sampled_mask.bool()).any()  # observations were fed


def test_the_contracts_defaults_and_the_vllm_engines_refusal_of_multi_turn_rollouts(tok):
    """An engine states only what differs from the contract's defaults: log-probs not exact, no version before its
    first push, no sync check, single-turn only. Both vLLM engines refuse multi-turn rollouts with one message."""
    engine = FixedEngine()
    assert (engine.exact_logps, engine.policy_version, engine.sync_unchanged) == (False, None, None)
    params = SamplingParams(num_generations=1, max_new_tokens=4, eos_token_ids=(EOS,), pad_token_id=0)
    with pytest.raises(ValueError, match="FixedEngine samples single-turn rollouts only"):
        engine.generate_turns(PROMPTS, echo_twice(), params)
    for cls in (VLLMEngine, VLLMServerEngine):  # no vLLM needed: the refusal comes before any of it
        with pytest.raises(ValueError) as info:
            object.__new__(cls).generate_turns(PROMPTS, echo_twice(), params)
        assert str(info.value) == SINGLE_TURN_ONLY and "\n" not in SINGLE_TURN_ONLY


def test_the_producer_tags_each_batch_with_the_policy_version_it_was_sampled_from(tok):
    """The asynchronous producer (a thread worker, its own copy of the policy and its own engine): each request
    carries the sampling settings and the seed it is sampled with, the weight push is its own message, and each
    batch comes back tagged with the version the worker's engine held, bit for bit what the own sampler samples
    from those weights with that seed."""
    model = toy.build_model("tiny", tokenizer=tok, seed=0).eval()
    params = SamplingParams(num_generations=2, max_new_tokens=8, eos_token_ids=(EOS,), pad_token_id=0)
    producer = RolloutProducer(model, params, staleness=1, seed=7, worker="thread")
    try:
        producer.start()
        producer.push_weights(model, version=0)
        producer.request(0, Prompts(PROMPTS[:2], group=2))
        moved = toy.build_model("tiny", tokenizer=tok, seed=1).eval()  # the next version's weights
        producer.push_weights(moved, version=1)
        producer.push_weights(moved, version=1)  # a version already pushed is not sent again
        producer.request(1, Prompts(PROMPTS[2:], group=2))
        first, second = producer.take(0), producer.take(1)
    finally:
        producer.close()
    assert (first.generation, first.version, second.generation, second.version) == (0, 0, 1, 1)
    assert first.staleness == 0 and producer.worker is None  # closed: the worker stopped
    for prompts, weights, produced in ((PROMPTS[:2], model, first), (PROMPTS[2:], moved, second)):
        seed = generator_seed(7, "train", produced.generation)
        want = LocalEngine(weights).generate(prompts, params, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(produced.output.completion_ids, want.completion_ids)
        assert torch.equal(produced.output.sampling_logps, want.sampling_logps)
    with pytest.raises(Exception, match="text prompts only"):
        RolloutProducer(model, params, staleness=1, seed=7, worker="thread").request(
            0, Prompts(PROMPTS, 1, inputs={"pixel_values": torch.zeros(1)})
        )


def test_the_producer_requests_ahead_on_its_fixed_schedule():
    """At the start of generation g the due generations are g .. g + N whose rows were read ahead and not yet
    requested, never past max_steps (but g itself always)."""
    producer = RolloutProducer(None, None, staleness=2, seed=0, worker="thread")
    windows = [[type("Ticket", (), {"generation": g, "rows": [g]})()] for g in range(5)]
    reader = producer.read_ahead(iter(windows))
    assert next(reader)[0].generation == 0 and sorted(producer.rows) == [0, 1, 2]  # read 2 ahead
    assert [h for h, _ in producer.due(0)] == [0, 1, 2]
    producer.versions.update({0: 0, 1: 0, 2: 0})  # requested
    next(reader)
    assert [h for h, _ in producer.due(1)] == [3] and producer.due(1, max_steps=3) == []  # never past max_steps
    assert [h for h, _ in producer.due(3, max_steps=3)] == [3]  # ... but the generation that starts always


def test_the_colocated_engine_calls_vllm_from_its_own_thread_unless_told_not_to(monkeypatch):
    """``VLLMEngine.call`` runs a call into vLLM on the engine's one thread (libgomp spins less once a second
    OpenMP pool exists: docs/vllm.md#speed), and in the caller's thread under ``TREADLE_VLLM_ENGINE_THREAD=0`` or
    without a runner (the server's ``ServedEngine``, whose requests run in threads already). No vLLM needed."""
    engine = object.__new__(VLLMEngine)
    engine.runner = engine_thread()
    here = threading.current_thread()
    try:
        ran_in = engine.call(threading.current_thread)
        assert ran_in is not here and ran_in.name.startswith("treadle-vllm")
        assert engine.call(threading.current_thread) is ran_in  # one thread, kept between calls
    finally:
        engine.runner.shutdown()
    monkeypatch.setenv("TREADLE_VLLM_ENGINE_THREAD", "0")
    engine.runner = engine_thread()
    assert engine.runner is None and engine.call(threading.current_thread) is here
    assert object.__new__(VLLMEngine).call(threading.current_thread) is here


@pytest.mark.slow
def test_the_engines_benchmark_serves_vllm_under_the_in_process_rows_allocator():
    """``benchmarks.engines`` records one allocator for every contender, and the in-process vLLM row runs in its
    own process under it; ``treadle vllm-serve`` alone leaves glibc's defaults, so the server row once ran under
    another. Its command sets the allocator first (freed memory kept, unless ``TREADLE_KEEP_FREED_MEMORY=0``): run
    here with the command's ``main`` replaced by one that reports the allocator's state. No vLLM needed."""
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, treadle.allocator as allocator, treadle.cli.command as command\n"
        "from benchmarks.engines import server_command\n"
        "line = server_command('toy:small', 8000, keep_freed=True)\n"
        "command.main = lambda argv: print(argv[:2], allocator._kept) or 0  # _kept: None until someone asks\n"
        "sys.argv = line[2:]\n"
        "exec(line[line.index('-c') + 1])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    env.pop("TREADLE_KEEP_FREED_MEMORY", None)
    for setting, kept in ((None, "True"), ("0", "False")):
        if setting is not None:
            env["TREADLE_KEEP_FREED_MEMORY"] = setting
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["['vllm-serve',", "'toy:small']", kept]
