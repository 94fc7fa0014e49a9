"""Group-relative policy optimisation: ``GRPOConfig`` + ``GRPOTrainer``.

GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300) samples G completions per prompt, scores them with
reward functions, and trains on each reward minus its group's mean (optionally divided by the group's std).
Generation is sequential (one forward per token), so one generation feeds several micro-steps: the
dataloader yields ``per_device_train_batch_size * steps_per_generation`` rows at once (each prompt G times in
a row), and ``prepare_window`` (once per optimizer step) generates and scores them into a buffer and hands
out one slice per micro-step::

    dataloader batch (repeated spg * μ times by RepeatSampler, so the base loop's epoch arithmetic holds)
      -> prepare_window: for each micro-step of the window, its generation's buffer, or if there is none yet:
         generate -> rewards -> advantages (all ranks) -> old / ref log-probs -> split into spg slices;
         the micro-step trains on slice (micro-step mod spg)
      -> get_num_items_in_batch: the window's completion tokens (dapo) or completions (grpo), all ranks
      -> compute_loss: losses.grpo_loss on the slice

How this departs from the paper and from TRL's GRPOTrainer (v0.2x):

1. The default loss is ``dapo``: the token sum divided by the completion tokens of the whole accumulation
   window on all ranks (DAPO, Yu et al. 2025), so that gradient accumulation and data parallelism give exactly
   the big batch's gradient. The paper's per-sequence mean is ``loss_type="grpo"``.
2. No KL term by default (``beta=0``, as DAPO and Dr. GRPO argue); then no reference model exists. With
   ``beta > 0`` the k3 estimator is added to the per-token loss, as in the paper (not to the reward).
3. Old log-probs are computed (and the importance ratio is not 1) exactly when the policy can change between
   generation and use: when a generation cycle of ``steps_per_generation * num_iterations`` micro-steps does
   not fit inside one accumulation window. TRL's rule is "num_iterations > 1 or steps_per_generation >
   gradient_accumulation_steps"; ours skips the extra forward when μ > 1 repeats a batch inside one window.
4. Old and reference log-probs are computed in eval mode (no dropout), like the sampling itself.
5. Training forwards get ``position_ids`` that start at 0 after the left padding, as during sampling, so the
   log-probs being trained are those of the distribution that was sampled. (RoPE models do not notice a
   shift of every position; models with absolute position embeddings, such as GPT-2, do.)
6. Groups may span ranks: rewards are gathered from every rank before the advantages are computed.
   A rank whose rows hold whole groups prefills each distinct prompt once (``generation.py``).
7. A ``dapo`` normaliser needs the completions of the whole window before its first micro-step, so every
   generation a window uses happens at the window's start (``prepare_window``), whatever the loss type. The
   policy does not change inside a window and each generation has its own seeded RNG, so the samples are the
   same as if generated one micro-step at a time.
8. Sampling is seeded by (``seed``, generation index, rank), and a checkpoint also stores the unconsumed
   generation buffer, so that resuming continues the run exactly even in the middle of a buffer.
9. Rewards come from Python functions only (no reward models by name); ``None`` means "no opinion" and a
   completion that no function scores is an error, not a NaN.
10. ``evaluate()`` reports what RL optimises, not a loss: mean rewards and pass@k (Chen et al. 2021) of
    ``num_generations_eval`` samples per prompt, greedy accuracy when ``eval_greedy``, and ``compute_metrics``
    on the sampled completions (its contract: ``rewards.check_compute_metrics``). ``per_device_eval_batch_size``
    counts prompts (TRL: completions). Evaluation draws from its own seeded generators and restores the global
    RNG states, so a run with evaluations trains exactly the weights of one without.
11. ``top_entropy_quantile`` takes the entropy quantile over this rank's micro-batch (TRL gathers the
    micro-batch's entropies from every rank first); identical on one process.
12. RLOO is an advantage estimator here (``advantage_estimator="rloo"``, with ``scale_rewards="none"`` for TRL's
    RLOOTrainer advantages), not a separate trainer: TRL's RLOOTrainer also puts a first-order KL into the reward
    and uses one ratio per sequence; here the KL stays the k3 loss term (``beta``) and GSPO's
    ``importance_sampling_level="sequence"`` gives a per-sequence ratio.
13. Multi-turn rollouts (``tools=`` as in TRL; ``env_factory=`` takes treadle's ``reset``/``step`` environments,
    not TRL's tool-method environments, hence the different name) keep each row's KV cache across turns and
    train only on sampled tokens (treadle.rollouts).
14. ``padding_free`` (TRL's name) is on by default: the training, old and reference log-prob forwards run on
    the micro-batch's rows packed side by side without padding (``logprobs.token_logps(padding_free=True)``,
    the packing rule of ``treadle.data``), which gives the same log-probs and gradients as the padded forward
    and skips the work on padding. It falls back to padded forwards where a one-time check finds it inexact.
    TRL's GRPO has no such option.
"""

from __future__ import annotations

