"""SFTTrainer: tokenisation of the three dataset forms, completion-only labels, truncation, packing without
cross-row attention, exact training against plain PyTorch, token accuracy, and errors."""

import copy

import pytest
import torch
import torch.nn.functional as F
from _factories import sft, tiny_llama

from treadle import SFTConfig, SFTTrainer
from treadle.data import SeededSampler
from treadle.demos import toy
from treadle.trainers.sft import (
    SFTCollator,
    dataset_form,
    pack_rows,
    token_accuracy_counts,
    tokenize_messages,
    tokenize_prompt_completion,
    tokenize_text,
)

EOS = 2
VOCAB = 103  # the toy tokenizer's


@pytest.fixture(scope="module")
def tokenizer():
    return toy.build_tokenizer()


def ids_of(text):
    """Toy tokenizer ids worked out by hand from its documented layout (7 specials, then the characters)."""
    return [7 + toy.CHARACTERS.index(c) for c in text]


def config(tmp_path, **kw):
    defaults = dict(
        output_dir=str(tmp_path),
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
    )
    return SFTConfig(**{**defaults, **kw})


PAIRS = [
    {"prompt": f"{a}+{b}=", "completion": str(a + b)}
    for a, b in [
        (1, 2),
        (12, 30),
        (7, 45),
        (99, 99),
        (3, 3),
        (50, 6),
        (18, 27),
        (64, 1),
        (9, 9),
        (10, 90),
        (2, 71),
        (40, 4),
    ]
]


# ---- the dataset forms --------------------------------------------------------------------------------------
def test_prompt_completion_rows_mask_the_prompt_and_end_with_eos(tokenizer):
    [(ids, mask)] = tokenize_prompt_completion(tokenizer, ["12+3="], ["15"])
    assert ids == ids_of("12+3=") + ids_of("15") + [EOS]
    assert mask == [0, 0, 0, 0, 0, 1, 1, 1]
    [(_, mask_all)] = tokenize_prompt_completion(tokenizer, ["12+3="], ["15"], completion_only=False)
    assert mask_all == [1] * 8


def test_text_rows_get_eos_once(tokenizer):
    rows = tokenize_text(tokenizer, ["ab", "ab</s>"])
    assert rows == [(ids_of("ab") + [EOS], [1, 1, 1])] * 2


def test_chat_rows_follow_the_template_and_can_train_only_on_the_assistant(tokenizer):
    chat = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    # template: <|user|> content \n <|assistant|> content </s>
    expected = [5] + ids_of("1+2=\n") + [6] + ids_of("3") + [EOS]
    [(ids, mask)] = tokenize_messages(tokenizer, [chat])
    assert ids == expected and mask == [1] * len(expected)
    [(ids, mask)] = tokenize_messages(tokenizer, [chat], assistant_only=True)
    assert ids == expected and mask == [0] * 7 + [1, 1]


def test_chat_prompt_completion_is_split_after_the_generation_prompt(tokenizer):
    prompt = [{"role": "user", "content": "1+2="}]
    completion = [{"role": "assistant", "content": "3"}]
    [(ids, mask)] = tokenize_prompt_completion(tokenizer, [prompt], [completion])
    assert ids == [5] + ids_of("1+2=\n") + [6] + ids_of("3") + [EOS]  # the template's eos is not doubled
    assert mask == [0] * 7 + [1, 1]


