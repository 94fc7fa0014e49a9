"""The second hostile trial (issue 33), in one process where the behaviour is not about the CLI process: what
overwrite_output_dir may delete, the lock race, checkpoint fingerprints, resuming a finished schedule, path
settings, config values at config time, merge into the base model's folder. docs/runs.md holds the table."""

from pathlib import Path

import pytest


def write(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---- data that would train on something the user did not mean ---------------------------------------------------
def sft(tmp_path, rows, **fields):
    from treadle.demos import toy
    from treadle.trainers.sft import SFTConfig, SFTTrainer

    fields = {"max_steps": 2, "per_device_train_batch_size": 2, "save_strategy": "no", **fields}
    args = SFTConfig(output_dir=str(tmp_path / "run"), report_to=[], disable_tqdm=True, logging_steps=1, **fields)
    tok = toy.build_tokenizer()
    return SFTTrainer(
        model=toy.build_model("tiny", tokenizer=tok), args=args, train_dataset=rows, processing_class=tok
    )


@pytest.mark.parametrize(
    "messages, needle",
    [
        (
            [{"role": "hacker", "content": "hi"}],
            "the train dataset, row 1: column 'messages', message 0 has role 'hacker', which no chat template renders",
        ),
        ([{"role": "user"}], "the train dataset, row 1: column 'messages', message 0 (user) has no 'content'"),
    ],
)
def test_chat_messages_of_an_unknown_role_or_without_content_name_the_row(tmp_path, messages, needle):
    from treadle.data import DatasetFileError

    ok = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    with pytest.raises(DatasetFileError) as error:
        sft(tmp_path, [{"messages": ok}, {"messages": messages}])
    assert needle in str(error.value) and len(str(error.value)) < 300


@pytest.mark.parametrize(
    "rows, needle",
    [
        (
            [{"prompt": "1+1=", "completion": ""}] * 4,
            r"4 of 4 train rows have an empty 'completion' \(rows 0, 1, 2, 3\)",
        ),
        (
            [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": " "}],
            r"1 of 2 train rows have an empty 'completion' \(rows 1\): SFT would train them on the end-of-text token",
        ),
        ([{"text": "1+1=2"}, {"text": ""}], r"1 of 2 train rows have an empty 'text'"),
    ],
)
def test_sft_refuses_empty_completions_as_dpo_does(tmp_path, rows, needle):
    with pytest.raises(ValueError, match=needle):
        sft(tmp_path, rows)


def test_a_run_that_trained_on_nothing_never_ends_as_if_it_had(tmp_path):
    from treadle.errors import NothingTrainedError, is_user_error

    rows = [{"input_ids": [1, 5, 6, 2], "completion_mask": [0, 0, 0, 0]}] * 4  # not one token with loss
    trainer = sft(tmp_path, rows)
    with pytest.raises(
        NothingTrainedError, match="the run took 2 steps but not one of its batches held a token with loss"
    ) as error:
        trainer.train()
    assert is_user_error(error.value)


def dpo(tmp_path, rows):
    from treadle.demos import toy
    from treadle.trainers.dpo import DPOConfig, DPOTrainer

    tok = toy.build_tokenizer()
    args = DPOConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
    )
    return DPOTrainer(toy.build_model("tiny", tokenizer=tok), args=args, train_dataset=rows, processing_class=tok)


def test_dpo_refuses_pairs_that_are_all_identical_and_notes_some(tmp_path, capsys):
    same = [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 1)} for a in range(4)]
    with pytest.raises(
        ValueError,
        match=r"every one of the 4 train pairs has chosen identical to rejected .*loss "
        r"log 2, gradient 0",
    ):
        dpo(tmp_path, same)
    mixed = same[:1] + [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(3)]
    dpo(tmp_path, mixed)
    assert "treadle: 1 of 4 train pairs have chosen identical to rejected (rows 0)" in capsys.readouterr().err


def test_a_batch_larger_than_the_dataset_is_capped_and_the_header_says_so(tmp_path, capsys):
    rows = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(6)]
    trainer = sft(tmp_path, rows, per_device_train_batch_size=10**7, max_steps=1)
    out = trainer.train()
    header = capsys.readouterr().out
    assert (
        "6 rows; 6 rows per step (6 per device x 1 accumulated x 1 processes, per_device_train_batch_size="
        "10000000 capped at the rows there are)" in header
    )
    assert trainer.get_train_dataloader().batch_size == 6
    samples_per_step = out.metrics["train_samples_per_second"] / out.metrics["train_steps_per_second"]
    assert samples_per_step == pytest.approx(6, rel=1e-2)  # was 10**7 "samples" a step


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


def test_python_api_refuses_a_model_vocabulary_smaller_than_the_tokenizer_as_the_cli_does(tmp_path):
    from treadle.demos import toy
    from treadle.errors import PreflightError
    from treadle.trainers.sft import SFTConfig, SFTTrainer

    tok = toy.build_tokenizer()
    with pytest.raises(
        PreflightError,
        match=rf"the tokenizer of LlamaForCausalLM has {len(tok)} tokens but the model's "
        r"embedding has 16 rows; .*resize_token_embeddings",
    ):
        SFTTrainer(
            toy.build_model("tiny", vocab_size=16),
            args=SFTConfig(output_dir=str(tmp_path), report_to=[]),
            train_dataset=[{"prompt": "1+1=", "completion": "2"}],
            processing_class=tok,
        )
