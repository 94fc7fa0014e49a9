"""``GRPOConfig``: the arguments of ``GRPOTrainer`` (trainers/grpo/trainer.py holds the trainer and its departures)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from treadle.arguments import TrainingArguments
from treadle.engines.options import check_vllm_options
from treadle.generation.sampling import SamplingParams, sampler_options
from treadle.generation.single import BACKENDS
from treadle.losses import (ADVANTAGE_ESTIMATORS, MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS, check_grpo_extras,
                            check_grpo_options, check_sampling_correction)
from treadle.errors import PreflightError

__all__ = ["GRPOConfig", "HEALTH_CHECKS", "WORKER_KINDS", "check_async_config", "resolve_health_checks"]

WORKER_KINDS = ("process", "thread")  # asynchronous GRPO's rollout worker (trainers/onpolicy/worker.py)


@dataclass
class GRPOConfig(TrainingArguments):
    """Arguments of ``GRPOTrainer``. Batch semantics (the most asked-about part of every GRPO library):

    - ``per_device_train_batch_size`` counts *completions* per micro-step on one process.
    - One generation samples ``per_device_train_batch_size * steps_per_generation * world_size`` completions:
      that many divided by ``num_generations`` distinct prompts, each G times. It must divide evenly.
    - That buffer feeds ``steps_per_generation`` micro-steps, and is reused ``num_iterations`` times (μ):
      generation runs once every ``steps_per_generation * num_iterations`` micro-steps.
    - An optimizer step still takes ``gradient_accumulation_steps`` micro-steps.

    Loss types (how the per-token losses are reduced; see ``losses.grpo_loss``): ``grpo`` the mean over
    sequences of each sequence's token mean (the paper); ``bnpo`` the token mean of each micro-batch;
    ``dr_grpo`` the token sum / (batch × max_completion_length) (Dr. GRPO); ``dapo`` the token sum / the
    completion tokens of the whole accumulation window on all ranks (DAPO; the default). ``cispo`` (MiniMax-M1)
    reduces like ``dapo`` and ``sapo`` (soft gates) like ``grpo``, as in TRL; the other objectives of the table
    (GSPO, two-sided clipping, entropy and off-policy masks, GDPO, RLOO) are the last block of fields.
    """

    min_num_generations: ClassVar[int] = 2  # a group needs two completions for a baseline (distillation: 1)

    learning_rate: float = 1e-6  # RL fine-tuning of a trained policy wants small steps (TRL's default)

    # --- sampling
    num_generations: int = 8  # G: completions per prompt, the group that forms the baseline; >= 2, often 4-16
    steps_per_generation: int | None = None  # micro-steps fed by one generation; None: gradient_accumulation_steps
    num_iterations: int = 1  # μ: passes over each generated buffer (PPO epochs); 1 is fully on-policy
    max_prompt_length: int | None = 512  # keep the last N prompt tokens; None keeps whole prompts
    max_completion_length: int = 256  # L: most tokens sampled per completion
    temperature: float = 1.0  # sampling temperature; the trained log-probs use it too; 0.7-1.0 typical
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]; 1.0 disables
    top_k: int = 0  # sample among the k most likely tokens; 0 disables
    repetition_penalty: float = 1.0  # CTRL penalty on tokens already in prompt or completion; 1.0 disables
    min_p: float | None = None  # drop tokens below min_p x the top token's probability (0.01-0.2); None disables
    generation_kwargs: dict | None = None  # GenerationConfig names the own sampler takes (sampling.GENERATION_KWARGS)
    generation_backend: str = "auto"  # "fast" (KV-cache sampler), "hf" (model.generate) or "auto"

    # --- vLLM as the rollout engine (treadle.engines.vllm; docs/vllm.md); TRL 1.16's names and defaults
    use_vllm: bool = False  # sample with vLLM instead of the own sampler (training and evaluation, single-turn)
    vllm_mode: str = "colocate"  # "colocate": an in-process engine on the policy's device; "server": treadle vllm-serve
    vllm_gpu_memory_utilization: float = 0.3  # share of GPU memory vLLM takes (weights + KV cache); CUDA only
    vllm_max_model_length: int | None = None  # context window; None: the model config's max_position_embeddings
    vllm_tensor_parallel_size: int = 1  # GPUs one engine spans
    vllm_enable_sleep_mode: bool = False  # GPU: the engine frees its memory through the optimizer step
    vllm_server_base_url: str | None = None  # vllm_mode "server": e.g. http://localhost:8000; else host and port below
    vllm_server_host: str = "0.0.0.0"  # the server's host when vllm_server_base_url is None (0.0.0.0: this machine)
    vllm_server_port: int = 8000  # the server's port when vllm_server_base_url is None
    vllm_server_timeout: float = 240.0  # seconds to wait for the server to answer before the run is refused

    # --- loss
    beta: float = 0.0  # β: weight of the k3 KL to the reference model; 0 creates no reference (DAPO, Dr. GRPO)
    epsilon: float = 0.2  # ε (ε_low): the ratio is clipped below at 1 - ε
    epsilon_high: float | None = None  # ε_high: the ratio is clipped above at 1 + ε_high; None: epsilon (DAPO: 0.28)
    loss_type: str = "dapo"  # "grpo", "bnpo", "dr_grpo", "dapo", "cispo" or "sapo" (see the class docstring)
    scale_rewards: str = "group"  # divide advantages by the "group" std (GRPO), the "batch" std, or "none" (Dr. GRPO)
    mask_truncated_completions: bool = False  # completions without EOS get no loss (DAPO's overlong filtering)

    # --- rewards and records
    reward_weights: list[float] | None = None  # one weight per reward function; None weighs each 1.0
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

    # --- multi-turn rollouts: tools and environments (treadle.rollouts; used when tools= or env_factory= is given)
    max_tool_calling_iterations: int | None = None  # TRL's name: most turns with tool calls per rollout; None: no cap
    tool_timeout: float | None = 10.0  # seconds a tool call may run before it is cut off (an error turn); None: never
    env_timeout: float | None = 60.0  # seconds an environment's reset/step may run; then its rollout ends; None: never
    tool_call_format: str = "auto"  # "tagged" (<call>f(x)</call>), "json" (<tool_call>{...}</tool_call>) or "auto"
    rollout_workers: int = 8  # threads stepping the environments (tools) concurrently; 0: in the loop, bit-reproducible

    # --- asynchronous GRPO (trainers/onpolicy/asynchronous.py; docs/async.md): sample the next batches while training
    max_staleness: int = 0  # N: train batches sampled from weights up to N optimizer steps old; 0: synchronous
    async_worker: str = "process"  # the rollout worker: "process" (own interpreter, own threads) or "thread"
    async_worker_threads: int | None = None  # the worker's torch threads; None: half of the trainer's (at least 1)
    async_timeout: float = 600.0  # seconds any wait on the worker may take before the run stops, naming the wait

    # --- padding-free training forwards (issue 18)
    padding_free: bool = True  # pack each micro-batch's rows without padding for the log-prob forwards (exact)
    shared_prefix: bool = True  # each prompt once per micro-batch, its completions after it (exact; off where unfit)

    # --- health checks and dynamic sampling (treadle.health, trainers/grpo/dynamic.py; docs/grpo.md "Health")
    health_checks: dict | bool | None = None  # overrides of HEALTH_CHECKS (None: its defaults; False: every check off)
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, sample more prompts to refill
    dynamic_sampling_max_rounds: int = 4  # most extra generation rounds per generation; short groups stay untrained

    # --- evaluation: what RL optimises, on sampled (and greedy) completions of eval_dataset (docs/grpo.md)
    num_generations_eval: int | None = None  # n: samples per evaluation prompt (TRL's name); None: num_generations
    eval_temperature: float | None = None  # evaluation sampling temperature; 0 decodes greedily; None: temperature
    eval_top_p: float | None = None  # evaluation nucleus mass; None: top_p
    eval_top_k: int | None = None  # evaluation top-k; None: top_k
    eval_pass_at_k: list[int] = field(default_factory=lambda: [1])  # log eval_pass@k for each k, 1 <= k <= n
    eval_success_threshold: float = 1.0  # a completion passes when its reward >= this (1.0: exact-match rewards)
    eval_greedy: bool = False  # also decode each prompt greedily: eval_greedy/reward, eval_greedy/accuracy

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self._validate_objective_table()
        self._validate_sampling_correction()
        self._validate_grpo_choices()
        self._validate_grpo_numbers()
        self._validate_generation_batch()
        self._resolve_eval_settings()
        self.health_checks = resolve_health_checks(self.health_checks)
        self._validate_dynamic_sampling()
        check_vllm_options(self)
        check_async_config(self)  # max_staleness and its worker (docs/async.md)

    def _validate_sampling_correction(self) -> None:
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated alias, with TRL's warning
            warnings.warn("vllm_importance_sampling_cap is deprecated (as in TRL, to be removed in v2.0.0): use "
                          "vllm_importance_sampling_clip_max instead", FutureWarning, stacklevel=4)
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        check_sampling_correction(self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
                                  self.vllm_importance_sampling_clip_max,
                                  enabled=self.vllm_importance_sampling_correction)

    def _validate_dynamic_sampling(self) -> None:
        rounds = self.dynamic_sampling_max_rounds
        if not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"dynamic_sampling_max_rounds must be an integer >= 0, got {rounds!r}")
        if self.dynamic_sampling and self.generation_batch_size % self.num_generations:
            raise ValueError(f"dynamic_sampling keeps or drops whole groups on each process, but one process holds "
                             f"generation_batch_size={self.generation_batch_size} completions, not a multiple of "
                             f"num_generations={self.num_generations}; make per_device_train_batch_size x "
                             f"steps_per_generation a multiple of num_generations")

    def _resolve_eval_settings(self) -> None:
        """Evaluation sampling defaults to training's (None), then obeys the same rules."""
        if self.num_generations_eval is None:
            self.num_generations_eval = self.num_generations
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, f"eval_{name}") is None:
                setattr(self, f"eval_{name}", getattr(self, name))
        n, ks = self.num_generations_eval, self.eval_pass_at_k
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"num_generations_eval must be an integer >= 1 (samples per evaluation prompt), got {n!r}")
        if not isinstance(ks, (list, tuple)) or not ks or not all(isinstance(k, int) and 1 <= k <= n for k in ks):
            raise ValueError(f"eval_pass_at_k must be a non-empty list of integers in 1..num_generations_eval={n}, "
                             f"got {ks!r}; e.g. eval_pass_at_k=[1, {n}] (raise num_generations_eval for a larger k)")
        if not math.isfinite(float(self.eval_success_threshold)) or self.eval_temperature < 0:
            raise ValueError(f"eval_success_threshold must be finite and eval_temperature >= 0 (0: greedy), got "
                             f"{self.eval_success_threshold!r} and {self.eval_temperature!r}")
        SamplingParams(num_generations=n, max_new_tokens=self.max_completion_length, eos_token_ids=(), pad_token_id=0,
                       temperature=self.eval_temperature or 1.0, top_p=self.eval_top_p, top_k=self.eval_top_k,
                       do_sample=self.eval_temperature > 0)
        best = (self.metric_for_best_model or "").removeprefix("eval_")
        if best == "loss":  # also TrainingArguments' default under load_best_model_at_end
            raise ValueError("GRPO's evaluation reports no loss: set metric_for_best_model='pass@1' (keeps the "
                             "policy that solved most) or 'reward'")
        missing_k = best.startswith("pass@") and best[5:] not in {str(k) for k in ks}
        if missing_k or (best.startswith("greedy/") and not self.eval_greedy):
            raise ValueError(f"metric_for_best_model={self.metric_for_best_model!r} is not evaluated: add its k to "
                             f"eval_pass_at_k={ks} (pass@k) or set eval_greedy=True (greedy/...)")

    def _validate_grpo_choices(self) -> None:
        for name, value, allowed in (("scale_rewards", self.scale_rewards, SCALE_REWARDS),
                                     ("generation_backend", self.generation_backend, BACKENDS)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported; use one of {list(allowed)}")

    def _validate_objective_table(self) -> None:
        check_grpo_extras(self.importance_sampling_level, self.delta, self.sapo_temperature_pos,
                          self.sapo_temperature_neg, self.top_entropy_quantile, self.off_policy_mask_threshold)
        for name, allowed in (("multi_objective_aggregation", MULTI_OBJECTIVE_AGGREGATIONS),
                              ("advantage_estimator", ADVANTAGE_ESTIMATORS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported; use one of {list(allowed)}")
        if self.multi_objective_aggregation == "normalize_then_sum" and self.advantage_estimator == "rloo":
            raise ValueError("multi_objective_aggregation='normalize_then_sum' (GDPO) forms its own advantages; "
                             "use it with advantage_estimator='grpo'")
        if self.loss_type == "cispo" and self.epsilon_high < 1:
            warnings.warn(f"loss_type='cispo' caps the importance ratio itself at epsilon_high={self.epsilon_high}, "
                          f"below 1, so every token's weight is capped (as in TRL); ScaleRL uses epsilon_high=5.0",
                          stacklevel=3)

    def _validate_grpo_numbers(self) -> None:
        if not isinstance(self.num_generations, int) or self.num_generations < self.min_num_generations:
            raise ValueError(f"num_generations must be an integer >= {self.min_num_generations} (GRPO: a group "
                             f"needs two completions for a baseline), got {self.num_generations!r}; e.g. 8")
        for name in ("steps_per_generation", "num_iterations", "max_completion_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_prompt_length is not None and (not isinstance(self.max_prompt_length, int)
                                                   or self.max_prompt_length < 1):
            raise ValueError(f"max_prompt_length must be an integer >= 1 or None, got {self.max_prompt_length!r}")
        # the sampling settings' rules live with the sampler: build its parameters once to check them
        settings = dict(top_p=self.top_p, top_k=self.top_k, repetition_penalty=self.repetition_penalty)
        options = sampler_options(self.min_p, self.generation_kwargs)
        SamplingParams(num_generations=self.num_generations, max_new_tokens=self.max_completion_length,
                       eos_token_ids=(), pad_token_id=0, temperature=self.temperature, **settings | options)
        if self.use_vllm and "suppress_token_ids" in options:
            raise ValueError("generation_kwargs' suppress_tokens reach treadle's own sampler only (vLLM takes no "
                             "suppress list); unset it or set use_vllm=False")
        check_grpo_options(self.loss_type, self.beta, self.epsilon, self.epsilon_high)  # the rules grpo_loss applies
        if self.reward_weights is not None and not all(math.isfinite(float(w)) for w in self.reward_weights):
            raise ValueError(f"reward_weights must be finite numbers, got {self.reward_weights}")

    def _validate_generation_batch(self) -> None:
        batch, spg, world, group = (self.per_device_train_batch_size, self.steps_per_generation,
                                    self.world_size, self.num_generations)
        total = batch * spg * world
        if total % group == 0:
            return
        batches = _nearest_multiples(batch, group // math.gcd(group, spg * world))  # O(1): no scan of candidates
        groups = _nearest_divisors(total, group)
        spgs = _nearest_multiples(spg, group // math.gcd(group, batch * world))
        raise ValueError(
            f"one generation samples per_device_train_batch_size x steps_per_generation x world_size = {batch} x "
            f"{spg} x {world} = {total} completions, which is not a multiple of num_generations={group} (every "
            f"prompt needs its whole group). Nearest valid: per_device_train_batch_size={_either(batches)}, "
            f"or num_generations={_either(groups)}, or steps_per_generation={_either(spgs)}")

    @property
    def generation_batch_size(self) -> int:
        """Completions per generation on one process: ``per_device_train_batch_size * steps_per_generation``."""
        return self.per_device_train_batch_size * self.steps_per_generation


# The health checks (treadle.health) and their defaults; GRPOConfig.health_checks overrides any of them by name.
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
        return {name: (False if name in _SWITCHES else None if name != "patience" else default)
                for name, default in HEALTH_CHECKS.items()}
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
            raise ValueError(f"health_checks['importance_ratio_bounds'] must be [low, high] with 0 <= low < 1 < high, "
                             f"or None (off), got {bounds!r}")
        checks["importance_ratio_bounds"] = [float(b) for b in bounds]
    return checks


def check_async_config(args) -> None:
    """The async fields' values, and one line for each setting that asynchronous GRPO does not take."""
    if not isinstance(args.max_staleness, int) or args.max_staleness < 0:
        raise ValueError(f"max_staleness must be an integer >= 0 (0: synchronous), got {args.max_staleness!r}")
    if args.async_worker not in WORKER_KINDS:
        raise ValueError(f"async_worker={args.async_worker!r} is not supported; use one of {list(WORKER_KINDS)}")
    threads = args.async_worker_threads
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"async_worker_threads must be an integer >= 1 or None, got {threads!r}")
    if not args.async_timeout > 0:
        raise ValueError(f"async_timeout must be a number of seconds > 0, got {args.async_timeout!r}")
    if not args.max_staleness:
        return
    if args.use_vllm:
        raise PreflightError("max_staleness > 0 runs with the own sampler only (the vLLM engine cannot sample in the "
                             "background yet): set use_vllm: false or max_staleness: 0")
    if args.dynamic_sampling:
        raise PreflightError("max_staleness > 0 cannot take dynamic_sampling (its extra rounds depend on the rewards "
                             "of the batch being sampled): set one of them off")
    if args.steps_per_generation * args.num_iterations != args.gradient_accumulation_steps:
        raise PreflightError(f"max_staleness > 0 needs one generation per optimizer step: steps_per_generation x "
                             f"num_iterations = {args.steps_per_generation} x {args.num_iterations} must equal "
                             f"gradient_accumulation_steps = {args.gradient_accumulation_steps}")


def _nearest_multiples(value: int, step: int) -> list[int]:
    """The multiples of ``step`` nearest below (at least 1) and above ``value``, by arithmetic."""
    below = value // step * step
    return [v for v in (below if below != value else below - step, below + step) if v >= 1]


def _nearest_divisors(total: int, value: int, most_trials: int = 1_000_000) -> list[int]:
    """The divisors (at least 2) of ``total`` nearest below and above ``value``; O(sqrt(total)) trials at most
    ``most_trials`` (a larger total gets no hint rather than a long wait)."""
    if total > most_trials**2:
        return []
    divisors = {d for i in range(1, math.isqrt(total) + 1) if total % i == 0 for d in (i, total // i)}
    below = max((d for d in divisors if 2 <= d < value), default=None)
    above = min((d for d in divisors if d > value), default=None)
    return [v for v in (below, above) if v is not None]


def _either(values: list[int]) -> str:
    return " or ".join(str(v) for v in values) if values else "(none)"


