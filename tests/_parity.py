"""The whole-run harness of the transformers parity tests: one tiny Llama trained by transformers.Trainer and by
treadle's Trainer with the same arguments, rows in the same order."""

import copy

import transformers
from _factories import tiny_llama

import treadle
from treadle.data import collator_for


class InOrder(treadle.Trainer):
    """treadle's Trainer reading the training rows in order (transformers: train_sampling_strategy="sequential")."""

    def build_sampler(self, dataset, *, shuffle):
        return super().build_sampler(dataset, shuffle=False)


COMMON = dict(
    per_device_train_batch_size=2,
    per_device_eval_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=4,
    learning_rate=1e-2,
    warmup_steps=1,
    lr_scheduler_type="cosine",
    weight_decay=0.1,
    max_grad_norm=0.5,
    seed=0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    dataloader_pin_memory=False,
)


def run_both(tmp_path, rows, eval_rows=None, model=None, **overrides):
    """(transformers' trainer, treadle's trainer) after training copies of ``model`` (default: a tiny Llama) with the
    same arguments."""
    from datasets import Dataset

    model = tiny_llama() if model is None else model
    kwargs = {**COMMON, **overrides}
    collator = collator_for(None)  # the same padded batches for both
    hf_args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, train_sampling_strategy="sequential", **kwargs
    )
    hf = transformers.Trainer(
        model=copy.deepcopy(model),
        args=hf_args,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None,
        data_collator=collator,
    )
    hf.train()
    ours = InOrder(
        copy.deepcopy(model),
        treadle.TrainingArguments(output_dir=str(tmp_path / "treadle"), **kwargs),
        train_dataset=rows,
        eval_dataset=eval_rows,
        data_collator=collator,
    )
    ours.train()
    return hf, ours


def train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h and "eval_loss" not in h]
