"""PEFT (LoRA) on every trainer: only adapters train, the adapters-off reference, adapter checkpoints that
peft and transformers load on their own, merged exports, exact resume in a new process, the CLI's ``peft:``
mapping and ``treadle merge``, and 2-process DDP / FSDP2 with LoRA."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from _factories import (  # noqa: E402
    PAIRS,
    SFT_ROWS,
    dpo_trainer,
    grpo_trainer,
    length_reward,
    reward_trainer,
    sft,
    sft_trainer,
    tiny_reward_model,
)

from treadle import TrainerCallback, peft as treadle_peft  # noqa: E402
from treadle.demos import toy  # noqa: E402
from treadle.generation import generate_completions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMON = dict(
    disable_tqdm=True,
    save_strategy="no",
    per_device_train_batch_size=2,
    learning_rate=1e-2,
    logging_steps=1,
    report_to="none",
)


pytestmark = pytest.mark.usefixtures("one_thread")


def lora(**overrides):
    return peft.LoraConfig(
        **{"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "task_type": "CAUSAL_LM", **overrides}
    )


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step


def build(kind: str, tmp_path, tok, model=None, peft_config=None, stop=None, **overrides):
    """A trainer of ``kind`` on the tiny toy model with ``peft_config`` (default: LoRA on every linear); ``stop``:
    end training after this step (as a preempted run would)."""
    model = model if model is not None else toy.build_model("tiny", tokenizer=tok)
    peft_config = peft_config if peft_config is not None else lora()
    callbacks = [StopAt(stop)] if stop else []
    fields = {**COMMON, "max_steps": 2, **overrides}
    if kind == "sft":
        return sft_trainer(
            tmp_path / kind, tok, SFT_ROWS, model, peft_config=peft_config, callbacks=callbacks, **fields
        )
    if kind == "dpo":
        return dpo_trainer(tmp_path / kind, tok, PAIRS, model, peft_config=peft_config, **fields)
    fields.update(per_device_train_batch_size=4, num_generations=4, max_completion_length=4)
    return grpo_trainer(
        tmp_path,
        tok,
        toy.load_task("addition", kind="rl", n=8),
        length_reward,
        model=model,
        peft_config=peft_config,
        **{"beta": 0.1, "output_dir": str(tmp_path / kind), **fields},
    )


def logits(model, ids=((1, 9, 10, 79, 11, 87),)):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


# ---- only the adapters train ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_each_trainer_with_peft_config_trains_only_the_adapters(tmp_path, tok, kind):
    trainer = build(kind, tmp_path, tok)
    assert isinstance(trainer.model, peft.PeftModel)
    if kind != "sft":
        assert trainer.ref_model is None  # the policy with adapters disabled is the reference: no copy
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    adapters = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    trainer.train()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    named = dict(trainer.model.named_parameters())
    assert optimized == {id(named[n]) for n in adapters}  # the optimizer state is the adapters' only
    after = trainer.model.state_dict()
    for name, value in before.items():
        changed = not torch.equal(value, after[name])
        assert changed == (name in adapters), f"{name}: changed={changed}"


def test_reward_trainer_with_a_sequence_classification_lora(tmp_path, tok):
    """RewardTrainer takes peft_config too: LoRA with task_type SEQ_CLS trains the adapters and the score head
    (peft's modules_to_save for classifiers), nothing else."""
    model = tiny_reward_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = reward_trainer(tmp_path, tok, model=model, peft_config=lora(task_type="SEQ_CLS"), **COMMON)
    trainer.train()
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or "score" in n for n in trained)
    after = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v
        for k, v in trainer.model.state_dict().items()
        if "lora_" not in k and "modules_to_save" not in k
    }
    after = {k.replace(".original_module", ""): v for k, v in after.items()}
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the base model and its original head


