"""Pure loss functions for preference optimisation (DPO family) and group-relative policy optimisation.

Everything here takes tensors and floats and returns tensors: no model, no trainer, no distributed calls.
Shapes are written next to the code (``# (B, T)``); ``B`` is the batch (pairs or completions), ``T`` the
completion length.

Papers:

- DPO, Rafailov et al. 2023, https://arxiv.org/abs/2305.18290 (the ``sigmoid`` loss).
- cDPO, conservative DPO, Mitchell 2023 (https://ericmitchell.ai/cdpo.pdf): ``sigmoid`` with
  ``label_smoothing`` = the probability that a preference label is flipped.
- IPO, Azar et al. 2023, https://arxiv.org/abs/2310.12036 (the ``ipo`` loss).
- Robust DPO, Chowdhury et al. 2024, https://arxiv.org/abs/2403.00409 (the ``robust`` loss).
- SLiC-style hinge loss (Zhao et al. 2023, https://arxiv.org/abs/2305.10425), the ``hinge`` loss.
- RPO, Pang et al. 2024, https://arxiv.org/abs/2404.19733: DPO plus an NLL term on the chosen response
  (``sft_loss``).
- GRPO, Shao et al. 2024 (DeepSeekMath), https://arxiv.org/abs/2402.03300: group advantages, clipped ratio,
  k3 KL to a reference.
- DAPO, Yu et al. 2025, https://arxiv.org/abs/2503.14476: token-level normalisation, asymmetric clipping
  (``epsilon_high`` > ``epsilon_low``).
- Dr. GRPO, Liu et al. 2025, https://arxiv.org/abs/2503.20783: no std scaling, constant normaliser.
- k3 KL estimator: J. Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html

The wider table (issue 17; each behind TRL 1.16's config name and default):

- GSPO, Zheng et al. 2025, https://arxiv.org/abs/2507.18071: ``importance_sampling_level="sequence"``, one
  ratio per sequence from the length-averaged log-ratio.
- CISPO, MiniMax-M1 2025, https://arxiv.org/abs/2506.13585: ``loss_type="cispo"``, REINFORCE weighted by the
  clipped, detached importance ratio (``epsilon_high`` is the cap, ~5; ScaleRL https://arxiv.org/abs/2510.13786).
- SAPO, Gao et al. 2025, https://arxiv.org/abs/2511.20347: ``loss_type="sapo"``, a soft sigmoid gate
  instead of the hard clip (``sapo_temperature_pos`` / ``_neg``).
- Two-sided clipping, INTELLECT-2 2025, https://arxiv.org/abs/2505.07291: ``delta`` caps the ratio of
  negative-advantage tokens too.
- High-entropy minority tokens, Wang et al. 2025, https://arxiv.org/abs/2506.01939: ``top_entropy_quantile``.
- Off-policy sequence masking and the bias-corrected KL, DeepSeek-V3.2 2025, https://arxiv.org/abs/2512.02556:
  ``off_policy_mask_threshold``, ``use_bias_correction_kl``.
- GDPO, 2026, https://arxiv.org/abs/2601.05242: ``multi_objective_aggregation="normalize_then_sum"``.
- RLOO, Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740: the leave-one-out baseline
  (``advantage_estimator="rloo"``).
- DPO family: SimPO-style length normalisation (``sigmoid_norm``, Meng et al. 2024,
  https://arxiv.org/abs/2405.14734), APO (``apo_zero`` / ``apo_down``, D'Oosterlinck et al. 2024,
  https://arxiv.org/abs/2408.06266), BCO (``bco_pair``, Jung et al. 2024, https://arxiv.org/abs/2404.04656),
  SPPO (``sppo_hard``, Wu et al. 2024, https://arxiv.org/abs/2405.00675), NCA (``nca_pair``, Chen et al. 2024,
  https://arxiv.org/abs/2402.05369), EXO (``exo_pair``, Ji et al. 2024, https://arxiv.org/abs/2402.00856),
  DiscoPOP (``discopop``, Chris Lu et al. 2024, https://arxiv.org/abs/2406.08414), AOT (``aot``,
  ``aot_unpaired``, Melnyk et al. 2024, https://arxiv.org/abs/2406.05882), MPO (a list of losses with
  ``loss_weights``, Wang et al. 2024, https://arxiv.org/abs/2411.10442), LD-DPO (``ld_alpha``, Liu et al. 2024,
  https://arxiv.org/abs/2409.06411), WPO (``use_weighting``, Zhou et al. 2024, https://arxiv.org/abs/2406.11827),
  f-DPO (``f_divergence_type``, Wang et al. 2023, https://arxiv.org/abs/2309.16240).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "sigmoid_norm", "apo_zero", "apo_down", "bco_pair",
                  "sppo_hard", "nca_pair", "exo_pair", "discopop", "aot", "aot_unpaired", "sft")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
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


# --------------------------------------------------------------------------------------------- DPO family


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
    _check_same_shape(chosen_logps=chosen_logps, rejected_logps=rejected_logps,
                      ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    types = dpo_loss_types(loss_type)
    check_dpo_options(beta, types, label_smoothing, loss_weights=loss_weights, discopop_tau=discopop_tau,
                      f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef)
    if (chosen_counts is None) != (rejected_counts is None):
        raise ValueError("pass both chosen_counts and rejected_counts (completion tokens per pair), or neither")
    if chosen_counts is not None:
        _check_same_shape(chosen_logps=chosen_logps, chosen_counts=chosen_counts, rejected_counts=rejected_counts)
    one = torch.ones_like(chosen_logps)
    counts = ChosenRejectedCounts(*(one if c is None else c.to(chosen_logps.dtype).clamp(min=1)
                                    for c in (chosen_counts, rejected_counts)))
    chosen_logratios = chosen_logps - ref_chosen_logps  # (B,)
    rejected_logratios = rejected_logps - ref_rejected_logps  # (B,)
    scores = (f_divergence_score(chosen_logratios, f_divergence_type, f_alpha_divergence_coef),
              f_divergence_score(rejected_logratios, f_divergence_type, f_alpha_divergence_coef))  # (B,) each
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    losses = torch.zeros_like(chosen_logratios)
    for name, weight in zip(types, weights):
        losses = losses + weight * _one_dpo_loss(name, beta, label_smoothing, discopop_tau, scores,
                                                 (chosen_logratios, rejected_logratios), counts,
                                                 (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps))
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
        return (torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps))
                + torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps)))
    if name == "nca_pair":
        return -F.logsigmoid(beta * chosen_lr) - 0.5 * F.logsigmoid(-beta * chosen_lr) - 0.5 * F.logsigmoid(
            -beta * rejected_lr)
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


def check_dpo_options(beta: float, loss_type: str | Sequence[str], label_smoothing: float, *,
                      loss_weights: Sequence[float] | None = None, ld_alpha: float | None = None,
                      discopop_tau: float = 0.05, f_divergence_type: str = "reverse_kl",
                      f_alpha_divergence_coef: float = 0.5, use_weighting: bool = False) -> None:
    """The DPO options' rules, in one place: ``dpo_loss`` and ``DPOConfig`` both check with this."""
    types = dpo_loss_types(loss_type)
    unknown = [t for t in types if t not in DPO_LOSS_TYPES] or ([] if types else [loss_type])
    if unknown:
        raise ValueError(f"loss_type={unknown[0]!r} is not supported; valid: {', '.join(DPO_LOSS_TYPES)}, or a list of "
                         f"them with loss_weights (add an NLL term on the chosen response with rpo_alpha or 'sft')")
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (typical 0.1), got {beta}")
    if loss_weights is not None and len(loss_weights) != len(types):
        raise ValueError(f"loss_weights has {len(loss_weights)} entries for {len(types)} loss types {list(types)}; "
                         f"give one weight per loss type (e.g. [0.8, 0.2, 1.0] for MPO)")
    _check_label_smoothing(types, label_smoothing)
    if ld_alpha is not None and not 0 <= ld_alpha <= 1:
        raise ValueError(f"ld_alpha must be in [0, 1] (1 weighs the verbose tail fully, 0 drops it) or None, "
                         f"got {ld_alpha}")
    if not discopop_tau > 0:
        raise ValueError(f"discopop_tau must be > 0 (the paper uses 0.05), got {discopop_tau}")
    if f_divergence_type not in F_DIVERGENCES:
        raise ValueError(f"f_divergence_type={f_divergence_type!r} is not supported; valid: {', '.join(F_DIVERGENCES)}")
    if f_divergence_type != "reverse_kl" and not set(types) <= F_DIVERGENCE_LOSSES:
        raise ValueError(f"f_divergence_type={f_divergence_type!r} works only with {sorted(F_DIVERGENCE_LOSSES)}, "
                         f"got {list(types)}; use f_divergence_type='reverse_kl' with these losses")
    if use_weighting and {"aot", "aot_unpaired"} & set(types):
        raise ValueError("use_weighting (WPO) cannot be combined with 'aot'/'aot_unpaired': they sort the pairs, "
                         "which would misalign the per-pair weights; drop one of them")


