"""The GRPO family: group advantages, the clipped-ratio objectives and their reductions, the k3 KL; pure functions
of tensors and floats. Papers and TRL names: ``treadle.losses``' docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from treadle.losses.dpo import check_same_shape

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
SAMPLING_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


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
        raise ValueError(
            f"the number of rewards ({rewards.numel()}) is not divisible by num_generations "
            f"({num_generations}): every prompt needs exactly num_generations completions"
        )
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; valid: {', '.join(SCALE_REWARDS)}")
    if advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage_estimator {advantage_estimator!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
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
    zero_std = zero_spread_groups(rewards, num_generations)  # (N/G,)
    metrics = {
        "reward": rewards.mean(),
        "reward_std": group_std.mean(),
        "frac_reward_zero_std": zero_std.float().mean(),
    }
    return advantages.reshape(-1), metrics


def zero_spread_groups(rewards: Tensor, num_generations: int) -> Tensor:
    """``(N/G,)`` bool: the groups (runs of ``num_generations`` consecutive entries of ``rewards`` ``(N,)``) whose
    rewards are all equal, so that every advantage in them is 0 and they carry no learning signal. max == min
    rather than std == 0: the mean of equal floats can round, leaving a std of ~1e-17.

    >>> zero_spread_groups(torch.tensor([1.0, 1.0, 0.0, 2.0]), 2).tolist()
    [True, False]
    """
    grouped = rewards.view(-1, num_generations)  # (N/G, G)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def decoupled_advantages(
    rewards_per_func: Tensor, weights: Sequence[float], num_generations: int, *, eps: float = 1e-4
) -> Tensor:
    """GDPO (``multi_objective_aggregation="normalize_then_sum"``, https://arxiv.org/abs/2601.05242): normalise
    each reward function within its group first, then sum with ``weights``, then normalise the sum over the batch.

    ``rewards_per_func`` ``(N, F)``, NaN where a function had no opinion (skipped in its statistics and in the
    sum, as TRL). Per function: ``(r - group mean) / (group std + eps)``; then ``(s - mean s) / (std s + eps)``
    over all N. Stds are unbiased (n - 1). Returns ``(N,)``; ``scale_rewards`` does not apply.

    >>> [round(a, 3) for a in decoupled_advantages(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), [1.0, 1.0], 2).tolist()]
    [0.707, -0.707]
    """
    if rewards_per_func.dim() != 2 or rewards_per_func.shape[0] % num_generations:
        raise ValueError(
            f"rewards_per_func must be (N, F) with N a multiple of num_generations={num_generations}, "
            f"got {tuple(rewards_per_func.shape)}"
        )
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


@dataclass(frozen=True, kw_only=True)
class GRPOObjective:
    """The settings of the GRPO objective (TRL's names), built once (``GRPOTrainer.objective``, from its config) and
    checked here, so that :func:`grpo_loss` takes one batch's tensors only (as verl's core_algos passes one config).

    Per token, for the clipped family (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``):
    ``-min(r A, clip(r, 1 - ε_low, 1 + ε_high) A) + β k3``, with ``r = exp(logps - old_logps)``; ``cispo``
    ``-sg(min(r, ε_high)) · A · logp`` (the gradient flows through ``logp`` only); ``sapo`` the soft gate
    ``-A · σ(τ (r - 1)) · 4/τ`` (slope 1 at ``r = 1``). How each ``loss_type`` reduces them: :func:`grpo_loss`.

    >>> GRPOObjective(loss_type="cispo", epsilon_high=5.0).aggregation
    'dapo'
    """

    loss_type: str = "dapo"  # the per-token objective and how it is reduced to a scalar (GRPO_LOSS_TYPES)
    beta: float = 0.0  # β, the k3 KL's weight; 0 disables the KL term and its metric (ref_logps needed when > 0)
    epsilon_low: float = 0.2  # the ratio is clipped below at 1 - ε_low
    epsilon_high: float = 0.2  # ... above at 1 + ε_high (DAPO's clip-higher: 0.28); cispo: the cap on r (ScaleRL: 5)
    delta: float | None = None  # INTELLECT-2's two-sided clip: r also capped at δ (> 1 + ε_high); clipped family only
    sapo_temperature_pos: float = 1.0  # SAPO's τ for A > 0
    sapo_temperature_neg: float = 1.05  # SAPO's τ for A <= 0
    importance_sampling_level: str = "token"  # one ratio per token, or "sequence" (GSPO: exp of the mean log-ratio)
    use_bias_correction_kl: bool = True  # k3 times the (differentiable) r: the unbiased KL gradient (DeepSeek-V3.2)
    top_entropy_quantile: float = 1.0  # ρ: only the batch's top-ρ share of tokens by entropy carry the policy term
    off_policy_mask_threshold: float | None = None  # δ: no policy term for A < 0 sequences with mean old - new > δ
    max_completion_length: int | None = None  # L, the constant of dr_grpo's B * L

    def __post_init__(self) -> None:
        check_grpo_options(self.loss_type, self.beta, self.epsilon_low, self.epsilon_high)
        check_grpo_extras(
            self.importance_sampling_level,
            self.delta,
            self.sapo_temperature_pos,
            self.sapo_temperature_neg,
            self.top_entropy_quantile,
            self.off_policy_mask_threshold,
        )
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length (the constant L in B * L)")

    @property
    def aggregation(self) -> str:
        """How the per-token losses reduce: ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo`` (:func:`grpo_aggregation`)."""
        return grpo_aggregation(self.loss_type)


def grpo_loss(
    logps: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    objective: GRPOObjective,
    *,
    old_logps: Tensor | None = None,
    ref_logps: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    importance_sampling_ratio: Tensor | None = None,
    entropies: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy-gradient loss with an optional k3 KL penalty: ``objective``'s per-token terms (:class:`GRPOObjective`)
    on one batch, aggregated per its ``loss_type``.

    Args:
        logps: ``(B, T)`` per completion token log-probs under the current policy (with gradient).
        advantages: ``(B,)`` one advantage per completion (see :func:`group_advantages`).
        completion_mask: ``(B, T)`` 1 for completion tokens, 0 for padding (bool, int or float). Padding
            positions may hold anything, even ±inf: they are replaced before any arithmetic.
        objective: the settings, built and checked once.
        old_logps: ``(B, T)`` log-probs of the policy that generated the samples. ``None`` means a single
            update per generation: ``old = logps.detach()``, so ``r`` is exactly 1 with gradient
            ``∇ logps`` (the REINFORCE gradient).
        ref_logps: ``(B, T)`` reference log-probs; required when ``objective.beta > 0``.
        normalizer: see below; a number or a 0-d tensor.
        importance_sampling_ratio: ``(B, T)`` or ``(B, 1)``, no gradient: the sampler correction
            (:func:`sampling_importance_ratio`) multiplying each token's policy term, after the masks and before the
            KL term is added (as TRL 1.16). None: no correction.
        entropies: ``(B, T)`` per-token entropies, needed when ``objective.top_entropy_quantile < 1`` (ties at the
            threshold kept; 0 keeps the highest; the KL term and the normalisers still count every token, as TRL).

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

    >>> loss, _ = grpo_loss(torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), GRPOObjective(loss_type="grpo"))
    >>> loss.item()  # r = 1: each token's term is -A
    -1.0
    """
    _check_batch(logps, advantages, completion_mask, old_logps, ref_logps, importance_sampling_ratio)
    _check_for_objective(objective, logps, ref_logps, entropies, normalizer)
    is_token = completion_mask.bool()  # (B, T)
    mask = is_token.to(logps.dtype)  # (B, T)
    if old_logps is None:
        old_logps = logps.detach()
    # torch.where, not multiplication by the mask: padding may hold inf, and inf * 0 is NaN (also in
    # the backward pass, so the padding has to be replaced before exp, not after).
    safe_logps = torch.where(is_token, logps, 0.0)  # (B, T)
    log_ratio = torch.where(is_token, logps - old_logps, 0.0)  # (B, T)
    if objective.importance_sampling_level == "sequence":  # GSPO: one ratio per sequence
        log_ratio = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    ratio = torch.exp(log_ratio)  # (B, T) or (B, 1)
    adv = advantages.unsqueeze(1).to(logps.dtype)  # (B, 1)
    per_token, metrics = _policy_term(objective, ratio, adv, safe_logps, mask)
    per_token = per_token.expand_as(mask)  # (B, T), also when the ratio is one per sequence
    if objective.off_policy_mask_threshold is not None:
        per_token = per_token * off_policy_mask(adv, logps, old_logps, mask, objective.off_policy_mask_threshold)
    if objective.top_entropy_quantile < 1.0:
        per_token = per_token * high_entropy_mask(entropies, mask, objective.top_entropy_quantile)
    if importance_sampling_ratio is not None:  # the sampler/trainer mismatch: weights only, never a gradient
        per_token = per_token * importance_sampling_ratio.detach().to(per_token.dtype)
    if objective.beta > 0:
        kl = kl_k3(safe_logps, torch.where(is_token, ref_logps, 0.0))  # (B, T), 0 on padding
        if objective.use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + objective.beta * kl
        metrics["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).detach()
    loss = _aggregate(per_token * mask, mask, objective.aggregation, normalizer, objective.max_completion_length)
    return loss, metrics


def sampling_importance_ratio(
    trainer_logps: Tensor,
    sampling_logps: Tensor,
    completion_mask: Tensor,
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> Tensor:
    """The importance weight that corrects for sampling from another distribution than the one trained (TRL 1.16's
    ``vllm_importance_sampling_*``; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training"): ``ρ = π_trainer / π_sampler`` per token, or ``exp`` of its log summed over the sequence.

    Args:
        trainer_logps: ``(B, T)`` the trained policy's log-probs of the sampled tokens at sampling time (the old
            policy's).
        sampling_logps: ``(B, T)`` the log-probs of the distribution the tokens were actually drawn from (after
            temperature, top-k, top-p, penalties). NaN (a token the engine could not score) counts as no gap.
        completion_mask: ``(B, T)`` 1 on the tokens that carry loss; padding may hold anything, even ±inf.
        mode: ``token_truncate`` / ``token_mask`` one ratio per token ``(B, T)``; ``sequence_truncate`` /
            ``sequence_mask`` one per sequence ``(B, 1)``, ``exp(Σ_t (trainer - sampling))`` (a sum, not GSPO's
            mean). ``*_truncate`` clamps the ratio to [clip_min, clip_max]; ``*_mask`` sets a ratio outside them to 0.
        clip_min, clip_max: C_min, C_max; None leaves that side open (a ``*_truncate`` mode needs one of them).

    Returns the ratio, detached: a weight on each token's policy term (``grpo_loss(importance_sampling_ratio=)``).

    >>> m = torch.ones(1, 2)
    >>> sampling_importance_ratio(torch.log(torch.tensor([[0.5, 0.2]])), torch.log(torch.tensor([[0.25, 0.4]])), m,
    ...                           mode="token_truncate", clip_max=1.5)
    tensor([[1.5000, 0.5000]])
    >>> sampling_importance_ratio(torch.log(torch.tensor([[0.5, 0.2]])), torch.log(torch.tensor([[0.1, 0.4]])), m,
    ...                           clip_max=2.0)  # sequence_mask: 5 x 0.5 = 2.5 > 2, the sequence is masked
    tensor([[0.]])
    """
    check_sampling_correction(mode, clip_min, clip_max)
    check_same_shape(trainer_logps=trainer_logps, sampling_logps=sampling_logps, completion_mask=completion_mask)
    gap = torch.where(completion_mask.bool(), trainer_logps.detach() - sampling_logps.detach(), 0.0)  # (B, T)
    gap = torch.nan_to_num(gap, nan=0.0)  # as TRL: an unscored token gets ratio 1
    if mode.startswith("sequence"):
        gap = gap.sum(dim=1, keepdim=True)  # (B, 1)
    ratio = torch.exp(gap)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def sampling_correction_values(
    trainer_logps: Tensor, sampling_logps: Tensor, ratio: Tensor, completion_mask: Tensor, mode: str
) -> tuple[Tensor, Tensor]:
    """What the sampler-correction metrics count, as TRL: ``(n,)`` the ``|trainer - sampling|`` log-prob gaps of the
    completion tokens (NaN ones left out) and ``(m,)`` the ratios (per completion token, or per sequence in a
    ``sequence_*`` mode, every sequence). Concatenate several batches' values before
    :func:`sampling_correction_metrics`.
    """
    is_token = completion_mask.bool()
    gap = (trainer_logps.detach() - sampling_logps.detach()).abs()
    gaps = gap[is_token & ~gap.isnan()]
    ratios = ratio.detach().flatten() if mode.startswith("sequence") else ratio.detach()[is_token]
    return gaps, ratios


def sampling_correction_metrics(gaps: Tensor, ratios: Tensor) -> dict[str, Tensor]:
    """TRL 1.16's metrics of the sampler correction from :func:`sampling_correction_values`: the mean and max log-prob
    gap and the ratio's min, mean and max (each 0 when there is nothing to count).

    >>> m = sampling_correction_metrics(torch.tensor([0.1, 0.3]), torch.tensor([0.5, 2.0]))
    >>> [round(m[k].item(), 3) for k in sorted(m)]
    [2.0, 1.25, 0.5, 0.3, 0.2]
    """

    def stat(values: Tensor, reduce) -> Tensor:
        return reduce(values) if values.numel() else values.new_zeros(())

    return {
        "sampling/sampling_logp_difference/mean": stat(gaps, torch.mean),
        "sampling/sampling_logp_difference/max": stat(gaps, torch.max),
        "sampling/importance_sampling_ratio/min": stat(ratios, torch.min),
        "sampling/importance_sampling_ratio/mean": stat(ratios, torch.mean),
        "sampling/importance_sampling_ratio/max": stat(ratios, torch.max),
    }


def check_sampling_correction(
    mode: str, clip_min: float | None, clip_max: float | None, *, enabled: bool = True
) -> None:
    """The sampler correction's rules (TRL 1.16's, plus a known mode and bounds >= 0): ``GRPOConfig`` and
    :func:`sampling_importance_ratio` both check with this; a ``*_truncate`` mode needs a bound only when
    ``enabled``."""
    if mode not in SAMPLING_CORRECTION_MODES:
        raise ValueError(
            f"vllm_importance_sampling_mode={mode!r} is not supported; use one of "
            f"{list(SAMPLING_CORRECTION_MODES)} (TRL's default: 'sequence_mask')"
        )
    for name, value in (("clip_min", clip_min), ("clip_max", clip_max)):
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value < math.inf):
            raise ValueError(f"vllm_importance_sampling_{name} must be a finite number >= 0 or None, got {value!r}")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(
            f"vllm_importance_sampling_clip_min ({clip_min}) must be less than "
            f"vllm_importance_sampling_clip_max ({clip_max})"
        )
    if enabled and mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError(
            f"vllm_importance_sampling_mode={mode!r} clamps the ratio: set "
            f"vllm_importance_sampling_clip_max (TRL's default: 3.0) or vllm_importance_sampling_clip_min"
        )


def grpo_aggregation(loss_type: str) -> str:
    """How ``loss_type`` reduces its per-token losses: ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo`` (as TRL 1.16:
    ``cispo`` like ``dapo``, ``sapo`` like ``grpo``). The trainer asks this to count a window's loss items.

    >>> grpo_aggregation("cispo"), grpo_aggregation("sapo")
    ('dapo', 'grpo')
    """
    return {"cispo": "dapo", "sapo": "grpo"}.get(loss_type, loss_type)


def _policy_term(
    objective: GRPOObjective, ratio: Tensor, adv: Tensor, safe_logps: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token policy loss (``(B, T)``, or ``(B, 1)`` for a sequence-level ratio outside ``cispo``) and
    its clipping metrics; ``ratio`` is ``(B, T)`` or ``(B, 1)``, ``adv`` ``(B, 1)``."""
    epsilon_low, epsilon_high, delta = objective.epsilon_low, objective.epsilon_high, objective.delta
    if objective.loss_type == "cispo":  # REINFORCE weighted by the capped ratio; no gradient through the weight
        weight = torch.clamp(ratio, max=epsilon_high).detach()
        flags = (ratio.detach() > epsilon_high) & (adv > 0)
        return -weight * adv * safe_logps, {"cispo_clip_ratio": _fraction(flags, mask)}
    if objective.loss_type == "sapo":  # soft gate: sigma(tau (r - 1)) * 4 / tau has value 1 and slope 1 at r = 1
        tau = torch.where(
            adv > 0, adv.new_tensor(objective.sapo_temperature_pos), adv.new_tensor(objective.sapo_temperature_neg)
        )  # (B, 1), adv's dtype
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv, {}
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:  # two-sided clipping: cap the unclipped ratio too (after the clipped one is taken)
        ratio = torch.clamp(ratio, max=delta)
    per_token = -torch.min(ratio * adv, clipped * adv)
    r = ratio.detach()
    low = (r < 1 - epsilon_low) & (adv < 0)
    high = (r > 1 + epsilon_high) & (adv > 0)
    return per_token, {
        "clip_ratio/low_mean": _fraction(low, mask),
        "clip_ratio/high_mean": _fraction(high, mask),
        "clip_ratio/region_mean": _fraction(low | high, mask),
    }


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


def check_grpo_extras(
    importance_sampling_level: str = "token",
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    top_entropy_quantile: float = 1.0,
    off_policy_mask_threshold: float | None = None,
) -> None:
    """The rules of the options issue 17 added to ``grpo_loss`` (GSPO, δ, SAPO, entropy and off-policy masks)."""
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level={importance_sampling_level!r} is not supported; use one of "
            f"{list(IMPORTANCE_SAMPLING_LEVELS)} ('sequence' is GSPO)"
        )
    if delta is not None and not delta > 1:
        raise ValueError(
            f"delta (two-sided clipping) must be > 1, ideally > 1 + epsilon_high (INTELLECT-2 uses 4), "
            f"or None to disable it; got {delta}"
        )
    if not (sapo_temperature_pos > 0 and sapo_temperature_neg > 0):
        raise ValueError(
            f"sapo_temperature_pos and sapo_temperature_neg must be > 0 (1.0 and 1.05 by default), got "
            f"{sapo_temperature_pos} and {sapo_temperature_neg}"
        )
    if not 0 <= top_entropy_quantile <= 1:
        raise ValueError(
            f"top_entropy_quantile must be in [0, 1] (the paper uses 0.2; 1.0 keeps every token), got "
            f"{top_entropy_quantile}"
        )
    if off_policy_mask_threshold is not None and not off_policy_mask_threshold > 0:
        raise ValueError(f"off_policy_mask_threshold must be > 0 (e.g. 0.5) or None, got {off_policy_mask_threshold}")


def _check_batch(logps, advantages, completion_mask, old_logps, ref_logps, importance_sampling_ratio) -> None:
    """One batch's tensors as :func:`grpo_loss` takes them: their shapes."""
    if logps.dim() != 2:
        raise ValueError(f"logps must be (B, T), got shape {tuple(logps.shape)}")
    tensors = {"logps": logps, "completion_mask": completion_mask}
    if old_logps is not None:
        tensors["old_logps"] = old_logps
    if ref_logps is not None:
        tensors["ref_logps"] = ref_logps
    check_same_shape(**tensors)
    if advantages.shape != logps.shape[:1]:
        raise ValueError(f"advantages must be (B,) = {tuple(logps.shape[:1])}, got {tuple(advantages.shape)}")
    if importance_sampling_ratio is not None and importance_sampling_ratio.shape not in (
        logps.shape,
        logps.shape[:1] + (1,),
    ):
        raise ValueError(
            f"importance_sampling_ratio must be (B, T) = {tuple(logps.shape)} or (B, 1), got "
            f"{tuple(importance_sampling_ratio.shape)}"
        )


def _check_for_objective(objective, logps, ref_logps, entropies, normalizer) -> None:
    """What ``objective`` needs of the batch (the objective checked itself: ``GRPOObjective.__post_init__``)."""
    if not isinstance(objective, GRPOObjective):
        raise TypeError(f"grpo_loss takes its settings as one GRPOObjective, got {type(objective).__name__}")
    if objective.beta > 0 and ref_logps is None:
        raise ValueError(
            "beta > 0 needs ref_logps (the reference model's per-token log-probs); pass them or set beta=0"
        )
    # A tensor normalizer is not inspected: reading its value would force a device sync.
    if isinstance(normalizer, (int, float)) and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    if objective.loss_type == "dr_grpo" and objective.max_completion_length < logps.shape[1]:
        raise ValueError(
            f"max_completion_length ({objective.max_completion_length}) is shorter than the "
            f"completions ({logps.shape[1]} tokens)"
        )
    if objective.top_entropy_quantile < 1.0:
        if entropies is None:
            raise ValueError("top_entropy_quantile < 1 needs entropies (B, T), the per-token entropies of the policy")
        check_same_shape(logps=logps, entropies=entropies)