def test_a_chat_completion_ends_where_the_template_ends_the_turn(tokenizer):
    """ChatML ends a turn with eos and then a newline: nothing is appended after the newline (SmolLM2 showed a
    second eos there, a token the model never sees after a turn at inference; TRL appends none)."""
    chatml = copy.copy(tokenizer)
    chatml.chat_template = (
        "{% for m in messages %}{{ m['role'] + ':' + m['content'] + '</s>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    )
    prompt, completion = [{"role": "user", "content": "1+2="}], [{"role": "assistant", "content": "3"}]
    [(ids, mask)] = tokenize_prompt_completion(chatml, [prompt], [completion])
    assert ids[-3:] == ids_of("3") + [EOS] + ids_of("\n") and mask[-3:] == [1, 1, 1]
    assert ids.count(EOS) == 2  # the user's turn and the assistant's, no third
    [(text_ids, _)] = tokenize_prompt_completion(chatml, ["1+2="], ["3\n"])
    assert text_ids[-2:] == ids_of("\n") + [EOS]  # a text completion still gets its eos


@pytest.mark.parametrize(
    "columns, form",
    [(["prompt", "completion", "x"], "prompt_completion"), (["messages"], "messages"), (["text", "id"], "text")],
)
def test_dataset_form_is_read_from_the_columns(columns, form):
    assert dataset_form(columns) == form


@pytest.mark.parametrize(
    "columns, needle",
    [(["prompt"], "'completion'"), (["completion"], "'prompt'"), (["question", "answer"], "none of its columns")],
)
def test_missing_columns_are_named(columns, needle):
    with pytest.raises(ValueError, match=needle) as error:
        dataset_form(columns)
    assert str(columns) in str(error.value)


def test_the_missing_column_message_names_each_other_form_once():
    for field, names in (("text", "a 'text' or 'messages' column"), ("messages", "a 'messages' column")):
        with pytest.raises(ValueError) as error:
            dataset_form(["prompt"], text_field=field)
        assert str(error.value).endswith(names)


def test_missing_columns_fail_in_the_constructor(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"'body'.*dataset_text_field"):
        SFTTrainer(
            tiny_llama(vocab_size=VOCAB), config(tmp_path), train_dataset=[{"body": "x"}], processing_class=tokenizer
        )


def test_other_text_field_and_truncation(tmp_path, tokenizer):
    trainer = SFTTrainer(
        tiny_llama(vocab_size=VOCAB),
        config(tmp_path, dataset_text_field="body", max_length=4),
        train_dataset=[{"body": "abcdef"}, {"body": "ab"}],
        processing_class=tokenizer,
    )
    assert trainer.train_dataset["input_ids"] == [ids_of("abcd"), ids_of("ab") + [EOS]]


def test_pretokenized_rows_pass_through(tmp_path):
    rows = [{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]}, {"input_ids": [9, 10]}]
    trainer = SFTTrainer(tiny_llama(), config(tmp_path), train_dataset=rows)
    assert trainer.train_dataset["completion_mask"] == [[0, 0, 1, 1], [1, 1]]


def test_a_tokenizer_is_needed_for_text(tmp_path):
    with pytest.raises(ValueError, match="processing_class"):
        SFTTrainer(tiny_llama(), config(tmp_path), train_dataset=[{"text": "a"}])


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(packing=True, max_length=None), "packing=True needs max_length"),
        (dict(max_length=1), "max_length must be"),
    ],
)
def test_config_validation_says_how_to_fix(tmp_path, kw, needle):
    with pytest.raises(ValueError, match=needle):
        config(tmp_path, **kw)


def test_a_plain_training_arguments_is_refused(tmp_path, tokenizer):
    from treadle import TrainingArguments

    with pytest.raises(TypeError, match="SFTConfig"):
        SFTTrainer(
            tiny_llama(vocab_size=VOCAB), TrainingArguments(output_dir=str(tmp_path)), processing_class=tokenizer
        )


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


# ---- collation ----------------------------------------------------------------------------------------------
def test_collator_builds_labels_from_the_completion_mask():
    batch = SFTCollator(pad_token_id=0)(
        [{"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}, {"input_ids": [8, 9], "completion_mask": [1, 1]}]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, 9, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert "position_ids" not in batch


# ---- packing ------------------------------------------------------------------------------------------------
def test_best_fit_decreasing_packing_by_hand():
    rows = [([1] * 5, [1] * 5), ([2] * 3, [0, 1, 1]), ([3] * 2, [1, 1]), ([4] * 4, [1] * 4)]
    # decreasing: 5 (row 0) opens bin A (3 left), 4 (row 3) opens bin B (4 left), 3 (row 1) fits A exactly,
    # 2 (row 2) goes to B, the only bin with room
    packed = pack_rows(rows, 8)
    assert packed["input_ids"] == [[1] * 5 + [2] * 3, [4] * 4 + [3] * 2]
    assert packed["position_ids"] == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1]]
    assert packed["completion_mask"] == [[0, 1, 1, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 1]]


def test_packing_refuses_rows_longer_than_max_length():
    with pytest.raises(ValueError, match="more than max_length"):
        pack_rows([([1] * 5, [1] * 5)], 4)


def per_token_losses(model, input_ids, labels, **kw):
    # use_cache=False as in Trainer.compute_loss: transformers reads packed rows from position_ids only
    # when there is no cache (and no attention_mask)
    logits = model(input_ids=input_ids, use_cache=False, **kw).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_do_not_attend_across_rows(attention):
    model = tiny_llama(vocab_size=VOCAB).eval()
    model.config._attn_implementation = attention
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(7, VOCAB, (n,), generator=g).tolist(), [1] * n) for n in (9, 4, 6, 7, 3)]
    packed = pack_rows(rows, 16)
    assert len(packed["input_ids"]) < len(rows)  # something was packed together
    batch = SFTCollator()([{k: v[i] for k, v in packed.items()} for i in range(len(packed["input_ids"]))])
    with torch.no_grad():
        together = per_token_losses(model, batch["input_ids"], batch["labels"], position_ids=batch["position_ids"])
        plain = per_token_losses(model, batch["input_ids"], batch["labels"])  # no position ids: leaks
        alone = {tuple(ids): per_token_losses(model, torch.tensor([ids]), torch.tensor([ids]))[0] for ids, _ in rows}
    found = 0
    for r, positions in enumerate(batch["position_ids"].tolist()):
        starts = [t for t, p in enumerate(positions) if p == 0] + [len(positions)]
        for start, end in zip(starts, starts[1:]):
            ids = tuple(batch["input_ids"][r, start:end].tolist())
            if ids not in alone:
                continue  # padding
            found += 1
            # the loss at t predicts token t+1: a row's own predictions are positions start .. end-2
            torch.testing.assert_close(together[r, start : end - 1], alone[ids], rtol=1e-5, atol=1e-5)
            if start > 0:
                assert together[r, start - 1].item() == 0.0  # no label across the boundary
                assert not torch.allclose(plain[r, start : end - 1], alone[ids], atol=1e-3)  # the test can fail
    assert found == len(rows)