def test_trainable_and_total_parameters_are_printed_and_counted(tok, capsys):
    model = toy.build_model("tiny", tokenizer=tok)
    total = sum(p.numel() for p in model.parameters())  # tied embeddings count once
    wrapped = treadle_peft.apply_peft(model, lora(target_modules=["q_proj", "v_proj"]))
    # per layer: q_proj 64->64 and v_proj 64->64 (4 kv heads of 16), A is r x in, B is out x r
    per_layer = 2 * (4 * 64 + 64 * 4)
    assert treadle_peft.parameter_counts(wrapped) == (2 * per_layer, total + 2 * per_layer)
    assert f"{2 * per_layer:,} trainable of {total + 2 * per_layer:,} parameters" in capsys.readouterr().out


# ---- the adapters-off reference ----------------------------------------------------------------------------
def test_adapters_off_reference_gives_dpo_loss_log2_at_step_0(tmp_path, tok):
    trainer = build("dpo", tmp_path, tok, max_steps=1)
    trainer.train()
    assert trainer.ref_model is None
    assert trainer.state.log_history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert trainer.state.log_history[0]["rewards/margins"] == 0.0


def test_adapters_off_reference_is_the_base_model_not_the_policy(tmp_path, tok):
    """With adapters that change the outputs (random B), the reference log-probs are the base model's (an
    independent copy made before wrapping) and differ from the policy's."""
    base = toy.build_model("tiny", tokenizer=tok)
    copy_of_base = copy.deepcopy(base)
    trainer = build("dpo", tmp_path, tok, model=base, peft_config=lora(init_lora_weights=False))
    batch = trainer.prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(2)]))
    reference = trainer.reference_logps(batch)
    want = trainer.completion_logps(copy_of_base, batch).logps
    torch.testing.assert_close(reference.chosen, want.chosen)
    torch.testing.assert_close(reference.rejected, want.rejected)
    policy = trainer.completion_logps(trainer.model, batch).logps
    assert not torch.allclose(policy.chosen, want.chosen, atol=1e-3)


def test_grpo_kl_reference_is_the_base_model(tmp_path, tok):
    base = toy.build_model("tiny", tokenizer=tok)
    copy_of_base = copy.deepcopy(base)
    trainer = build("grpo", tmp_path, tok, model=base, peft_config=lora(init_lora_weights=False))
    rows = [trainer.train_dataset[0]] * 4
    buffer = trainer.generate_and_score(rows, 0)
    batch = buffer[0]
    want = trainer.frozen_logps(copy_of_base, batch)
    torch.testing.assert_close(batch.ref_logps, want)
    assert not torch.allclose(trainer.frozen_logps(trainer.model, batch), want, atol=1e-3)


# ---- generation samples from the adapted model -------------------------------------------------------------
def test_fast_generation_samples_from_the_adapted_model(tok):
    model = treadle_peft.apply_peft(toy.build_model("tiny", tokenizer=tok), lora(init_lora_weights=False))
    prompts = [[1, 9, 10, 79], [1, 12, 87]]
    out = generate_completions(
        model,
        prompts,
        num_generations=1,
        max_new_tokens=6,
        eos_token_id=None,
        pad_token_id=0,
        do_sample=False,
        backend="fast",
    )
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            want = model.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :]
            assert out.completion_ids[row].tolist() == want.tolist()
        with model.disable_adapter():  # and not from the base model
            base = model.generate(
                input_ids=torch.tensor([prompts[0]]),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, 4:]
    assert out.completion_ids[0].tolist() != base.tolist()
    assert all(not p.requires_grad or "lora_" in n for n, p in model.named_parameters())


# ---- gradient checkpointing ------------------------------------------------------------------------------
def test_gradient_checkpointing_with_peft_trains_the_adapters(tmp_path, tok):
    trainer = build("sft", tmp_path, tok, gradient_checkpointing=True)
    before = {n: p.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.model.get_base_model().is_gradient_checkpointing
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if n in before)


# ---- saving, loading, merging ------------------------------------------------------------------------------
def test_save_model_writes_an_adapter_peft_loads_without_treadle(tmp_path, tok):
    trainer = build("sft", tmp_path, tok, peft_config=lora(init_lora_weights=False))
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(tmp_path / "out"))
    # peft and transformers only: the toy model is a plain LlamaForCausalLM built from its seed
    loaded = peft.PeftModel.from_pretrained(toy.build_model("tiny", tokenizer=tok), str(tmp_path / "out"))
    torch.testing.assert_close(logits(loaded), logits(trainer.model), rtol=0, atol=0)
    with open(tmp_path / "out" / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] is None  # built in code, not from load_model


