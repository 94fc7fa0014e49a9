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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")


# --------------------------------------------------------------------------------------------- DPO family


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair DPO-family losses from summed completion log-probs.

    Args:
        chosen_logps, rejected_logps: ``(B,)`` policy log-probs of the chosen / rejected completions
            (summed over completion tokens; for ``ipo`` see below).
        ref_chosen_logps, ref_rejected_logps: ``(B,)`` the same under the reference model (no gradient
            is expected to flow through them, none is blocked either).
        beta: the paper's β (> 0). It scales the whole log-ratio difference:
            ``logits = β * ((pc - rc) - (pr - rr))``.
        loss_type: one of ``sigmoid`` (DPO / cDPO), ``robust`` (robust DPO), ``hinge``, ``ipo``.
        label_smoothing: ε, the assumed probability that a label is flipped. ``sigmoid`` with ε > 0 is
            conservative DPO, ``-(1-ε) logσ(z) - ε logσ(-z)`` (needs 0 ≤ ε ≤ 0.5); ``robust`` is the
            unbiased estimator ``((1-ε)(-logσ(z)) + ε logσ(-z)) / (1 - 2ε)`` (needs 0 ≤ ε < 0.5).
            ``hinge`` and ``ipo`` do not use it and reject ε ≠ 0 rather than silently ignore it.

    IPO: ``(h - 1/(2β))²`` with ``h = (pc - rc) - (pr - rr)``. The IPO paper reasons about per-token
    averaged log-probs (the loss's fixed point ``h = 1/(2β)`` is on the scale of one token); with summed
    log-probs the target margin is tiny relative to ``h`` and long answers dominate. This function uses
    whatever it is given: the caller decides (and documents) whether it passes sums or length averages.

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
    check_dpo_options(beta, loss_type, label_smoothing)
    chosen_logratios = chosen_logps - ref_chosen_logps  # (B,)
    rejected_logratios = rejected_logps - ref_rejected_logps  # (B,)
    h = chosen_logratios - rejected_logratios  # (B,)
    logits = beta * h  # (B,)
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = torch.relu(1 - logits)
    else:  # "ipo"
        losses = (h - 1 / (2 * beta)) ** 2
    metrics = {
        "chosen_rewards": (beta * chosen_logratios).detach(),
        "rejected_rewards": (beta * rejected_logratios).detach(),
        "logits": logits.detach(),
    }
    return losses, metrics


def check_dpo_options(beta: float, loss_type: str, label_smoothing: float) -> None:
    """The DPO options' rules, in one place: ``dpo_loss`` and ``DPOConfig`` both check with this."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not supported; valid: {', '.join(DPO_LOSS_TYPES)} (add an "
                         f"NLL term on the chosen response with rpo_alpha)")
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (typical 0.1), got {beta}")
    if loss_type == "sigmoid" and not 0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing for 'sigmoid' (cDPO) must be in [0, 0.5], got {label_smoothing}")
    if loss_type == "robust" and not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing for 'robust' must be in [0, 0.5) (it divides by 1 - 2ε), "
                         f"got {label_smoothing}")
    if loss_type in ("hinge", "ipo") and label_smoothing != 0:
        raise ValueError(f"loss_type {loss_type!r} does not use label_smoothing; set it to 0 "
                         f"(got {label_smoothing})")


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


# ------------------------------------------------------------------------------------------ GRPO family


def group_advantages(
    rewards: Tensor,
    num_generations: int,
    *,
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Group-relative advantages: each reward minus its group's mean, optionally scaled.

    Args:
        rewards: ``(N,)``; each run of ``num_generations`` consecutive entries is one prompt's group. In a
            distributed run pass the rewards gathered from every rank, so groups are whole and ``batch``
            statistics are global; then keep this rank's slice of the result.
        num_generations: G ≥ 2, the group size.
        scale_rewards: ``group`` divides by (the group's std + eps) as in GRPO; ``batch`` by (the std of
            all N rewards + eps); ``none`` does not divide (Dr. GRPO).
            The std is the unbiased one (``torch.std`` default, divisor n - 1).
        eps: added to the std so that groups with equal rewards give 0, not NaN.

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
    rewards = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    grouped = rewards.view(-1, num_generations)  # (N/G, G)
    group_mean = grouped.mean(dim=1, keepdim=True)  # (N/G, 1)
    group_std = grouped.std(dim=1)  # (N/G,)
    advantages = grouped - group_mean  # (N/G, G)
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss with an optional k3 KL penalty, aggregated four ways.

    Per token: ``-min(r A, clip(r, 1 - ε_low, 1 + ε_high) A) + β k3``, with ``r = exp(logps - old_logps)``.

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
        epsilon_low, epsilon_high: clip range (DAPO's "clip-higher" uses e.g. 0.2 / 0.28).
        loss_type: how the masked per-token losses are reduced to a scalar (below).
        normalizer: see below; a number or a 0-d tensor.
        max_completion_length: L, required by ``dr_grpo``.

    Aggregation, and what to pass so that gradient accumulation over a window of ``k`` micro-batches (and
    data parallelism) gives the gradient of the whole window as one batch:

    - ``grpo``: each sequence's masked token mean, summed over sequences, divided by ``normalizer`` =
      the number of sequences in the whole accumulation window over all ranks (default: ``B``, right
      for one micro-batch on one process).
    - ``bnpo``: masked token sum / completion tokens in this local batch; ``normalizer`` is ignored.
      The loss is by definition a per-micro-batch token mean: the caller divides it by ``k`` when
      accumulating, and the window's gradient is then the mean of micro-batch gradients (equal to the
      big-batch token mean only when micro-batches hold equal token counts).
    - ``dr_grpo``: masked token sum / (``B * max_completion_length``); ``normalizer`` is ignored. With
      equal-sized micro-batches, dividing by ``k`` when accumulating gives exactly the big-batch value.
    - ``dapo``: masked token sum / ``normalizer`` = the number of completion tokens in the whole
      accumulation window over all ranks (default: completion tokens in this batch).

    Data parallelism: DDP and FSDP *average* gradients over the ``W`` ranks. With a global normalizer
    (``grpo``, ``dapo``) multiply the returned loss by ``W`` (or pass ``normalizer / W``) to get the
    gradient of the global batch; ``bnpo`` and ``dr_grpo`` already are per-rank means.

    Returns:
        ``(loss, metrics)``: a scalar loss and detached scalars: ``kl`` (masked token mean of k3, only
        when ``beta > 0``), ``clip_ratio/low_mean`` (fraction of completion tokens with
        ``r < 1 - ε_low`` and ``A < 0``, where the clip removes the gradient), ``clip_ratio/high_mean``
        (``r > 1 + ε_high`` and ``A > 0``) and ``clip_ratio/region_mean`` (either). Metrics are local to
        this batch; the caller gathers them across ranks if it wants global values.
    """
    _check_grpo_inputs(logps, advantages, completion_mask, old_logps, ref_logps, beta, epsilon_low,
                       epsilon_high, loss_type, normalizer, max_completion_length)
    is_token = completion_mask.bool()  # (B, T)
    mask = is_token.to(logps.dtype)  # (B, T)
    if old_logps is None:
        old_logps = logps.detach()
    # torch.where, not multiplication by the mask: padding may hold inf, and inf * 0 is NaN (also in
    # the backward pass, so the padding has to be replaced before exp, not after).
    log_ratio = torch.where(is_token, logps - old_logps, 0.0)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages.unsqueeze(1).to(logps.dtype)  # (B, 1)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)  # (B, T)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)  # (B, T)
    metrics: dict[str, Tensor] = {}
    num_tokens = mask.sum()
    if beta > 0:
        safe_logps = torch.where(is_token, logps, 0.0)
        safe_ref = torch.where(is_token, ref_logps, 0.0)
        kl = kl_k3(safe_logps, safe_ref)  # (B, T), 0 on padding
        per_token = per_token + beta * kl
        metrics["kl"] = ((kl * mask).sum() / num_tokens.clamp(min=1)).detach()
    per_token = per_token * mask  # (B, T)
    loss = _aggregate(per_token, mask, loss_type, normalizer, max_completion_length)
    metrics.update(_clip_metrics(ratio.detach(), adv, mask, epsilon_low, epsilon_high))
    return loss, metrics


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


def _clip_metrics(ratio: Tensor, adv: Tensor, mask: Tensor, epsilon_low: float,
                  epsilon_high: float) -> dict[str, Tensor]:
    low = (ratio < 1 - epsilon_low) & (adv < 0)  # (B, T)
    high = (ratio > 1 + epsilon_high) & (adv > 0)  # (B, T)
    num_tokens = mask.sum().clamp(min=1)

    def fraction(flags: Tensor) -> Tensor:
        return (flags.to(mask.dtype) * mask).sum() / num_tokens

    return {
        "clip_ratio/low_mean": fraction(low),
        "clip_ratio/high_mean": fraction(high),
        "clip_ratio/region_mean": fraction(low | high),
    }


def check_grpo_options(loss_type: str, beta: float, epsilon_low: float, epsilon_high: float) -> None:
    """The GRPO loss options' rules, in one place: ``grpo_loss`` and ``GRPOConfig`` both check with this."""
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not supported; valid: {', '.join(GRPO_LOSS_TYPES)}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}; 0 disables the KL term")
    if not 0 <= epsilon_low < 1:
        raise ValueError(f"epsilon must be in [0, 1), got {epsilon_low}; 0.2 is usual")
    if epsilon_high < 0:
        raise ValueError(f"epsilon_high must be >= 0, got {epsilon_high}; e.g. 0.28 (DAPO)")


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
