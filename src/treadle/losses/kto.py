"""KTO and unpaired APO-zero: per-row losses from unpaired, labelled completions. Pure functions of tensors.

KTO, Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306 (Eq. 7); APO-zero unpaired, D'Oosterlinck et al.
2024, https://arxiv.org/abs/2408.06266 (Eq. 7, unpaired). For row i with summed completion log-probs of the
policy ``p_i`` and of the reference ``r_i``, the log-ratio ``u_i = p_i - r_i`` and the reference point ``z``
(KTO's KL estimate, detached, >= 0):

- ``kto``: desirable rows ``w_d (1 - σ(β (u_i - z)))``, undesirable rows ``w_u (1 - σ(β (z - u_i)))``;
- ``apo_zero_unpaired``: desirable ``w_d (1 - σ(β u_i))``, undesirable ``w_u σ(β u_i)`` (no reference point).

The reward of a row is ``β u_i`` (detached), as TRL reports it.
"""

from __future__ import annotations

import torch
from torch import Tensor

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kto_uses_kl(loss_type: str) -> bool:
    """Whether ``loss_type`` needs KTO's reference point, the KL estimate from mismatched pairs (as TRL)."""
    return loss_type == "kto"


def check_kto_options(loss_type: str, beta: float, desirable_weight: float, undesirable_weight: float) -> None:
    """ValueError, naming the fix, for an unknown loss type or a non-positive β or weight."""
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not a KTO loss; use one of {list(KTO_LOSS_TYPES)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (typical 0.1), got {beta}")
    for name, weight in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if not weight > 0:
            raise ValueError(f"{name} must be > 0 (1.0 weighs both kinds alike), got {weight}")


def kto_kl(kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """This batch's KL estimate before gathering: the mean over rows ``(B,)`` of the policy's minus the
    reference's summed log-probs of mismatched (prompt, completion) pairs, detached. The trainer averages it
    over ranks and clamps the result at 0 (``kto_loss`` takes that as ``kl``).

    >>> kto_kl(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0]))
    tensor(0.)
    """
    return (kl_logps - ref_kl_logps).mean().detach()


def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    kl: Tensor | float,
    *,
    beta: float = 0.1,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Per-row KTO-family losses, not reduced, and the rows' rewards.

    Args:
        logps, ref_logps: ``(B,)`` summed completion log-probs of the policy and of the reference.
        labels: ``(B,)`` bool, True for a desirable completion.
        kl: the reference point z (a float or a 0-d tensor; no gradient flows through it); ignored by
            ``apo_zero_unpaired``.
        beta, loss_type, desirable_weight, undesirable_weight: as ``KTOConfig``.

    Returns ``(losses (B,), rewards (B,))``: the weighted loss of each row and ``β (logps - ref_logps)``
    detached.

    >>> losses, rewards = kto_loss(torch.zeros(2), torch.zeros(2), torch.tensor([True, False]), 0.0)
    >>> losses
    tensor([0.5000, 0.5000])
    """
    check_kto_options(loss_type, beta, desirable_weight, undesirable_weight)
    if not (logps.shape == ref_logps.shape == labels.shape) or logps.dim() != 1:
        raise ValueError(
            f"logps, ref_logps and labels must all be (B,); got {tuple(logps.shape)}, "
            f"{tuple(ref_logps.shape)}, {tuple(labels.shape)}"
        )
    labels = labels.to(torch.bool)
    logratios = logps - ref_logps  # (B,)
    if kto_uses_kl(loss_type):
        z = torch.as_tensor(kl, dtype=logratios.dtype, device=logratios.device).detach()
        desirable = 1 - torch.sigmoid(beta * (logratios - z))
        undesirable = 1 - torch.sigmoid(beta * (z - logratios))
    else:
        desirable = 1 - torch.sigmoid(beta * logratios)
        undesirable = torch.sigmoid(beta * logratios)
    losses = torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)  # (B,)
    return losses, beta * logratios.detach()


__all__ = ["KTO_LOSS_TYPES", "check_kto_options", "kto_kl", "kto_loss", "kto_uses_kl"]
