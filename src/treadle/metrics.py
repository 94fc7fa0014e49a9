"""The metrics window: every windowed metric of every trainer, as ``(sum, count)`` per name, on the device.

A trainer records with one call (``trainer.metrics.add("rewards/chosen", total, count)``) and the base
Trainer does the rest: at log time the window of a mode (``"train"`` or ``"eval"``) is reduced over ranks in
ONE all-reduce, turned into means, and emptied; at checkpoint time its ``state_dict()`` is saved with the
checkpoint, so a resumed run logs exactly the means an uninterrupted run would have logged.

Sums of tensors stay tensors on the device between logs (reading a value every micro-step would make the host
wait for the accelerator), each added in place in float64; Python numbers are summed on the host. At a reduction
the window becomes one ``(M, 2)`` tensor and takes ONE all-reduce.

Under several processes every rank must take part in each reduction (``reduce`` / ``means``), as in any
collective; the ranks agree on the names first, so a rank may record names in any order, or none at all (one
with no evaluation batch), without a hang.

The module also holds the run's other metric rules: the training loss's weighting (``record_loss``), ``num_tokens``
(a run total, not a mean: ``record_num_tokens``), speed metrics, and the unbiased pass@k estimator of GRPO's
evaluation (``pass_at_k``, ``pass_at_k_sums``).

>>> window = MetricWindow()
>>> window.add("accuracy", 3.0, 4.0)
>>> window.add_many({"accuracy": (1.0, 4.0), "length": (12.0, 3.0)})
>>> window.means("train")
{'accuracy': 0.5, 'length': 4.0}
>>> window.means("train")  # a reduction empties the window
{}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from treadle import distributed as dist
from treadle.errors import NonFiniteLossError, NothingTrainedError, resume_hint

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
        self._sums: dict[str, dict[str, list]] = {}  # mode -> name -> [sum, count]: float64 tensors or floats

    def add(self, name: str, total: Number, count: Number = 1, mode: str = "train") -> None:
        """Add ``total`` over ``count`` items to metric ``name`` (its mean is sum of totals / sum of counts)."""
        self.add_many({name: (total, count)}, mode)

    def add_many(self, values: Mapping[str, tuple[Number, Number]], mode: str = "train") -> None:
        """Add ``{name: (total, count)}``. Totals and counts may be Python numbers (added on the host, free) or
        0-d tensors (one in-place add each, in float64 on the window's device: no host-device sync here)."""
        window = self._sums.setdefault(mode, {})
        for name, pair in values.items():
            entry = window.get(name)
            if entry is None:
                window[name] = [_start(v, self.device) for v in pair]
            else:
                entry[0] = _accumulate(entry[0], pair[0], self.device)
                entry[1] = _accumulate(entry[1], pair[1], self.device)

    def reduce(self, mode: str = "train") -> dict[str, tuple[float, float]]:
        """``{name: (sum, count)}`` of the window over all ranks, and an empty window. Names are sorted. Every
        rank must call it; under several processes the ranks first agree on the names (a rank that recorded
        none, e.g. one with no evaluation batch, adds zeros), then take one all-reduce."""
        window = self._sums.pop(mode, {})
        names = sorted(window)
        if dist.get_world_size() > 1:
            names = sorted(set().union(*dist.gather_objects(names)))
        if not names:
            return {}
        totals = dist.all_reduce_sum(self._stacked(window, names)).tolist()
        return {name: (total, count) for name, (total, count) in zip(names, totals)}

    def _stacked(self, window: dict[str, list], names: list[str]) -> torch.Tensor:
        """``(M, 2)`` float64 on the window's device: one row (sum, count) per name (zeros for a name not here)."""
        values = [_as_tensor(v, self.device) for name in names for v in window.get(name, (0.0, 0.0))]
        return torch.stack(values).view(len(names), 2)

    def means(self, mode: str = "train") -> dict[str, float]:
        """The window's mean of each metric over all ranks (see ``reduce``); metrics with no count are left out."""
        return means_of(self.reduce(mode))

    def clear(self, mode: str | None = None) -> None:
        """Forget the window of ``mode`` (every mode when None) without reducing it."""
        if mode is None:
            self._sums.clear()
        else:
            self._sums.pop(mode, None)

    def names(self, mode: str = "train") -> tuple[str, ...]:
        """The metrics recorded in the window of ``mode`` since its last reduction."""
        return tuple(self._sums.get(mode, ()))

    def state_dict(self) -> dict:
        """This rank's unreduced windows as CPU tensors (for ``torch.save`` / ``weights_only`` loading)."""
        return {
            mode: {"names": list(window), "sums": self._stacked(window, list(window)).cpu()}
            for mode, window in self._sums.items()
            if window
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (on the same rank)."""
        self.clear()
        for mode, saved in state.items():
            sums = saved["sums"].to(self.device, torch.float64)
            self._sums[mode] = {
                name: [sums[i, 0].clone(), sums[i, 1].clone()] for i, name in enumerate(saved["names"])
            }


def mode_of(model) -> str:
    """The metrics window a forward of ``model`` records into: "train" in train mode, else "eval"."""
    return "train" if model.training else "eval"


def means_of(sums: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """``{name: sum / count}`` of reduced ``(sum, count)`` pairs; metrics with no count are left out."""
    return {name: total / count for name, (total, count) in sums.items() if count}


def _start(value: Number, device: torch.device):
    """A window's first value: a float64 copy of a tensor on the window's device (later adds are in place, and a
    0-d tensor from any device adds into it), or a float."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, torch.float64, copy=True).reshape(())
    return float(value)


def _accumulate(acc, value: Number, device: torch.device):
    if isinstance(acc, torch.Tensor):
        return acc.add_(value.detach().reshape(()) if isinstance(value, torch.Tensor) else value)
    return _start(value, device).add_(acc) if isinstance(value, torch.Tensor) else acc + float(value)


def _as_tensor(value: Number, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device, torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64, device=device)


# ---------------------------------------------------------------------------------------------------------
# The training loss in the window
# ---------------------------------------------------------------------------------------------------------
def record_loss(
    window: MetricWindow, step_loss: torch.Tensor, num_items: int | None, *, items_are_global: bool
) -> None:
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


NUM_TOKENS = "num_tokens"  # TRL's name: the tokens trained on so far (a run total, see record_num_tokens)


def record_num_tokens(window: MetricWindow, tokens: int) -> None:
    """Add this rank's ``tokens`` to TRL's ``num_tokens``: not a mean but a run total. The window sums them over the
    steps and ranks (count 0, so no mean is taken); each training log adds that sum to ``state.num_tokens`` and logs
    the total (``training_logs``). A trainer that never records it logs no ``num_tokens``; a log window in which
    it recorded none (an on-policy step that sampled nothing new) logs none, as TRL's."""
    window.add(NUM_TOKENS, tokens, 0)


def training_logs(window: MetricWindow, state, grad_norm, learning_rate: float | None) -> dict[str, float] | None:
    """The log of a training window (one all-reduce): the mean loss, ``grad_norm`` and ``learning_rate`` of the
    last step, the run's ``num_tokens`` when recorded (``record_num_tokens``), and the mean of every other metric
    recorded since the last log. None when there is nothing to log (no step since the last log, or no loss item in
    the window's micro-batches: every label masked)."""
    if "loss" not in window.names("train"):
        return None
    sums = window.reduce("train")
    tokens = sums.pop(NUM_TOKENS, None)
    if tokens is not None:  # counted before a window without loss items returns: the run's total stays exact
        state.num_tokens += int(tokens[0])
    logs = fold_loss(state, sums.pop("loss"))
    if not logs:
        return None
    if tokens is not None:
        logs[NUM_TOKENS] = state.num_tokens
    check_logged_loss(logs, state)
    if grad_norm is not None:
        logs["grad_norm"] = float(grad_norm)
    logs["learning_rate"] = learning_rate
    logs.update(means_of(sums))
    return logs


def prediction_output(
    preds: list, labels: list, recorded: dict[str, float], compute_metrics, prefix: str
) -> PredictionOutput:
    """What ``evaluation_loop`` returns: predictions and labels gathered from every rank (padded with -100), and
    the metrics: the loss and what the "eval" window ``recorded``, ``compute_metrics(EvalPrediction)`` when
    given, each named ``{prefix}_<name>``."""
    loss = recorded.pop("loss", None)
    predictions, label_ids = (dist.gather_padded(parts) if parts else None for parts in (preds, labels))
    metrics = {"loss": loss} if loss is not None else {}
    if compute_metrics is not None and predictions is not None and label_ids is not None:
        metrics.update(compute_metrics(EvalPrediction(predictions, label_ids)))
    metrics.update(recorded)
    metrics = {k if k.startswith(f"{prefix}_") else f"{prefix}_{k}": as_float(v) for k, v in metrics.items()}
    return PredictionOutput(predictions, label_ids, metrics)


def fold_loss(state, loss: tuple[float, float]) -> dict[str, float]:
    """Add a reduced window's (loss sum, items) to the run's totals in ``state`` (for ``train_loss``);
    ``{"loss": mean}`` (empty when the window had no items)."""
    total, items = loss
    state.total_loss_sum += total
    state.total_loss_items += items
    return {"loss": total / items} if items else {}


def speed_metrics(start_time: float, steps: int, samples: int, state) -> dict[str, float]:
    """``train_runtime``, samples and steps per second, and ``train_loss`` (the run's item-weighted mean).
    Raises NothingTrainedError when the run took steps without one loss item (``train_loss`` would be NaN): a
    run that trained on nothing never ends as if it had trained (the CLI then saves no model, and exits 2)."""
    import time

    if steps > 0 and not state.total_loss_items:
        raise NothingTrainedError(
            f"the run took {steps} steps but not one of its batches held a token with loss (train_loss is "
            f"undefined), so it trained on nothing and nothing was saved after it; check the dataset: every row's "
            f"loss mask is empty (completion_mask / labels all -100, completions cut away)"
        )
    runtime = time.time() - start_time
    train_loss = state.total_loss_sum / state.total_loss_items if state.total_loss_items else float("nan")
    return {
        "train_runtime": round(runtime, 4),
        "train_samples_per_second": round(samples / max(runtime, 1e-9), 3),
        "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
        "train_loss": train_loss,
    }


# ---------------------------------------------------------------------------------------------------------
# A loss that is not a number
# ---------------------------------------------------------------------------------------------------------
def nonfinite_fix() -> str:
    """What to do about a loss that is not a number; how to resume is ``resume_hint()``'s (a demo is not resumed)."""
    return (
        "lower learning_rate, keep max_grad_norm > 0 (clipping), check the data (e.g. rows with no loss token), or "
        f"set skip_nonfinite_steps: N to skip up to N such steps; from a checkpoint before it: {resume_hint()}"
    )


def check_logged_loss(logs: dict[str, float], state) -> None:
    """Stop (NonFiniteLossError) when the loss logged at ``state.global_step`` is NaN or infinite: nothing is
    saved after it, and the message names the steps of the logging window."""
    import math

    loss = logs.get("loss", logs.get("train_loss"))
    if loss is None or math.isfinite(loss):
        return
    logged = [h["step"] for h in state.log_history if "loss" in h]
    first = logged[-1] + 1 if logged else 1
    steps = f"step {state.global_step}" if first >= state.global_step else f"steps {first}-{state.global_step}"
    raise NonFiniteLossError(
        f"the training loss became {loss} ({steps}); the run stopped without saving after it; {nonfinite_fix()}"
    )


def skip_nonfinite_step(step_loss: torch.Tensor, state, args) -> bool:
    """Whether the optimizer step now ending must be skipped: its loss (this rank's, or any rank's) is NaN or
    infinite and ``args.skip_nonfinite_steps`` allows one more skip (counted in ``state``). Past the budget:
    NonFiniteLossError. One host-device sync per step, only when ``skip_nonfinite_steps`` > 0."""
    import sys

    bad = not bool(torch.isfinite(step_loss))
    if dist.get_world_size() > 1:
        bad = dist.any_rank(bad, step_loss.device)
    if not bad:
        return False
    step = state.global_step + 1
    state.nonfinite_steps_skipped += 1
    if state.nonfinite_steps_skipped > args.skip_nonfinite_steps:
        raise NonFiniteLossError(
            f"the training loss was NaN or infinite at step {step}: "
            f"{state.nonfinite_steps_skipped} such steps, more than skip_nonfinite_steps="
            f"{args.skip_nonfinite_steps} allows; {nonfinite_fix()}"
        )
    if dist.is_main_process():
        print(
            f"treadle: step {step}: the loss is not finite; step skipped ({state.nonfinite_steps_skipped} of "
            f"skip_nonfinite_steps={args.skip_nonfinite_steps})",
            file=sys.stderr,
        )
    return True


def input_tokens(batches: list, how: str, pad_token_id: int | None = None) -> int:
    """This rank's input tokens in ``batches``: ``"all"`` counts every ``input_ids`` entry (padding too),
    ``"non_padding"`` the ``attention_mask`` ones (else the ids that are not ``pad_token_id``). Batches are dicts of
    tensors or typed batches with those fields (GRPO's Sample).

    >>> ids, mask = torch.tensor([[5, 6, 0], [7, 0, 0]]), torch.tensor([[1, 1, 0], [1, 0, 0]])
    >>> input_tokens([{"input_ids": ids, "attention_mask": mask}] * 2, "all")
    12
    >>> input_tokens([{"input_ids": ids, "attention_mask": mask}] * 2, "non_padding")
    6
    >>> input_tokens([{"input_ids": ids}], "non_padding", pad_token_id=0)
    3
    """
    total = 0
    for batch in batches:
        ids, mask = (
            batch.get(k) if isinstance(batch, dict) else getattr(batch, k, None)
            for k in ("input_ids", "attention_mask")
        )
        if not isinstance(ids, torch.Tensor):
            raise ValueError("counting input tokens needs batches with an 'input_ids' tensor")
        if how == "all":
            total += ids.numel()
        elif isinstance(mask, torch.Tensor):
            total += int(mask.sum())
        else:
            total += int(ids.ne(pad_token_id).sum()) if pad_token_id is not None else ids.numel()
    return total


def count_input_tokens(batches: list, args, tokenizer=None) -> int:
    """Input tokens in ``batches`` (one accumulation window), summed over ranks, as transformers counts them for
    ``args.include_num_input_tokens_seen`` (``input_tokens``' rules ``"all"`` and ``"non_padding"``, with the
    tokenizer's pad token); ``"no"`` counts nothing (0)."""
    how = args.include_num_input_tokens_seen
    if how == "no":
        return 0
    try:
        total = input_tokens(batches, how, getattr(tokenizer, "pad_token_id", None))
    except ValueError as error:
        raise ValueError(f"include_num_input_tokens_seen: {error}; set it to 'no'") from None
    if dist.get_world_size() > 1:
        total = int(dist.all_reduce_sum(torch.tensor(total, device=args.device)).item())
    return total


def as_float(value):
    """A metric as a float when it is a number (compute_metrics may return anything)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


# ---------------------------------------------------------------------------------------------------------
# pass@k: how often a policy solves a problem in k tries (GRPO evaluation)
# ---------------------------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` pass (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code", https://arxiv.org/abs/2107.03374, eq. 1): the probability that at least
    one of ``k`` samples drawn without replacement from the ``n`` passes, ``1 - C(n - c, k) / C(n, k)``.
    Exact integer binomials, so any ``n`` is safe. Its mean over problems estimates pass@k without the bias of
    ``1 - (1 - c/n)^k``.

    >>> pass_at_k(8, 2, 1)  # pass@1 is the fraction that passes
    0.25
    >>> round(pass_at_k(8, 2, 4), 6)  # 1 - C(6, 4) / C(8, 4) = 1 - 15 / 70
    0.785714
    >>> pass_at_k(8, 5, 4)  # fewer than k failures: some pass in every draw of 4
    1.0
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_sums(rewards: torch.Tensor, threshold: float, ks) -> dict[int, tuple[float, int]]:
    """``{k: (sum over problems of pass@k, problems)}`` for ``rewards`` ``(P, n)``: n sampled rewards per problem,
    NaN where unscored; a sample passes when its reward >= ``threshold``. A problem with fewer than k scored
    samples has no pass@k estimate and is left out of that k's count (sums, so that batches and ranks add up)."""
    scored = (~rewards.isnan()).sum(dim=1).tolist()  # (P,)
    passed = (rewards >= threshold).sum(dim=1).tolist()  # NaN >= t is False: unscored never passes
    out = {}
    for k in ks:
        values = [pass_at_k(n, c, k) for n, c in zip(scored, passed) if n >= k]
        out[k] = (sum(values), len(values))
    return out
