"""vLLM as GRPO's rollout engine (treadle.engines.vllm), with the real engine on CPU.

The tests marked ``vllm`` need .venv-vllm (`make test-vllm`; the main suite deselects them): one GRPOTrainer with
``use_vllm=True`` on toy "small" (head size 32: vLLM's CPU attention has no kernel for toy tiny's 16) is built
once per module, so the engine starts once. Each checks vLLM against an independent reference: the own sampler's
greedy tokens, a plain-PyTorch forward for the sampled log-probs, the trained model's log-probs after a GRPO step
(the engine's copy before the sync must differ from them, or the check could not see a skipped sync), and a
hand-merged LoRA model. A second engine (module fixture ``lora_trainer``) serves a PEFT LoRA policy as vLLM LoRA
requests: its syncs are counted (adapters only) and it scores as peft's ``merge_and_unload``. The unmarked tests
check the options' one-line refusals, the LoRA plan, and a head size vLLM's CPU attention lacks (refused before the
engine starts, against a stand-in ``vllm`` package), and need no vLLM.
"""

import copy
import dataclasses
import json
import os
import shutil
import sys
import types

import peft
import pytest
import torch
from _factories import digit_sum_reward, untimed
from _vllm_common import load_with_push_skipped, model_logps, one_line, prompts, rows_of

from treadle.cli.command import main
from treadle.demos import toy
from treadle.engines import vllm as vllm_engines
from treadle.engines.local import LocalEngine
from treadle.engines.vllm import VLLMNotInstalled, merged_state_dict, vllm_engine
from treadle.engines.vllm_lora import adapter_tensors, lora_plan, lora_rank_bound
from treadle.errors import UserError, is_user_error
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import sample_completions
from treadle.models import unwrapped_for_generation
from treadle.trainers.distillation import DistillationConfig, DistillationTrainer
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

EOS = 2  # the toy tokenizer's eos id


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        learning_rate=1e-2,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1000,
        use_vllm=True,
        vllm_max_model_length=128,
        temperature=1.0,
        eval_temperature=0.0,
        eval_greedy=True,
    )
    values.update(overrides)
    return GRPOConfig(**values)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for these prompts
    tok = toy.build_tokenizer()
    model = toy.build_model("small", tokenizer=tok, seed=0)
    dataset = toy.load_task("addition", kind="rl", n=16)
    trainer = GRPOTrainer(
        model,
        digit_sum_reward,
        args=config(tmp_path_factory.mktemp("vllm")),
        train_dataset=dataset,
        processing_class=tok,
    )
    yield trainer
    trainer.close()


