"""``OnPolicyConfig``: the arguments every on-policy trainer shares (``GRPOConfig`` and ``DistillationConfig`` add
their own; trainers/onpolicy/trainer.py holds ``OnPolicyTrainer``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from treadle.arguments import TrainingArguments
from treadle.engines.options import check_vllm_options
from treadle.errors import PreflightError
from treadle.generation.sampling import SamplingParams, sampler_options
from treadle.generation.single import BACKENDS
from treadle.generation.static import DecodeSettings

__all__ = ["MAX_STALENESS", "OnPolicyConfig", "WORKER_KINDS", "check_async_config"]

WORKER_KINDS = ("process", "thread")  # the asynchronous producer's rollout worker (trainers/onpolicy/worker.py)
# The most optimizer steps a batch may be stale (docs/async.md "Limits"): each step ahead holds a sampled batch and a
# window of rows in memory, and the sampler correction's ratio of weights more steps apart is clipped or masked
# anyway (TRL's AsyncGRPO drops samples older than 4 by default).
MAX_STALENESS = 64


@dataclass
class OnPolicyConfig(TrainingArguments):
    """Arguments of an on-policy trainer: it samples its own training data. Batch semantics (the most asked-about
    part of every GRPO library):

    - ``per_device_train_batch_size`` counts *completions* per micro-step on one process.
    - One generation samples ``per_device_train_batch_size * steps_per_generation * world_size`` completions:
      that many divided by ``num_generations`` distinct prompts, each G times. It must divide evenly.
    - That buffer feeds ``steps_per_generation`` micro-steps, and is reused ``num_iterations`` times (μ):
      generation runs once every ``steps_per_generation * num_iterations`` micro-steps.
    - An optimizer step still takes ``gradient_accumulation_steps`` micro-steps.
    """

    min_num_generations: ClassVar[int] = 1  # completions per prompt a trainer needs (GRPO: 2, for a baseline)

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
    # TRL's name: "static" decodes over a static KV cache, the step compiled once per bucket (CUDA graphs on a GPU,
    # eager on CPU; generation/static.py); None: the dynamic cache. Not for vLLM (which has its own)
    cache_implementation: str | None = None
    mask_truncated_completions: bool = False  # completions without EOS get no loss (DAPO's overlong filtering)

    # --- vLLM as the rollout engine (treadle.engines.vllm; docs/vllm.md); TRL 1.16's names and defaults
    use_vllm: bool = False  # sample with vLLM instead of the own sampler (training and evaluation, single-turn)
    vllm_mode: str = "colocate"  # "colocate": in-process on the policy's device; "server": treadle vllm-serve
    vllm_gpu_memory_utilization: float = 0.3  # share of GPU memory vLLM takes (weights + KV cache); CUDA only
    vllm_max_model_length: int | None = None  # context window; None: the model config's max_position_embeddings
    vllm_tensor_parallel_size: int = 1  # GPUs one engine spans
    vllm_enable_sleep_mode: bool = False  # GPU: the engine frees its memory through the optimizer step
    vllm_server_base_url: str | None = None  # vllm_mode "server": e.g. http://localhost:8000; else host and port below
    vllm_server_host: str = "0.0.0.0"  # the server's host when vllm_server_base_url is None (0.0.0.0: this machine)
    vllm_server_port: int = 8000  # the server's port when vllm_server_base_url is None
    vllm_server_timeout: float = 240.0  # seconds the server may take to answer /health (its start; then each probe)
    vllm_request_timeout: float = 1800.0  # server mode: seconds one request (a generation, a weight push) may wait

    # --- rewards: what evaluation scores (GRPO also trains on them)
    reward_weights: list[float] | None = None  # one weight per reward function; None weighs each 1.0

    # --- multi-turn rollouts: tools and environments (treadle.rollouts; used when tools= or env_factory= is given)
    max_tool_calling_iterations: int | None = None  # TRL's name: most turns with tool calls per rollout; None: no cap
    tool_timeout: float | None = 10.0  # seconds a tool call may run before it is cut off (an error turn); None: never
    env_timeout: float | None = 60.0  # seconds an environment's reset/step may run; then its rollout ends; None: never
    tool_call_format: str = "auto"  # "tagged" (<call>f(x)</call>), "json" (<tool_call>{...}</tool_call>) or "auto"
    rollout_workers: int = 8  # threads stepping the environments (tools) at once; 0: in the loop, bit-reproducible

    # --- asynchronous generation (trainers/onpolicy/producer.py; docs/async.md): sample next batches while training
    max_staleness: int = 0  # N: train batches sampled from weights up to N optimizer steps old; 0: synchronous
    async_worker: str = "process"  # the rollout worker: "process" (own interpreter, own threads) or "thread"
    async_worker_threads: int | None = None  # the worker's torch threads; None: half of the trainer's (at least 1)
    async_timeout: float = 600.0  # seconds any wait on the worker may take before the run stops, naming the wait

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
        if self.generation_backend not in BACKENDS:
            raise ValueError(
                f"generation_backend={self.generation_backend!r} is not supported; use one of {list(BACKENDS)}"
            )
        DecodeSettings(self.cache_implementation)  # raises ValueError naming the values it takes
        self._validate_sampling_numbers()
        self._validate_generation_batch()
        self._resolve_eval_settings()
        check_vllm_options(self)
        check_async_config(self)  # max_staleness and its worker (docs/async.md)

    def _validate_sampling_numbers(self) -> None:
        if not isinstance(self.num_generations, int) or self.num_generations < self.min_num_generations:
            raise ValueError(
                f"num_generations must be an integer >= {self.min_num_generations} (GRPO: a group "
                f"needs two completions for a baseline), got {self.num_generations!r}; e.g. 8"
            )
        for name in ("steps_per_generation", "num_iterations", "max_completion_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_prompt_length is not None and (
            not isinstance(self.max_prompt_length, int) or self.max_prompt_length < 1
        ):
            raise ValueError(f"max_prompt_length must be an integer >= 1 or None, got {self.max_prompt_length!r}")
        # the sampling settings' rules live with the sampler: build its parameters once to check them
        settings = dict(top_p=self.top_p, top_k=self.top_k, repetition_penalty=self.repetition_penalty)
        options = sampler_options(self.min_p, self.generation_kwargs)
        SamplingParams(
            num_generations=self.num_generations,
            max_new_tokens=self.max_completion_length,
            eos_token_ids=(),
            pad_token_id=0,
            temperature=self.temperature,
            **settings | options,
        )
        if self.use_vllm and "suppress_token_ids" in options:
            raise ValueError(
                "generation_kwargs' suppress_tokens reach treadle's own sampler only (vLLM takes no "
                "suppress list); unset it or set use_vllm=False"
            )
        if self.reward_weights is not None and not all(math.isfinite(float(w)) for w in self.reward_weights):
            raise ValueError(f"reward_weights must be finite numbers, got {self.reward_weights}")

    def _resolve_eval_settings(self) -> None:
        """Evaluation sampling defaults to training's (None), then obeys the same rules."""
        if self.num_generations_eval is None:
            self.num_generations_eval = self.num_generations
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, f"eval_{name}") is None:
                setattr(self, f"eval_{name}", getattr(self, name))
        n, ks = self.num_generations_eval, self.eval_pass_at_k
        if not isinstance(n, int) or n < 1:
            raise ValueError(
                f"num_generations_eval must be an integer >= 1 (samples per evaluation prompt), got {n!r}"
            )
        if not isinstance(ks, (list, tuple)) or not ks or not all(isinstance(k, int) and 1 <= k <= n for k in ks):
            raise ValueError(
                f"eval_pass_at_k must be a non-empty list of integers in 1..num_generations_eval={n}, "
                f"got {ks!r}; e.g. eval_pass_at_k=[1, {n}] (raise num_generations_eval for a larger k)"
            )
        if not math.isfinite(float(self.eval_success_threshold)) or self.eval_temperature < 0:
            raise ValueError(
                f"eval_success_threshold must be finite and eval_temperature >= 0 (0: greedy), got "
                f"{self.eval_success_threshold!r} and {self.eval_temperature!r}"
            )
        SamplingParams(
            num_generations=n,
            max_new_tokens=self.max_completion_length,
            eos_token_ids=(),
            pad_token_id=0,
            temperature=self.eval_temperature or 1.0,
            top_p=self.eval_top_p,
            top_k=self.eval_top_k,
            do_sample=self.eval_temperature > 0,
        )
        best = (self.metric_for_best_model or "").removeprefix("eval_")
        if best == "loss":  # also TrainingArguments' default under load_best_model_at_end
            raise ValueError(
                "GRPO's evaluation reports no loss: set metric_for_best_model='pass@1' (keeps the "
                "policy that solved most) or 'reward'"
            )
        missing_k = best.startswith("pass@") and best[5:] not in {str(k) for k in ks}
        if missing_k or (best.startswith("greedy/") and not self.eval_greedy):
            raise ValueError(
                f"metric_for_best_model={self.metric_for_best_model!r} is not evaluated: add its k to "
                f"eval_pass_at_k={ks} (pass@k) or set eval_greedy=True (greedy/...)"
            )

    def _validate_generation_batch(self) -> None:
        batch, spg, world, group = (
            self.per_device_train_batch_size,
            self.steps_per_generation,
            self.world_size,
            self.num_generations,
        )
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
            f"or num_generations={_either(groups)}, or steps_per_generation={_either(spgs)}"
        )

    @property
    def generation_batch_size(self) -> int:
        """Completions per generation on one process: ``per_device_train_batch_size * steps_per_generation``."""
        return self.per_device_train_batch_size * self.steps_per_generation


