"""Rows and limits in training (the fourth hostile trial's cases, issue 59): SFT rows the tokenizer writes as
``<unk>``, pre-tokenised ids outside the vocabulary, GRPO prompts longer than the model's positions, rewards that
overflow float32, a NaN loss on a step that is not logged, and KTO labels read from a CSV. docs/runs.md lists every
case."""

import json

import pytest
import torch
from _factories import grpo_trainer, sft_trainer
from test_run_errors import error_line, treadle

from treadle.errors import NonFiniteLossError, PreflightError
from treadle.rewards import RewardFunctionError


# ---- SFT --------------------------------------------------------------------------------------------------------
def test_rows_the_tokenizer_writes_as_unk_are_noted_once_with_their_share(tmp_path, tok, capfd):
    """Regression: SFT rows with emoji, accents and CJK on a tokenizer that maps them to <unk> trained the model to
    write <unk>, without a word."""
    rows = [{"prompt": "1+2=", "completion": "3 🎉"}, {"prompt": "café ", "completion": "日本"}]
    rows += [{"prompt": "1+1=", "completion": "2"}] * 2
    sft_trainer(tmp_path / "a", tok, rows, eval_dataset=rows, eval_strategy="steps", eval_steps=1)
    notes = [line for line in capfd.readouterr().err.splitlines() if "<unk>" in line]
    assert len(notes) == 1, notes  # the eval rows hold <unk> too: still one note
    ids = [tok(r["prompt"] + r["completion"])["input_ids"] for r in rows]
    unknown = sum(i.count(tok.unk_token_id) for i in ids)
    assert unknown == 4 and f"treadle: {unknown} of the " in notes[0] and "of the train dataset" in notes[0]
    assert "(3 of them in the loss)" in notes[0] and "emoji, accents, CJK" in notes[0]
    sft_trainer(tmp_path / "b", tok, [{"prompt": "1+1=", "completion": "2"}] * 4)
    assert "<unk>" not in capfd.readouterr().err  # rows the tokenizer covers: no note


@pytest.mark.parametrize("bad", [10_000, -100])
def test_pretokenised_ids_outside_the_vocabulary_name_the_row_and_the_size_before_step_1(tmp_path, tok, bad):
    """Regression: an id beyond the vocabulary (or -100) in pre-tokenised input_ids was a 27-frame IndexError at step
    1, no row named."""
    rows = [{"input_ids": [5, 6, 7]}, {"input_ids": [5, 6, 7]}, {"input_ids": [5, bad, 7]}, {"input_ids": [8, 9]}]
    with pytest.raises(ValueError) as error:
        sft_trainer(tmp_path, tok, rows)
    size = len(tok)
    assert str(error.value) == (
        f"the train dataset's input_ids: row 2 holds the id {bad} at position 1, outside the model's vocabulary of "
        f"{size} ids (0 to {size - 1}); tokenise the rows with this model's tokenizer (-100 marks ignored labels, not "
        f"inputs)"
    )


# ---- GRPO: positions --------------------------------------------------------------------------------------------
def test_grpo_prompts_longer_than_the_models_positions_are_refused_before_training(tmp_path, tok):
    """Regression: 602-token prompts cut to max_prompt_length=512 on a 256-position model: 516 tokens ran through it
    without a word."""
    prompts = [{"prompt": "1" * 600 + f"{i}="} for i in range(4)]  # the toy tokenizer: a token per character
    with pytest.raises(PreflightError) as error:
        grpo_trainer(tmp_path, tok, prompts, max_prompt_length=512, max_completion_length=4)
    assert str(error.value) == (
        "the train dataset: the longest prompt has 512 tokens (cut to max_prompt_length=512) and "
        "max_completion_length=4 more are sampled after it, 516 positions, more than the model's "
        "max_position_embeddings=256; lower max_prompt_length to 252 (or max_completion_length), or shorten the "
        "prompts"
    )
    grpo_trainer(tmp_path, tok, prompts, max_prompt_length=200, max_completion_length=4)  # fits: accepted


