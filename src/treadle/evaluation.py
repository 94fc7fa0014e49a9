"""The Trainer's evaluation and prediction methods, in a room of their own (``trainer.Trainer`` inherits them; they
are overridable like the loop's, under transformers' names): ``evaluate`` (the loss and ``compute_metrics`` over an
evaluation set, logged; every ``evaluate``, an override's too, ends in ``log_evaluation``), ``predict``, and the
``evaluation_loop`` over ``prediction_step``. They read the Trainer's attributes and call its public methods
(``compute_loss``, ``count_items``, ``prepare_inputs``, ``autocast``, ``log``, the dataloader builders)."""

from __future__ import annotations

import torch

from treadle import data, models
from treadle.metrics import PredictionOutput, prediction_output

__all__ = ["Evaluation"]


class Evaluation:
    """The evaluation half of ``Trainer`` (see the module docstring)."""

    scored_only = False  # True: evaluation asks compute_loss for the mean loss alone (DPO, KTO, reward models)

    def get_eval_dataloader(self, eval_dataset=None):
        """The evaluation DataLoader over ``eval_dataset`` (or the Trainer's), in order, split across ranks."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (pass one to Trainer or to evaluate)")
        return self._ordered_dataloader(dataset, "evaluation")

    def get_test_dataloader(self, test_dataset):
        """The prediction DataLoader over ``test_dataset``, in order, split across ranks."""
        return self._ordered_dataloader(test_dataset, "prediction")

    def _ordered_dataloader(self, dataset, description: str):
        dataset = self.remove_unused_columns(dataset, description)
        sampler = self.build_sampler(dataset, shuffle=False) if hasattr(dataset, "__len__") else None
        return self.build_dataloader(dataset, batch_size=self.args.per_device_eval_batch_size, sampler=sampler)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """``{prefix}_loss`` (item-weighted mean) and ``{prefix}_<metric>`` of ``compute_metrics``, logged."""
        self.callback_handler.eval_dataloader = dataloader = self.get_eval_dataloader(eval_dataset)
        output = self.evaluation_loop(dataloader, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        return self.log_evaluation(output.metrics)

    def log_evaluation(self, metrics: dict[str, float]) -> dict[str, float]:
        """The end of every ``evaluate`` (an override's too): log ``metrics``, fire ``on_evaluate``, return them."""
        self.log(metrics)
        self._event("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions (numpy, padded with -100), labels and metrics on ``test_dataset``; fires ``on_predict``."""
        self.callback_handler.eval_dataloader = dataloader = self.get_test_dataloader(test_dataset)
        output = self.evaluation_loop(
            dataloader, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, prediction_loss_only=False
        )
        self._event("on_predict", metrics=output.metrics)
        return output

    def evaluation_loop(
        self, dataloader, *, ignore_keys=None, metric_key_prefix="eval", prediction_loss_only=None
    ) -> PredictionOutput:
        """Run ``prediction_step`` over ``dataloader``, moving predictions to the CPU batch by batch. The loss and
        what the "eval" window records meanwhile (SFT token accuracy, DPO rewards) are reduced once at the end."""
        if prediction_loss_only is None:  # evaluate(): logits are gathered only when compute_metrics wants them
            prediction_loss_only = self.args.prediction_loss_only or self.compute_metrics is None
        self.metrics.clear("eval")
        preds, labels = [], []
        with models.eval_mode(self.model_wrapped):
            for inputs, keep in data.eval_batches(dataloader, self.args.label_names[0]):
                items = self.count_items(inputs)
                weight = items if items is not None else (data.batch_rows(inputs) if keep is None else keep)
                loss, logits, label = self.prediction_step(
                    self.model_wrapped, inputs, prediction_loss_only, ignore_keys=ignore_keys
                )
                if loss is not None:  # a batch of repeated rows only (no weight) adds 0, not its 0/0 mean
                    self.metrics.add("loss", loss.double() * weight if weight else 0.0, weight, mode="eval")
                if logits is not None:
                    preds.append(data.to_cpu(logits)[:keep])
                if label is not None:
                    labels.append(data.to_cpu(label)[:keep])
                self._event("on_prediction_step")
        return prediction_output(preds, labels, self.metrics.means("eval"), self.compute_metrics, metric_key_prefix)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """(loss, logits, labels) for one evaluation batch, without gradients. The loss is the model's mean over
        the batch's items; logits are its outputs other than the loss (and ``ignore_keys``), none if
        ``scored_only``."""
        inputs = self.prepare_inputs(inputs)
        has_labels = isinstance(inputs, dict) and all(inputs.get(k) is not None for k in self.args.label_names)
        with torch.no_grad(), self.autocast():
            if has_labels or self.scored_only:  # a scored trainer's batch holds what its loss needs, never labels
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
                loss = loss.detach().float()
            else:
                loss, outputs = None, model(**inputs)
        if prediction_loss_only or self.scored_only:
            return loss, None, None
        labels = inputs[self.args.label_names[0]] if has_labels else None
        return loss, models.logits_of(outputs, ignore_keys), labels
