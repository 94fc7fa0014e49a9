"""The DPO family of preference losses (and RPO's NLL term, ``sft_loss``): pure functions of tensors and floats.
Papers and TRL names: ``treadle.losses``' docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

DPO_LOSS_TYPES = (
    "sigmoid",
    "robust",
    "hinge",
    "ipo",
    "sigmoid_norm",
    "apo_zero",
    "apo_down",
    "bco_pair",
    "sppo_hard",
    "nca_pair",
    "exo_pair",
    "discopop",
    "aot",
    "aot_unpaired",
    "sft",
)
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# Losses built on the chosen-minus-rejected score, the only ones an f-divergence generalises (as TRL).
F_DIVERGENCE_LOSSES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
SMOOTHING_RULES = {  # the losses that use label_smoothing: (test, allowed range as shown in errors)
    "sigmoid": (lambda e: 0 <= e <= 0.5, "[0, 0.5] (cDPO)"),
    "robust": (lambda e: 0 <= e < 0.5, "[0, 0.5) (it divides by 1 - 2ε)"),
    "exo_pair": (lambda e: 0 < e < 1, "(0, 1); the EXO paper uses 1e-3"),
    "aot": (lambda e: 0 <= e <= 0.5, "[0, 0.5]"),
    "aot_unpaired": (lambda e: 0 <= e <= 0.5, "[0, 0.5]"),
}


def dpo_loss_types(loss_type: str | Sequence[str]) -> tuple[str, ...]:
    """``loss_type`` as a tuple: TRL's ``DPOConfig`` accepts one name or a list of names (MPO)."""
    return (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    label_smoothing: float = 0.0,
    loss_weights: Sequence[float] | None = None,
    chosen_counts: Tensor | None = None,
    rejected_counts: Tensor | None = None,
    discopop_tau: float = 0.05,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair DPO-family losses from summed completion log-probs.

    Args:
        chosen_logps, rejected_logps: ``(B,)`` policy log-probs of the chosen / rejected completions
            (summed over completion tokens).
        ref_chosen_logps, ref_rejected_logps: ``(B,)`` the same under the reference model (no gradient
            is expected to flow through them, none is blocked either).
        beta: the paper's β (> 0). It scales the whole log-ratio difference:
            ``logits = β * ((pc - rc) - (pr - rr))``.
        loss_type: one name or a list of names (MPO), see ``DPO_LOSS_TYPES`` and docs/dpo.md; a list is
            summed with ``loss_weights`` (default 1.0 each).
        label_smoothing: ε, the assumed probability that a label is flipped. ``sigmoid`` with ε > 0 is
            conservative DPO, ``-(1-ε) logσ(z) - ε logσ(-z)`` (needs 0 ≤ ε ≤ 0.5); ``robust`` is the
            unbiased estimator ``((1-ε)(-logσ(z)) + ε logσ(-z)) / (1 - 2ε)`` (needs 0 ≤ ε < 0.5); ``exo_pair``
            needs 0 < ε < 1 (the paper: 1e-3); ``aot`` smooths like cDPO. A list in which no loss uses it
            rejects ε ≠ 0 rather than silently ignore it.
        chosen_counts, rejected_counts: ``(B,)`` completion tokens, for the length-normalised losses
            (``ipo``, ``sigmoid_norm``, ``sft``); None means 1 (the log-probs are used as given).
        discopop_tau: DiscoPOP's τ (0.05).
        f_divergence_type, f_alpha_divergence_coef: f-DPO's regulariser; the log-ratio ``u`` becomes
            ``f'(e^u)`` (``reverse_kl`` keeps ``u``).

    IPO: ``(h - 1/(2β))²`` with ``h`` on per-token means (as TRL; the IPO paper's fixed point ``h = 1/(2β)``
    is on the scale of one token).

    Returns:
        ``(losses, metrics)``: ``losses`` is ``(B,)`` per pair, not reduced (the caller averages or sums it
        to match its normalisation); ``metrics`` holds detached ``(B,)`` tensors ``chosen_rewards =
        β (pc - rc)``, ``rejected_rewards = β (pr - rr)`` and ``logits = β h``.

    >>> z = torch.zeros(2)
    >>> losses, m = dpo_loss(z, z, z, z)
    >>> round(losses[0].item(), 4)  # log 2 when policy == reference
    0.6931
    """
    check_same_shape(
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    types = dpo_loss_types(loss_type)
    check_dpo_options(
        beta,
        types,
        label_smoothing,
        loss_weights=loss_weights,
        discopop_tau=discopop_tau,
        f_divergence_type=f_divergence_type,
        f_alpha_divergence_coef=f_alpha_divergence_coef,
    )
    if (chosen_counts is None) != (rejected_counts is None):
        raise ValueError("pass both chosen_counts and rejected_counts (completion tokens per pair), or neither")
    if chosen_counts is not None:
        check_same_shape(chosen_logps=chosen_logps, chosen_counts=chosen_counts, rejected_counts=rejected_counts)
    one = torch.ones_like(chosen_logps)
    counts = ChosenRejectedCounts(
        *(one if c is None else c.to(chosen_logps.dtype).clamp(min=1) for c in (chosen_counts, rejected_counts))
    )
    chosen_logratios = chosen_logps - ref_chosen_logps  # (B,)
    rejected_logratios = rejected_logps - ref_rejected_logps  # (B,)
    scores = (
        f_divergence_score(chosen_logratios, f_divergence_type, f_alpha_divergence_coef),
        f_divergence_score(rejected_logratios, f_divergence_type, f_alpha_divergence_coef),
    )  # (B,) each
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    losses = torch.zeros_like(chosen_logratios)
    for name, weight in zip(types, weights):
        losses = losses + weight * _one_dpo_loss(
            name,
            beta,
            label_smoothing,
            discopop_tau,
            scores,
            (chosen_logratios, rejected_logratios),
            counts,
            (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps),
        )
    metrics = {
        "chosen_rewards": (beta * chosen_logratios).detach(),
        "rejected_rewards": (beta * rejected_logratios).detach(),
        "logits": (beta * (scores[0] - scores[1])).detach(),
    }
    return losses, metrics


class ChosenRejectedCounts(NamedTuple):
    chosen: Tensor  # (B,) completion tokens, >= 1
    rejected: Tensor  # (B,)


def _one_dpo_loss(name: str, beta: float, eps: float, tau: float, scores, logratios, counts, logps) -> Tensor:
    """One loss type's ``(B,)`` per-pair losses; the formulas are TRL 1.16's (see the module docstring's papers)."""
    chosen_score, rejected_score = scores  # f'(ratio) of each side; the log-ratio for reverse_kl
    chosen_lr, rejected_lr = logratios
    z = beta * (chosen_score - rejected_score)  # (B,)
    if name == "sigmoid":  # cDPO when eps > 0 (TRL 1.16's sigmoid ignores label_smoothing; see docs/dpo.md)
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if name == "robust":
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if name == "hinge":
        return torch.relu(1 - z)
    if name in ("ipo", "sigmoid_norm"):
        h = chosen_score / counts.chosen - rejected_score / counts.rejected  # per-token means
        return (h - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * h)
    if name == "exo_pair":  # KL(softmax(z, -z) || (1 - eps, eps))
        return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (
            F.logsigmoid(-z) - math.log(eps)
        )
    if name == "nca_pair":
        return (
            -F.logsigmoid(beta * chosen_lr)
            - 0.5 * F.logsigmoid(-beta * chosen_lr)
            - 0.5 * F.logsigmoid(-beta * rejected_lr)
        )
    if name == "bco_pair":
        return -F.logsigmoid(beta * chosen_lr) - F.logsigmoid(-beta * rejected_lr)
    if name == "sppo_hard":  # the hard-label form: P(win) = 1, P(lose) = 0
        return (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
    if name == "apo_zero":  # chosen better than the model's own outputs: raise chosen, lower rejected
        return 1 - torch.sigmoid(beta * chosen_lr) + torch.sigmoid(beta * rejected_lr)
    if name == "apo_down":  # chosen worse than the model's outputs: lower both, rejected more
        return torch.sigmoid(beta * chosen_lr) + 1 - torch.sigmoid(beta * (chosen_lr - rejected_lr))
    if name == "discopop":  # blend of logistic and exponential losses, modulated by the margin
        mix = torch.sigmoid(z / tau)
        return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
    if name in ("aot", "aot_unpaired"):  # optimal transport: compare sorted margins (within the batch)
        chosen_logps, rejected_logps, ref_chosen, ref_rejected = logps
        if name == "aot":
            delta = torch.sort(chosen_logps - rejected_logps).values - torch.sort(ref_chosen - ref_rejected).values
        else:
            delta = torch.sort(chosen_lr).values - torch.sort(rejected_lr).values
        return -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    # "sft": the chosen response's per-token NLL (per pair; TRL takes one token mean over the batch)
    return -logps[0] / counts.chosen


def f_divergence_score(logratio: Tensor, f_divergence_type: str = "reverse_kl", alpha: float = 0.5) -> Tensor:
    """f-DPO: ``f'(t)`` at ``t = exp(logratio)``; ``reverse_kl`` gives the log-ratio itself (plain DPO).

    ``forward_kl``: ``1 - 1/t``; ``js_divergence``: ``log 2 + logσ(log t)``; ``alpha_divergence``:
    ``(t^(α-1) - 1)/(α-1)`` (the exponent clamped at 80 so it stays finite, as TRL).

    >>> f_divergence_score(torch.tensor([0.0]), "forward_kl")
    tensor([0.])
    """
    if f_divergence_type == "reverse_kl" or (f_divergence_type == "alpha_divergence" and abs(alpha - 1) < 1e-6):
        return logratio
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratio)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratio)
    exponent = torch.clamp((alpha - 1) * logratio, max=80.0)
    return (torch.exp(exponent) - 1) / (alpha - 1)


def ld_token_weights(chosen_mask: Tensor, rejected_mask: Tensor, ld_alpha: float) -> tuple[Tensor, Tensor]:
    """LD-DPO (https://arxiv.org/abs/2409.06411): per-token weights ``(B, T)`` for each side: 1 on the first
    ``min(len_chosen, len_rejected)`` completion tokens (the shared length), ``ld_alpha`` on the rest ("verbose"
    tail), 0 on padding. Summing log-probs with these weights gives TRL's ``shared + α tail``.

    >>> c, r = ld_token_weights(torch.tensor([[1, 1, 1]]), torch.tensor([[1, 0, 0]]), 0.5)
    >>> c.tolist(), r.tolist()
    ([[1.0, 0.5, 0.5]], [[1.0, 0.0, 0.0]])
    """
    dtype = chosen_mask.dtype if chosen_mask.is_floating_point() else torch.get_default_dtype()

    def weights(mask: Tensor, shared: Tensor) -> Tensor:
        position = mask.cumsum(dim=1)  # (B, T) 1-based index among completion tokens
        inside = mask.bool()
        return (inside & (position <= shared)).to(dtype) + ld_alpha * (inside & (position > shared)).to(dtype)

    shared = torch.minimum(chosen_mask.sum(dim=1), rejected_mask.sum(dim=1)).unsqueeze(1)  # (B, 1)
    return weights(chosen_mask, shared), weights(rejected_mask, shared)


def wpo_weights(chosen_log_weights: Tensor, rejected_log_weights: Tensor) -> Tensor:
    """WPO (https://arxiv.org/abs/2406.11827, Eq. 2): the per-pair weight ``(B,)``, detached, from each side's
    ``(B,)`` mean over completion tokens of ``log p(y_t) - log Σ_v p(v)²`` (the probability "aligned" to the
    policy's own sampling distribution): ``exp(chosen) * exp(rejected)``.

    >>> wpo_weights(torch.tensor([0.0]), torch.tensor([-1.0]))
    tensor([0.3679])
    """
    return torch.exp(chosen_log_weights + rejected_log_weights).detach()


def check_dpo_options(
    beta: float,
    loss_type: str | Sequence[str],
    label_smoothing: float,
    *,
    loss_weights: Sequence[float] | None = None,
    ld_alpha: float | None = None,
    discopop_tau: float = 0.05,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    use_weighting: bool = False,
) -> None:
    """The DPO options' rules, in one place: ``dpo_loss`` and ``DPOConfig`` both check with this."""
    types = dpo_loss_types(loss_type)
    unknown = [t for t in types if t not in DPO_LOSS_TYPES] or ([] if types else [loss_type])
    if unknown:
        raise ValueError(
            f"loss_type={unknown[0]!r} is not supported; valid: {', '.join(DPO_LOSS_TYPES)}, or a list of "
            f"them with loss_weights (add an NLL term on the chosen response with rpo_alpha or 'sft')"
        )
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (typical 0.1), got {beta}")
    if loss_weights is not None and len(loss_weights) != len(types):
        raise ValueError(
            f"loss_weights has {len(loss_weights)} entries for {len(types)} loss types {list(types)}; "
            f"give one weight per loss type (e.g. [0.8, 0.2, 1.0] for MPO)"
        )
    _check_label_smoothing(types, label_smoothing)
    if ld_alpha is not None and not 0 <= ld_alpha <= 1:
        raise ValueError(
            f"ld_alpha must be in [0, 1] (1 weighs the verbose tail fully, 0 drops it) or None, got {ld_alpha}"
        )
    if not discopop_tau > 0:
        raise ValueError(f"discopop_tau must be > 0 (the paper uses 0.05), got {discopop_tau}")
    if f_divergence_type not in F_DIVERGENCES:
        raise ValueError(
            f"f_divergence_type={f_divergence_type!r} is not supported; valid: {', '.join(F_DIVERGENCES)}"
        )
    if f_divergence_type != "reverse_kl" and not set(types) <= F_DIVERGENCE_LOSSES:
        raise ValueError(
            f"f_divergence_type={f_divergence_type!r} works only with {sorted(F_DIVERGENCE_LOSSES)}, "
            f"got {list(types)}; use f_divergence_type='reverse_kl' with these losses"
        )
    if use_weighting and {"aot", "aot_unpaired"} & set(types):
        raise ValueError(
            "use_weighting (WPO) cannot be combined with 'aot'/'aot_unpaired': they sort the pairs, "
            "which would misalign the per-pair weights; drop one of them"
        )


def _check_label_smoothing(types: tuple[str, ...], label_smoothing: float) -> None:
    users = [t for t in types if t in SMOOTHING_RULES]
    if not users and label_smoothing != 0:
        raise ValueError(
            f"loss_type {list(types) if len(types) > 1 else types[0]!r} does not use label_smoothing; "
            f"set it to 0 (got {label_smoothing})"
        )
    for name in users:
        ok, allowed = SMOOTHING_RULES[name]
        if not ok(label_smoothing):
            raise ValueError(f"label_smoothing for {name!r} must be in {allowed}, got {label_smoothing}")


def sft_loss(chosen_logps_sum: Tensor, chosen_token_counts: Tensor) -> Tensor:
    """Per-pair negative log-likelihood per token of the chosen responses (RPO's extra term).

    ``chosen_logps_sum`` ``(B,)`` summed log-probs, ``chosen_token_counts`` ``(B,)`` the number of
    completion tokens in each. Returns ``(B,)``: ``-sum / count``. A count of 0 is treated as 1 (an empty
    completion has a zero sum, so its loss is 0 rather than NaN).

    >>> sft_loss(torch.tensor([-6.0]), torch.tensor([3]))
    tensor([2.])
    """
    check_same_shape(chosen_logps_sum=chosen_logps_sum, chosen_token_counts=chosen_token_counts)
    counts = chosen_token_counts.to(chosen_logps_sum.dtype).clamp(min=1)  # (B,)
    return -chosen_logps_sum / counts


def check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shapes must match: {listed}")
