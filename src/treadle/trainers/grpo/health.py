"""Health checks of an RL run: say when it has stopped learning, instead of letting it burn hours on nothing.

Pure check functions of what one generation or one log tells, and :class:`HealthCallback`, which keeps the
streaks across steps (in ``state.stateful_callbacks``, so they survive a resume), warns once per check and stops
a run that cannot learn. The settings are ``GRPOConfig.health_checks`` (defaults:
``trainers.grpo.config.HEALTH_CHECKS``; docs/grpo.md "Health" lists every check, its metric and action).

- **Stops** (after ``patience`` consecutive optimizer steps): no learning signal (every group's rewards equal,
  ``frac_reward_zero_std == 1``); every completion truncated (``completions/clipped_ratio == 1``) for twice
  ``patience`` *while the mean reward does not rise* (:func:`reward_rose`; truncation alone, after ``patience``
  steps, is a warning: short answers of a fixed length are a legitimate task); a weight sync that left a rollout
  engine's log-probs unchanged (a hook: :meth:`HealthCallback.record_weight_sync`; the own sampler samples from
  the live policy, so with it this cannot happen). A stop ends the run like a preemption does (the step's
  checkpoint is written, even with ``save_strategy="no"``), then ``train()`` raises :class:`TrainingStalled`, a
  ``UserError``: one line and exit status 2 from the ``treadle`` command.
- **Warnings** (once per check, with the step): a reward function that gave every sample one value for
  ``patience`` steps (by name), the logged entropy below ``min_entropy``, the clipped-token fraction above
  ``max_clip_ratio``, the mean sampler importance ratio (``sampling/importance_sampling_ratio/mean``, logged when
  the sampler correction applies: trainers/grpo/correction.py) outside ``importance_ratio_bounds``.

Rewards whose weighted sum or group advantages overflow float32 stop the run at once, on every generation, naming the
reward function (:func:`check_finite_rewards`).

A check's warning or stop is also logged as ``health/warning/<check>`` or ``health/stop/<check>`` = 1 at the
step it happened (metrics.jsonl; report.html marks it on the panels). Every decision is made from numbers that
are the same on every rank (gathered rewards, reduced logs), so all ranks stop after the same step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from treadle import distributed as dist
from treadle.callbacks import TrainerCallback
from treadle.checkpoint import path_for
from treadle.errors import UserError, resume_hint
from treadle.losses import zero_spread_groups
from treadle.record.plots import HEALTH_MARKERS
from treadle.rewards import RewardFunctionError

__all__ = [
    "GenerationHealth",
    "HealthCallback",
    "HealthWarning",
    "TrainingStalled",
    "check_finite_rewards",
    "constant_values",
    "generation_health",
    "log_warnings",
    "reward_rose",
    "rl_summary",
]

STATE_KEY = "HealthCallback"  # its entry in state.stateful_callbacks (GRPOTrainer.summary_lines reads it)


class TrainingStalled(UserError):
    """A health check stopped the run: the message says what, since which step, the likely causes and the fix."""


class HealthWarning(UserWarning):
    """A health check's warning (each check warns at most once per run)."""


@dataclass
class GenerationHealth:
    """What one generation (all ranks' rows) tells the checks."""

    zero_spread_fraction: float  # groups whose rewards were all equal / groups
    truncated_fraction: float  # completions with no EOS within max_completion_length / completions
    constant_rewards: dict[str, float | None]  # per reward function: its one value when it gave every scored
    #                                            sample that value, else None
    mean_reward: float = 0.0  # the mean weighted total reward (the logged ``reward``)


def constant_values(rewards: torch.Tensor, names: list[str]) -> dict[str, float | None]:
    """Per reward function (a column of ``rewards`` ``(N, F)``, NaN: no opinion), the one value it gave every
    scored sample, or None when it gave several (or scored none).

    >>> constant_values(torch.tensor([[1.0, 0.0], [1.0, 2.0], [float("nan"), 1.0]]), ["a", "b"])
    {'a': 1.0, 'b': None}
    """
    out = {}
    for j, name in enumerate(names):
        scored = rewards[:, j][~rewards[:, j].isnan()]
        out[name] = float(scored[0]) if len(scored) and bool((scored == scored[0]).all()) else None
    return out


