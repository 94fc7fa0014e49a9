"""The Trainer core: exact gradient accumulation, logging, evaluation, subclassing hooks, errors."""

import copy
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from _factories import lm_rows, sft, tiny_llama

from treadle import Trainer, TrainingArguments
from treadle.callbacks import TrainerCallback
from treadle.data import PaddingCollator
from treadle.errors import NothingTrainedError


def args_for(tmp_path, **kw):
    defaults = dict(
        output_dir=str(tmp_path),
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        learning_rate=1e-2,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
    )
    return TrainingArguments(**{**defaults, **kw})


def reference_token_mean_loss(model, rows):
    """Plain PyTorch: the mean next-token cross-entropy over every label token of ``rows``."""
    total, count = 0.0, 0
    for row in rows:
        ids = torch.tensor([row["input_ids"]])
        logits = model(input_ids=ids).logits[0, :-1]
        labels = torch.tensor(row["labels"][1:])
        total = total + F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    return total / count


class Recorder(TrainerCallback):
    def __init__(self):
        self.events, self.logs = [], []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            events = object.__getattribute__(self, "events")

            def record(args, state, control, **kwargs):
                events.append(name)
                if name == "on_log":
                    object.__getattribute__(self, "logs").append(dict(kwargs["logs"]))

            return record
        return object.__getattribute__(self, name)


# --- exactness -----------------------------------------------------------------------------------------------
def test_gradient_accumulation_matches_the_big_batch_on_variable_lengths(tmp_path):
    rows = lm_rows(16)
    results = []
    for batch, accum in ((8, 1), (2, 4), (1, 8)):
        model = tiny_llama()
        trainer = Trainer(
            model,
            args_for(
                tmp_path / f"{batch}",
                per_device_train_batch_size=batch,
                gradient_accumulation_steps=accum,
                max_steps=2,
                optim="sgd",
                adam_beta1=0.0,
            ),
            train_dataset=rows,
        )
        trainer.train()
        results.append(([h["loss"] for h in trainer.state.log_history if "loss" in h], model.state_dict()))
    (loss_a, w_a), *others = results
    for loss_b, w_b in others:
        assert loss_b == pytest.approx(loss_a, rel=1e-5)
        for k in w_a:
            torch.testing.assert_close(w_b[k], w_a[k], rtol=1e-5, atol=1e-6)


