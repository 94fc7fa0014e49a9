"""Pure loss functions: preference optimisation (the DPO family, ``losses.dpo``), the reward model
(``losses.reward``), KTO (``losses.kto``), distillation divergences (``losses.distill``) and group-relative
policy optimisation (``losses.grpo``). This module re-exports them all
(``from treadle.losses import dpo_loss`` is the public path).

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
- The sampler/trainer importance-sampling correction (truncated / masked IS, token or sequence level), Yao et al.
  2025, https://fengyao.notion.site/off-policy-rl, and TRL 1.16's ``vllm_importance_sampling_*``:
  ``sampling_importance_ratio``.
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

from treadle.losses.distill import check_distill_options, chunked_generalized_jsd, generalized_jsd
from treadle.losses.dpo import (
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSSES,
    F_DIVERGENCES,
    SMOOTHING_RULES,
    ChosenRejectedCounts,
    check_dpo_options,
    check_same_shape,
    dpo_loss,
    dpo_loss_types,
    f_divergence_score,
    ld_token_weights,
    sft_loss,
    wpo_weights,
)
from treadle.losses.grpo import (
    ADVANTAGE_ESTIMATORS,
    GRPO_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SAMPLING_CORRECTION_MODES,
    SCALE_REWARDS,
    GRPOObjective,
    check_grpo_extras,
    check_grpo_options,
    check_sampling_correction,
    decoupled_advantages,
    group_advantages,
    grpo_aggregation,
    grpo_loss,
    high_entropy_mask,
    kl_k3,
    off_policy_mask,
    sampling_correction_metrics,
    sampling_correction_values,
    sampling_importance_ratio,
    zero_spread_groups,
)
from treadle.losses.kto import KTO_LOSS_TYPES, check_kto_options, kto_kl, kto_loss, kto_uses_kl
from treadle.losses.reward import bradley_terry_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ChosenRejectedCounts",
    "DPO_LOSS_TYPES",
    "F_DIVERGENCES",
    "F_DIVERGENCE_LOSSES",
    "GRPOObjective",
    "GRPO_LOSS_TYPES",
    "IMPORTANCE_SAMPLING_LEVELS",
    "KTO_LOSS_TYPES",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "SAMPLING_CORRECTION_MODES",
    "SCALE_REWARDS",
    "SMOOTHING_RULES",
    "bradley_terry_loss",
    "check_dpo_options",
    "check_grpo_extras",
    "check_grpo_options",
    "check_distill_options",
    "check_kto_options",
    "chunked_generalized_jsd",
    "generalized_jsd",
    "kto_kl",
    "kto_loss",
    "kto_uses_kl",
    "check_same_shape",
    "decoupled_advantages",
    "dpo_loss",
    "dpo_loss_types",
    "f_divergence_score",
    "group_advantages",
    "grpo_aggregation",
    "grpo_loss",
    "high_entropy_mask",
    "kl_k3",
    "ld_token_weights",
    "off_policy_mask",
    "sft_loss",
    "wpo_weights",
    "zero_spread_groups",
    "check_sampling_correction",
    "sampling_importance_ratio",
    "sampling_correction_values",
    "sampling_correction_metrics",
]