def test_grpo_on_a_model_of_64_learned_positions_with_72_token_prompts_is_one_line_at_setup(tmp_path, tok):
    """Regression: a model of 64 learned positions given 72-token prompts was a 37-frame IndexError at the first
    generation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=1, n_head=2, eos_token_id=2)
    model = GPT2LMHeadModel(config)
    prompts = [{"prompt": "2" * 70 + f"{i}="} for i in range(4)]
    with pytest.raises(PreflightError, match="the longest prompt has 72 tokens and max_completion_length=3 more"):
        grpo_trainer(tmp_path, tok, prompts, model=model)
    grpo_trainer(tmp_path, tok, [{"prompt": "2" * 50 + f"{i}="} for i in range(4)], model=model)  # 52 + 3 fit


def test_a_stream_of_prompts_too_long_is_refused_at_its_first_generation(tmp_path, tok):
    from datasets import Dataset

    stream = Dataset.from_list([{"prompt": "1" * 300 + f"{i}="} for i in range(8)]).to_iterable_dataset()
    trainer = grpo_trainer(tmp_path, tok, stream, max_prompt_length=None, max_completion_length=4)
    with pytest.raises(PreflightError, match="the train prompts: the longest prompt has 302 tokens"):
        trainer.train()


# ---- GRPO: rewards and losses that are not numbers ---------------------------------------------------------------
def huge(completion_ids, **kwargs):
    return [1e308 if i == 1 else 0.0 for i in range(len(completion_ids))]


def spread_too_wide(completion_ids, **kwargs):
    return [3e38 if i % 2 else -3e38 for i in range(len(completion_ids))]


def large(completion_ids, **kwargs):
    return [3e38] * len(completion_ids)


def also_large(completion_ids, **kwargs):
    return [3e38] * len(completion_ids)


@pytest.mark.parametrize(
    "reward, needle",
    [
        (huge, "reward function 'huge' returned 1e+308 for sample 1 at step 0, beyond the float32 range"),
        (spread_too_wide, "at step 0 overflow float32 in their weighted sum, spread or group advantages (a NaN"),
        (spread_too_wide, "the largest in size, -3e+38, came from reward function 'spread_too_wide'"),
        ([large, also_large], "overflow float32 in their weighted sum, spread or group advantages"),
    ],
)
def test_a_reward_that_overflows_is_named_at_its_step_with_the_default_logging_steps(tmp_path, tok, reward, needle):
    """Regression: a GRPO reward of 1e308 with the default logging_steps: the NaN step was not caught, and step 2's
    sampler died in torch.multinomial (24 frames)."""
    prompts = [{"prompt": f"{i}+{i}="} for i in range(4)]
    trainer = grpo_trainer(tmp_path, tok, prompts, reward=reward, logging_steps=10, max_steps=3)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(RewardFunctionError) as error:
        trainer.train()
    assert needle in str(error.value) and "\n" not in str(error.value)
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # no NaN reached them


def test_a_nan_loss_on_a_step_that_is_not_logged_stops_before_its_optimizer_step(tmp_path, tok, monkeypatch):
    prompts = [{"prompt": f"{i}+{i}="} for i in range(4)]
    trainer = grpo_trainer(tmp_path, tok, prompts, logging_steps=10, max_steps=3)
    compute_loss = type(trainer).compute_loss

    def nan_at_step_2(self, model, inputs, **kwargs):
        loss = compute_loss(self, model, inputs, **kwargs)
        return loss * float("nan") if self.state.global_step == 1 else loss

    monkeypatch.setattr(type(trainer), "compute_loss", nan_at_step_2)
    with pytest.raises(NonFiniteLossError, match="the training loss became nan at step 2, before its optimizer step"):
        trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


# ---- KTO ----------------------------------------------------------------------------------------------------------
def kto_config(tmp_path, labels: list[str]):
    rows = [(f"{a}+{a}=", str(2 * a) if good == "True" else str(2 * a + 1), good) for a, good in enumerate(labels)]
    (tmp_path / "kto.csv").write_text("prompt,completion,label\n" + "".join(f"{p},{c},{g}\n" for p, c, g in rows))
    config = tmp_path / "kto.yaml"
    config.write_text(
        f"trainer: kto\nmodel: toy:tiny\ndataset: kto.csv\noutput_dir: {tmp_path / 'run'}\nmax_steps: 1\n"
        "per_device_train_batch_size: 4\nlogging_steps: 1\nsave_strategy: 'no'\ndisable_tqdm: true\n"
    )
    return config


def test_kto_labels_read_from_a_csv_as_true_and_false_train_both_kinds(tmp_path):
    """Still open from the third trial: labels read from a CSV as True / False strings were all taken as desirable
    (no rewards/rejected metric). Already parsed on main (kto.desirable); this proves it end to end."""
    from treadle.cli.command import main

    assert main(["train", str(kto_config(tmp_path, ["True", "False", "True", "False"]))]) == 0
    logs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(entry for entry in logs if "loss" in entry)
    assert "rewards/chosen" in step and "rewards/rejected" in step


@pytest.mark.slow
def test_a_kto_label_that_is_not_a_boolean_is_one_line(tmp_path):
    line = error_line(treadle("train", kto_config(tmp_path, ["True", "maybe", "True", "False"]), cwd=tmp_path))
    assert "row 1: label 'maybe' is neither desirable nor undesirable" in line