def generation_health(
    rewards: torch.Tensor,
    total: torch.Tensor,
    truncated: torch.Tensor,
    group: int,
    names: list[str],
    weights: torch.Tensor | None = None,
) -> GenerationHealth:
    """The health of one generation from every rank's rewards ``(W*N, F)``, their weighted total ``(W*N,)`` and
    truncation flags ``(W*N,)``; ``group`` completions per prompt. A reward of weight 0 (``weights``, ``(F,)``) is
    only recorded: it is left out of the constant-reward check, as it adds nothing to the advantages by design."""
    kept = [j for j in range(len(names)) if weights is None or float(weights[j]) != 0]
    constant = constant_values(rewards[:, kept], [names[j] for j in kept])
    return GenerationHealth(
        zero_spread_fraction=float(zero_spread_groups(total, group).float().mean()),
        truncated_fraction=float(truncated.float().mean()),
        constant_rewards=constant,
        mean_reward=float(total.float().mean()) if total.numel() else 0.0,
    )


def check_finite_rewards(
    rewards: torch.Tensor,
    total: torch.Tensor,
    advantages: torch.Tensor,
    spread: torch.Tensor,
    names: list[str],
    step: int,
) -> None:
    """Stop (``RewardFunctionError``, one line) a generation whose weighted rewards ``(W*N,)``, group advantages
    ``(W*N,)`` or reward spread (the logged ``reward_std``) are not finite although every reward ``(W*N, F)`` is:
    rewards so large that their sum or spread overflows float32 (a NaN advantage, or an infinite spread that scales
    every advantage to 0). Checked on every generation, so a NaN never reaches the weights (and the next sampling
    step), naming the reward function with the largest reward."""
    if all(bool(torch.isfinite(t).all()) for t in (total, advantages, spread)):
        return
    largest = rewards.abs().nan_to_num(nan=-1.0)  # (W*N, F)
    i, j = divmod(int(largest.argmax()), rewards.shape[1])
    raise RewardFunctionError(
        f"the rewards at step {step} overflow float32 in their weighted sum, spread or group advantages (a NaN "
        f"or infinity); the largest in size, {float(rewards[i, j]):g}, came from reward function {names[j]!r}; "
        f"return rewards of a sensible scale (e.g. within +-1e6), or lower its weight in reward_weights"
    )


def merged(parts: list[GenerationHealth]) -> GenerationHealth:
    """The health of one optimizer step that trained on several generations (of equal size)."""
    names = parts[0].constant_rewards
    same = {
        n: parts[0].constant_rewards[n]
        if all(p.constant_rewards[n] == parts[0].constant_rewards[n] for p in parts)
        else None
        for n in names
    }
    return GenerationHealth(
        sum(p.zero_spread_fraction for p in parts) / len(parts),
        sum(p.truncated_fraction for p in parts) / len(parts),
        same,
        sum(p.mean_reward for p in parts) / len(parts),
    )


def reward_rose(first: list[float], last: list[float]) -> bool:
    """Whether a run is still learning while every completion is truncated: the mean reward of the streak's last
    steps (``last``) is above that of its first steps (``first``; the two windows do not overlap). A plain
    comparison of means, no noise margin, made from ``2 x patience`` steps on: a run whose reward moves up keeps
    going, one whose reward is flat (or falls) stops when its noise first puts the last window at or below the
    first (``python -m benchmarks.lab.health_false_alarms`` measures both; at ``patience`` steps, slow learners were
    stopped too).

    >>> reward_rose([0.1, 0.2], [0.3, 0.4]), reward_rose([0.3, 0.2], [0.25, 0.2])
    (True, False)
    """
    return sum(last) / len(last) > sum(first) / len(first)


