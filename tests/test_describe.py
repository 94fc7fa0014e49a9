"""What made a run (treadle.describe: run.json's model, data, reward functions, LoRA) as two tiny runs write it, and
report.html marking the arguments set differently from the defaults and, in an overlay, what differs between the
runs."""

import json

import pytest
from datasets import load_dataset

from treadle import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from treadle.cli import report
from treadle.demos import toy
from treadle.describe import describe_run
from treadle.record import runfiles


def sft_run(folder, rows: int, peft_config=None, **settings):
    args = SFTConfig(
        output_dir=str(folder),
        max_steps=1,
        per_device_train_batch_size=4,
        save_strategy="no",
        disable_tqdm=True,
        **settings,
    )
    trainer = SFTTrainer(
        toy.build_model("tiny"),
        args,
        train_dataset=toy.load_task("addition", n=rows),
        processing_class=toy.build_tokenizer(),
        peft_config=peft_config,
    )
    trainer.train()
    return trainer


def test_two_runs_record_what_made_them_and_the_report_marks_what_differs(tmp_path):
    peft = pytest.importorskip("peft")
    plain = sft_run(tmp_path / "plain", 16, learning_rate=3e-3)
    lora = sft_run(
        tmp_path / "lora",
        32,
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    a, b = (runfiles.read_run_info(tmp_path / run) for run in ("plain", "lora"))
    total = sum(p.numel() for p in plain.model.parameters())
    assert (a["trainer"], a["config"], a["peft"]) == ("SFTTrainer", "SFTConfig", None)
    assert a["model"] == {
        "class": "LlamaForCausalLM",
        "name_or_path": "",
        "parameters": total,
        "trainable": total,
        "dtype": "torch.float32",
    }
    assert a["train_dataset"]["rows"] == 16 and "input_ids" in a["train_dataset"]["columns"]  # as trained on
    lora_params = sum(p.numel() for n, p in lora.model.named_parameters() if "lora_" in n)
    assert b["model"]["trainable"] == lora_params and b["model"]["parameters"] == total + lora_params
    assert (b["peft"]["r"], b["peft"]["lora_alpha"], b["peft"]["target_modules"]) == (4, 8, ["q_proj", "v_proj"])

    page = report.write_html(tmp_path / "plain").read_text()
    changed = page[page.index("Set differently from SFTConfig") : page.index("Every argument")]
    assert "<tr><td class=t>learning_rate</td><td class=n>0.003</td><td class=n>2e-05</td></tr>" in changed
    assert "<td class=t>max_steps</td><td class=n>1</td><td class=n>-1</td>" in changed
    assert ">seed<" not in changed and ">output_dir<" not in changed  # the default; the folder always differs
    assert "<tr><td class=t>model.class</td><td class=t>LlamaForCausalLM</td></tr>" in page

    overlay = report.write_overlay([tmp_path / "plain", tmp_path / "lora"], tmp_path / "compare").read_text()
    differ = overlay[overlay.index("What differs between the runs") :]
    assert "<tr><td class=t>run: train_dataset.rows</td><td class=n>16</td><td class=n>32</td></tr>" in differ
    assert "<td class=t>run: peft.r</td><td class=t></td><td class=n>4</td>" in differ
    assert "<td class=t>learning_rate</td><td class=n>0.003</td><td class=n>2e-05</td>" in differ
    assert "run: model.class" not in differ and "run: trainer" not in differ  # the same in both


def test_a_grpo_run_records_its_reward_functions_and_the_datasets_builder(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in toy.load_task("addition", kind="rl", n=8)))
    rows = load_dataset("json", data_files=str(path), split="train")
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,  # within toy tiny's 256 positions
        reward_weights=[1.0, 0.5],
    )
    trainer = GRPOTrainer(
        toy.build_model("tiny"),
        [toy.addition_reward, lambda completions, **k: [0.0] * len(completions)],
        args=args,
        train_dataset=rows,
        processing_class=toy.build_tokenizer(),
    )
    record = describe_run(trainer)
    assert record["reward_funcs"] == ["treadle.demos.toy.addition_reward", "test_describe.<lambda>"]
    assert record["reward_weights"] == [1.0, 0.5] and record["train_dataset"]["builder"] == "json"
    assert record["train_dataset"]["fingerprint"] == rows._fingerprint and "eval_dataset" not in record