def _check_label_smoothing(types: tuple[str, ...], label_smoothing: float) -> None:
    users = [t for t in types if t in SMOOTHING_RULES]
    if not users and label_smoothing != 0:
        raise ValueError(f"loss_type {list(types) if len(types) > 1 else types[0]!r} does not use label_smoothing; "
                         f"set it to 0 (got {label_smoothing})")
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
    _check_same_shape(chosen_logps_sum=chosen_logps_sum, chosen_token_counts=chosen_token_counts)
    counts = chosen_token_counts.to(chosen_logps_sum.dtype).clamp(min=1)  # (B,)
    return -chosen_logps_sum / counts


def bradley_terry_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, *, margin: Tensor | None = None,
                       center_rewards_coefficient: float | None = None) -> Tensor:
    """Per-pair reward-model loss ``(B,)``: ``-logσ(r_c - r_r - margin) + c (r_c + r_r)²`` (Bradley–Terry, with
    the optional ``margin`` ``(B,)`` of Llama 2 and the centring term of https://arxiv.org/abs/2312.09244).

    >>> bradley_terry_loss(torch.tensor([0.0]), torch.tensor([0.0])).tolist()  # log 2 for a tie
    [0.6931471824645996]
    """
    _check_same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    difference = chosen_rewards - rejected_rewards  # (B,)
    if margin is not None:
        difference = difference - margin.to(difference.dtype)
    losses = -F.logsigmoid(difference)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return losses