import json
import math
import os
import random
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from treadle import checkpoint as ckpt
from treadle import distributed as dist, runfiles
from treadle.arguments import TrainingArguments
from treadle.data import RepeatSampler, column_names, require_columns
from treadle.text import encode_prompt, eos_ids, is_conversation, pad_token_id
from treadle.generation import BACKENDS, GenerationOutput, SamplingParams, distinct_prompts, generate_completions
from treadle.logprobs import token_logps
from treadle.losses import (ADVANTAGE_ESTIMATORS, MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS, check_grpo_extras,
                            check_grpo_options, decoupled_advantages, grpo_aggregation, grpo_loss, group_advantages)
from treadle.metrics import means_of, pass_at_k_sums
from treadle.packing import position_ids
from treadle.models import eval_mode, frozen_reference
from treadle.peft import reference_of
from treadle.rewards import (METRICS_ARGUMENTS, RewardFunction, call_compute_metrics, check_compute_metrics,
                             reward_name, score_completions, weighted_rewards)
from treadle.rollouts import RolloutRunner
from treadle.trainer import Trainer

STATE_KEY = "GRPOTrainer"  # our entry in TrainerState.stateful_callbacks


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
    generation_backend: str = "auto"  # "fast" (KV-cache sampler), "hf" (model.generate) or "auto"

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

    # --- multi-turn rollouts: tools and environments (treadle.rollouts; used when tools= or env_factory= is given)
    max_tool_calling_iterations: int | None = None  # TRL's name: most turns with tool calls per rollout; None: no cap
    tool_timeout: float | None = 10.0  # seconds a tool call may run before it is cut off (an error turn); None: never
    tool_call_format: str = "auto"  # "tagged" (<call>f(x)</call>), "json" (<tool_call>{...}</tool_call>) or "auto"
    rollout_workers: int = 8  # threads stepping the environments (tools) concurrently; 0: in the loop, bit-reproducible

    # --- padding-free training forwards (issue 18)
    padding_free: bool = True  # pack each micro-batch's rows without padding for the log-prob forwards (exact)

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
        self._validate_grpo_choices()
        self._validate_grpo_numbers()
        self._validate_generation_batch()
        self._resolve_eval_settings()

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
        if not isinstance(self.num_generations, int) or self.num_generations < 2:
            raise ValueError(f"num_generations must be an integer >= 2 (a group needs at least two completions "
                             f"for a baseline), got {self.num_generations!r}; e.g. num_generations=8")
        for name in ("steps_per_generation", "num_iterations", "max_completion_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_prompt_length is not None and (not isinstance(self.max_prompt_length, int)
                                                   or self.max_prompt_length < 1):
            raise ValueError(f"max_prompt_length must be an integer >= 1 or None, got {self.max_prompt_length!r}")
        # the sampling settings' rules live with the sampler: build its parameters once to check them
        SamplingParams(num_generations=self.num_generations, max_new_tokens=self.max_completion_length,
                       eos_token_ids=(), pad_token_id=0, temperature=self.temperature, top_p=self.top_p,
                       top_k=self.top_k, repetition_penalty=self.repetition_penalty)
        check_grpo_options(self.loss_type, self.beta, self.epsilon, self.epsilon_high)  # the rules grpo_loss applies
        if self.reward_weights is not None and not all(math.isfinite(float(w)) for w in self.reward_weights):
            raise ValueError(f"reward_weights must be finite numbers, got {self.reward_weights}")

    def _validate_generation_batch(self) -> None:
        batch, spg, world, group = (self.per_device_train_batch_size, self.steps_per_generation,
                                    self.world_size, self.num_generations)
        total = batch * spg * world
        if total % group == 0:
            return
        batches = _nearest(batch, lambda b: b * spg * world % group == 0)
        groups = _nearest(group, lambda g: g >= 2 and total % g == 0, lowest=2)
        spgs = _nearest(spg, lambda s: batch * s * world % group == 0)
        raise ValueError(
            f"one generation samples per_device_train_batch_size x steps_per_generation x world_size = {batch} x "
            f"{spg} x {world} = {total} completions, which is not a multiple of num_generations={group} (every "
            f"prompt needs its whole group). Nearest valid: per_device_train_batch_size={_either(batches)}, "
            f"or num_generations={_either(groups)}, or steps_per_generation={_either(spgs)}")

    @property
    def generation_batch_size(self) -> int:
        """Completions per generation on one process: ``per_device_train_batch_size * steps_per_generation``."""
        return self.per_device_train_batch_size * self.steps_per_generation


def _nearest(value: int, ok, lowest: int = 1) -> list[int]:
    """The nearest integers below and above ``value`` (at least ``lowest``) for which ``ok`` holds."""
    below = next((v for v in range(value - 1, lowest - 1, -1) if ok(v)), None)
    above = next((v for v in range(value + 1, 64 * value + 64) if ok(v)), None)
    return [v for v in (below, above) if v is not None]


def _either(values: list[int]) -> str:
    return " or ".join(str(v) for v in values) if values else "(none)"


def _sample_record(rows: list[dict], out: GenerationOutput, completions: list, completion_lists: list,
                   **extra) -> dict[str, Any]:
    """What sampling returns (``GRPOTrainer._sample`` and ``rollout``): the rows' prompts and other columns,
    the decoded completions and their token lists, the generation's tensors, and ``extra`` entries."""
    return {"prompts": [row["prompt"] for row in rows],
            "columns": {k: [row[k] for row in rows] for k in rows[0] if k != "prompt"},
            "completions": completions, "completion_lists": completion_lists, "prompt_ids": out.prompt_ids,
            "prompt_mask": out.prompt_mask, "completion_ids": out.completion_ids,
            "completion_mask": out.completion_mask, "is_truncated": out.is_truncated, **extra}