def test_one_step_equals_plain_pytorch_token_mean(tmp_path):
    rows = lm_rows(8)
    model, reference = tiny_llama(), tiny_llama()
    trainer = Trainer(
        model,
        args_for(
            tmp_path,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=1,
            optim="sgd",
            adam_beta1=0.0,
            learning_rate=0.1,
        ),
        train_dataset=rows,
    )
    order = trainer.get_train_dataloader().sampler.indices()
    trainer.train()
    loss = reference_token_mean_loss(reference, [rows[i] for i in order[:8]])
    loss.backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    assert trainer.state.log_history[0]["loss"] == pytest.approx(loss.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


class MeanLossForCausalLM(torch.nn.Module):
    """Returns the mean loss over (shifted) label tokens and cannot take num_items_in_batch. Its name ends with
    ForCausalLM, which tells count_items that labels are shifted (any other model: override count_items)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, labels):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        return {"loss": F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100), "logits": logits}


class SumLossForCausalLM(MeanLossForCausalLM):
    """Opts in to num_items_in_batch and returns sum / num_items_in_batch itself."""

    def forward(self, input_ids, attention_mask, labels, num_items_in_batch=None):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        loss = F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="sum")
        return {"loss": loss / num_items_in_batch}


@pytest.mark.parametrize("module", [MeanLossForCausalLM, SumLossForCausalLM])
def test_plain_modules_get_the_same_exact_accumulation(tmp_path, module):
    rows = lm_rows(8)

    def run(batch, accum):
        model = module(tiny_llama())
        model.inner.config.architectures = None
        Trainer(
            model,
            args_for(
                tmp_path / f"{module.__name__}{batch}",
                per_device_train_batch_size=batch,
                gradient_accumulation_steps=accum,
                max_steps=1,
                optim="sgd",
                adam_beta1=0.0,
            ),
            train_dataset=rows,
        ).train()
        return model.state_dict()

    big, small = run(8, 1), run(2, 4)
    for k in big:
        torch.testing.assert_close(small[k], big[k], rtol=1e-5, atol=1e-6)
    # and both equal the transformers model trained the same way
    hf = tiny_llama()
    Trainer(
        hf,
        args_for(
            tmp_path / "hf",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            max_steps=1,
            optim="sgd",
            adam_beta1=0.0,
        ),
        train_dataset=rows,
    ).train()
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(big[f"inner.{k}"], v, rtol=1e-5, atol=1e-6)


def test_logged_loss_is_the_item_weighted_mean_of_the_logging_window(tmp_path):
    rows = lm_rows(12)
    model = tiny_llama()
    snapshot = copy.deepcopy(model)
    trainer = Trainer(
        model,
        args_for(
            tmp_path,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=1,
            max_steps=3,
            logging_steps=3,
            learning_rate=0.0,
        ),
        train_dataset=rows,
    )
    order = trainer.get_train_dataloader().sampler.indices()
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [3]
    expected = reference_token_mean_loss(snapshot, [rows[i] for i in order[:6]]).item()
    assert logged[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert {"grad_norm", "learning_rate"} <= set(logged[0]) or "learning_rate" in logged[0]
    assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(expected, rel=1e-5)


def test_grad_norm_and_learning_rate_are_logged(tmp_path, rows):
    trainer = Trainer(
        tiny_llama(),
        args_for(tmp_path, max_steps=2, max_grad_norm=1.0, learning_rate=1e-3, lr_scheduler_type="linear"),
        train_dataset=rows,
    )
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["grad_norm"] > 0 and math.isfinite(first["grad_norm"])
    assert first["learning_rate"] == pytest.approx(1e-3)  # the lr step 1 used (linear decay: 1, 1/2), as transformers


def test_loss_decreases_on_a_learnable_task(tmp_path):
    rows = lm_rows(8, min_len=10, max_len=10)
    trainer = Trainer(
        tiny_llama(),
        args_for(tmp_path, per_device_train_batch_size=8, max_steps=30, learning_rate=3e-3, logging_steps=10),
        train_dataset=rows,
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0] - 0.5


# --- evaluation ----------------------------------------------------------------------------------------------
def test_evaluate_returns_prefixed_metrics_and_calls_compute_metrics(tmp_path, rows):
    seen = {}

    def compute_metrics(pred):
        seen["shapes"] = (pred.predictions.shape, pred.label_ids.shape)
        seen["type"] = type(pred.predictions).__module__
        return {"accuracy": float((pred.predictions.argmax(-1)[:, :-1] == pred.label_ids[:, 1:]).mean())}

    recorder = Recorder()
    model = tiny_llama()
    trainer = Trainer(
        model,
        args_for(tmp_path, per_device_eval_batch_size=5),
        eval_dataset=rows,
        compute_metrics=compute_metrics,
        callbacks=[recorder],
    )
    metrics = trainer.evaluate()
    assert set(metrics) == {"eval_loss", "eval_accuracy"}
    assert metrics["eval_loss"] == pytest.approx(reference_token_mean_loss(model, rows).item(), rel=1e-5)
    (pred_shape, label_shape) = seen["shapes"]
    assert pred_shape[:2] == label_shape == (len(rows), 12) and seen["type"] == "numpy"
    assert recorder.events.count("on_prediction_step") == 5 and recorder.events[-1] == "on_evaluate"
    assert model.training  # restored


def test_predict_returns_predictions_and_fires_on_predict(tmp_path, rows):
    recorder = Recorder()
    out = Trainer(tiny_llama(), args_for(tmp_path), callbacks=[recorder]).predict(rows[:3])
    assert out.predictions.shape[0] == 3 and "test_loss" in out.metrics
    assert recorder.events[-1] == "on_predict"


# --- the two subclassing examples of the transformers guide --------------------------------------------------
class MultiBatchTrainer(Trainer):
    """get_train_dataloader override: each micro-batch holds `factor` times the configured rows."""

    factor = 3

    def get_train_dataloader(self):
        dataset = self.remove_unused_columns(self.train_dataset)
        return self.build_dataloader(
            dataset,
            batch_size=self.args.per_device_train_batch_size * self.factor,
            sampler=self.build_sampler(dataset, shuffle=True),
        )


def test_get_train_dataloader_override_changes_the_batch(tmp_path, rows):
    seen = []

    class Spy(MultiBatchTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(inputs["input_ids"].shape[0])
            return super().training_step(model, inputs, num_items_in_batch)

    trainer = Spy(
        tiny_llama(), args_for(tmp_path, per_device_train_batch_size=2, num_train_epochs=1), train_dataset=rows
    )
    trainer.train()
    assert seen == [6, 6, 6, 6] and trainer.state.global_step == 4


class WeightedLossTrainer(Trainer):
    """compute_loss override: a class-weighted cross-entropy, normalised by num_items_in_batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits[:, :-1].float()
        weights = torch.ones(logits.shape[-1])
        weights[:32] = 2.0
        loss = F.cross_entropy(
            logits.transpose(1, 2), labels[:, 1:], weight=weights, ignore_index=-100, reduction="sum"
        )
        loss = loss / (num_items_in_batch or 1)
        return (loss, outputs) if return_outputs else loss


def test_compute_loss_override_is_used(tmp_path, rows):
    a, b = tiny_llama(), tiny_llama()
    Trainer(a, args_for(tmp_path / "a", max_steps=2), train_dataset=rows).train()
    trainer = WeightedLossTrainer(b, args_for(tmp_path / "b", max_steps=2), train_dataset=rows)
    trainer.train()
    assert trainer.state.global_step == 2
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert math.isfinite(trainer.state.log_history[0]["loss"])


# --- precision, memory ---------------------------------------------------------------------------------------
def test_bf16_runs_under_autocast(tmp_path, rows):
    dtypes = []

    class Spy(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, out = super().compute_loss(model, inputs, True, num_items_in_batch)
            dtypes.append(out.logits.dtype)
            return (loss, out) if return_outputs else loss

    model = tiny_llama()
    trainer = Spy(model, args_for(tmp_path, max_steps=2, bf16=True), train_dataset=rows)
    trainer.train()
    assert torch.bfloat16 in dtypes  # the LM head ran under autocast
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_gradient_checkpointing_gives_the_same_weights(tmp_path, rows):
    a, b = tiny_llama(), tiny_llama()
    Trainer(a, args_for(tmp_path / "a", max_steps=2), train_dataset=rows).train()
    Trainer(b, args_for(tmp_path / "b", max_steps=2, gradient_checkpointing=True), train_dataset=rows).train()
    assert b.model.gradient_checkpointing
    for k, v in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[k], v, rtol=1e-5, atol=1e-6)


# --- columns and errors --------------------------------------------------------------------------------------
def test_unused_columns_are_dropped_and_named_once(tmp_path, capsys):
    from datasets import Dataset

    data = Dataset.from_list([{**r, "source": "web", "id": i} for i, r in enumerate(lm_rows(8))])
    trainer = Trainer(tiny_llama(), args_for(tmp_path, max_steps=2, per_device_train_batch_size=2), train_dataset=data)
    trainer.train()
    err = capsys.readouterr().err
    assert err.count("dropping training dataset columns ['source', 'id']") == 1


def test_unused_columns_kept_when_asked(tmp_path):
    from datasets import Dataset

    data = Dataset.from_list([{**r, "id": i} for i, r in enumerate(lm_rows(4))])
    trainer = Trainer(tiny_llama(), args_for(tmp_path, remove_unused_columns=False), train_dataset=data)
    assert "id" in trainer.get_train_dataloader().dataset.column_names


def test_text_only_dataset_fails_before_training_naming_columns(tmp_path):
    from datasets import Dataset

    data = Dataset.from_list([{"text": "hello"}, {"text": "world"}])
    with pytest.raises(ValueError, match=r"\['text'\].*tokenize"):
        Trainer(tiny_llama(), args_for(tmp_path, max_steps=1), train_dataset=data).train()


def test_missing_labels_fails_before_training(tmp_path):
    rows = [{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"]} for r in lm_rows(4)]
    recorder = Recorder()
    trainer = Trainer(tiny_llama(), args_for(tmp_path, max_steps=1), train_dataset=rows, callbacks=[recorder])
    with pytest.raises(ValueError, match=r"\['labels'\].*\['attention_mask', 'input_ids'\]"):
        trainer.train()
    assert "on_train_begin" not in recorder.events


def test_a_broken_collator_is_reported_with_the_columns(tmp_path):
    rows = [{"input_ids": "not ids", "labels": 3}]

    def collate(rows):
        return {"input_ids": torch.tensor([r["input_ids"] for r in rows])}

    with pytest.raises(ValueError, match="collator failed.*input_ids"):
        Trainer(tiny_llama(), args_for(tmp_path, max_steps=1), data_collator=collate, train_dataset=rows).train()


def test_empty_dataset_and_no_dataset_errors(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        Trainer(tiny_llama(), args_for(tmp_path, max_steps=1), train_dataset=[]).train()
    with pytest.raises(ValueError, match="needs a train_dataset"):
        Trainer(tiny_llama(), args_for(tmp_path, max_steps=1)).train()


def test_a_model_without_loss_says_how_to_fix(tmp_path):
    class NoLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x, labels=None):
            return {"logits": self.lin(x)}

    rows = [{"x": [1.0, 2.0], "labels": 1}] * 4
    with pytest.raises(ValueError, match="returned no loss.*override Trainer.compute_loss"):
        Trainer(NoLoss(), args_for(tmp_path, max_steps=1), train_dataset=rows).train()


def test_a_plain_module_returning_a_tuple_trains(tmp_path):
    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def forward(self, x, y):
            pred = self.lin(x).squeeze(-1)
            return F.mse_loss(pred, y), pred

    g = torch.Generator().manual_seed(0)
    xs = torch.randn(64, 2, generator=g)
    rows = [{"x": x, "y": (x @ torch.tensor([2.0, -1.0])) + 0.5} for x in xs]
    model = Regressor()
    trainer = Trainer(
        model,
        args_for(tmp_path, per_device_train_batch_size=16, num_train_epochs=40, learning_rate=0.05, logging_steps=40),
        train_dataset=rows,
    )
    trainer.train()
    torch.testing.assert_close(model.lin.weight.detach(), torch.tensor([[2.0, -1.0]]), atol=0.05, rtol=0)


def test_a_run_that_trained_on_nothing_never_ends_as_if_it_had(tmp_path):
    from treadle.errors import NothingTrainedError, is_user_error

    rows = [{"input_ids": [1, 5, 6, 2], "completion_mask": [0, 0, 0, 0]}] * 4  # not one token with loss
    trainer = sft(tmp_path, rows)
    with pytest.raises(
        NothingTrainedError, match="the run took 2 steps but not one of its batches held a token with loss"
    ) as error:
        trainer.train()
    assert is_user_error(error.value)


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


# --- run record ----------------------------------------------------------------------------------------------
def test_metrics_file_has_one_line_per_log_event(tmp_path, rows):
    trainer = Trainer(
        tiny_llama(),
        args_for(tmp_path, max_steps=4, logging_steps=2, eval_strategy="steps", eval_steps=4),
        train_dataset=rows,
        eval_dataset=rows[:4],
    )
    trainer.train()
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [(r["step"], sorted(k for k in r if k not in ("step", "epoch"))) for r in lines] == [
        (2, ["grad_norm", "learning_rate", "loss"] if "grad_norm" in lines[0] else ["learning_rate", "loss"]),
        (4, sorted(lines[1].keys() - {"step", "epoch"})),
        (4, ["eval_loss"]),
        (4, ["train_loss", "train_runtime", "train_samples_per_second", "train_steps_per_second"]),
    ]
    assert lines == [{**h, "epoch": r["epoch"]} for h, r in zip(trainer.state.log_history, lines)]


def test_collator_pads_labels_with_ignore_index():
    batch = PaddingCollator(pad_token_id=7)(
        [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4], "labels": [4]}]
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 7, 7]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]
    left = PaddingCollator(pad_token_id=7, padding_side="left")([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    assert left["input_ids"].tolist() == [[1, 2], [7, 3]]


def test_wrap_around_rows_of_a_rank_count_nowhere_in_evaluation(tmp_path, rows):
    """Rank 1 of 2 over 5 rows gets rows [1, 3] and a repeat of row 0 (so both ranks run as many forwards);
    the repeat must weigh nothing in the loss and be cut from the predictions."""
    from treadle.data import SeededSampler

    model = tiny_llama()
    trainer = Trainer(model, args_for(tmp_path, per_device_eval_batch_size=2))
    data = rows[:5]
    sampler = SeededSampler(5, shuffle=False, rank=1, world_size=2)
    assert list(sampler) == [1, 3, 0] and sampler.num_real_rows() == 2
    loader = trainer.build_dataloader(data, batch_size=2, sampler=sampler)
    out = trainer.evaluation_loop(loader, prediction_loss_only=False)
    expected = reference_token_mean_loss(model, [data[1], data[3]]).item()
    assert out.metrics["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert out.predictions.shape[0] == 2 and out.label_ids.shape[0] == 2


def test_training_step_works_on_its_own_outside_train(tmp_path):
    """No run state is needed: a lone micro-batch's loss (its share of a window of num_items_in_batch items)
    and its gradient equal plain PyTorch's token sum / num_items_in_batch."""
    rows = lm_rows(4)
    model, reference = tiny_llama(), tiny_llama()
    trainer = Trainer(model, args_for(tmp_path), train_dataset=rows)
    batch = trainer.data_collator(rows)
    items = trainer.count_items(batch)
    loss = trainer.training_step(model, batch, num_items_in_batch=2 * items)  # half of a two-batch window
    expected = reference_token_mean_loss(reference, rows) / 2
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    model.zero_grad()
    mean = trainer.training_step(model, batch)  # no item count: the model's own mean
    assert mean.item() == pytest.approx(2 * expected.item(), rel=1e-5)


def test_a_window_without_loss_items_logs_nothing(tmp_path):
    rows = [{**row, "labels": [-100] * len(row["labels"])} for row in lm_rows(8)]
    trainer = Trainer(tiny_llama(), args_for(tmp_path, max_steps=2, per_device_train_batch_size=4), train_dataset=rows)
    with pytest.raises(NothingTrainedError, match="the run took 2 steps but not one of its batches held a token"):
        trainer.train()  # a run that trained on nothing never ends as if it had (it used to: train_loss nan)
    assert trainer.state.log_history == []  # no {grad_norm, lr} without loss