# ------------------------------------------------------------------------------------------ GRPO family


def group_advantages(
    rewards: Tensor,
    num_generations: int,
    *,
    scale_rewards: str = "group",
    eps: float = 1e-4,
    advantage_estimator: str = "grpo",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Group-relative advantages: each reward minus its group's mean (or, for RLOO, minus the mean of the
    *other* rewards of its group), optionally scaled.

    Args:
        rewards: ``(N,)``; each run of ``num_generations`` consecutive entries is one prompt's group. In a
            distributed run pass the rewards gathered from every rank, so groups are whole and ``batch``
            statistics are global; then keep this rank's slice of the result.
        num_generations: G ≥ 2, the group size.
        scale_rewards: ``group`` divides by (the group's std + eps) as in GRPO; ``batch`` by (the std of
            all N rewards + eps); ``none`` does not divide (Dr. GRPO).
            The std is the unbiased one (``torch.std`` default, divisor n - 1).
        eps: added to the std so that groups with equal rewards give 0, not NaN.
        advantage_estimator: ``grpo`` (baseline: the group mean) or ``rloo`` (baseline: the mean of the
            group's other G - 1 rewards, Ahmadian et al. 2024; ``r - (S - r)/(G - 1) = G/(G - 1) (r - mean)``).
            TRL's RLOOTrainer is ``rloo`` with ``scale_rewards="none"``.

    Returns:
        ``(advantages (N,), metrics)`` with detached scalars ``reward`` (mean of all rewards),
        ``reward_std`` (mean of the per-group stds) and ``frac_reward_zero_std`` (fraction of groups whose
        rewards are all equal: such groups carry no learning signal).

    >>> adv, m = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, scale_rewards="none")
    >>> adv.tolist(), m["frac_reward_zero_std"].item()
    ([0.5, -0.5, 0.0, 0.0], 0.5)
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if num_generations < 2:
        raise ValueError(f"num_generations must be >= 2 to form a group baseline, got {num_generations}")
    if rewards.numel() % num_generations != 0:
        raise ValueError(f"the number of rewards ({rewards.numel()}) is not divisible by num_generations "
                         f"({num_generations}): every prompt needs exactly num_generations completions")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; valid: {', '.join(SCALE_REWARDS)}")
    if advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage_estimator {advantage_estimator!r}; "
                         f"valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
    rewards = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    grouped = rewards.view(-1, num_generations)  # (N/G, G)
    group_mean = grouped.mean(dim=1, keepdim=True)  # (N/G, 1)
    group_std = grouped.std(dim=1)  # (N/G,)
    if advantage_estimator == "rloo":  # leave-one-out: the mean of the other G - 1 rewards
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)  # (N/G, G)
    else:
        baseline = group_mean
    advantages = grouped - baseline  # (N/G, G)
    if scale_rewards == "group":
        advantages = advantages / (group_std.unsqueeze(1) + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + eps)
    # max == min rather than std == 0: the mean of equal floats can round, leaving a std of ~1e-17.
    zero_std = grouped.amax(dim=1) == grouped.amin(dim=1)  # (N/G,)
    metrics = {
        "reward": rewards.mean(),
        "reward_std": group_std.mean(),
        "frac_reward_zero_std": zero_std.float().mean(),
    }
    return advantages.reshape(-1), metrics