def test_merge_adapters_writes_a_plain_transformers_model_with_the_same_logits(tmp_path, tok, capsys):
    from transformers import AutoModelForCausalLM

    trainer = build("sft", tmp_path, tok, peft_config=lora(init_lora_weights=False), merge_adapters=True)
    trainer.train()
    trainer.save_model()
    merged_dir = Path(trainer.args.output_dir) / "merged"
    assert f"merged into the base model, a plain transformers model, in {merged_dir}" in capsys.readouterr().out
    assert (merged_dir / "config.json").is_file() and not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir))
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(logits(merged), logits(trainer.model), rtol=1e-5, atol=1e-5)
    assert isinstance(trainer.model, peft.PeftModel)  # the trainer's model is left as it was


def test_checkpoint_holds_the_adapter_and_loads_back(tmp_path, tok):
    from treadle import checkpoint as ckpt

    trainer = build("sft", tmp_path, tok, save_strategy="steps", save_steps=2)
    trainer.train()
    folder = Path(trainer.args.output_dir) / "checkpoint-2"
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= set(os.listdir(folder))
    assert not (folder / "model.safetensors").exists()
    fresh = treadle_peft.apply_peft(toy.build_model("tiny", tokenizer=tok), lora())
    ckpt.load_weights(fresh, str(folder))
    torch.testing.assert_close(logits(fresh), logits(trainer.model), rtol=0, atol=0)
    with pytest.raises(ckpt.CheckpointError, match="do not fit"):  # another rank: checked before loading
        ckpt.load_weights(treadle_peft.apply_peft(toy.build_model("tiny", tokenizer=tok), lora(r=2)), str(folder))