def test_the_trainer_loss_of_a_packed_batch_is_that_of_the_rows_alone(tmp_path, tokenizer):
    model = tiny_llama(vocab_size=VOCAB)
    rows = PAIRS[:6]
    packed = SFTTrainer(
        model, config(tmp_path, packing=True, max_length=24), train_dataset=rows, processing_class=tokenizer
    )
    alone = SFTTrainer(model, config(tmp_path), train_dataset=rows, processing_class=tokenizer)
    assert len(packed.train_dataset) < len(alone.train_dataset)
    with torch.no_grad():
        loss_packed = packed.compute_loss(model, packed.data_collator(list(packed.train_dataset)))
        loss_alone = alone.compute_loss(model, alone.data_collator(list(alone.train_dataset)))
    assert loss_packed.item() == pytest.approx(loss_alone.item(), rel=1e-5)


def test_packed_training_sees_every_row_once(tmp_path, tokenizer):
    trainer = SFTTrainer(
        tiny_llama(vocab_size=VOCAB),
        config(tmp_path, packing=True, max_length=32),
        train_dataset=PAIRS,
        processing_class=tokenizer,
    )
    unpacked = tokenize_prompt_completion(tokenizer, [r["prompt"] for r in PAIRS], [r["completion"] for r in PAIRS])
    assert sorted(sum(trainer.train_dataset["input_ids"], [])) == sorted(sum((ids for ids, _ in unpacked), []))
    assert all(len(ids) <= 32 for ids in trainer.train_dataset["input_ids"])
    # label tokens: each row's completion (the first token of each packed row is never a label)
    labels = sum(sum(m) for m in trainer.train_dataset["completion_mask"])
    assert labels == sum(sum(m) for _, m in unpacked)
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))


