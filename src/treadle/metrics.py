"""The metrics window: every windowed metric of every trainer, as ``(sum, count)`` per name, on the device.

A trainer records with one call (``trainer.metrics.add("rewards/chosen", total, count)``) and the base
Trainer does the rest: at log time the window of a mode (``"train"`` or ``"eval"``) is reduced over ranks in
ONE all-reduce, turned into means, and emptied; at checkpoint time its ``state_dict()`` is saved with the
checkpoint, so a resumed run logs exactly the means an uninterrupted run would have logged.

Sums stay tensors on the device between logs: reading a value every micro-step would make the host wait for
the accelerator. A batch's metrics are added as one ``(M, 2)`` tensor, not M scalar operations (a few dozen
scalar operations per step cost a visible share of a tiny model's step, benchmarks/trainers.py).

Every rank must record the same names before a reduction (the all-reduce adds the windows position by
position); names are sorted before reducing, so the order in which they were recorded does not matter.

>>> window = MetricWindow()
>>> window.add("accuracy", 3.0, 4.0)
>>> window.add_many({"accuracy": (1.0, 4.0), "length": (12.0, 3.0)})
>>> window.means("train")
{'accuracy': 0.5, 'length': 4.0}
>>> window.means("train")  # a reduction empties the window
{}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from treadle import distributed as dist

Number = float | int | torch.Tensor


class EvalPrediction(NamedTuple):
    """What ``compute_metrics`` receives: numpy arrays gathered over the evaluation set (padded with -100)."""

    predictions: Any
    label_ids: Any


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


class PredictionOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict[str, float]


class MetricWindow:
    """Running ``(sum, count)`` per metric name and mode since the last reduction."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._names: dict[str, tuple[str, ...]] = {}  # mode -> names, in the row order of _sums
        self._sums: dict[str, torch.Tensor] = {}  # mode -> (M, 2) float64: sum, count

    def add(self, name: str, total: Number, count: Number = 1, mode: str = "train") -> None:
        """Add ``total`` over ``count`` items to metric ``name`` (its mean is sum of totals / sum of counts)."""
        self.add_many({name: (total, count)}, mode)

    def add_many(self, values: Mapping[str, tuple[Number, Number]], mode: str = "train") -> None:
        """Add ``{name: (total, count)}`` in one tensor operation. Totals and counts may be Python numbers or
        0-d tensors (kept on their device until the reduction: no host-device sync here)."""
        if not values:
            return
        names = tuple(values)
        parts = [v for pair in values.values() for v in pair]
        if any(isinstance(v, torch.Tensor) for v in parts):
            batch = torch.stack([_as_tensor(v, self.device) for v in parts])
        else:
            batch = torch.tensor(parts, dtype=torch.float64)
        self._merge(mode, names, batch.to(self.device, torch.float64).view(len(names), 2))

    def _merge(self, mode: str, names: tuple[str, ...], batch: torch.Tensor) -> None:
        old_names = self._names.get(mode)
        if old_names is None:
            self._names[mode], self._sums[mode] = names, batch.clone()
        elif old_names == names:  # the usual case: the same metrics every step
            self._sums[mode] += batch
        else:  # new names (a metric that only some batches have): widen the window
            union = tuple(dict.fromkeys(old_names + names))
            merged = torch.zeros(len(union), 2, dtype=torch.float64, device=self.device)
            merged[[union.index(n) for n in old_names]] += self._sums[mode]
            merged[[union.index(n) for n in names]] += batch
            self._names[mode], self._sums[mode] = union, merged

    def reduce(self, mode: str = "train") -> dict[str, tuple[float, float]]:
        """``{name: (sum, count)}`` of the window over all ranks (one all-reduce: every rank must call it),
        and an empty window. Names are sorted."""
        names, sums = self._names.pop(mode, ()), self._sums.pop(mode, None)
        if sums is None:
            return {}
        order = sorted(range(len(names)), key=names.__getitem__)
        totals = dist.all_reduce_sum(sums[order].to(self.device)).tolist()
        return {names[i]: (total, count) for i, (total, count) in zip(order, totals)}

    def means(self, mode: str = "train") -> dict[str, float]:
        """The window's mean of each metric over all ranks (see ``reduce``); metrics with no count are left out."""
        return {name: total / count for name, (total, count) in self.reduce(mode).items() if count}

    def clear(self, mode: str | None = None) -> None:
        """Forget the window of ``mode`` (every mode when None) without reducing it."""
        for m in [mode] if mode is not None else list(self._sums):
            self._names.pop(m, None)
            self._sums.pop(m, None)

    def names(self, mode: str = "train") -> tuple[str, ...]:
        """The metrics recorded in the window of ``mode`` since its last reduction."""
        return self._names.get(mode, ())

    def state_dict(self) -> dict:
        """This rank's unreduced windows as CPU tensors (for ``torch.save`` / ``weights_only`` loading)."""
        return {mode: {"names": list(self._names[mode]), "sums": sums.cpu()} for mode, sums in self._sums.items()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (on the same rank)."""
        self.clear()
        for mode, saved in state.items():
            self._names[mode] = tuple(saved["names"])
            self._sums[mode] = saved["sums"].to(self.device, torch.float64)


def _as_tensor(value: Number, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64, device=device)


# ---------------------------------------------------------------------------------------------------------
# The training loss in the window
# ---------------------------------------------------------------------------------------------------------
def record_loss(window: MetricWindow, step_loss: torch.Tensor, num_items: int | None, *,
                items_are_global: bool) -> None:
    """Add one optimizer step's loss (this rank's sum of its micro-batches' losses) to ``window``, weighted so
    that the logged loss is the mean over every item of the logging window, over all ranks.

    With ``num_items`` (the window's items), ``step_loss`` is this rank's item sum / num_items: the sum goes
    in as is, and the count once -- from rank 0 when ``num_items`` already counts every rank's items
    (``average_tokens_across_devices``), from each rank otherwise. Without it, each step is one item per rank
    (the mean of its micro-batches' means)."""
    if num_items is None:
        window.add("loss", step_loss, 1)
    else:
        window.add("loss", step_loss * num_items, num_items if dist.is_main_process() or not items_are_global else 0)


def fold_loss(state, loss: tuple[float, float]) -> dict[str, float]:
    """Add a reduced window's (loss sum, items) to the run's totals in ``state`` (for ``train_loss``);
    ``{"loss": mean}`` (empty when the window had no items)."""
    total, items = loss
    state.total_loss_sum += total
    state.total_loss_items += items
    return {"loss": total / items} if items else {}


def speed_metrics(start_time: float, steps: int, samples: int, state) -> dict[str, float]:
    """``train_runtime``, samples and steps per second, and ``train_loss`` (the run's item-weighted mean)."""
    import time

    runtime = time.time() - start_time
    train_loss = state.total_loss_sum / state.total_loss_items if state.total_loss_items else float("nan")
    return {"train_runtime": round(runtime, 4), "train_samples_per_second": round(samples / max(runtime, 1e-9), 3),
            "train_steps_per_second": round(steps / max(runtime, 1e-9), 3), "train_loss": train_loss}