def _keep_rows(rows: list[dict]) -> list[dict]:
    """The collator: GRPO batches stay lists of dataset rows (prompts are tokenised when sampled)."""
    return rows


class GRPOTrainer(Trainer):
    """Online RL with group-relative advantages; see the module docstring for the data flow.

    ``reward_funcs``: one function or a list, each ``fn(prompts, completions, completion_ids, **columns) ->
    list[float | None]`` (see treadle.rewards). ``train_dataset`` needs a ``prompt`` column (text, or chat
    messages rendered with the tokenizer's chat template); every other column reaches the reward functions.
    ``processing_class`` is the tokenizer (required). ``ref_model`` is used when ``args.beta > 0`` (default: a
    frozen copy of ``model`` taken at construction; for a PEFT model, e.g. with ``peft_config``, the model itself
    with its adapters disabled).

    Multi-turn rollouts (treadle.rollouts, docs/agents.md): ``tools`` (annotated, docstring'd functions the model
    calls, TRL's argument) or ``env_factory`` (a callable returning a fresh ``rollouts.Environment`` per rollout).
    Observation tokens are in the context but masked out of the loss; ``rollout`` is the hook to override.

    ``compute_metrics(prompts, completions, completion_ids, rewards, reward, **columns) -> dict`` adds custom
    evaluation metrics (``rewards.check_compute_metrics``).
    """

    config_class = GRPOConfig

    def __init__(self, model=None, reward_funcs: RewardFunction | Sequence[RewardFunction] | None = None,
                 args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None, processing_class=None,
                 callbacks=None, optimizers=(None, None), ref_model=None, peft_config=None, compute_metrics=None,
                 tools=None, env_factory=None):
        args = self.check_args(args)  # needed before super().__init__: the dataset check reads it
        if compute_metrics is not None:
            check_compute_metrics(compute_metrics, column_names(eval_dataset) or ())
        self.rollout_runner = None if tools is None and env_factory is None else RolloutRunner(
            processing_class, tools=tools, env_factory=env_factory, call_format=args.tool_call_format,
            max_tool_calling_iterations=args.max_tool_calling_iterations, tool_timeout=args.tool_timeout,
            workers=args.rollout_workers)
        self.reward_funcs = _reward_list(reward_funcs)
        self.reward_weights = _reward_weights(args.reward_weights, self.reward_funcs)
        _check_tokenizer(processing_class)
        _check_dataset(train_dataset, args)
        super().__init__(model=model, args=args, data_collator=_keep_rows, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, compute_metrics=compute_metrics)
        self.ref_model = self.build_reference_model(ref_model) if args.beta > 0 else None
        self.pad_token_id = pad_token_id(processing_class)
        self._buffers: dict[int, list[dict]] = {}  # generation index -> its slices (this rank's rows)
        self._completions_file_checked = False

    def build_reference_model(self, ref_model=None):
        """The frozen reference policy for the KL term: ``ref_model``, or a copy of the model as it is now; None
        for a PEFT model, which is its own reference with its adapters disabled (no second copy)."""
        return frozen_reference(self.model, ref_model, device=self.args.device)

    # ---- data -------------------------------------------------------------------------------------------
    def get_train_dataloader(self):
        """Batches of ``generation_batch_size`` rows on this rank, each prompt ``num_generations`` times in a row,
        the same prompts on every rank, each batch repeated ``steps_per_generation * num_iterations`` times (one
        micro-step each) so that the base loop counts micro-steps and epochs as usual. Every column is kept."""
        args = self.args
        if self.train_dataset is None:
            raise ValueError("GRPOTrainer.train() needs a train_dataset with a 'prompt' column")
        if not hasattr(self.train_dataset, "__len__"):
            raise ValueError("GRPOTrainer needs a dataset with a length (a datasets.Dataset or a list of rows)")
        world = dist.get_world_size()
        sampler = RepeatSampler(len(self.train_dataset), mini_repeat_count=args.num_generations,
                                batch_size=args.generation_batch_size * world // args.num_generations,
                                repeat_count=self._cycle_length(), shuffle=True, seed=args.data_seed,
                                rank=dist.get_rank(), world_size=world)
        return self.build_dataloader(self.train_dataset, batch_size=args.generation_batch_size, sampler=sampler,
                                     collate_fn=_keep_rows)

    def _cycle_length(self) -> int:
        """Micro-steps fed by one generation."""
        return self.args.steps_per_generation * self.args.num_iterations

    def _needs_old_logps(self) -> bool:
        """Whether the policy can change between a generation and the use of its samples: when a cycle of
        micro-steps does not fit inside one accumulation window (windows and cycles both start at epoch starts)."""
        cycle, accum = self._cycle_length(), self.args.gradient_accumulation_steps
        return cycle > accum or accum % cycle != 0

    # ---- the buffer -------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None):
        self._buffers = {}  # a resumed run restores its own (load_extra_checkpoint_state)
        self._completions_file_checked = False
        return super().train(resume_from_checkpoint=resume_from_checkpoint)

    def prepare_window(self, batch_samples: list) -> list[dict]:
        """The slices of the generation buffers that this window's micro-steps train on. A buffer that does not
        exist yet is generated, scored and split here, from the dataloader's prompt rows (``batch_samples``):
        the policy does not change inside a window, so sampling them all at its start gives the same samples
        as sampling at each micro-step (each generation has its own seeded RNG)."""
        first = self.micro_step
        window = [self._buffer_for(first + i, rows)[self._slice_index(first + i)]
                  for i, rows in enumerate(batch_samples)]
        self.micro_step = first + len(window)
        next_generation = self.micro_step // self._cycle_length()
        self._buffers = {g: b for g, b in self._buffers.items() if g >= next_generation}
        return window

    @property
    def micro_step(self) -> int:
        """Micro-steps consumed in this run. Kept in ``state.stateful_callbacks`` (one value for every rank, saved
        in ``trainer_state.json``), so that a resumed run knows where it is in the generation cycle."""
        return self.state.stateful_callbacks.get(STATE_KEY, {}).get("micro_step", 0)

    @micro_step.setter
    def micro_step(self, value: int) -> None:
        self.state.stateful_callbacks[STATE_KEY] = {"micro_step": value}

    def count_items(self, inputs: dict) -> int | None:
        """A slice's loss items: completion tokens (``dapo``) or completions (``grpo``); None for ``bnpo`` and
        ``dr_grpo``, whose per-micro-batch means the loop averages. The inherited ``get_num_items_in_batch``
        sums it over the window and the ranks."""
        aggregation = grpo_aggregation(self.args.loss_type)  # cispo counts like dapo, sapo like grpo
        if aggregation == "dapo":
            return int(inputs["completion_mask"].sum())
        return inputs["completion_mask"].shape[0] if aggregation == "grpo" else None

    def get_num_items_in_batch(self, batch_samples: list) -> int | None:
        total = super().get_num_items_in_batch(batch_samples)
        return None if total is None else max(total, 1)  # all completions masked: zero loss, not 0/0

    def _slice_index(self, micro_step: int) -> int:
        return micro_step % self._cycle_length() % self.args.steps_per_generation

    def _buffer_for(self, micro_step: int, rows: list[dict]) -> list[dict]:
        generation = micro_step // self._cycle_length()
        if generation not in self._buffers:
            if micro_step % self._cycle_length():
                warnings.warn(f"GRPO: resuming at micro-step {micro_step}, inside a generation cycle, without its "
                              f"saved buffer (no extra_state file in the checkpoint): sampling it again from the "
                              f"current policy, so this run is not an exact continuation", stacklevel=3)
            self._buffers[generation] = self.generate_and_score(rows, generation)
        return self._buffers[generation]

    # ---- generation and scoring ---------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], *, num_generations: int,
                 generator: torch.Generator | None = None, mode: str = "train") -> GenerationOutput:
        """Sample ``num_generations`` completions for each distinct prompt (token ids) with the sampling settings
        of ``mode`` (``sampling_settings``); rows come back grouped (prompt b's completions are rows b*G ..
        b*G+G-1). The one place where training and evaluation sample: override it to plug in another engine."""
        args = self.args
        return generate_completions(self.model_wrapped, prompt_ids, num_generations=num_generations,
                                    max_new_tokens=args.max_completion_length,
                                    eos_token_id=self.processing_class.eos_token_id, pad_token_id=self.pad_token_id,
                                    repetition_penalty=args.repetition_penalty, generator=generator,
                                    backend=args.generation_backend, **self.sampling_settings(mode))

    def sampling_settings(self, mode: str = "train") -> dict[str, Any]:
        """``temperature``, ``top_p``, ``top_k`` and ``do_sample`` of ``mode``: "train" (the config's), "eval"
        (its ``eval_*`` fields; temperature 0 decodes greedily) or "greedy" (argmax)."""
        args = self.args
        if mode == "train":
            return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "do_sample": True}
        temperature = args.eval_temperature if mode == "eval" else 0.0
        return {"temperature": temperature or 1.0, "top_p": args.eval_top_p, "top_k": args.eval_top_k,
                "do_sample": temperature > 0}

    def generate_and_score(self, rows: list[dict], generation: int) -> list[dict]:
        """Sample one completion per row, score all rows of all ranks, and return the buffer: a list of
        ``steps_per_generation`` slices, each a dict of device tensors (``input_ids``, ``attention_mask``,
        ``completion_mask``, ``advantages``, and ``old_logps`` / ``ref_logps`` when needed)."""
        args, step = self.args, self.state.global_step
        sample = self._sample(rows, self._generator("train", generation))
        rewards = score_completions(self.reward_funcs, self.reward_weights, prompts=sample["prompts"],
                                    completions=sample["completions"], completion_ids=sample["completion_lists"],
                                    columns=sample["columns"], step=step)  # (N, F)
        all_rewards = _gather_rows(rewards)  # (W*N, F)
        advantages, metrics = group_advantages(weighted_rewards(all_rewards, self.reward_weights),
                                               args.num_generations, scale_rewards=args.scale_rewards,
                                               advantage_estimator=args.advantage_estimator)
        if args.multi_objective_aggregation == "normalize_then_sum":  # GDPO: each reward normalised on its own
            advantages = decoupled_advantages(all_rewards, self.reward_weights, args.num_generations)
        rank, rows_here = dist.get_rank(), len(rows)
        local_advantages = advantages[rank * rows_here:(rank + 1) * rows_here]  # (N,)
        self._record_generation_metrics(metrics, all_rewards, sample)
        if args.log_completions:
            self._log_completions(sample, rewards, local_advantages)
        loss_mask = sample.get("sampled_mask", sample["completion_mask"])  # multi-turn: no loss on observations
        if args.mask_truncated_completions:
            loss_mask = loss_mask * (~sample["is_truncated"]).unsqueeze(1).to(loss_mask.dtype)
        return [self._build_slice(sample, loss_mask, local_advantages, s) for s in range(args.steps_per_generation)]

    def _sample(self, rows: list[dict], generator: torch.Generator | None, mode: str = "train") -> dict[str, Any]:
        """Tokenise the rows' prompts, sample one completion per row (``mode``: see ``sampling_settings``), decode.
        Rows that hold whole groups (the same prompt G times in a row) are sampled as distinct prompts x G: each
        prompt is prefilled once. With tools or an environment, ``rollout`` samples instead."""
        if self.rollout_runner is not None:
            return self.rollout(rows, generator, mode=mode)
        prompts = [row["prompt"] for row in rows]
        distinct, group = distinct_prompts(self._tokenize_prompts(prompts), self._group_size(mode))
        settings = {"mode": mode} if mode != "train" else {}  # an engine written for training only still trains
        out = self.generate(distinct, num_generations=group, generator=generator, **settings)
        lengths = out.completion_mask.sum(dim=1).tolist()
        completion_lists = [ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)]
        texts = self.processing_class.batch_decode(completion_lists, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if is_conversation(p) else t
                       for p, t in zip(prompts, texts)]
        return _sample_record(rows, out, completions, completion_lists)

    def _group_size(self, mode: str) -> int:
        """Completions per prompt in ``mode``: ``num_generations`` (train), ``num_generations_eval`` (eval), 1."""
        return {"train": self.args.num_generations, "eval": self.args.num_generations_eval}.get(mode, 1)

    def rollout(self, rows: list[dict], generator: torch.Generator | None, mode: str = "train") -> dict[str, Any]:
        """Multi-turn rollouts (``tools=`` or ``env_factory=``; treadle.rollouts), one per row, sampled as ``mode``
        says (``sampling_settings``): the hook to override for another agent loop. Returns what single-turn
        sampling returns plus ``sampled_mask`` (1 on sampled tokens: the loss mask), ``transcripts`` and
        ``rollout_metrics``; the reward functions also get the ``transcript`` and ``env_reward`` columns."""
        args = self.args
        settings = self.sampling_settings(mode)
        params = SamplingParams(num_generations=self._group_size(mode), max_new_tokens=args.max_completion_length,
                                eos_token_ids=eos_ids(self.processing_class.eos_token_id),
                                pad_token_id=self.pad_token_id, repetition_penalty=args.repetition_penalty, **settings)
        out = self.rollout_runner.run(self.model_wrapped, rows, params, max_prompt_length=args.max_prompt_length,
                                      generator=generator, backend=args.generation_backend)
        sample = _sample_record(rows, out.generation, out.completions, out.completion_lists,
                                sampled_mask=out.generation.sampled_mask, transcripts=out.transcripts,
                                rollout_metrics=out.metrics)
        sample["columns"].update(transcript=out.transcripts, env_reward=out.env_rewards)
        return sample

    def _tokenize_prompts(self, prompts: list) -> list[list[int]]:
        """Token ids of each prompt (``treadle.data.encode_prompt``: text with the tokenizer's special tokens,
        chat messages rendered with a generation prompt), cut to the last ``max_prompt_length``."""
        limit = self.args.max_prompt_length
        cache: dict[str, list[int]] = {}  # a prompt repeats G times in a row: encode it once
        out = []
        for prompt in prompts:
            key = json.dumps(prompt) if not isinstance(prompt, str) else prompt
            if key not in cache:
                cache[key] = encode_prompt(self.processing_class, prompt)
            ids = cache[key]
            out.append(list(ids[-limit:] if limit else ids))
        return out

    def _generator(self, *key) -> torch.Generator:
        """A generator seeded by (seed, key, rank): sampling is reproducible and a resumed run samples alike."""
        seed = random.Random("/".join(str(k) for k in (self.args.seed, *key, dist.get_rank()))).getrandbits(63)
        return torch.Generator(device=self.args.device).manual_seed(seed)

    def _build_slice(self, sample: dict, loss_mask: torch.Tensor, advantages: torch.Tensor, index: int) -> dict:
        """Rows of slice ``index``, cut to their own longest prompt and completion, with the log-probs the loss
        needs from policies other than the current one."""
        size = self.args.per_device_train_batch_size
        rows = slice(index * size, (index + 1) * size)
        prompt_mask, completion_attention = sample["prompt_mask"][rows], sample["completion_mask"][rows]
        first = int(prompt_mask.any(dim=0).nonzero()[0])  # prompts are left-padded
        width = max(1, int(completion_attention.sum(dim=1).max()))
        device = self.args.device
        batch = {
            "input_ids": torch.cat([sample["prompt_ids"][rows, first:], sample["completion_ids"][rows, :width]], 1),
            "attention_mask": torch.cat([prompt_mask[:, first:], completion_attention[:, :width]], 1),
            "completion_mask": loss_mask[rows, :width],
            "advantages": advantages[rows],
        }
        batch = {k: v.to(device) for k, v in batch.items()}
        if self._needs_old_logps():
            batch["old_logps"] = self._frozen_logps(self.model, batch)
        if self.args.beta > 0:
            with reference_of(self.model, self.ref_model) as reference:  # a PEFT policy: adapters disabled
                batch["ref_logps"] = self._frozen_logps(reference, batch)
        return batch

    @torch.no_grad()
    def _frozen_logps(self, model, batch: dict) -> torch.Tensor:
        with eval_mode(model), self.autocast():
            logps = self._completion_logps(model, batch).logps
        return logps.float()

    def _completion_logps(self, model, batch: dict, return_entropy: bool = False):
        """A ``logprobs.TokenLogps``: per-token log-probs ``(B, C)`` (and entropies) of the completion tokens, at the
        sampling temperature, with positions counted from the first prompt token as during sampling."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        start = ids.shape[1] - batch["completion_mask"].shape[1] - 1
        positions = position_ids(mask)
        return token_logps(model, ids, mask, start=start, temperature=self.args.temperature,
                           return_entropy=return_entropy, position_ids=positions, padding_free=self.args.padding_free)

    # ---- the loss ---------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``losses.grpo_loss`` on one slice; ``num_items_in_batch`` is the window's normaliser (``dapo``: its
        completion tokens, ``grpo``: its completions, both over all ranks)."""
        args = self.args
        logps, entropy = self._completion_logps(model, inputs, return_entropy=True)  # (B, C) each
        normalizer = num_items_in_batch if grpo_aggregation(args.loss_type) in ("grpo", "dapo") else None
        loss, metrics = grpo_loss(logps, inputs["advantages"], inputs["completion_mask"],
                                  old_logps=inputs.get("old_logps"), ref_logps=inputs.get("ref_logps"),
                                  beta=args.beta, epsilon_low=args.epsilon, epsilon_high=args.epsilon_high,
                                  loss_type=args.loss_type, normalizer=normalizer,
                                  max_completion_length=args.max_completion_length, **self.objective_options(entropy))
        mask = inputs["completion_mask"].to(entropy.dtype)
        metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)
        self.metrics.add_many({name: (value, 1) for name, value in metrics.items()})  # means over micro-steps
        return (loss, {"logps": logps}) if return_outputs else loss

    def objective_options(self, entropy: torch.Tensor) -> dict:
        """The ``grpo_loss`` options of the objective table (issue 17), from the config; ``entropy`` ``(B, C)``."""
        args = self.args
        return dict(importance_sampling_level=args.importance_sampling_level, delta=args.delta,
                    sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
                    use_bias_correction_kl=args.use_bias_correction_kl, entropies=entropy.detach(),
                    top_entropy_quantile=args.top_entropy_quantile,
                    off_policy_mask_threshold=args.off_policy_mask_threshold)

    # ---- metrics and records ----------------------------------------------------------------------------
    def _record_generation_metrics(self, metrics: dict, all_rewards: torch.Tensor, sample: dict) -> None:
        """Reward and length statistics of one generation, over all ranks (means over generations at log time)."""
        record = {name: (float(value), 1) for name, value in metrics.items()}
        # reward_std means what TRL's means: the std of the whole generation's rewards; the mean of the groups'
        # stds (what group scaling divides by) is logged as reward_group_std
        if "reward_std" in record:
            record["reward_group_std"] = record.pop("reward_std")
        total = weighted_rewards(all_rewards, self.reward_weights)  # (W*N,)
        record["reward_std"] = (float(total.std()) if total.numel() > 1 else 0.0, 1)
        for j, fn in enumerate(self.reward_funcs):
            column = all_rewards[:, j]
            scored = column[~column.isnan()]
            if len(scored):
                record[f"rewards/{reward_name(fn)}/mean"] = (float(scored.mean()), 1)
                record[f"rewards/{reward_name(fn)}/std"] = (float(scored.std()) if len(scored) > 1 else 0.0, 1)
        lengths = _gather_rows(sample["completion_mask"].sum(dim=1).float().cpu())  # (W*N,)
        truncated = _gather_rows(sample["is_truncated"].float().cpu())
        record.update({"completions/mean_length": (float(lengths.mean()), 1),
                       "completions/min_length": (float(lengths.min()), 1),
                       "completions/max_length": (float(lengths.max()), 1),
                       "completions/clipped_ratio": (float(truncated.mean()), 1)})
        self.metrics.add_many({**record, **sample.get("rollout_metrics", {})})

    def _log_completions(self, sample: dict, rewards: torch.Tensor, advantages: torch.Tensor) -> None:
        """Append this generation's completions (all ranks) to output_dir/completions.jsonl, from rank 0."""
        names = [reward_name(fn) for fn in self.reward_funcs]
        records = [{"step": self.state.global_step, "prompt": p, "completion": c,
                    "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(names, r)}, "advantage": a}
                   for p, c, r, a in zip(sample["prompts"], sample["completions"], rewards.tolist(),
                                         advantages.tolist())]
        for record, transcript in zip(records, sample.get("transcripts", ())):
            record["transcript"] = transcript  # multi-turn: every turn with its role
        records = [r for part in dist.gather_objects(records) for r in part]
        if not dist.is_main_process():
            return
        path = os.path.join(self.args.output_dir, runfiles.COMPLETIONS_FILE)
        if not self._completions_file_checked:
            step = self.state.global_step  # a resumed run writes the steps from its checkpoint on again
            runfiles.cut_back(path, lambda r: r["step"] < step)
            self._completions_file_checked = True
        runfiles.append_records(path, records)

    # ---- checkpoints ------------------------------------------------------------------------------------
    def extra_checkpoint_state(self) -> dict:
        """This rank's unconsumed generation buffers, saved in every checkpoint so that resuming inside a
        generation cycle is exact (the cursor is in ``trainer_state.json``, the metrics in the Trainer's window)."""
        return {"buffers": {str(g): [{k: v.cpu() for k, v in s.items()} for s in b] for g, b in self._buffers.items()}}

    def load_extra_checkpoint_state(self, state: dict) -> None:
        device = self.args.device
        self._buffers = {int(g): [{k: v.to(device) for k, v in s.items()} for s in b]
                         for g, b in state["buffers"].items()}

    # ---- evaluation -------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sample ``num_generations_eval`` completions for each evaluation prompt with the evaluation sampling
        settings (and one greedy completion when ``eval_greedy``), score them with every reward function, and
        report, for the weighted total and for each function: ``<prefix>_reward`` / ``_rewards/<name>/mean`` (mean
        reward), ``_pass@k`` / ``_rewards/<name>/pass@k`` (unbiased pass@k, ``eval_pass_at_k``; a completion passes
        when its reward >= ``eval_success_threshold``), ``_greedy/reward`` / ``_greedy/accuracy`` / ``_greedy/
        rewards/<name>/mean|accuracy``, ``_completions/mean_length``, and what ``compute_metrics`` returns.
        Sampling is seeded by (seed, batch, rank): the same samples for the same weights; the global RNG states
        are restored afterwards. Logs the metrics and fires ``on_evaluate``."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset with a 'prompt' column")
        require_columns(dataset, ["prompt"], what="GRPOTrainer.evaluate")
        loader = self.build_dataloader(dataset, batch_size=self.args.per_device_eval_batch_size,
                                       sampler=self.build_sampler(dataset, shuffle=False), collate_fn=_keep_rows)
        self.callback_handler.eval_dataloader = loader
        self.metrics.clear("eval")
        rng = ckpt.rng_state()  # reward functions and compute_metrics may draw from the global RNGs
        try:
            samples = [self._score_eval_batch(rows, index) for index, rows in enumerate(loader)]
            custom = self._custom_eval_metrics(samples) if self.compute_metrics is not None else {}
        finally:
            ckpt.set_rng_state(rng)
        recorded = {**means_of(self.metrics.reduce("eval")), **custom}  # one all-reduce for every metric
        metrics = {f"{metric_key_prefix}_{name}": value for name, value in recorded.items()}
        self.log(metrics)
        self.control = self.callback_handler.call_event("on_evaluate", self.args, self.state, self.control,
                                                        metrics=metrics)
        return metrics

    def _score_eval_batch(self, rows: list[dict], index: int) -> dict | None:
        """Sample n completions per prompt of ``rows`` (and a greedy one with ``eval_greedy``), and record their
        rewards, pass@k and lengths in the "eval" window; returns the samples when ``compute_metrics`` needs them."""
        args, n, names = self.args, self.args.num_generations_eval, [reward_name(fn) for fn in self.reward_funcs]
        repeated = [row for row in rows for _ in range(n)]
        sample, rewards = self._sample_and_score(repeated, self._generator("eval", index), mode="eval")  # (N, F)
        record = {"completions/mean_length": (sample["completion_mask"].sum(), len(repeated)),
                  **_reward_sums(rewards, self.reward_weights, names, n, args.eval_pass_at_k,
                                 args.eval_success_threshold)}
        if args.eval_greedy:
            _, greedy = self._sample_and_score(rows, None, mode="greedy")
            record.update({f"greedy/{key}": pair for key, pair in _reward_sums(
                greedy, self.reward_weights, names, 1, [1], args.eval_success_threshold, "accuracy").items()})
        self.metrics.add_many(record, mode="eval")
        self.callback_handler.call_event("on_prediction_step", self.args, self.state, self.control)
        if self.compute_metrics is None:
            return None
        return {"prompts": sample["prompts"], "completions": sample["completions"],
                "completion_ids": sample["completion_lists"], "rewards": rewards.tolist(), "columns": sample["columns"]}

    def _sample_and_score(self, rows: list[dict], generator: torch.Generator | None, mode: str):
        """``(sample, rewards)``: one completion per row sampled in ``mode``, and every function's float64 rewards
        ``(N, F)`` (NaN: no opinion)."""
        sample = self._sample(rows, generator, mode=mode)
        rewards = score_completions(self.reward_funcs, self.reward_weights, prompts=sample["prompts"],
                                    completions=sample["completions"], completion_ids=sample["completion_lists"],
                                    columns=sample["columns"], step=self.state.global_step)
        return sample, rewards.double()

    def _custom_eval_metrics(self, batches: list[dict | None]) -> dict[str, float]:
        """``compute_metrics`` on every sampled evaluation completion of every rank (called on each rank with the
        same arguments, so every rank logs the same values)."""
        mine = [b for b in batches if b is not None]
        parts = [b for rank_batches in dist.gather_objects(mine) for b in rank_batches]
        names = [reward_name(fn) for fn in self.reward_funcs]
        rewards = torch.tensor([r for b in parts for r in b["rewards"]], dtype=torch.float64).view(-1, len(names))
        columns = {key: [v for b in parts for v in b["columns"][key]] for key in (parts[0]["columns"] if parts else ())}
        clash = sorted(set(columns) & set(METRICS_ARGUMENTS))
        if clash:
            raise ValueError(f"evaluation column(s) {clash} clash with compute_metrics' own arguments "
                             f"{list(METRICS_ARGUMENTS)}; rename the column(s)")
        return call_compute_metrics(
            self.compute_metrics, prompts=[p for b in parts for p in b["prompts"]],
            completions=[c for b in parts for c in b["completions"]],
            completion_ids=[ids for b in parts for ids in b["completion_ids"]],
            rewards={name: [None if math.isnan(v) else v for v in rewards[:, j].tolist()]
                     for j, name in enumerate(names)},
            reward=weighted_rewards(rewards, self.reward_weights).tolist(), **columns)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        raise NotImplementedError("GRPOTrainer has no per-batch prediction step: use trainer.evaluate() for "
                                  "sampled rewards, or treadle.generation.generate_completions to sample")


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def _reward_list(reward_funcs) -> list[RewardFunction]:
    if reward_funcs is None:
        raise ValueError("GRPOTrainer needs reward_funcs: a function or a list of functions "
                         "fn(prompts, completions, completion_ids, **columns) -> list[float | None]")
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError("reward_funcs is empty; pass at least one reward function")
    for fn in funcs:
        if not callable(fn):
            raise TypeError(f"reward function {fn!r} is not callable; reward models by name are not supported, "
                            f"pass a function fn(prompts, completions, completion_ids, **columns)")
    names = [reward_name(fn) for fn in funcs]
    if len(set(names)) != len(names):
        raise ValueError(f"reward functions need distinct names (they are logged as rewards/<name>/mean), got "
                         f"{names}; rename one (e.g. set fn.__name__)")
    return funcs