def decoupled_advantages(rewards_per_func: Tensor, weights: Sequence[float], num_generations: int, *,
                         eps: float = 1e-4) -> Tensor:
    """GDPO (``multi_objective_aggregation="normalize_then_sum"``, https://arxiv.org/abs/2601.05242): normalise
    each reward function within its group first, then sum with ``weights``, then normalise the sum over the batch.

    ``rewards_per_func`` ``(N, F)``, NaN where a function had no opinion (skipped in its statistics and in the
    sum, as TRL). Per function: ``(r - group mean) / (group std + eps)``; then ``(s - mean s) / (std s + eps)``
    over all N. Stds are unbiased (n - 1). Returns ``(N,)``; ``scale_rewards`` does not apply.

    >>> [round(a, 3) for a in decoupled_advantages(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), [1.0, 1.0], 2).tolist()]
    [0.707, -0.707]
    """
    if rewards_per_func.dim() != 2 or rewards_per_func.shape[0] % num_generations:
        raise ValueError(f"rewards_per_func must be (N, F) with N a multiple of num_generations={num_generations}, "
                         f"got {tuple(rewards_per_func.shape)}")
    rewards = rewards_per_func.detach().to(torch.promote_types(rewards_per_func.dtype, torch.float32))
    grouped = rewards.view(-1, num_generations, rewards.shape[1])  # (N/G, G, F)
    normalised = (grouped - grouped.nanmean(dim=1, keepdim=True)) / (_nanstd(grouped, dim=1) + eps)
    w = torch.as_tensor(list(weights), dtype=rewards.dtype, device=rewards.device)  # (F,)
    summed = torch.nansum(normalised.view(-1, rewards.shape[1]) * w, dim=1)  # (N,)
    return (summed - summed.mean()) / (summed.std() + eps)


def _nanstd(x: Tensor, dim: int) -> Tensor:
    """Unbiased std along ``dim`` (kept) ignoring NaN; NaN where fewer than two values."""
    count = (~x.isnan()).sum(dim=dim, keepdim=True)
    sq = ((x - x.nanmean(dim=dim, keepdim=True)) ** 2).nansum(dim=dim, keepdim=True)
    return (sq / (count - 1)).sqrt()


def kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(π ‖ π_ref), per token: ``exp(ref - logp) - (ref - logp) - 1``.

    Unbiased for samples drawn from π, always ≥ 0, and differentiable wrt ``logps``. Same shape as the
    inputs.

    >>> kl_k3(torch.tensor([0.0]), torch.tensor([0.0]))
    tensor([0.])
    """
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def grpo_loss(
    logps: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    old_logps: Tensor | None = None,
    ref_logps: Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    loss_type: str = "dapo",
    normalizer: float | Tensor | None = None,
    max_completion_length: int | None = None,
    importance_sampling_level: str = "token",
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    use_bias_correction_kl: bool = True,
    entropies: Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    off_policy_mask_threshold: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy-gradient loss with an optional k3 KL penalty, aggregated per ``loss_type``.

    Per token, for the clipped family (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``):
    ``-min(r A, clip(r, 1 - ε_low, 1 + ε_high) A) + β k3``, with ``r = exp(logps - old_logps)``.

    Args:
        logps: ``(B, T)`` per completion token log-probs under the current policy (with gradient).
        advantages: ``(B,)`` one advantage per completion (see :func:`group_advantages`).
        completion_mask: ``(B, T)`` 1 for completion tokens, 0 for padding (bool, int or float). Padding
            positions may hold anything, even ±inf: they are replaced before any arithmetic.
        old_logps: ``(B, T)`` log-probs of the policy that generated the samples. ``None`` means a single
            update per generation: ``old = logps.detach()``, so ``r`` is exactly 1 with gradient
            ``∇ logps`` (the REINFORCE gradient).
        ref_logps: ``(B, T)`` reference log-probs; required when ``beta > 0``.
        beta: KL coefficient β (0 disables the KL term and its metric).
        epsilon_low, epsilon_high: clip range (DAPO's "clip-higher" uses e.g. 0.2 / 0.28). For ``cispo``,
            ``epsilon_high`` is the cap on the ratio itself (ScaleRL: 5.0).
        loss_type: the per-token objective and how it is reduced to a scalar (below).
        normalizer: see below; a number or a 0-d tensor.
        max_completion_length: L, required by ``dr_grpo``.
        importance_sampling_level: ``token`` (one ratio per token) or ``sequence`` (GSPO: one ratio per
            sequence, ``exp`` of the masked mean log-ratio, shared by its tokens).
        delta: two-sided clipping (INTELLECT-2): the unclipped ratio is also capped at ``delta`` (> 1 + ε_high),
            which bounds the loss of negative-advantage tokens. None disables it. Clipped family only.
        sapo_temperature_pos, sapo_temperature_neg: SAPO's τ for ``A > 0`` / ``A ≤ 0``: the per-token term is
            ``-A · σ(τ (r - 1)) · 4/τ`` (slope 1 at ``r = 1``).
        use_bias_correction_kl: multiply the k3 term by the (differentiable) ratio ``r`` (DeepSeek-V3.2), so its
            gradient is the unbiased reverse-KL gradient; the value is unchanged on-policy (``r = 1``). TRL's
            default, True. False: the plain k3 term.
        entropies: ``(B, T)`` per-token entropies, needed when ``top_entropy_quantile < 1``.
        top_entropy_quantile: ρ: only the top-ρ fraction of this batch's completion tokens by entropy carry the
            policy term (ties at the threshold kept; 0 keeps the highest); the KL term and the normalisers still
            count every token (as TRL). 1.0 keeps all.
        off_policy_mask_threshold: δ: a sequence with ``A < 0`` whose mean ``old_logps - logps`` exceeds δ gets no
            policy term (DeepSeek-V3.2, Eq. 9). None disables it.

    Per-token terms by ``loss_type``: the clipped family above; ``cispo`` ``-sg(min(r, ε_high)) · A · logp``
    (the gradient flows through ``logp`` only); ``sapo`` the soft gate above.

    Aggregation, and what to pass so that gradient accumulation over a window of ``k`` micro-batches (and
    data parallelism) gives the gradient of the whole window as one batch:

    - ``grpo`` and ``sapo``: each sequence's masked token mean, summed over sequences, divided by
      ``normalizer`` = the number of sequences in the whole accumulation window over all ranks (default:
      ``B``, right for one micro-batch on one process).
    - ``bnpo``: masked token sum / completion tokens in this local batch; ``normalizer`` is ignored.
      The loss is by definition a per-micro-batch token mean: the caller divides it by ``k`` when
      accumulating, and the window's gradient is then the mean of micro-batch gradients (equal to the
      big-batch token mean only when micro-batches hold equal token counts).
    - ``dr_grpo``: masked token sum / (``B * max_completion_length``); ``normalizer`` is ignored. With
      equal-sized micro-batches, dividing by ``k`` when accumulating gives exactly the big-batch value.
    - ``dapo`` and ``cispo``: masked token sum / ``normalizer`` = the number of completion tokens in the
      whole accumulation window over all ranks (default: completion tokens in this batch).

    Data parallelism: DDP and FSDP *average* gradients over the ``W`` ranks. With a global normalizer
    (``grpo``, ``dapo``) multiply the returned loss by ``W`` (or pass ``normalizer / W``) to get the
    gradient of the global batch; ``bnpo`` and ``dr_grpo`` already are per-rank means.

    Returns:
        ``(loss, metrics)``: a scalar loss and detached scalars: ``kl`` (masked token mean of the KL term as
        added, only when ``beta > 0``); for the clipped family ``clip_ratio/low_mean`` (fraction of completion
        tokens, or of sequences at sequence level, with ``r < 1 - ε_low`` and ``A < 0``, where the clip removes
        the gradient), ``clip_ratio/high_mean`` (``r > 1 + ε_high`` and ``A > 0``) and ``clip_ratio/region_mean``
        (either); for ``cispo`` ``cispo_clip_ratio`` (``r > ε_high`` and ``A > 0``). Metrics are local to this
        batch; the caller gathers them across ranks if it wants global values.
    """
    _check_grpo_inputs(logps, advantages, completion_mask, old_logps, ref_logps, beta, epsilon_low,
                       epsilon_high, loss_type, normalizer, max_completion_length)
    check_grpo_extras(importance_sampling_level, delta, sapo_temperature_pos, sapo_temperature_neg,
                      top_entropy_quantile, off_policy_mask_threshold)
    if top_entropy_quantile < 1.0:
        if entropies is None:
            raise ValueError("top_entropy_quantile < 1 needs entropies (B, T), the per-token entropies of the policy")
        _check_same_shape(logps=logps, entropies=entropies)
    is_token = completion_mask.bool()  # (B, T)
    mask = is_token.to(logps.dtype)  # (B, T)
    if old_logps is None:
        old_logps = logps.detach()
    # torch.where, not multiplication by the mask: padding may hold inf, and inf * 0 is NaN (also in
    # the backward pass, so the padding has to be replaced before exp, not after).
    safe_logps = torch.where(is_token, logps, 0.0)  # (B, T)
    log_ratio = torch.where(is_token, logps - old_logps, 0.0)  # (B, T)
    if importance_sampling_level == "sequence":  # GSPO: one ratio per sequence
        log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    ratio = torch.exp(log_ratio)  # (B, T) or (B, 1)
    adv = advantages.unsqueeze(1).to(logps.dtype)  # (B, 1)
    per_token, metrics = _policy_term(loss_type, ratio, adv, safe_logps, epsilon_low, epsilon_high, delta,
                                      sapo_temperature_pos, sapo_temperature_neg, mask)
    per_token = per_token.expand_as(mask)  # (B, T), also when the ratio is one per sequence
    if off_policy_mask_threshold is not None:
        per_token = per_token * off_policy_mask(adv, logps, old_logps, mask, off_policy_mask_threshold)
    if top_entropy_quantile < 1.0:
        per_token = per_token * high_entropy_mask(entropies, mask, top_entropy_quantile)
    if beta > 0:
        kl = kl_k3(safe_logps, torch.where(is_token, ref_logps, 0.0))  # (B, T), 0 on padding
        if use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
        metrics["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).detach()
    loss = _aggregate(per_token * mask, mask, grpo_aggregation(loss_type), normalizer, max_completion_length)
    return loss, metrics


def grpo_aggregation(loss_type: str) -> str:
    """How ``loss_type`` reduces its per-token losses: ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo`` (as TRL 1.16:
    ``cispo`` like ``dapo``, ``sapo`` like ``grpo``). The trainer asks this to count a window's loss items.

    >>> grpo_aggregation("cispo"), grpo_aggregation("sapo")
    ('dapo', 'grpo')
    """
    return {"cispo": "dapo", "sapo": "grpo"}.get(loss_type, loss_type)


def _policy_term(loss_type: str, ratio: Tensor, adv: Tensor, safe_logps: Tensor, epsilon_low: float,
                 epsilon_high: float, delta: float | None, tau_pos: float, tau_neg: float,
                 mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token policy loss (``(B, T)``, or ``(B, 1)`` for a sequence-level ratio outside ``cispo``) and
    its clipping metrics; ``ratio`` is ``(B, T)`` or ``(B, 1)``, ``adv`` ``(B, 1)``."""
    if loss_type == "cispo":  # REINFORCE weighted by the capped ratio; no gradient through the weight
        weight = torch.clamp(ratio, max=epsilon_high).detach()
        flags = (ratio.detach() > epsilon_high) & (adv > 0)
        return -weight * adv * safe_logps, {"cispo_clip_ratio": _fraction(flags, mask)}
    if loss_type == "sapo":  # soft gate: sigma(tau (r - 1)) * 4 / tau has value 1 and slope 1 at r = 1
        tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))  # (B, 1), adv's dtype
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv, {}
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:  # two-sided clipping: cap the unclipped ratio too (after the clipped one is taken)
        ratio = torch.clamp(ratio, max=delta)
    per_token = -torch.min(ratio * adv, clipped * adv)
    r = ratio.detach()
    low = (r < 1 - epsilon_low) & (adv < 0)
    high = (r > 1 + epsilon_high) & (adv > 0)
    return per_token, {"clip_ratio/low_mean": _fraction(low, mask), "clip_ratio/high_mean": _fraction(high, mask),
                       "clip_ratio/region_mean": _fraction(low | high, mask)}


def _fraction(flags: Tensor, mask: Tensor) -> Tensor:
    """Share of completion tokens ``(B, T)`` flagged, or of sequences when ``flags`` is ``(B, 1)`` (as TRL)."""
    if flags.shape[1] == 1 and mask.shape[1] != 1:
        return flags.to(mask.dtype).mean()
    return (flags.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)


def off_policy_mask(advantages: Tensor, logps: Tensor, old_logps: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask ``(B, 1)``: 0 for a sequence with ``A < 0`` whose mean
    ``old_logps - logps`` over its tokens (a KL estimate of how far the policy moved) exceeds ``threshold``,
    else 1. ``advantages`` ``(B, 1)``; the others ``(B, T)``.

    >>> off_policy_mask(torch.tensor([[-1.0], [1.0]]), torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2), 0.5)
    tensor([[0.],
            [1.]])
    """
    gap = torch.where(mask.bool(), old_logps - logps.detach(), 0.0)  # (B, T)
    mean_gap = gap.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    return ((advantages >= 0) | (mean_gap <= threshold)).to(mask.dtype)


def high_entropy_mask(entropies: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """``(B, T)`` 1 on the completion tokens whose entropy is at least the ``1 - quantile`` quantile of this
    batch's completion-token entropies (the top ``quantile`` share, "Beyond the 80/20 rule"), else 0.

    >>> high_entropy_mask(torch.tensor([[0.1, 0.9, 0.5, 7.0]]), torch.tensor([[1, 1, 1, 0]]), 0.5).tolist()
    [[0.0, 1.0, 1.0, 0.0]]
    """
    is_token = mask.bool()
    values = entropies.detach()[is_token].float()
    if values.numel() == 0:
        return torch.zeros_like(mask, dtype=entropies.dtype)
    threshold = torch.quantile(values, 1 - quantile)
    return (is_token & (entropies.detach() >= threshold)).to(entropies.dtype)


def _aggregate(per_token: Tensor, mask: Tensor, loss_type: str, normalizer, max_completion_length) -> Tensor:
    """Reduce masked per-token losses ``(B, T)`` to a scalar; see :func:`grpo_loss` for the contract."""
    batch_size = per_token.shape[0]
    if loss_type == "grpo":
        seq_means = per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (B,)
        return seq_means.sum() / (batch_size if normalizer is None else normalizer)
    if loss_type == "bnpo":
        return per_token.sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return per_token.sum() / (batch_size * max_completion_length)
    # "dapo"
    # clamp(min=1): a batch with no completion tokens gives loss 0, not NaN.
    return per_token.sum() / (mask.sum().clamp(min=1) if normalizer is None else normalizer)


def check_grpo_options(loss_type: str, beta: float, epsilon_low: float, epsilon_high: float) -> None:
    """The GRPO loss options' rules, in one place: ``grpo_loss`` and ``GRPOConfig`` both check with this."""
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not supported; valid: {', '.join(GRPO_LOSS_TYPES)}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}; 0 disables the KL term")
    if not 0 <= epsilon_low < 1:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon_low}; 0.2 is usual")
    if epsilon_high < 0:
        raise ValueError(f"epsilon_high must be >= 0, got {epsilon_high}; e.g. 0.28 (DAPO), 5.0 for cispo")


def check_grpo_extras(importance_sampling_level: str = "token", delta: float | None = None,
                      sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05,
                      top_entropy_quantile: float = 1.0, off_policy_mask_threshold: float | None = None) -> None:
    """The rules of the options issue 17 added to ``grpo_loss`` (GSPO, δ, SAPO, entropy and off-policy masks)."""
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r} is not supported; use one of "
                         f"{list(IMPORTANCE_SAMPLING_LEVELS)} ('sequence' is GSPO)")
    if delta is not None and not delta > 1:
        raise ValueError(f"delta (two-sided clipping) must be > 1, ideally > 1 + epsilon_high (INTELLECT-2 uses 4), "
                         f"or None to disable it; got {delta}")
    if not (sapo_temperature_pos > 0 and sapo_temperature_neg > 0):
        raise ValueError(f"sapo_temperature_pos and sapo_temperature_neg must be > 0 (1.0 and 1.05 by default), got "
                         f"{sapo_temperature_pos} and {sapo_temperature_neg}")
    if not 0 <= top_entropy_quantile <= 1:
        raise ValueError(f"top_entropy_quantile must be in [0, 1] (the paper uses 0.2; 1.0 keeps every token), got "
                         f"{top_entropy_quantile}")
    if off_policy_mask_threshold is not None and not off_policy_mask_threshold > 0:
        raise ValueError(f"off_policy_mask_threshold must be > 0 (e.g. 0.5) or None, got {off_policy_mask_threshold}")


