"""What every on-policy trainer records (GRPO, distillation): a generation's completion lengths and tokens
(``completion_metrics``), the step clock (``StepClock``: TRL's ``step_time``), evaluation sums (mean reward, pass@k)
and ``compute_metrics`` over every rank's evaluation samples. Pure functions of their arguments, apart from the
gathers over ranks."""

from __future__ import annotations

import math

import torch

from treadle import distributed as dist
from treadle.metrics import NUM_TOKENS, pass_at_k_sums
from treadle.rewards import METRICS_ARGUMENTS, call_compute_metrics, weighted_rewards
from treadle.trainers.onpolicy.data import Rollout

__all__ = ["StepClock", "completion_metrics", "custom_eval_metrics", "reward_sums"]


def completion_metrics(rollout: Rollout) -> dict[str, tuple[float, int]]:
    """TRL's length metrics of one training generation, every rank's completions together, and its ``num_tokens``.

    A completion's length is its sampled tokens, EOS included (multi-turn: not the tool results or observations fed
    between turns, as TRL's ``tool_mask``); ``completions/mean_length``, ``/min_length``, ``/max_length`` over the
    generation's completions, ``/clipped_ratio`` the fraction with no EOS within ``max_completion_length``, and
    ``/mean_terminated_length``, ``/min_terminated_length``, ``/max_terminated_length`` over those that ended with
    EOS (all three 0 when none did, as TRL). Each is one value per generation (``(value, 1)``: the log shows their
    mean over the generations since the last log). ``num_tokens`` adds this rank's prompt tokens and completion
    lengths to the run's total (``metrics.record_num_tokens``: summed over ranks; counted once per generation,
    however many times its samples are trained on, as TRL)."""
    generation = rollout.generation
    lengths_here = rollout.loss_mask.sum(dim=1).float().cpu()  # (N,) before any masking of the loss
    lengths = dist.gather_rows(lengths_here)  # (W*N,)
    truncated = dist.gather_rows(generation.is_truncated.bool().cpu())  # (W*N,)
    terminated = lengths[~truncated] if not truncated.all() else torch.zeros(1)
    return {
        NUM_TOKENS: (float(generation.prompt_mask.sum()) + float(lengths_here.sum()), 0),
        "completions/mean_length": (float(lengths.mean()), 1),
        "completions/min_length": (float(lengths.min()), 1),
        "completions/max_length": (float(lengths.max()), 1),
        "completions/clipped_ratio": (float(truncated.float().mean()), 1),
        "completions/mean_terminated_length": (float(terminated.mean()), 1),
        "completions/min_terminated_length": (float(terminated.min()), 1),
        "completions/max_terminated_length": (float(terminated.max()), 1),
    }


class StepClock:
    """TRL's ``step_time``: the wall time, in seconds, of one optimizer step's work before its optimizer update --
    its window's ``prepare_window`` (sampling and scoring, when the window starts a generation; TRL samples inside
    ``training_step``) and each of its micro-batches' ``training_step`` (forward and backward) -- without the
    gradient clipping, the optimizer step or the callbacks. Host time, as TRL's: no wait for the accelerator.

    >>> clock = StepClock()
    >>> clock.start(2.0, micro_steps=2)  # prepare_window took 2 s; two micro-batches follow
    >>> clock.add(0.5) is None  # the first one took 0.5 s
    True
    >>> clock.add(0.25)  # the last one: the step's time
    2.75
    >>> clock.add(1.0) is None  # a training_step outside a window is not timed
    True
    """

    def __init__(self):
        self.seconds, self.left = 0.0, 0

    def start(self, seconds: float, micro_steps: int) -> None:
        """A window starts: ``seconds`` spent preparing it, ``micro_steps`` training steps to come."""
        self.seconds, self.left = seconds, micro_steps

    def add(self, seconds: float) -> float | None:
        """One training step took ``seconds``: the step's total after its window's last one, else None."""
        if self.left <= 0:
            return None
        self.seconds += seconds
        self.left -= 1
        return self.seconds if self.left == 0 else None


def reward_sums(
    rewards: torch.Tensor,
    weights: list[float],
    names: list[str],
    group: int,
    ks,
    threshold: float,
    pass_key: str = "pass@{k}",
) -> dict[str, tuple[float, int]]:
    """``{metric: (sum, count)}`` of the mean reward and pass@k of the weighted total (``reward``, ``pass@k``) and
    of each function (``rewards/<name>/mean``, ``rewards/<name>/pass@k``) for ``rewards`` ``(N, F)``, N = prompts x
    ``group`` samples in a row; unscored (NaN) samples count in no mean and never pass."""
    columns = [("reward", "", weighted_rewards(rewards, weights))]  # (N,) each
    columns += [(f"rewards/{name}/mean", f"rewards/{name}/", rewards[:, j]) for j, name in enumerate(names)]
    out = {}
    for mean_key, stem, values in columns:
        out[mean_key] = (float(values.nan_to_num(0.0).sum()), int((~values.isnan()).sum()))
        for k, pair in pass_at_k_sums(values.view(-1, group), threshold, ks).items():
            out[stem + pass_key.format(k=k)] = pair
    return out


def custom_eval_metrics(
    compute_metrics, batches: list[dict | None], names: list[str], weights: list[float]
) -> dict[str, float]:
    """``compute_metrics`` on every sampled evaluation completion of every rank (called on each rank with the
    same arguments, so every rank logs the same values)."""
    mine = [b for b in batches if b is not None]
    parts = [b for rank_batches in dist.gather_objects(mine) for b in rank_batches]
    rewards = torch.tensor([r for b in parts for r in b["rewards"]], dtype=torch.float64).view(-1, len(names))
    columns = {key: [v for b in parts for v in b["columns"][key]] for key in (parts[0]["columns"] if parts else ())}
    clash = sorted(set(columns) & set(METRICS_ARGUMENTS))
    if clash:
        raise ValueError(
            f"evaluation column(s) {clash} clash with compute_metrics' own arguments "
            f"{list(METRICS_ARGUMENTS)}; rename the column(s)"
        )
    return call_compute_metrics(
        compute_metrics,
        prompts=[p for b in parts for p in b["prompts"]],
        completions=[c for b in parts for c in b["completions"]],
        completion_ids=[ids for b in parts for ids in b["completion_ids"]],
        rewards={name: [None if math.isnan(v) else v for v in rewards[:, j].tolist()] for j, name in enumerate(names)},
        reward=weighted_rewards(rewards, weights).tolist(),
        **columns,
    )