def _reward_weights(weights, funcs: list) -> list[float]:
    if weights is None:
        return [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions "
                         f"{[reward_name(f) for f in funcs]}; give one weight per function")
    return [float(w) for w in weights]


def _check_tokenizer(tokenizer) -> None:
    if tokenizer is None or not callable(getattr(tokenizer, "batch_decode", None)):
        raise ValueError("GRPOTrainer needs processing_class=<a tokenizer> to encode prompts and decode "
                         "completions (e.g. treadle.toy.build_tokenizer() or AutoTokenizer.from_pretrained(path))")


def _check_dataset(dataset, args: GRPOConfig) -> None:
    if dataset is None:
        return
    require_columns(dataset, ["prompt"], what="GRPOTrainer",
                    fix="Rename the column holding the prompts (text or chat messages) to 'prompt'.")
    if hasattr(dataset, "__len__"):
        prompts = args.generation_batch_size * args.world_size // args.num_generations
        if len(dataset) < prompts:
            raise ValueError(f"one generation needs {prompts} distinct prompts (generation_batch_size "
                             f"{args.generation_batch_size} x world_size {args.world_size} / num_generations "
                             f"{args.num_generations}) but the dataset has {len(dataset)} rows; use more rows, "
                             f"a smaller per_device_train_batch_size or steps_per_generation")