@pytest.fixture(scope="module")
def lora_trainer(tmp_path_factory):
    """A GRPOTrainer on a LoRA policy (r 4 on q_proj and v_proj of toy small's 4 layers): its own engine, started on
    the base weights with vLLM's LoRA support (the module's second and last engine start)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    tok = toy.build_tokenizer()
    trainer = GRPOTrainer(
        toy.build_model("small", tokenizer=tok, seed=0),
        digit_sum_reward,
        args=config(tmp_path_factory.mktemp("vllm-lora")),
        processing_class=tok,
        train_dataset=toy.load_task("addition", kind="rl", n=16),
        peft_config=LORA,
    )
    yield trainer
    trainer.close()


LORA = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
# by hand: 4 layers x (q_proj, v_proj) x (A 4x256, B 256x4): 16 tensors of 1,024 floats, 65,536 bytes in float32
ADAPTER_TENSORS, ADAPTER_BYTES = 16, 16 * 1024 * 4


# ---------------------------------------------------------------------------------------- the real engine
@pytest.mark.vllm
def test_greedy_completions_equal_the_own_samplers(trainer):
    ids = prompts(trainer.processing_class)
    params = SamplingParams(
        num_generations=2, max_new_tokens=12, eos_token_ids=(EOS,), pad_token_id=0, do_sample=False
    )
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
    vllm_engine_, trainer.rollout_sampler.engine = trainer.engine, LocalEngine(trainer.model)  # the sampler's
    try:
        ours = trainer.evaluate(eval_rows)
    finally:
        trainer.rollout_sampler.engine = vllm_engine_
    assert theirs == ours


@pytest.mark.vllm
def test_sampling_logps_are_the_processed_distributions(trainer):
    """vLLM's sampled log-probs equal a plain-PyTorch recomputation under temperature, top-k and top-p, and the
    same generator state gives the same completions."""
    ids = prompts(trainer.processing_class, n=3)
    params = SamplingParams(
        num_generations=4, max_new_tokens=8, eos_token_ids=(EOS,), pad_token_id=0, temperature=0.7, top_k=12, top_p=0.9
    )
    trainer.engine.load_weights(trainer.model)
    out = trainer.engine.generate(ids, params, generator=torch.Generator().manual_seed(3))
    again = trainer.engine.generate(ids, params, generator=torch.Generator().manual_seed(3))
    assert torch.equal(out.completion_ids, again.completion_ids)
    completions = rows_of(out)
    assert len({tuple(c) for c in completions}) > 1  # sampled, not greedy
    for row, (prompt, completion) in enumerate(zip([p for p in ids for _ in range(4)], completions)):
        with torch.no_grad():
            logits = trainer.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / 0.7
        kth = logits.topk(12, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        ascending, order = logits.sort(dim=-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - 0.9
        drop[:, -1] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
        expected = logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        got = out.sampling_logps[row, : len(completion)]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert (out.sampling_logps[row, len(completion) :] == 0).all()


@pytest.mark.vllm
def test_min_p_reaches_vllm_and_its_log_probs_are_the_min_p_distributions(trainer):
    """min_p (TRL's) is sampled by vLLM: the sampled log-probs equal a plain-PyTorch recomputation under temperature,
    top-k and min-p (no top-p: there the two orders keep the same tokens), and no completion holds a token min-p
    drops; a suppress list (generation_kwargs' suppress_tokens) is refused in one line."""
    ids = prompts(trainer.processing_class, n=3)
    params = SamplingParams(
        num_generations=6, max_new_tokens=8, eos_token_ids=(EOS,), pad_token_id=0, temperature=1.5, top_k=40, min_p=0.8
    )  # 0.2 dropped nothing from this flat model
    trainer.engine.load_weights(trainer.model)
    out = trainer.engine.generate(ids, params, generator=torch.Generator().manual_seed(5))
    dropped_mass = []
    for row, (prompt, completion) in enumerate(zip([p for p in ids for _ in range(6)], rows_of(out))):
        with torch.no_grad():
            logits = trainer.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1] / 1.5
        logits = logits.masked_fill(logits < logits.topk(40, dim=-1).values[:, -1:], float("-inf"))
        probs = logits.softmax(-1)
        dropped = probs < 0.8 * probs.amax(-1, keepdim=True)
        dropped_mass.append(probs.masked_fill(~dropped, 0).sum(-1))
        assert not dropped.gather(1, torch.tensor(completion)[:, None]).any()
        expected = logits.masked_fill(dropped, float("-inf")).log_softmax(-1)
        got = out.sampling_logps[row, : len(completion)]
        torch.testing.assert_close(got, expected.gather(1, torch.tensor(completion)[:, None])[:, 0], atol=1e-4, rtol=0)
    assert torch.cat(dropped_mass).max() > 0.05  # min-p dropped real mass: without it the log-probs would differ
    with pytest.raises(UserError, match="suppress_tokens reach treadle's own sampler only"):
        trainer.engine.generate(ids, dataclasses.replace(params, suppress_token_ids=(7,)))


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
    lora = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
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
    full = shared(
        toy.build_model("small", tokenizer=tok, seed=1),
        digit_sum_reward,
        args=config(tmp_path / "full", **common),
        train_dataset=dataset,
        processing_class=tok,
    )
    full.train()
    os.makedirs(tmp_path / "resumed" / "run")
    shutil.copytree(tmp_path / "full" / "run" / "checkpoint-1", tmp_path / "resumed" / "run" / "checkpoint-1")
    resumed = shared(
        toy.build_model("small", tokenizer=tok, seed=5),
        digit_sum_reward,  # weights come from disk
        args=config(tmp_path / "resumed", **common),
        train_dataset=dataset,
        processing_class=tok,
    )
    resumed.train(resume_from_checkpoint=True)
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    later = lambda history: [h for h in untimed(history) if h["step"] > 1 and "reward" in h]  # noqa: E731
    assert later(resumed.state.log_history) == later(full.state.log_history) != []


@pytest.mark.vllm
def test_a_sync_that_changed_nothing_is_caught(trainer):
    """The weight-sync check (health's ``weight_sync``): after a generation, a push of changed weights that the
    engine never loaded (the push planted as a no-op) reports ``sync_unchanged``; a real push of changed weights
    does not; a push of the same weights is not checked (its log-probs rightly stay)."""
    engine, policy = trainer.engine, trainer.model
    engine.load_weights(policy)
    engine.generate(
        prompts(trainer.processing_class, 2),
        trainer.sampling_params("train"),
        generator=torch.Generator().manual_seed(0),
    )
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    load_with_push_skipped(engine, moved)  # the planted "skip the sync"
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
    lora = peft.get_peft_model(
        copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    )
    state = merged_state_dict(lora)
    with unwrapped_for_generation(lora) as injected:  # what load_weights sees: the base model, adapters injected
        assert merged_state_dict(injected).keys() == state.keys()
    expected = copy.deepcopy(lora).merge_and_unload().state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, atol=1e-6, rtol=0)
    assert not torch.equal(
        state["model.layers.0.self_attn.q_proj.weight"], model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    )
    base = merged_state_dict(lora, adapters=False)  # what a LoRA engine starts from: the untouched base weights
    assert base.keys() == model.state_dict().keys()
    assert all(torch.equal(base[name], tensor) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("vllm_mode", "remote", "vllm_mode='remote' is not supported"),
        ("vllm_gpu_memory_utilization", 0.0, "vllm_gpu_memory_utilization must be in (0, 1]"),
        ("vllm_tensor_parallel_size", 0, "vllm_tensor_parallel_size must be an integer >= 1"),
        ("vllm_max_model_length", 8, "leaves no room"),
    ],
)
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
        GRPOTrainer(
            toy.build_model("tiny", tokenizer=tok),
            digit_sum_reward,
            args=config(tmp_path),
            train_dataset=toy.load_task("addition", kind="rl", n=8),
            processing_class=tok,
        )
    assert is_user_error(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------- LoRA adapters synced alone
@pytest.mark.vllm
def test_a_lora_policy_syncs_its_adapters_alone_and_scores_as_its_merge(lora_trainer):
    """The engine holds the base weights from its start; each sync after a GRPO step at lr 1e-2 sends the 16
    adapter tensors (65,536 bytes) and nothing through the full-weight path, and the engine then scores and
    generates as peft's merge_and_unload of the trained policy (before that sync it did not: a skipped sync
    fails)."""
    engine, tok = lora_trainer.engine, lora_trainer.processing_class
    assert engine.lora is not None and engine.last_sync == {
        "kind": "lora",
        "tensors": ADAPTER_TENSORS,
        "bytes": ADAPTER_BYTES,
    }
    base_file = os.path.getsize(os.path.join(engine.folder, "model.safetensors"))
    assert os.path.getsize(os.path.join(engine.folder, "adapter", "adapter_model.safetensors")) < base_file / 100
    full_pushes, rpc = [], engine.llm.collective_rpc
    engine.llm.collective_rpc = lambda *args, **kwargs: full_pushes.append(args[0]) or rpc(*args, **kwargs)
    first = engine.lora_request.lora_int_id
    try:
        lora_trainer.train()  # one step: the sync before sampling sent the adapter, then the step moved it
    finally:
        del engine.llm.collective_rpc
    assert full_pushes == [] and engine.lora_request.lora_int_id == first + 1
    assert engine.last_sync == {"kind": "lora", "tensors": ADAPTER_TENSORS, "bytes": ADAPTER_BYTES}
    ids = prompts(tok, n=3)
    fixed = [tok("12")["input_ids"] + [EOS], tok("7")["input_ids"], tok("345")["input_ids"] + [EOS]]
    merged = copy.deepcopy(lora_trainer.model).merge_and_unload()
    after = model_logps(merged, ids, fixed)
    stale = engine.score(ids, fixed)
    assert max((s - a).abs().max().item() for s, a in zip(stale, after)) > 1e-2
    engine.load_weights(lora_trainer.model_wrapped)
    assert engine.last_sync["bytes"] == ADAPTER_BYTES and engine.lora_request.lora_int_id == first + 2
    for s, a in zip(engine.score(ids, fixed), after):
        torch.testing.assert_close(s, a, atol=1e-4, rtol=0)
    params = SamplingParams(
        num_generations=2, max_new_tokens=12, eos_token_ids=(EOS,), pad_token_id=0, do_sample=False
    )
    assert rows_of(engine.generate(ids, params)) == rows_of(sample_completions(merged, ids, params))


@pytest.mark.vllm
def test_a_lora_sync_that_changed_nothing_is_caught(lora_trainer):
    """The weight-sync check with adapters: a planted no-op push of a moved adapter is caught, a real one is not."""
    engine, policy = lora_trainer.engine, lora_trainer.model
    engine.generate(
        prompts(lora_trainer.processing_class, 2),
        lora_trainer.sampling_params("train"),
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
    load_with_push_skipped(engine, policy)  # the planted "skip the sync"
    assert engine.sync_unchanged is True
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(policy)
    assert engine.sync_unchanged is False


# ---------------------------------------------------------------------------------- distillation
@pytest.mark.vllm
def test_a_distillation_step_samples_through_vllm(trainer, tmp_path):
    """DistillationTrainer with use_vllm=True (issue 27): its student's completions come from the engine (top_k=1
    sampling: they equal the own sampler's greedy completions of the student before the step), and the step trains.
    It shares the module's engine (build_engine overridden: no further vLLM start) and syncs its student into it."""
    tok = trainer.processing_class
    shared = type("SharedEngineDistillation", (DistillationTrainer,), {"build_engine": lambda self: trainer.engine})
    student = toy.build_model("small", tokenizer=tok, seed=2)
    args = DistillationConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        max_steps=1,
        max_completion_length=6,
        learning_rate=1e-2,
        top_k=1,
        use_vllm=True,
        vllm_max_model_length=128,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
    )
    distill = shared(
        student,
        toy.build_model("small", tokenizer=tok, seed=3),
        args=args,
        processing_class=tok,
        train_dataset=toy.load_task("addition", kind="rl", n=8),
    )
    before = copy.deepcopy(student)
    calls, generate = [], trainer.engine.generate
    trainer.engine.generate = lambda ids, params, **kwargs: (
        calls.append((ids, generate(ids, params, **kwargs))) or calls[-1][1]
    )
    try:
        distill.train()
    finally:
        del trainer.engine.generate
        trainer.engine.load_weights(trainer.model)  # the module's trainer samples from its own policy again
    assert len(calls) == 1
    ids, out = calls[0]
    greedy = SamplingParams(
        num_generations=1, max_new_tokens=6, eos_token_ids=(EOS,), pad_token_id=tok.pad_token_id, do_sample=False
    )
    assert rows_of(out) == rows_of(sample_completions(before, ids, greedy))
    assert any(not torch.equal(p, q) for p, q in zip(student.parameters(), before.parameters()))
    assert distill.state.log_history[0]["loss"] > 0


# ---------------------------------------------------------------------------------------- the demo
@pytest.mark.vllm
@pytest.mark.slow
def test_the_demo_runs_grpo_through_vllm(tmp_path):
    """`treadle demo --use-vllm`, shortened: GRPO samples through vLLM (its sampler/trainer log-prob metrics exist
    only under an engine other than the own sampler, and agree to 1e-4: the engine holds the trained weights) on
    tiny32 (vLLM has no CPU kernel for tiny's head size 16). A third engine start (~1 minute with the demo)."""
    out = tmp_path / "demo"
    assert (
        main(
            [
                "demo",
                "--use_vllm",
                "--sft-steps",
                "20",
                "--grpo-steps",
                "3",
                "--eval-size",
                "20",
                "--output-dir",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["use_vllm"] is True and results["settings"]["model_size"] == "tiny32"
    steps = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    differences = [s["sampling/sampling_logp_difference/max"] for s in steps if "loss" in s]
    assert len(differences) == 3 and max(differences) < 1e-4


def test_demo_use_vllm_trains_tiny32_and_other_tasks_refuse_it(capsys):
    """--use-vllm picks tiny32 (head size 32: vLLM's CPU attention has no kernel for tiny's 16); a demo without a
    vLLM path refuses the flag in one line (exit 2) before anything runs."""
    from treadle.demos.addition import DemoSettings

    assert DemoSettings(use_vllm=True).model_size == "tiny32" and DemoSettings().model_size == "tiny"
    assert toy.MODEL_SIZES["tiny32"]["hidden_size"] // toy.MODEL_SIZES["tiny32"]["num_attention_heads"] == 32
    assert main(["demo", "--task", "tools", "--use-vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--use-vllm" in err and "--task tools" in err and "\n" not in err


# --------------------------------------------------------------------------- the LoRA plan, no vLLM
def test_lora_plan_takes_plain_lora_and_leaves_the_rest_to_merged_weights():
    """vLLM serves one plain LoRA adapter; DoRA, modules_to_save, biases, a plain model go the merged way."""

    def policy(**options):
        config = peft.LoraConfig(**{"r": 4, "target_modules": ["q_proj"], **options})
        return peft.get_peft_model(toy.build_model("tiny", seed=0), config)

    model = policy()
    assert lora_plan(model)[1:] == ("default", model.peft_config["default"])
    assert lora_plan(toy.build_model("tiny", seed=0)) is None
    for options in (dict(use_dora=True), dict(modules_to_save=["lm_head"]), dict(bias="lora_only")):
        assert lora_plan(policy(**options)) is None, options
    assert [lora_rank_bound(peft.LoraConfig(r=r)) for r in (1, 4, 8, 9, 512)] == [1, 8, 8, 16, 512]
    assert lora_rank_bound(peft.LoraConfig(r=4, rank_pattern={"v_proj": 40})) == 64


def test_adapter_tensors_are_what_peft_saves(tmp_path):
    """The tensors a sync writes equal peft's save_pretrained file, key for key."""
    from safetensors.torch import load_file

    model = peft.get_peft_model(toy.build_model("small", seed=0), LORA)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    with unwrapped_for_generation(model) as inner:
        ours = adapter_tensors(inner, model, "default")
    assert ours.keys() == saved.keys() and len(ours) == ADAPTER_TENSORS
    assert sum(t.numel() * t.element_size() for t in ours.values()) == ADAPTER_BYTES
    for key, tensor in saved.items():
        assert torch.equal(ours[key], tensor), key


# ----------------------------------------------------------------- a head size vLLM's CPU attention lacks
def fake_vllm(monkeypatch, *, cpu: bool = True):
    """A ``vllm`` package whose CPU attention has vLLM 0.32's head sizes and whose ``LLM`` must not start."""

    class CPUAttentionBackend:
        @classmethod
        def get_supported_head_sizes(cls):
            return [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]

        @classmethod
        def supports_head_size(cls, size):
            return size in cls.get_supported_head_sizes()

    def llm(**kwargs):
        raise AssertionError("the engine started")

    modules = {
        "vllm": types.SimpleNamespace(__version__="0.32.0", LLM=llm),
        "vllm.platforms": types.SimpleNamespace(current_platform=types.SimpleNamespace(is_cpu=lambda: cpu)),
        "vllm.v1.attention.backends.cpu_attn": types.SimpleNamespace(CPUAttentionBackend=CPUAttentionBackend),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_colocated_vllm_refuses_a_head_size_its_cpu_kernels_lack_before_the_engine_starts(monkeypatch):
    fake_vllm(monkeypatch)
    with pytest.raises(UserError) as info:
        vllm_engines.VLLMEngine(toy.build_model("tiny"))  # head size 64 / 4 = 16
    assert one_line(info.value).startswith(
        "vLLM 0.32.0's CPU attention has no kernel for this model's head size 16 (it has 32, 64, 80"
    )
    assert "use_vllm: false" in str(info.value)
    with pytest.raises(AssertionError, match="the engine started"):  # toy small's 32 is checked and passes
        vllm_engines.VLLMEngine(toy.build_model("small"))


def test_the_head_size_check_leaves_other_platforms_to_vllm(monkeypatch):
    fake_vllm(monkeypatch, cpu=False)
    with pytest.raises(AssertionError, match="the engine started"):
        vllm_engines.VLLMEngine(toy.build_model("tiny"))


@pytest.mark.vllm
def test_a_head_size_the_installed_vllms_cpu_kernels_lack_is_refused_before_the_engine_starts():
    """Toy tiny (head size 16) under the installed vLLM: one line in seconds (vLLM's own import), where the engine
    failed only after its ~80 s start (issue 44); the check asks vLLM's CPU attention backend itself."""
    with pytest.raises(UserError) as info:
        vllm_engine(toy.build_model("tiny"), GRPOConfig(output_dir="unused", use_vllm=True))
    message = str(info.value)
    assert "CPU attention has no kernel for this model's head size 16" in message and "\n" not in message