def log_warnings(logs: dict, checks: dict) -> dict[str, str]:
    """``{check: message}`` of the warnings one training log raises (entropy floor, clip ratio, sampler IS ratio);
    the message says the value, the threshold and the fix (the step is added by the caller)."""
    out = {}
    entropy, floor = logs.get("entropy"), checks["min_entropy"]
    if floor is not None and entropy is not None and entropy < floor:
        out["min_entropy"] = (
            f"the policy's entropy is {entropy:.4g} nats per token, below min_entropy={floor:g}: "
            f"it has (nearly) collapsed onto one completion per prompt, so groups stop differing; "
            f"lower learning_rate, raise temperature, set beta > 0 or epsilon_high (clip-higher)"
        )
    clipped = max((logs[k] for k in ("clip_ratio/region_mean", "cispo_clip_ratio") if k in logs), default=None)
    most = checks["max_clip_ratio"]
    if most is not None and clipped is not None and clipped > most:
        out["max_clip_ratio"] = (
            f"{clipped:.3g} of the tokens have a clipped importance ratio, above "
            f"max_clip_ratio={most:g}: the policy moves too far per generation; lower "
            f"learning_rate or num_iterations, or sample more often (steps_per_generation)"
        )
    ratio, bounds = logs.get("sampling/importance_sampling_ratio/mean"), checks["importance_ratio_bounds"]
    if bounds is not None and ratio is not None and not bounds[0] <= ratio <= bounds[1]:
        out["importance_ratio_bounds"] = (
            f"the mean sampler importance ratio (sampling/importance_sampling_ratio/mean, after the correction's "
            f"clipping or masking) is {ratio:.4g}, outside importance_ratio_bounds={bounds}: the rollout engine "
            f"samples from another distribution than the one trained, by stale or unsynced weights or by heavy "
            f"truncation (top_k / top_p / min_p / repetition_penalty); check the engine's load_weights "
            f"(sampling/sampling_logp_difference/max), sample less truncated, or use "
            f"vllm_importance_sampling_mode='token_truncate'"
        )
    return out


# what a stop says: {check: (what, likely causes and fix)}
_STOPS = {
    "no_learning_signal": (
        "no learning signal: every group of {group} completions got equal rewards (frac_reward_zero_std = 1), "
        "so every advantage is 0 and the policy cannot change",
        "likely causes: a reward that cannot tell completions apart (constant, or 0 for all because the task is too "
        "hard or answers never parse), too little sampling diversity; fix: check the rewards on a few completions "
        "(log_completions=True), raise temperature or num_generations, use easier prompts, or set "
        "dynamic_sampling=True",
    ),
    "all_truncated": (
        "every completion hit max_completion_length={length} without an end-of-sequence token "
        "(completions/clipped_ratio = 1) and the mean reward did not rise ({before:.4g} over the streak's first "
        "{window} steps, {now:.4g} over its last {window})",
        "likely causes: max_completion_length too small for the task, or a tokenizer whose eos_token_id the model "
        "never emits; fix: raise max_completion_length, check eos_token_id, or start from a model that ends its "
        "answers (SFT first)",
    ),
    "weight_sync": (
        "the rollout engine's log-probs did not change after a weight sync, although the policy was updated: "
        "it samples from stale weights",
        "fix: check the engine's load_weights (the weight names, LoRA merging, the server's sync endpoint)",
    ),
}