def _check_grpo_inputs(logps, advantages, completion_mask, old_logps, ref_logps, beta, epsilon_low,
                       epsilon_high, loss_type, normalizer, max_completion_length) -> None:
    check_grpo_options(loss_type, beta, epsilon_low, epsilon_high)
    if logps.dim() != 2:
        raise ValueError(f"logps must be (B, T), got shape {tuple(logps.shape)}")
    tensors = {"logps": logps, "completion_mask": completion_mask}
    if old_logps is not None:
        tensors["old_logps"] = old_logps
    if ref_logps is not None:
        tensors["ref_logps"] = ref_logps
    _check_same_shape(**tensors)
    if advantages.shape != logps.shape[:1]:
        raise ValueError(f"advantages must be (B,) = {tuple(logps.shape[:1])}, got {tuple(advantages.shape)}")
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (the reference model's per-token log-probs); "
                         "pass them or set beta=0")
    # A tensor normalizer is not inspected: reading its value would force a device sync.
    if isinstance(normalizer, (int, float)) and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length (the constant L in B * L)")
        if max_completion_length < logps.shape[1]:
            raise ValueError(f"max_completion_length ({max_completion_length}) is shorter than the "
                             f"completions ({logps.shape[1]} tokens)")


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shapes must match: {listed}")