def _reward_sums(rewards: torch.Tensor, weights: list[float], names: list[str], group: int, ks, threshold: float,
                 pass_key: str = "pass@{k}") -> dict[str, tuple[float, int]]:
    """``{metric: (sum, count)}`` of the mean reward and pass@k of the weighted total (``reward``, ``pass@k``) and
    of each function (``rewards/<name>/mean``, ``rewards/<name>/pass@k``) for ``rewards`` ``(N, F)``, N = prompts x
    ``group`` samples in a row; unscored (NaN) samples count in no mean and never pass."""
    columns = [("reward", "", weighted_rewards(rewards, weights))]  # (N,) each
    columns += [(f"rewards/{name}/mean", f"rewards/{name}/", rewards[:, j]) for j, name in enumerate(names)]
    out = {}
    for mean_key, stem, values in columns:
        out[mean_key] = (float(values.nan_to_num(0.0).sum()), int((~values.isnan()).sum()))
        for k, pair in pass_at_k_sums(values.view(-1, group), threshold, ks).items():
            out[stem + pass_key.format(k=k)] = pair
    return out


def _gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate a CPU tensor's rows from every rank, in rank order (the tensor itself in one process)."""
    if dist.get_world_size() == 1:
        return tensor
    return torch.cat(dist.gather_objects(tensor))