class HealthCallback(TrainerCallback):
    """Keeps the health checks' streaks, warns once per check and stops a run that cannot learn (module docstring).

    The trainer reports each training generation (``record_generation``); each training log is checked in
    ``on_log``; an engine may report weight syncs (``record_weight_sync``). Markers go into the trainer's metrics
    window (``metrics``): a stop's and a step check's are in the log of their step, a log check's in the next log.
    ``raise_if_stopped`` (after ``on_train_end``) raises :class:`TrainingStalled` when a check stopped the run."""

    def __init__(self, checks: dict, metrics, *, num_generations: int, max_completion_length: int):
        self.checks, self.metrics = checks, metrics
        self.num_generations, self.max_completion_length = num_generations, max_completion_length
        self.pending: list[GenerationHealth] = []  # the generations of the step in progress
        self.last: GenerationHealth | None = None  # the step before's (a generation can feed several steps)
        self.stopped: str | None = None  # the stop's message
        self.sync_unchanged = False

    def record_generation(self, health: GenerationHealth) -> dict[str, tuple[float, int]]:
        """Note one training generation's health; returns its metrics for the trainer's window."""
        self.pending.append(health)
        return {
            "health/no_signal": (float(health.zero_spread_fraction == 1.0), 1),
            "health/all_truncated": (float(health.truncated_fraction == 1.0), 1),
        }

    def record_weight_sync(self, unchanged: bool) -> None:
        """A rollout engine's report of one weight sync (``engines.vllm.weight_sync_unchanged``): the run stops at this
        step's end when the sync left its log-probs unchanged. The own sampler never calls it."""
        self.sync_unchanged = self.sync_unchanged or unchanged

    def on_train_begin(self, args, state, control, **kwargs):
        self.pending, self.last, self.stopped, self.sync_unchanged = [], None, None, False
        self._saved(state)

    def _saved(self, state) -> dict:
        return state.stateful_callbacks.setdefault(
            STATE_KEY,
            {
                "streaks": {},
                "warned": [],
                "warnings": [],
                "steps": 0,
                "signal_steps": 0,
                "truncated_sum": 0.0,
                "truncated_rewards": {"first": [], "last": []},  # _count_streaks
            },
        )

    def on_step_end(self, args, state, control, **kwargs):
        health = merged(self.pending) if self.pending else self.last
        self.pending, self.last = [], health
        saved, step = self._saved(state), state.global_step
        if self.sync_unchanged and self.checks["weight_sync"]:
            self._stop("weight_sync", step, step, control, state)
        self.sync_unchanged = False
        if health is None:  # resumed inside a generation: its numbers are not known, skip the step
            return
        saved["steps"] += 1
        saved["signal_steps"] += health.zero_spread_fraction < 1.0
        saved["truncated_sum"] += health.truncated_fraction
        self._count_streaks(saved, health, step)
        count, since = saved["streaks"]["no_learning_signal"]
        if self.checks["no_learning_signal"] and count >= self.checks["patience"]:
            self._stop("no_learning_signal", since, step, control, state)
        if self.checks["all_truncated"]:
            self._check_truncation(saved, step, control, state)
        if self.checks["constant_reward"]:
            for name, value in health.constant_rewards.items():
                count, since = saved["streaks"][f"constant_reward:{name}"]
                if count >= self.checks["patience"]:
                    self._warn(
                        state,
                        f"constant_reward:{name}",
                        f"reward function {name!r} returned {value:g} for "
                        f"every sample since step {since} ({count} steps): it adds nothing to the advantages; "
                        f"check it on a few completions (log_completions=True)",
                    )

    def _count_streaks(self, saved: dict, health: GenerationHealth, step: int) -> None:
        """Each condition's streak ``[steps in a row, since step]``; while every completion is truncated, the mean
        rewards of the streak's first and last ``window`` steps (what ``reward_rose`` compares)."""
        conditions = {
            "no_learning_signal": health.zero_spread_fraction == 1.0,
            "all_truncated": health.truncated_fraction == 1.0,
        }
        conditions.update(
            {f"constant_reward:{name}": value is not None for name, value in health.constant_rewards.items()}
        )
        for name, holds in conditions.items():
            streak = saved["streaks"].get(name, [0, step])
            saved["streaks"][name] = [streak[0] + 1, streak[1]] if holds else [0, step + 1]
        rewards = saved.setdefault("truncated_rewards", {"first": [], "last": []})  # bounded: 2 x window floats
        if not conditions["all_truncated"]:
            rewards["first"], rewards["last"] = [], []
            return
        window = self._window()
        if len(rewards["first"]) < window:
            rewards["first"].append(health.mean_reward)
        rewards["last"] = (rewards["last"] + [health.mean_reward])[-window:]

    def _window(self) -> int:
        """Steps in each of the two windows of rewards an all-truncated streak compares: half the patience."""
        return max(1, self.checks["patience"] // 2)

    def _check_truncation(self, saved: dict, step: int, control, state) -> None:
        """Every completion truncated for ``patience`` steps: a warning (once); for ``2 x patience`` steps (at least
        2) while the mean reward did not rise over the streak (``reward_rose``): a stop. A fixed-length task learns
        with every completion cut, and a slow learner's rise needs that many steps to show through its noise."""
        count, since = saved["streaks"]["all_truncated"]
        patience, window = self.checks["patience"], self._window()
        if count < patience:
            return
        first, last = saved["truncated_rewards"]["first"], saved["truncated_rewards"]["last"]
        before, now = sum(first) / len(first), sum(last) / len(last)
        if count >= max(2 * patience, 2) and not reward_rose(first, last):
            self._stop("all_truncated", since, step, control, state, before=before, now=now, window=window)
            return
        self._warn(
            state,
            "all_truncated",
            f"every completion hit max_completion_length={self.max_completion_length} without an end-of-sequence "
            f"token since step {since} ({count} steps; the mean reward {before:.4g} over the streak's first "
            f"{window} steps, {now:.4g} over its last {window}): fine for answers of a fixed length while the "
            f"reward rises, and the run stops if it has not risen after {2 * patience} such steps; if answers "
            f"should end, raise max_completion_length or check eos_token_id",
        )

    def _stop(self, check: str, since: int, step: int, control, state, **details) -> None:
        if self.stopped is not None:
            return
        what, fix = _STOPS[check]
        what = what.format(group=self.num_generations, length=self.max_completion_length, **details)
        self.stopped = (
            f"health check {check!r} stopped the run at step {step}: {what}, since step {since}; {fix}; "
            f"or turn the check off (health_checks={{{check!r}: False}})"
        )
        self.metrics.add(f"{HEALTH_MARKERS[1]}{check}", 1.0, 1)
        self._saved(state)["warnings"].append({"step": step, "check": check, "stop": True})
        control.should_training_stop = control.should_save = control.should_log = True

    def _warn(self, state, check: str, message: str) -> None:
        saved = self._saved(state)
        if check in saved["warned"]:
            return
        saved["warned"].append(check)
        saved["warnings"].append({"step": state.global_step, "check": check, "stop": False})
        self.metrics.add(f"{HEALTH_MARKERS[0]}{check.split(':')[0]}", 1.0, 1)
        if dist.is_main_process():
            warnings.warn(f"treadle: health: step {state.global_step}: {message}", HealthWarning, stacklevel=2)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:  # a training log (the same on every rank: it is reduced)
            for check, message in log_warnings(logs, self.checks).items():
                self._warn(state, check, message)

    def raise_if_stopped(self, args, state) -> None:
        """After ``on_train_end`` of a run a check stopped (its checkpoint written): raise ``TrainingStalled``."""
        if self.stopped is None:
            return
        raise TrainingStalled(
            f"{self.stopped}; checkpoint: {path_for(args.output_dir, state.global_step)}; {resume_hint()} once fixed"
        )


HELD_OUT = ("eval_greedy/accuracy", "eval_pass@1", "eval_reward")  # the held-out score the summary shows, by choice


def rl_summary(history: list[dict], health: dict | None) -> list[str]:
    """The lines a GRPO run's end summary adds (``GRPOTrainer.summary_lines``; none for a run that logged no
    ``reward``): the reward and the held-out score at start and end, the entropy trend, the truncation rate, the
    fraction of steps with a learning signal and every health warning (``health``: ``HealthCallback``'s saved
    state)."""

    def trend(key: str) -> str | None:
        values = [h[key] for h in history if isinstance(h.get(key), (int, float))]
        return f"{key} {values[0]:.4g} -> {values[-1]:.4g}" if values else None

    if not any("reward" in h for h in history):
        return []
    held_out = next((key for key in HELD_OUT if any(key in h for h in history)), None)
    lines = ["; ".join(t for t in (trend("reward"), held_out and trend(held_out), trend("entropy")) if t)]
    clipped = [h["completions/clipped_ratio"] for h in history if "completions/clipped_ratio" in h]
    rates = [f"truncated {sum(clipped) / len(clipped):.1%} of completions"] if clipped else []
    if health and health.get("steps"):
        rates.append(f"learning signal in {health['signal_steps'] / health['steps']:.0%} of {health['steps']} steps")
    lines += ["; ".join(rates)] if rates else []
    for event in (health or {}).get("warnings", []):
        lines.append(f"health {'stop' if event['stop'] else 'warning'} at step {event['step']}: {event['check']}")
    return lines
