"""vLLM as GRPO's rollout engine (treadle.engines.vllm), with the real engine on CPU.

The tests marked ``vllm`` need .venv-vllm (`make test-vllm`; the main suite deselects them): one GRPOTrainer with
``use_vllm=True`` on toy "small" (head size 32: vLLM's CPU attention has no kernel for toy tiny's 16) is built
once per module, so the engine starts once. Each checks vLLM against an independent reference: the own sampler's
greedy tokens, a plain-PyTorch forward for the sampled log-probs, the trained model's log-probs after a GRPO step
(the engine's copy before the sync must differ from them, or the check could not see a skipped sync), and a
hand-merged LoRA model. The unmarked tests check the options' one-line refusals and need no vLLM.
"""

import copy
import os
import shutil
import sys

import peft
import pytest
import torch

from treadle import toy
from treadle.engines.local import LocalEngine
from treadle.engines.vllm import VLLMNotInstalled, merged_state_dict, vllm_engine
from treadle.errors import is_user_error
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import sample_completions
from treadle.models import unwrapped_for_generation
from treadle.trainers.grpo import GRPOConfig, GRPOTrainer

EOS = 2  # the toy tokenizer's eos id


def config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=8, max_steps=1, learning_rate=1e-2, disable_tqdm=True, save_strategy="no",
                  logging_steps=1000, use_vllm=True, vllm_max_model_length=128, temperature=1.0,
                  eval_temperature=0.0, eval_greedy=True)
    values.update(overrides)
    return GRPOConfig(**values)


def digit_sum_reward(completion_ids, **kwargs):
    """A reward that varies between completions, so advantages are not all zero and a step moves the weights."""
    return [float(sum(ids) % 5) for ids in completion_ids]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for these prompts
    tok = toy.build_tokenizer()
    model = toy.build_model("small", tokenizer=tok, seed=0)
    dataset = toy.load_task("addition", kind="rl", n=16)
    trainer = GRPOTrainer(model, digit_sum_reward, args=config(tmp_path_factory.mktemp("vllm")),
                          train_dataset=dataset, processing_class=tok)
    yield trainer
    trainer.close()


def prompts(tok, n=4):
    return [tok(row["prompt"])["input_ids"] for row in toy.load_task("addition", kind="rl", n=n)]


def model_logps(model, prompt_ids, completion_ids):
    """Plain PyTorch: each completion token's log-prob under ``model`` (one unpadded forward per row)."""
    out = []
    with torch.no_grad():
        for p, c in zip(prompt_ids, completion_ids):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1].float()
            out.append(logits.log_softmax(-1).gather(1, torch.tensor(c)[:, None])[:, 0])
    return out


def rows_of(output):
    lengths = output.completion_mask.sum(1).tolist()
    return [ids[:n] for ids, n in zip(output.completion_ids.tolist(), lengths)]


# ---------------------------------------------------------------------------------------- the real engine
@pytest.mark.vllm
def test_greedy_completions_equal_the_own_samplers(trainer):
    ids = prompts(trainer.processing_class)
    params = SamplingParams(num_generations=2, max_new_tokens=12, eos_token_ids=(EOS,), pad_token_id=0,
                            do_sample=False)
    trainer.engine.load_weights(trainer.model)
    ours = sample_completions(trainer.model, ids, params)
    theirs = trainer.engine.generate(ids, params)
    assert rows_of(theirs) == rows_of(ours)
    assert torch.equal(theirs.prompt_ids, ours.prompt_ids) and torch.equal(theirs.is_truncated, ours.is_truncated)


@pytest.mark.vllm
def test_evaluation_samples_through_the_engine(trainer):
    """evaluate() with vLLM (greedy: eval_temperature=0) reports what the own sampler's evaluation reports."""
    eval_rows = toy.load_task("addition", "test", kind="rl", n=8)
    calls = []
    generate = trainer.engine.generate
    trainer.engine.generate = lambda *args, **kwargs: calls.append(1) or generate(*args, **kwargs)
    try:
        theirs = trainer.evaluate(eval_rows)
    finally:
        del trainer.engine.generate
    assert calls
    vllm_engine_, trainer.engine = trainer.engine, LocalEngine(trainer.model)
    try:
        ours = trainer.evaluate(eval_rows)
    finally:
        trainer.engine = vllm_engine_
    assert theirs == ours