RESUME_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
sys.path.insert(0, {tests!r})
import test_peft as t
print(json.dumps(t.resume_run(sys.argv[1], sys.argv[2])))
"""


def resume_run(output_dir: str, resume: str | None = None, stop: int | None = None) -> list[float]:
    """Four SFT steps of a LoRA run with LoRA dropout on (so the RNG state matters), checkpoints every 2."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reduction order as the resuming process
    try:
        trainer = build(
            "sft",
            Path(output_dir),
            toy.build_tokenizer(),
            max_steps=4,
            save_strategy="steps",
            save_steps=2,
            peft_config=lora(lora_dropout=0.3),
            stop=stop,
        )
        trainer.train(resume_from_checkpoint=resume)
    finally:
        torch.set_num_threads(threads)
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow
def test_a_lora_run_resumes_exactly_in_a_new_process(tmp_path):
    """Four steps in one go vs two steps, then a new interpreter resuming from checkpoint-2."""
    from safetensors.torch import load_file

    full = resume_run(str(tmp_path / "a"))
    resume_run(str(tmp_path / "b"), stop=2)
    script = tmp_path / "run.py"
    script.write_text(RESUME_SCRIPT.format(tests=str(ROOT / "tests")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(script), str(tmp_path / "b"), str(tmp_path / "b" / "sft" / "checkpoint-2")]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(full) == 4 and resumed == full
    a = load_file(str(tmp_path / "a" / "sft" / "checkpoint-4" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "sft" / "checkpoint-4" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- the peft: mapping, errors ---------------------------------------------------------------------------
def test_lora_config_from_a_yaml_mapping():
    config = treadle_peft.lora_config(
        {
            "r": 8,
            "lora_alpha": 16,
            "lora_dropout": 0.05,
            "target_modules": "all-linear",
            "modules_to_save": ["lm_head"],
        }
    )
    assert isinstance(config, peft.LoraConfig) and config.task_type == "CAUSAL_LM"
    assert (config.r, config.lora_alpha, config.target_modules) == (8, 16, "all-linear")
    with pytest.raises(ValueError, match="unknown LoraConfig key.*'rank'"):
        treadle_peft.lora_config({"rank": 8})
    with pytest.raises(ValueError, match="must be a mapping"):
        treadle_peft.lora_config([8])


def test_missing_peft_names_the_install_command(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"pip install 'treadle\[peft\]'"):
        treadle_peft.apply_peft(toy.build_model("tiny", tokenizer=tok), object())


def test_bad_peft_config_and_double_wrapping_are_refused(tok):
    model = toy.build_model("tiny", tokenizer=tok)
    with pytest.raises(TypeError, match="peft_config must be a peft config"):
        treadle_peft.apply_peft(model, {"r": 8})
    wrapped = treadle_peft.apply_peft(model, lora())
    with pytest.raises(ValueError, match="already a PEFT model"):
        treadle_peft.apply_peft(wrapped, lora())


def test_merge_adapters_without_adapters_and_a_classifier_task_type_on_a_causal_lm_are_refused(tmp_path):
    pytest.importorskip("peft")
    from treadle.peft import lora_config

    rows = [{"prompt": "1+1=", "completion": "2"}] * 2
    with pytest.raises(ValueError, match="merge_adapters=True but the model has no adapters to merge"):
        sft(tmp_path, rows, merge_adapters=True)
    with pytest.raises(ValueError, match="peft task_type 'SEQ_CLS' does not fit LlamaForCausalLM, a causal LM"):
        from treadle.demos import toy
        from treadle.trainers.sft import SFTConfig, SFTTrainer

        tok = toy.build_tokenizer()
        SFTTrainer(
            toy.build_model("tiny", tokenizer=tok),
            args=SFTConfig(output_dir=str(tmp_path / "r"), report_to=[]),
            train_dataset=rows,
            processing_class=tok,
            peft_config=lora_config({"r": 2, "target_modules": "all-linear", "task_type": "SEQ_CLS"}),
        )


@pytest.mark.slow
def test_cli_trains_a_lora_run_and_merges_it(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from treadle.cli.command import main

    config = ROOT / "examples" / "lora.yaml"
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                str(config),
                "--output_dir",
                str(run),
                "--max_steps",
                "2",
                "--disable_tqdm",
                "true",
                "--merge_adapters",
                "false",
            ]
        )
        == 0
    )
    assert not (run / "merged").exists()
    with open(run / "adapter_config.json") as f:
        assert json.load(f)["base_model_name_or_path"] == "toy:tiny"
    assert main(["merge", str(run)]) == 0
    assert f"merged model saved in {run / 'merged'}" in capsys.readouterr().out
    adapted = peft.PeftModel.from_pretrained(toy.build_model("tiny", seed=42), str(run))
    merged = AutoModelForCausalLM.from_pretrained(str(run / "merged"))
    torch.testing.assert_close(logits(merged), logits(adapted), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(merged), logits(toy.build_model("tiny", seed=42)), atol=1e-4)  # it trained
    assert main(["merge", str(tmp_path)]) == 2  # no adapter there: one line, exit 2
    assert "holds no adapter_config.json" in capsys.readouterr().err


# ---- two processes -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ddp_and_fsdp2_lora_match_one_process(tmp_path):
    import _peft_dist_worker as worker

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "tests" / "_peft_dist_worker.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    want = worker.run(str(tmp_path / "one"), world_size=1)
    for name in ("ddp", "fsdp"):
        with open(tmp_path / f"{name}.json") as f:
            got = json.load(f)
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-4), name
        assert got["optimizer_params"] == want["optimizer_params"], name  # adapter-only optimizer state
        assert got["base_unchanged"], name
        from safetensors.torch import load_file

        adapter = load_file(str(tmp_path / name / "final" / "adapter_model.safetensors"))
        reference = load_file(str(tmp_path / "one" / "final" / "adapter_model.safetensors"))
        assert adapter.keys() == reference.keys()
        for key in reference:
            torch.testing.assert_close(adapter[key], reference[key], rtol=0, atol=2e-5, msg=f"{name} {key}")
