"""``GRPOConfig``: the arguments of ``GRPOTrainer`` (trainers/grpo/trainer.py holds the trainer and its departures):
``OnPolicyConfig``'s (sampling, batch semantics, rollout engine, evaluation) plus the objective, its reference, the
sampler correction, the log-prob forwards, dynamic sampling and the health checks."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

from treadle.arguments import PaddingFreeOption, SharedPrefixOption
from treadle.errors import PreflightError
from treadle.losses import (
    ADVANTAGE_ESTIMATORS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    SCALE_REWARDS,
    GRPOObjective,
    check_sampling_correction,
)
from treadle.trainers.onpolicy.config import OnPolicyConfig

__all__ = ["GRPOConfig", "HEALTH_CHECKS", "resolve_health_checks"]


@dataclass
class GRPOConfig(SharedPrefixOption, PaddingFreeOption, OnPolicyConfig):
    """Arguments of ``GRPOTrainer``. Batch semantics: ``OnPolicyConfig`` (trainers/onpolicy/config.py).

    Loss types (how the per-token losses are reduced; see ``losses.grpo_loss``): ``grpo`` the mean over
    sequences of each sequence's token mean (the paper); ``bnpo`` the token mean of each micro-batch;
    ``dr_grpo`` the token sum / (batch × max_completion_length) (Dr. GRPO); ``dapo`` the token sum / the
    completion tokens of the whole accumulation window on all ranks (DAPO; the default). ``cispo`` (MiniMax-M1)
    reduces like ``dapo`` and ``sapo`` (soft gates) like ``grpo``, as in TRL; the other objectives of the table
    (GSPO, two-sided clipping, entropy and off-policy masks, GDPO, RLOO) are the last block of fields.
    """

    min_num_generations: ClassVar[int] = 2  # a group needs two completions for a baseline

    # --- loss
    beta: float = 0.0  # β: weight of the k3 KL to the reference model; 0 creates no reference (DAPO, Dr. GRPO)
    epsilon: float = 0.2  # ε (ε_low): the ratio is clipped below at 1 - ε
    epsilon_high: float | None = None  # ε_high: the ratio is clipped above at 1 + ε_high; None: epsilon (DAPO: 0.28)
    loss_type: str = "dapo"  # "grpo", "bnpo", "dr_grpo", "dapo", "cispo" or "sapo" (see the class docstring)
    scale_rewards: str = "group"  # divide advantages by the "group" std (GRPO), the "batch" std, or "none" (Dr. GRPO)

    # --- what a run writes besides its metrics
    log_completions: bool = False  # append prompt, completion, rewards, advantage to output_dir/completions.jsonl

    # --- objective table (issue 17): names and defaults of TRL 1.16's GRPOConfig; see docs/grpo.md
    importance_sampling_level: str = "token"  # "token", or "sequence": one ratio per sequence (GSPO)
    delta: float | None = None  # two-sided clip: also cap the ratio at delta (> 1 + epsilon_high) when A < 0
    sapo_temperature_pos: float = 1.0  # τ of SAPO's soft gate for A > 0 (loss_type="sapo")
    sapo_temperature_neg: float = 1.05  # τ of SAPO's soft gate for A <= 0
    top_entropy_quantile: float = 1.0  # ρ: only the top-ρ tokens by entropy carry the policy loss (paper: 0.2)
    off_policy_mask_threshold: float | None = None  # δ: drop A < 0 sequences that drifted > δ from the sampler
    use_bias_correction_kl: bool = True  # k3 term times the ratio: the unbiased KL gradient (DeepSeek-V3.2)
    multi_objective_aggregation: str = "sum_then_normalize"  # or "normalize_then_sum": per-reward normalisation (GDPO)
    advantage_estimator: str = "grpo"  # baseline: "grpo" the group mean, "rloo" the mean of the other G - 1 rewards

    # --- sampler correction: TRL 1.16's names and defaults (docs/grpo.md "Importance-sampling correction"); applied
    # when the engine's sampled distribution may differ from the trained one (trainers/grpo/correction.py)
    vllm_importance_sampling_correction: bool = True  # weigh each token's policy loss by pi_trainer / pi_sampler
    vllm_importance_sampling_mode: str = "sequence_mask"  # "token_" or "sequence_" + "truncate" or "mask"
    vllm_importance_sampling_clip_max: float | None = 3.0  # C_max: *_truncate clamps at it, *_mask zeroes above it
    vllm_importance_sampling_clip_min: float | None = None  # C_min: the lower bound the same way; None: open
    vllm_importance_sampling_cap: float | None = None  # deprecated (TRL 1.6): sets vllm_importance_sampling_clip_max

    # --- health checks and dynamic sampling (trainers/grpo/health.py, dynamic.py; docs/grpo.md "Health")
    health_checks: dict | bool | None = None  # overrides of HEALTH_CHECKS (None: its defaults; False: every check off)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, sample more prompts to refill
    dynamic_sampling_max_rounds: int = 4  # most extra generation rounds per generation; short groups stay untrained

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self._validate_objective_table()
        self._validate_sampling_correction()
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(
                f"scale_rewards={self.scale_rewards!r} is not supported; use one of {list(SCALE_REWARDS)}"
            )
        self.health_checks = resolve_health_checks(self.health_checks)
        self._validate_dynamic_sampling()

    def _validate_sampling_correction(self) -> None:
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated alias, with TRL's warning
            warnings.warn(
                "vllm_importance_sampling_cap is deprecated (as in TRL, to be removed in v2.0.0): use "
                "vllm_importance_sampling_clip_max instead",
                FutureWarning,
                stacklevel=4,
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        check_sampling_correction(
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
            enabled=self.vllm_importance_sampling_correction,
        )

    def _validate_dynamic_sampling(self) -> None:
        rounds = self.dynamic_sampling_max_rounds
        if not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"dynamic_sampling_max_rounds must be an integer >= 0, got {rounds!r}")
        if self.dynamic_sampling and self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"dynamic_sampling keeps or drops whole groups on each process, but one process holds "
                f"generation_batch_size={self.generation_batch_size} completions, not a multiple of "
                f"num_generations={self.num_generations}; make per_device_train_batch_size x "
                f"steps_per_generation a multiple of num_generations"
            )
        if self.dynamic_sampling and self.max_staleness:
            raise PreflightError(
                "max_staleness > 0 cannot take dynamic_sampling (its extra rounds depend on the "
                "rewards of the batch being sampled): set one of them off"
            )

    def objective(self) -> GRPOObjective:
        """The objective's settings as ``losses.grpo_loss`` takes them: a ``GRPOObjective``, which checks them."""
        return GRPOObjective(
            loss_type=self.loss_type,
            beta=self.beta,
            epsilon_low=self.epsilon,
            epsilon_high=self.epsilon_high,
            delta=self.delta,
            sapo_temperature_pos=self.sapo_temperature_pos,
            sapo_temperature_neg=self.sapo_temperature_neg,
            importance_sampling_level=self.importance_sampling_level,
            use_bias_correction_kl=self.use_bias_correction_kl,
            top_entropy_quantile=self.top_entropy_quantile,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            max_completion_length=self.max_completion_length,
        )

    def _validate_objective_table(self) -> None:
        self.objective()  # the rules grpo_loss applies, checked where they live (losses.GRPOObjective)
        for name, allowed in (
            ("multi_objective_aggregation", MULTI_OBJECTIVE_AGGREGATIONS),
            ("advantage_estimator", ADVANTAGE_ESTIMATORS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported; use one of {list(allowed)}")
        if self.multi_objective_aggregation == "normalize_then_sum" and self.advantage_estimator == "rloo":
            raise ValueError(
                "multi_objective_aggregation='normalize_then_sum' (GDPO) forms its own advantages; "
                "use it with advantage_estimator='grpo'"
            )
        if self.loss_type == "cispo" and self.epsilon_high < 1:
            warnings.warn(
                f"loss_type='cispo' caps the importance ratio itself at epsilon_high={self.epsilon_high}, "
                f"below 1, so every token's weight is capped (as in TRL); ScaleRL uses epsilon_high=5.0",
                stacklevel=3,
            )


# The health checks (trainers/grpo/health.py), their defaults; GRPOConfig.health_checks overrides any of them by name.
HEALTH_CHECKS = {
    "patience": 10,  # consecutive optimizer steps a condition must hold before its check acts
    "no_learning_signal": True,  # stop: every group's rewards were all equal (frac_reward_zero_std == 1)
    "all_truncated": True,  # stop: every completion hit max_completion_length (completions/clipped_ratio == 1)
    "constant_reward": True,  # warn once: a reward function gave every sample the same value
    "min_entropy": 0.01,  # warn once: the logged entropy (nats per token) fell below this; None: off
    "max_clip_ratio": 0.2,  # warn once: the logged fraction of clipped tokens rose above this; None: off
    "importance_ratio_bounds": [0.5, 2.0],  # warn once: the logged sampler IS ratio left [low, high]; None: off
    "weight_sync": True,  # stop: a rollout engine's log-probs did not change after a weight sync (engine hook)
}
_SWITCHES = ("no_learning_signal", "all_truncated", "constant_reward", "weight_sync")


def resolve_health_checks(value) -> dict:
    """Every health check's setting: ``HEALTH_CHECKS`` with ``value``'s overrides (a mapping), every check off
    (``False``), or the defaults (None / True). A setting that is already whole is checked and returned."""
    if value is None or value is True:
        return dict(HEALTH_CHECKS)
    if value is False:
        return {
            name: (False if name in _SWITCHES else None if name != "patience" else default)
            for name, default in HEALTH_CHECKS.items()
        }
    if not isinstance(value, dict):
        raise ValueError(f"health_checks must be a mapping of check names to settings (or False), got {value!r}")
    unknown = sorted(set(value) - set(HEALTH_CHECKS))
    if unknown:
        raise ValueError(f"health_checks has unknown key(s) {unknown}; valid: {list(HEALTH_CHECKS)}")
    checks = {**HEALTH_CHECKS, **value}
    if not isinstance(checks["patience"], int) or isinstance(checks["patience"], bool) or checks["patience"] < 1:
        raise ValueError(f"health_checks['patience'] must be an integer >= 1 (steps), got {checks['patience']!r}")
    for name in _SWITCHES:
        if not isinstance(checks[name], bool):
            raise ValueError(f"health_checks[{name!r}] must be True or False, got {checks[name]!r}")
    for name in ("min_entropy", "max_clip_ratio"):
        if checks[name] is not None and not (isinstance(checks[name], (int, float)) and checks[name] >= 0):
            raise ValueError(f"health_checks[{name!r}] must be a number >= 0 or None (off), got {checks[name]!r}")
    bounds = checks["importance_ratio_bounds"]
    if bounds is not None:
        if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2 and 0 <= bounds[0] < 1 < bounds[1]):
            raise ValueError(
                f"health_checks['importance_ratio_bounds'] must be [low, high] with 0 <= low < 1 < high, "
                f"or None (off), got {bounds!r}"
            )
        checks["importance_ratio_bounds"] = [float(b) for b in bounds]
    return checks