# ---- training -----------------------------------------------------------------------------------------------
def test_training_equals_plain_pytorch_on_completion_tokens(tmp_path, tokenizer):
    """Two SGD steps of 2 x 2 accumulated rows against a hand-written loop: completion tokens + eos only."""
    model = tiny_llama(vocab_size=VOCAB)
    reference = copy.deepcopy(model)
    trainer = SFTTrainer(
        model,
        config(tmp_path, optim="sgd", adam_beta1=0.0, learning_rate=0.5, gradient_accumulation_steps=2),
        train_dataset=PAIRS,
        processing_class=tokenizer,
    )
    trainer.train()
    order = SeededSampler(len(PAIRS), seed=42).indices()
    losses = []
    for step in range(2):
        window = [PAIRS[i] for i in order[4 * step : 4 * step + 4]]
        total, count = 0.0, 0
        for row in window:
            prompt, completion = ids_of(row["prompt"]), ids_of(row["completion"]) + [EOS]
            logits = reference(input_ids=torch.tensor([prompt + completion])).logits[0]
            predicted = logits[len(prompt) - 1 : -1]  # the logits that predict the completion tokens
            total = total + F.cross_entropy(predicted, torch.tensor(completion), reduction="sum")
            count += len(completion)
        loss = total / count
        reference.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.5 * p.grad
        losses.append(loss.item())
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert logged == pytest.approx(losses, rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_every_parameter_changes_and_the_loss_falls(tmp_path, tokenizer):
    model = tiny_llama(vocab_size=VOCAB)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = SFTTrainer(
        model,
        config(tmp_path, max_steps=30, per_device_train_batch_size=4, learning_rate=1e-2),
        train_dataset=PAIRS,
        processing_class=tokenizer,
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert set(changed) == set(before)


def test_chat_datasets_train(tmp_path, tokenizer):
    data = toy.load_task("addition", kind="chat", n=8)
    trainer = SFTTrainer(
        tiny_llama(vocab_size=VOCAB),
        config(tmp_path, assistant_only_loss=True),
        train_dataset=data,
        processing_class=tokenizer,
    )
    assert sum(trainer.train_dataset["completion_mask"][0]) == len(data[0]["messages"][1]["content"]) + 1
    trainer.train()
    assert trainer.state.global_step == 2


def test_token_accuracy_counts_by_hand():
    logits = torch.full((1, 4, 5), -1.0)
    for t, token in enumerate([1, 2, 3, 0]):
        logits[0, t, token] = 1.0  # argmax predictions 1, 2, 3 (the last position predicts nothing)
    labels = torch.tensor([[-100, 1, 0, 3]])  # targets 1 (right), 0 (wrong), 3 (right)
    assert token_accuracy_counts(logits, labels).tolist() == [2.0, 3.0]


def test_eval_reports_loss_and_token_accuracy_like_plain_pytorch(tmp_path, tokenizer):
    model = tiny_llama(vocab_size=VOCAB)
    trainer = SFTTrainer(
        model,
        config(tmp_path, per_device_eval_batch_size=3),
        train_dataset=PAIRS,
        eval_dataset=PAIRS[:5],
        processing_class=tokenizer,
    )
    metrics = trainer.evaluate()
    total, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for row in PAIRS[:5]:
            prompt, completion = ids_of(row["prompt"]), ids_of(row["completion"]) + [EOS]
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            total += F.cross_entropy(logits, torch.tensor(completion), reduction="sum").item()
            correct += int((logits.argmax(-1) == torch.tensor(completion)).sum())
            count += len(completion)
    assert metrics["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert metrics["eval_mean_token_accuracy"] == pytest.approx(correct / count)
    # raw rows handed to evaluate() are tokenised the same way
    assert trainer.evaluate(PAIRS[:5]) == pytest.approx(metrics)


def test_training_logs_token_accuracy(tmp_path, tokenizer):
    trainer = SFTTrainer(
        tiny_llama(vocab_size=VOCAB), config(tmp_path), train_dataset=PAIRS, processing_class=tokenizer
    )
    trainer.train()
    accuracies = [h["mean_token_accuracy"] for h in trainer.state.log_history if "loss" in h]
    assert len(accuracies) == 2 and all(0.0 <= a <= 1.0 for a in accuracies)


def test_a_local_model_folder_loads_with_its_tokenizer(tmp_path, tokenizer):
    model = toy.build_model("tiny", tokenizer=tokenizer)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    trainer = SFTTrainer(str(tmp_path / "m"), config(tmp_path / "out"), train_dataset=PAIRS[:4])
    assert trainer.processing_class.eos_token_id == EOS
    torch.testing.assert_close(trainer.model.model.embed_tokens.weight, model.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="model folder .*missing not found, and it is not a Hugging Face model id"):
        SFTTrainer(str(tmp_path / "missing"), config(tmp_path / "out"), train_dataset=PAIRS[:4])


# ------------------------------------------------------------------------------------ golden regression
GOLDEN_SFT = [4.540508270263672, 4.215397119522095, 3.943326473236084, 3.8179378509521484, 3.695596218109131]


def test_golden_losses_of_a_fixed_seed(tmp_path):
    """The first 5 logged losses of a fixed-seed run (toy model, accumulation 2), recorded before the metrics
    window and loop refactor: any change to the loss, the data order or the loop shows up here."""
    tok = toy.build_tokenizer()
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=5,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        learning_rate=3e-3,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
    )
    trainer = SFTTrainer(
        toy.build_model("tiny", tokenizer=tok, seed=0),
        args,
        train_dataset=toy.load_task("addition", n=64),
        processing_class=tok,
    )
    trainer.train()
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h] == pytest.approx(GOLDEN_SFT, rel=1e-5)
