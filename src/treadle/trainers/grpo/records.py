"""What GRPO records of its samples: the metrics of one generation and the completions.jsonl records (what every
on-policy trainer records, the evaluation sums included, is in trainers/onpolicy/records.py). Pure functions of
their arguments, apart from the gathers over ranks."""

from __future__ import annotations

import math

import torch

from treadle import distributed as dist
from treadle.rewards import reward_name, weighted_rewards
from treadle.trainers.onpolicy.data import Rollout
from treadle.trainers.onpolicy.records import completion_metrics

__all__ = ["completion_records", "generation_metrics"]


def generation_metrics(
    metrics: dict, all_rewards: torch.Tensor, rollout: Rollout, reward_funcs: list, weights: list[float]
) -> dict[str, tuple[float, int]]:
    """Reward and length statistics of one generation, over all ranks (means over generations at log time; the
    lengths and ``num_tokens``: ``onpolicy.records.completion_metrics``); ``metrics`` are the advantage estimator's,
    ``all_rewards`` (W*N, F) every rank's rewards."""
    record = {name: (float(value), 1) for name, value in metrics.items()}
    # reward_std means what TRL's means: the std of the whole generation's rewards; the mean of the groups'
    # stds (what group scaling divides by) is logged as reward_group_std
    if "reward_std" in record:
        record["reward_group_std"] = record.pop("reward_std")
    total = weighted_rewards(all_rewards, weights)  # (W*N,)
    record["reward_std"] = (float(total.std()) if total.numel() > 1 else 0.0, 1)
    for j, fn in enumerate(reward_funcs):
        column = all_rewards[:, j]
        scored = column[~column.isnan()]
        if len(scored):
            record[f"rewards/{reward_name(fn)}/mean"] = (float(scored.mean()), 1)
            record[f"rewards/{reward_name(fn)}/std"] = (float(scored.std()) if len(scored) > 1 else 0.0, 1)
    return {**record, **completion_metrics(rollout), **rollout.rollout_metrics}  # completions/*, num_tokens


def completion_records(
    rollout: Rollout, rewards: torch.Tensor, advantages: torch.Tensor, names: list[str], step: int
) -> list[dict]:
    """This generation's completions.jsonl records, every rank's (rank order), on every rank."""
    records = [
        {
            "step": step,
            "prompt": p,
            "completion": c,
            "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(names, r)},
            "advantage": a,
        }
        for p, c, r, a in zip(rollout.prompts, rollout.completions, rewards.tolist(), advantages.tolist())
    ]
    for record, transcript in zip(records, rollout.transcripts or ()):
        record["transcript"] = transcript  # multi-turn: every turn with its role
    return [r for part in dist.gather_objects(records) for r in part]