def check_async_config(args) -> None:
    """The async fields' values, and one line for each setting that asynchronous generation does not take."""
    if not isinstance(args.max_staleness, int) or isinstance(args.max_staleness, bool) or args.max_staleness < 0:
        raise ValueError(f"max_staleness must be an integer >= 0 (0: synchronous), got {args.max_staleness!r}")
    if args.max_staleness > MAX_STALENESS:
        raise ValueError(
            f"max_staleness={args.max_staleness} is above the cap of {MAX_STALENESS} optimizer steps (each step ahead "
            f"holds a sampled batch in memory, and weights that far apart leave the sampler correction nothing to "
            f"train on); use 1-4 (TRL's AsyncGRPO default: 4)"
        )
    if args.async_worker not in WORKER_KINDS:
        raise ValueError(f"async_worker={args.async_worker!r} is not supported; use one of {list(WORKER_KINDS)}")
    threads = args.async_worker_threads
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"async_worker_threads must be an integer >= 1 or None, got {threads!r}")
    if not args.async_timeout > 0:
        raise ValueError(f"async_timeout must be a number of seconds > 0, got {args.async_timeout!r}")
    if not args.max_staleness:
        return
    if args.use_vllm and args.vllm_mode != "server":
        raise PreflightError(
            "max_staleness > 0 samples with the own sampler or the vLLM server: the colocated vLLM engine "
            "cannot sample in the background (it shares the trainer's process and threads); set vllm_mode: "
            "server (treadle vllm-serve), use_vllm: false, or max_staleness: 0"
        )
    if args.cache_implementation == "static" and not args.use_vllm:
        raise PreflightError(
            "max_staleness > 0 samples in a rollout worker on the dynamic KV cache: set cache_implementation: "
            "null, or max_staleness: 0 for the static decode step"
        )
    if args.steps_per_generation * args.num_iterations != args.gradient_accumulation_steps:
        raise PreflightError(
            f"max_staleness > 0 needs one generation per optimizer step: steps_per_generation x "
            f"num_iterations = {args.steps_per_generation} x {args.num_iterations} must equal "
            f"gradient_accumulation_steps = {args.gradient_accumulation_steps}"
        )


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