@pytest.mark.vllm
def test_sampling_logps_are_the_processed_distributions(trainer):
    """vLLM's sampled log-probs equal a plain-PyTorch recomputation under temperature, top-k and top-p, and the
    same generator state gives the same completions."""
    ids = prompts(trainer.processing_class, n=3)
    params = SamplingParams(num_generations=4, max_new_tokens=8, eos_token_ids=(EOS,), pad_token_id=0,
                            temperature=0.7, top_k=12, top_p=0.9)
    trainer.engine.load_weights(trainer.model)
    out = trainer.engine.generate(ids, params, generator=torch.Generator().manual_seed(3))
    again = trainer.engine.generate(ids, params, generator=torch.Generator().manual_seed(3))
    assert torch.equal(out.completion_ids, again.completion_ids)
    completions = rows_of(out)
    assert len({tuple(c) for c in completions}) > 1  # sampled, not greedy
    for row, (prompt, completion) in enumerate(zip([p for p in ids for _ in range(4)], completions)):
        with torch.no_grad():
            logits = trainer.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1] / 0.7
        kth = logits.topk(12, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        ascending, order = logits.sort(dim=-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - 0.9
        drop[:, -1] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
        expected = logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        got = out.sampling_logps[row, :len(completion)]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert (out.sampling_logps[row, len(completion):] == 0).all()


@pytest.mark.vllm
def test_after_a_grpo_step_the_engine_scores_like_the_trained_model(trainer):
    tok = trainer.processing_class
    ids = prompts(tok, n=3)
    fixed = [tok("12")["input_ids"] + [EOS], tok("7")["input_ids"], tok("345")["input_ids"] + [EOS]]
    before = [t.clone() for t in model_logps(trainer.model, ids, fixed)]
    trainer.train()  # one step at lr 1e-2: the engine synced before sampling, so it holds the pre-step weights
    after = model_logps(trainer.model, ids, fixed)
    assert max((a - b).abs().max().item() for a, b in zip(after, before)) > 1e-2  # the step moved the policy
    stale = trainer.engine.score(ids, fixed)  # no sync yet: a planted "skip the sync" would leave this
    assert max((s - a).abs().max().item() for s, a in zip(stale, after)) > 1e-2
    for s, b in zip(stale, before):
        torch.testing.assert_close(s, b, atol=1e-4, rtol=0)
    trainer.engine.load_weights(trainer.model_wrapped)
    for s, a in zip(trainer.engine.score(ids, fixed), after):
        torch.testing.assert_close(s, a, atol=1e-4, rtol=0)


@pytest.mark.vllm
def test_a_lora_policy_generates_as_its_merged_model(trainer):
    """load_weights(peft model) sends base + B A scaling: vLLM then scores as peft's own merge_and_unload."""
    base = copy.deepcopy(trainer.model)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False))
    merged = copy.deepcopy(lora).merge_and_unload()
    tok = trainer.processing_class
    ids, fixed = prompts(tok, n=2), [tok("42")["input_ids"], tok("9")["input_ids"] + [EOS]]
    trainer.engine.load_weights(lora)
    try:
        scored = trainer.engine.score(ids, fixed)
    finally:
        trainer.engine.load_weights(trainer.model)
    for s, m in zip(scored, model_logps(merged, ids, fixed)):
        torch.testing.assert_close(s, m, atol=1e-4, rtol=0)


