"""The static decode step (generation/static.py, ``cache_implementation="static"``) against the dynamic path it
replaces: the same tokens (greedy, and sampled with the same generator: the same rows draw the same random numbers),
log-probs within float32 rounding (attention sums over the whole padded capacity, in another order), on a tiny Llama
(SDPA and eager attention) and a tiny Gemma 3 whose sliding window every completion crosses.

Compiled steps are traced with dynamo's "eager" backend here (the same graphs, guards and recompilations without
generating code, seconds instead of a minute); one slow test compiles with inductor itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _factories import grpo_trainer
from test_generation import PAD, PROMPTS, tiny_llama  # this folder is on sys.path (no __init__.py)
from test_sliding_window import PROMPTS as GEMMA_PROMPTS, tiny_gemma3

from treadle.demos import toy
from treadle.engines.local import LocalEngine
from treadle.errors import PreflightError
from treadle.generation import SamplingParams, sample_completions, static
from treadle.generation.static import DecodeSettings, bucket, static_decoder, static_problem
from treadle.trainers.grpo.config import GRPOConfig

transformers = pytest.importorskip("transformers")

SETTINGS = [
    {"do_sample": False},
    {},
    {"temperature": 0.8, "top_k": 10},
    {"top_p": 0.9, "repetition_penalty": 1.3},
    {"eos_token_ids": (2,)},  # rows finish: they leave the sampling state, their cache rows stay
]


def sample(model, prompts, decode=None, *, seed=3, group=4, max_new_tokens=20, **settings):
    params = SamplingParams(
        num_generations=group,
        max_new_tokens=max_new_tokens,
        eos_token_ids=settings.pop("eos_token_ids", ()),
        pad_token_id=PAD,
        **settings,
    )
    generator = torch.Generator().manual_seed(seed)
    return sample_completions(model, prompts, params, generator=generator, backend="fast", decode=decode)


def assert_same_samples(static_out, dynamic_out):
    assert torch.equal(static_out.completion_ids, dynamic_out.completion_ids)
    assert torch.equal(static_out.completion_mask, dynamic_out.completion_mask)
    assert torch.equal(static_out.is_truncated, dynamic_out.is_truncated)
    torch.testing.assert_close(static_out.sampling_logps, dynamic_out.sampling_logps, rtol=0, atol=1e-5)


@pytest.fixture
def dynamo_only(monkeypatch):
    """decode_compile="inductor" traced by dynamo without code generation; the counters start at zero."""
    monkeypatch.setattr(static, "INDUCTOR_BACKEND", "eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters["stats"]
    torch._dynamo.reset()


def graphs(stats) -> int:
    return stats["unique_graphs"]


def test_buckets_are_powers_of_two():
    assert [bucket(n, 8) for n in (1, 8, 9, 12, 64, 65)] == [8, 8, 16, 16, 64, 128]
    assert bucket(19, 64) == 64


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize(
    "build, prompts",
    [(tiny_llama, PROMPTS), (lambda: tiny_llama(attention="eager"), PROMPTS), (tiny_gemma3, GEMMA_PROMPTS)],
    ids=["llama-sdpa", "llama-eager", "gemma3-sliding"],
)
def test_static_step_gives_the_dynamic_tokens(build, prompts, settings):
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn: this must run the static step itself
        static_out = sample(model, prompts, DecodeSettings("static"), **dict(settings))
    assert static_decoder(model, "auto", torch.device("cpu")).steps  # a bucket was built
    assert_same_samples(static_out, sample(model, prompts, **dict(settings)))


def test_gemma3_completions_cross_the_window():
    """The sliding test above means something only if prompt + completion outgrow the window (8)."""
    assert max(len(p) for p in GEMMA_PROMPTS) + 20 > 2 * tiny_gemma3().config.sliding_window


def test_compiled_step_same_tokens_and_one_graph_per_bucket(dynamo_only):
    model = tiny_llama()
    decode = DecodeSettings("static", "inductor")
    first = sample(model, PROMPTS, decode)
    assert_same_samples(first, sample(model, PROMPTS))
    decoder = static_decoder(model, "inductor", torch.device("cpu"))
    assert (decoder.captures, graphs(dynamo_only)) == (1, 1)
    again = sample(model, PROMPTS, decode, seed=4)  # another generation in the same bucket: no new graph
    assert_same_samples(again, sample(model, PROMPTS, seed=4))
    assert (decoder.captures, graphs(dynamo_only)) == (1, 1)


def test_the_engine_s_eager_stance_does_not_stop_the_compiled_step(dynamo_only):
    """LocalEngine samples under ``force_eager`` (training's compiled blocks would recompile per token); the static
    step is compiled all the same, and gives the same tokens."""
    model = tiny_llama()
    params = SamplingParams(num_generations=4, max_new_tokens=20, eos_token_ids=(), pad_token_id=PAD)
    engine = LocalEngine(model, backend="fast", decode=DecodeSettings("static", "inductor"))
    out = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(3))
    assert graphs(dynamo_only) == 1
    assert_same_samples(out, sample(model, PROMPTS))


def test_in_place_weight_updates_need_no_new_capture(dynamo_only):
    """An optimizer step changes the parameters in place: the compiled step reads them, without recompiling."""
    model = tiny_llama()
    decode = DecodeSettings("static", "inductor")
    before = sample(model, PROMPTS, decode, do_sample=False)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(9)
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.2)
    after = sample(model, PROMPTS, decode, do_sample=False)
    assert not torch.equal(after.completion_ids, before.completion_ids)  # the update changed the greedy tokens
    assert_same_samples(after, sample(model, PROMPTS, do_sample=False))  # ... to the updated model's
    assert (static_decoder(model, "inductor", torch.device("cpu")).captures, graphs(dynamo_only)) == (1, 1)


def test_compilations_are_bounded_by_the_buckets(dynamo_only):
    """A GRPO-like sequence: training generations of 12 rows with prompts of every width, evaluations with other
    group sizes; one graph per (rows, capacity) bucket met, however many generations."""
    model = tiny_llama()
    decode = DecodeSettings("static", "inductor")
    met = set()
    for width in (2, 5, 9, 30, 44, 7, 60, 3):
        prompts = [[5 + i] * width for i in range(3)]
        for group in (4, 4, 2, 8):  # training twice, then evaluation with n=2 and n=8
            sample(model, prompts, decode, group=group, max_new_tokens=12)
            met.add((bucket(3 * group, 8), bucket(width + 12, 64)))
    decoder = static_decoder(model, "inductor", torch.device("cpu"))
    assert len(met) == 6  # rows {8, 16, 32} x capacity {64, 128}, for 32 generations
    assert decoder.captures == graphs(dynamo_only) == len(met)


def test_a_grpo_run_compiles_once_per_bucket_across_optimizer_steps(tmp_path, dynamo_only):
    """Training generations between optimizer steps (in-place weight updates) and an evaluation: one graph per
    bucket met, never a recompilation for new weights."""
    tok, rows = toy.build_tokenizer(), toy.load_task("addition", kind="rl", n=16)
    trainer = grpo_trainer(tmp_path, tok, rows, cache_implementation="static", max_steps=4, learning_rate=1e-2)
    trainer.engine.decode = DecodeSettings("static", "inductor")  # CPU's "auto" is eager: compile it here
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    trainer.evaluate(rows.select(range(6)))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # the weights moved
    decoder = static_decoder(trainer.model, "inductor", torch.device("cpu"))
    # 4 training generations of 4 rows (bucket 8) and one evaluation of 6 x 4 rows (bucket 32), prompts + 3 tokens
    # within 64: two buckets, two graphs
    assert sorted(decoder.steps) == [(8, 64), (32, 64)]
    assert decoder.captures == graphs(dynamo_only) == 2


def test_a_model_that_cannot_run_static_says_so_once_and_samples_on_the_dynamic_cache(monkeypatch):
    model = tiny_llama()
    monkeypatch.setattr(static, "attention_kind", lambda m: "flash_attention_2")
    monkeypatch.setattr(static, "_WARNED", set())
    with pytest.warns(UserWarning, match="on the dynamic cache: attention implementation 'flash_attention_2'"):
        first = sample(model, PROMPTS, DecodeSettings("static"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        second = sample(model, PROMPTS, DecodeSettings("static"), seed=5)
    assert_same_samples(first, sample(model, PROMPTS))
    assert_same_samples(second, sample(model, PROMPTS, seed=5))


def test_static_problem_names_a_cache_layer_it_cannot_hold():
    class OtherLayer:
        is_initialized = True

    class OtherCache:
        layers = [OtherLayer()]

    assert "OtherLayer cache layer has no static counterpart" in static_problem(tiny_llama(), OtherCache())


def test_hf_backend_takes_the_static_cache_too():
    model = tiny_llama()
    params = SamplingParams(num_generations=2, max_new_tokens=10, eos_token_ids=(), pad_token_id=PAD, do_sample=False)
    out = sample_completions(model, PROMPTS, params, backend="hf", decode=DecodeSettings("static"))
    assert torch.equal(
        out.completion_ids, sample(model, PROMPTS, group=2, max_new_tokens=10, do_sample=False).completion_ids
    )


def test_settings_are_checked():
    with pytest.raises(ValueError, match="cache_implementation='paged' is not supported"):
        DecodeSettings("paged")
    with pytest.raises(ValueError, match="decode_compile must be one of"):
        DecodeSettings("static", "max-autotune")
    with pytest.raises(ValueError, match="CUDA graphs"):
        static_decoder(tiny_llama(), "reduce-overhead", torch.device("cpu"))


def test_the_field_is_trls():
    trl_config = pytest.importorskip("trl.trainer.grpo_config").GRPOConfig
    assert GRPOConfig.__dataclass_fields__["cache_implementation"].default is None
    assert trl_config.__dataclass_fields__["cache_implementation"].default is None


def test_grpo_config_wires_the_field_to_the_engine(tmp_path):
    with pytest.raises(ValueError, match="cache_implementation='offloaded' is not supported"):
        GRPOConfig(output_dir=str(tmp_path), cache_implementation="offloaded")
    with pytest.raises(PreflightError, match="cache_implementation: null"):
        GRPOConfig(output_dir=str(tmp_path), cache_implementation="static", max_staleness=1)
    tok = toy.build_tokenizer()
    trainer = grpo_trainer(tmp_path, tok, toy.load_task("addition", kind="rl", n=8), cache_implementation="static")
    assert trainer.engine.decode == DecodeSettings("static")


def test_grpo_evaluation_is_the_same_with_the_static_step(tmp_path):
    tok, rows = toy.build_tokenizer(), toy.load_task("addition", kind="rl", n=8)
    trainers = [grpo_trainer(tmp_path / str(s), tok, rows, cache_implementation=s) for s in (None, "static")]
    metrics = [trainer.evaluate(rows) for trainer in trainers]
    assert static_decoder(trainers[1].model, "auto", torch.device("cpu")).steps  # evaluated on the static step
    assert metrics[0] == metrics[1]


def test_multi_turn_rollouts_say_they_keep_the_ragged_cache(monkeypatch):
    monkeypatch.setattr(static, "_WARNED", set())
    model = tiny_llama()
    params = SamplingParams(num_generations=2, max_new_tokens=12, eos_token_ids=(2,), pad_token_id=PAD)

    def respond(row, turn):
        return [7, 8] if len(turn) < 6 else None

    def rollouts(decode):
        engine = LocalEngine(model, backend="fast", decode=decode)
        return engine.generate_turns(PROMPTS, respond, params, generator=torch.Generator().manual_seed(1))

    with pytest.warns(UserWarning, match="multi-turn rollouts keep a ragged cache"):
        kept = rollouts(DecodeSettings("static"))
    assert torch.equal(kept.completion_ids, rollouts(None).completion_ids)


@pytest.mark.slow
def test_inductor_compiled_step_same_tokens_and_reads_updated_weights():
    """decode_compile="inductor" for real (C++ code generation: about a minute on two cores)."""
    torch._dynamo.reset()
    model = tiny_llama()
    decode = DecodeSettings("static", "inductor")
    assert_same_samples(sample(model, PROMPTS, decode), sample(model, PROMPTS))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.3)
    assert_same_samples(sample(model, PROMPTS, decode, seed=8), sample(model, PROMPTS, seed=8))
    assert static_decoder(model, "inductor", torch.device("cpu")).captures == 1
    torch._dynamo.reset()


@pytest.mark.slow
def test_gpu_check_capture_rows_run_on_cpu(tmp_path):
    """``gpu_check --real-rows capture``, the lent GPU's one command, in its CPU smoke mode (about a minute)."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "capture.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    command = ["-m", "benchmarks.gpu_check", "--cpu-smoke", "--modes", "real", "--real-rows", "capture"]
    proc = subprocess.run(
        [sys.executable, *command, "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["own", "hf", "static", "grpo", "grpo-static", "own-0.5b", "static-0.5b", "hf-0.5b"]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows.values())
    assert "cache_implementation static" in rows["static"]["engine"] and 0 < rows["grpo-static"]["sampling_share"] < 1
    assert rows["static"]["captures"] == 0  # CPU: "auto" runs the static step eagerly
    assert "static-0.5b / hf-0.5b tokens/s" in proc.stdout
