"""What GRPO records of its samples: the metrics of one generation and its completions.jsonl entries (what every
on-policy trainer records, the evaluation sums included, is in trainers/onpolicy/metrics.py). Pure functions of
their arguments, apart from the gathers over ranks."""

from __future__ import annotations

import math

import torch

from treadle import distributed as dist
from treadle.rewards import reward_name, weighted_rewards
from treadle.trainers.onpolicy.data import Rollout
from treadle.trainers.onpolicy.metrics import completion_metrics

__all__ = ["completion_entries", "generation_metrics"]


def generation_metrics(
    metrics: dict, all_rewards: torch.Tensor, rollout: Rollout, reward_funcs: list, weights: list[float]
) -> dict[str, tuple[float, int]]:
    """Reward and length statistics of one generation, over all ranks (means over generations at log time; the
    lengths and ``num_tokens``: ``onpolicy.metrics.completion_metrics``); ``metrics`` are the advantage estimator's,
    ``all_rewards`` (W*N, F) every rank's rewards."""
    sums = {name: (float(value), 1) for name, value in metrics.items()}
    # reward_std means what TRL's means: the std of the whole generation's rewards; the mean of the groups'
    # stds (what group scaling divides by) is logged as reward_group_std
    if "reward_std" in sums:
        sums["reward_group_std"] = sums.pop("reward_std")
    total = weighted_rewards(all_rewards, weights)  # (W*N,)
    sums["reward_std"] = (float(total.std()) if total.numel() > 1 else 0.0, 1)
    for j, fn in enumerate(reward_funcs):
        column = all_rewards[:, j]
        scored = column[~column.isnan()]
        if len(scored):
            sums[f"rewards/{reward_name(fn)}/mean"] = (float(scored.mean()), 1)
            sums[f"rewards/{reward_name(fn)}/std"] = (float(scored.std()) if len(scored) > 1 else 0.0, 1)
    return {**sums, **completion_metrics(rollout), **rollout.rollout_metrics}  # completions/*, num_tokens


def completion_entries(
    rollout: Rollout, rewards: torch.Tensor, advantages: torch.Tensor, names: list[str], step: int
) -> list[dict]:
    """This generation's completions.jsonl entries, every rank's (rank order), on every rank."""
    entries = [
        {
            "step": step,
            "prompt": p,
            "completion": c,
            "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(names, r)},
            "advantage": a,
        }
        for p, c, r, a in zip(rollout.prompts, rollout.completions, rewards.tolist(), advantages.tolist())
    ]
    for entry, transcript in zip(entries, rollout.transcripts or ()):
        entry["transcript"] = transcript  # multi-turn: every turn with its role
    return [r for part in dist.gather_objects(entries) for r in part]