@pytest.mark.vllm
def test_resume_with_vllm_is_exact(trainer, tmp_path):
    """A run stopped after step 1 and resumed samples its next generations through vLLM from the restored weights
    and seed: the same weights and logged rewards as the uninterrupted run. Both runs share the module's engine
    (build_engine overridden: one vLLM start per session); each syncs its own policy into it."""
    tok, dataset = trainer.processing_class, toy.load_task("addition", kind="rl", n=16)
    shared = type("SharedEngineGRPO", (GRPOTrainer,), {"build_engine": lambda self: trainer.engine})
    common = dict(max_steps=3, save_strategy="steps", save_steps=1, logging_steps=1)
    full = shared(toy.build_model("small", tokenizer=tok, seed=1), digit_sum_reward,
                  args=config(tmp_path / "full", **common), train_dataset=dataset, processing_class=tok)
    full.train()
    os.makedirs(tmp_path / "resumed" / "run")
    shutil.copytree(tmp_path / "full" / "run" / "checkpoint-1", tmp_path / "resumed" / "run" / "checkpoint-1")
    resumed = shared(toy.build_model("small", tokenizer=tok, seed=5), digit_sum_reward,  # weights come from disk
                     args=config(tmp_path / "resumed", **common), train_dataset=dataset, processing_class=tok)
    resumed.train(resume_from_checkpoint=True)
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    later = lambda history: [h for h in history if h["step"] > 1 and "reward" in h]  # noqa: E731
    assert later(resumed.state.log_history) == later(full.state.log_history) != []


@pytest.mark.vllm
def test_a_sync_that_changed_nothing_is_caught(trainer):
    """The weight-sync check (health's ``weight_sync``): after a generation, a push of changed weights that the
    engine never loaded (the push planted as a no-op) reports ``sync_unchanged``; a real push of changed weights
    does not; a push of the same weights is not checked (its log-probs rightly stay)."""
    engine, policy = trainer.engine, trainer.model
    engine.load_weights(policy)
    engine.generate(prompts(trainer.processing_class, 2), trainer.sampling_params("train"),
                    generator=torch.Generator().manual_seed(0))
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    real_push, engine.push = engine.push, lambda weights: None  # the planted "skip the sync"
    try:
        engine.load_weights(moved)
    finally:
        engine.push = real_push
    assert engine.sync_unchanged is True
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    engine.load_weights(moved)
    assert engine.sync_unchanged is False
    engine.load_weights(moved)  # the same weights again: not checked, the last verdict kept
    assert engine.sync_unchanged is False
    engine.load_weights(policy)  # the module's trainer samples from its own policy again


# ------------------------------------------------------------------------------- no vLLM needed
def test_merged_state_dict_of_a_lora_model_is_the_merge_and_names_the_base_weights():
    model = toy.build_model("tiny", seed=0)
    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                                     init_lora_weights=False))
    state = merged_state_dict(lora)
    with unwrapped_for_generation(lora) as injected:  # what load_weights sees: the base model, adapters injected
        assert merged_state_dict(injected).keys() == state.keys()
    expected = copy.deepcopy(lora).merge_and_unload().state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, atol=1e-6, rtol=0)
    assert not torch.equal(state["model.layers.0.self_attn.q_proj.weight"],
                           model.state_dict()["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("field, value, fragment", [
    ("vllm_mode", "remote", "vllm_mode='remote' is not supported"),
    ("vllm_gpu_memory_utilization", 0.0, "vllm_gpu_memory_utilization must be in (0, 1]"),
    ("vllm_tensor_parallel_size", 0, "vllm_tensor_parallel_size must be an integer >= 1"),
    ("vllm_max_model_length", 8, "leaves no room"),
])
def test_config_refuses_vllm_settings_in_one_line(tmp_path, field, value, fragment):
    with pytest.raises(ValueError) as info:
        config(tmp_path, **{field: value})
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_multi_turn_with_vllm_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="single-turn rollouts only") as info:
        vllm_engine(None, config(tmp_path), multi_turn=True)
    assert "\n" not in str(info.value)


def test_use_vllm_without_vllm_is_one_line_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed (import raises ImportError)
    tok = toy.build_tokenizer()
    with pytest.raises(VLLMNotInstalled, match="make test-vllm") as info:
        GRPOTrainer(toy.build_model("tiny", tokenizer=tok), digit_sum_reward, args=config(tmp_path),
                    train_dataset=toy.load_task("addition", kind="rl", n=8), processing_class=tok)
    assert is_user_error(info.value) and "\n" not in str(info.value)
