"""The reward-model loss (Bradley-Terry on chosen / rejected scores): a pure function of tensors."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from treadle.losses.dpo import check_same_shape


def bradley_terry_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    *,
    margin: Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> Tensor:
    """Per-pair reward-model loss ``(B,)``: ``-logσ(r_c - r_r - margin) + c (r_c + r_r)²`` (Bradley–Terry, with
    the optional ``margin`` ``(B,)`` of Llama 2 and the centring term of https://arxiv.org/abs/2312.09244).

    >>> import torch
    >>> bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.0])).tolist()  # log 2 for a tie
    [0.6931471824645996]
    """
    check_same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    difference = chosen_rewards - rejected_rewards  # (B,)
    if margin is not None:
        difference = difference - margin.to(difference.dtype)
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return losses
