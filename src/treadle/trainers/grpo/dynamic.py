"""Dynamic sampling (DAPO, Yu et al. 2025, https://arxiv.org/abs/2503.14476, section 3.2): a group whose
rewards are all equal has zero advantages and only dilutes the batch, so it is dropped and more prompts are
sampled until the batch is full again (``GRPOConfig.dynamic_sampling``).

How it is done here (and how it departs from DAPO's recipe):

1. Each process keeps or drops whole groups of its own rows (its rows hold whole groups: ``GRPOConfig`` checks
   it), so every rank ends with the same number of groups and the batch shapes never change: the accumulation
   window's normaliser and every slice stay exact.
2. Extra prompts come from a seeded draw over the whole dataset, keyed by (``seed``, generation, round), the same
   on every rank, not from the dataloader's stream: the epoch's data order, the step plan and exact resume are
   untouched. A prompt may so be seen twice in an epoch.
3. Rounds go on while any rank is short, at most ``dynamic_sampling_max_rounds`` extra ones. A rank still short
   then fills its batch with dropped groups whose loss mask is zero: they are never trained on (no loss, no
   tokens in the normaliser), and ``dynamic_sampling/unfilled_fraction`` says how much of the batch they are.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from treadle import distributed as dist
from treadle.errors import PreflightError
from treadle.losses import zero_spread_groups
from treadle.rewards import weighted_rewards
from treadle.streaming import is_stream
from treadle.trainers.onpolicy.data import Rollout, join_rows

__all__ = ["check_stream", "extra_rows", "fill_with_signal"]

Draw = Callable[[int], tuple[Rollout, torch.Tensor]]  # round -> (its rollout, its rewards (N, F))


def check_stream(dataset, args) -> None:
    """Extra prompts are drawn from the whole dataset, which a stream does not allow: refused in one line."""
    if args.dynamic_sampling and is_stream(dataset):
        raise PreflightError(
            "dynamic_sampling draws extra prompts from the whole dataset, which a stream does not "
            "allow; set dynamic_sampling: false or give a datasets.Dataset"
        )


def extra_rows(dataset, *, seed: int, generation: int, round_: int, group: int, rows_per_rank: int) -> list[dict]:
    """This rank's rows of extra round ``round_`` of ``generation``: distinct prompts drawn by a generator seeded
    by (seed, generation, round), the same on every rank, each ``group`` times in a row; rank r keeps rows
    ``r * rows_per_rank ..`` as ``RepeatSampler`` does."""
    world, rank = dist.get_world_size(), dist.get_rank()
    prompts = rows_per_rank * world // group
    picker = random.Random(f"dynamic/{seed}/{generation}/{round_}")
    indices = picker.sample(range(len(dataset)), min(prompts, len(dataset)))
    indices += [
        picker.randrange(len(dataset)) for _ in range(prompts - len(indices))
    ]  # a dataset smaller than a batch
    rows = [i for i in indices for _ in range(group)][rank * rows_per_rank : (rank + 1) * rows_per_rank]
    return [dataset[i] for i in rows]


def fill_with_signal(
    rollout: Rollout,
    rewards: torch.Tensor,
    draw: Draw,
    *,
    weights: list[float],
    group: int,
    max_rounds: int,
    pad_token_id: int,
    device,
) -> tuple[Rollout, torch.Tensor, torch.Tensor, dict]:
    """Keep this rank's groups whose rewards differ, drawing extra rounds (``draw(round)``) while any rank is short
    and at most ``max_rounds`` times. Returns the batch (as many rows as ``rollout``), its rewards ``(N, F)``, a
    ``(N,)`` bool of the rows to train on (False: a filler group, loss-masked) and the metrics
    (``dynamic_sampling/rounds``, ``/dropped_fraction``, ``/unfilled_fraction``) as window pairs."""
    needed = rewards.shape[0] // group
    pool, kept, drawn, dropped = [(rollout, rewards)], [], 0, 0
    rounds = 0
    while True:
        current, scores = pool[-1]
        signal = ~zero_spread_groups(weighted_rewards(scores, weights), group)  # (n/G,)
        drawn, dropped = drawn + len(signal), dropped + int((~signal).sum())
        room = needed - len(kept)
        kept += [(len(pool) - 1, int(g)) for g in signal.nonzero().flatten().tolist()][:room]
        if rounds == max_rounds or not dist.any_rank(len(kept) < needed, device):
            break
        rounds += 1
        pool.append(draw(rounds) if len(kept) < needed else (current, scores[:0]))  # a full rank draws nothing
    fillers = [(0, g) for g in range(needed) if (0, g) not in kept][: needed - len(kept)]
    groups = kept + fillers
    parts = [(pool[i][0], list(range(g * group, (g + 1) * group))) for i, g in groups]
    batch = join_rows(parts, pad_token_id)
    batch_rewards = torch.cat([pool[i][1][g * group : (g + 1) * group] for i, g in groups])
    train = torch.tensor([i < len(kept) for i in range(len(groups)) for _ in range(group)])
    metrics = {
        "dynamic_sampling/rounds": (float(rounds), 1),
        "dynamic_sampling/dropped_fraction": (dropped, drawn),
        "dynamic_sampling/unfilled_fraction": (len(fillers), needed),
    }
    return batch, batch_rewards, train, metrics
