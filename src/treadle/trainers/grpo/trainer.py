"""Group-relative policy optimisation: ``GRPOTrainer`` (its arguments, ``GRPOConfig``, are in trainers/grpo/config.py).

GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300) samples G completions per prompt, scores them with
reward functions, and trains on each reward minus its group's mean (optionally divided by the group's std). It is
an ``OnPolicyTrainer`` (trainers/onpolicy/trainer.py: the dataloader, the generation windows and buffer, the
rollout engine, sampling, evaluation by rewards), sibling of on-policy distillation, and adds what turns a rollout
into a training signal (``generate_and_score``)::

    rollout of a generation's rows (sample_generation)
      -> rewards (all ranks) -> group advantages -> old / reference log-probs when needed
      -> spg slices (Samples) into the buffer
      -> get_num_items_in_batch: the window's completion tokens (dapo) or completions (grpo), all ranks
      -> compute_loss: losses.grpo_loss on the slice (the clipped objective, the KL to the reference, the
         sampler correction's weight)

How this departs from the paper and from TRL's GRPOTrainer (v0.2x):

1. The default loss is ``dapo``: the token sum divided by the completion tokens of the whole accumulation
   window on all ranks (DAPO, Yu et al. 2025), so that gradient accumulation and data parallelism give exactly
   the big batch's gradient. The paper's per-sequence mean is ``loss_type="grpo"``.
2. No KL term by default (``beta=0``, as DAPO and Dr. GRPO argue); then no reference model exists. With
   ``beta > 0`` the k3 estimator is added to the per-token loss, as in the paper (not to the reward).
3. Old log-probs are computed (and the importance ratio is not 1) exactly when the policy can change between
   generation and use: when a generation cycle of ``steps_per_generation * num_iterations`` micro-steps does
   not fit inside one accumulation window. TRL's rule is "num_iterations > 1 or steps_per_generation >
   gradient_accumulation_steps"; ours skips the extra forward when μ > 1 repeats a batch inside one window. The
   sampler correction needs them too; for a generation trained in one micro-step they are the loss forward's own,
   detached, with no extra forward (trainers/grpo/correction.py).
4. Old and reference log-probs are computed in eval mode (no dropout), like the sampling itself.
5. Training forwards get ``position_ids`` that start at 0 after the left padding, as during sampling, so the
   log-probs being trained are those of the distribution that was sampled. (RoPE models do not notice a
   shift of every position; models with absolute position embeddings, such as GPT-2, do.)
6. Groups may span ranks: rewards are gathered from every rank before the advantages are computed.
   A rank whose rows hold whole groups prefills each distinct prompt once (``generation.single``).
7. A ``dapo`` normaliser needs the completions of the whole window before its first micro-step, so every
   generation a window uses happens at the window's start (``prepare_window``), whatever the loss type. The
   policy does not change inside a window and each generation has its own seeded RNG, so the samples are the
   same as if generated one micro-step at a time.
8. Sampling is seeded by (``seed``, generation index, rank), and a checkpoint also stores the generation
   buffer (its unconsumed slices and its cursor, ``onpolicy.data.GenerationBuffer``), so that resuming continues the
   run exactly even in the middle of a buffer.
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
    the micro-batch's rows packed side by side without padding (``logprobs.token_logps(padding_free=True)``, the
    packing rule of ``treadle.data``), which gives the same log-probs and gradients as the padded forward and skips the
    work on padding. It falls back to padded forwards where a one-time check finds it inexact. TRL's GRPO has no such
    option. ``shared_prefix`` (on by default) goes further: the rows of a micro-batch that hold the same prompt run it
    once, their completions after it under a 4D mask (``treadle.logprobs.prefix``; exact, and off by itself where the
    model or the batch does not fit).
15. Sampling goes through one rollout sampler (trainers/onpolicy/sampler.py) and its rollout engine
    (``treadle.engines``; ``build_engine`` returns the own KV-cached sampler), single-turn, multi-turn and image rows
    alike, which also returns the log-probs of the distribution it sampled from; they travel with each ``Sample`` as
    ``sampling_logps``. Where that distribution may differ from the trained one (the sampler does not report
    ``exact_logps``: the engine's own kernels, or batches sampled ahead with ``max_staleness``, or the sampling
    settings reshape it), the loss is weighed by the sampler correction
    (trainers/grpo/correction.py; TRL corrects only with vLLM).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import torch

import treadle.trainers.grpo.correction as correction
import treadle.trainers.onpolicy.vision as onpolicy_vision
from treadle import distributed as dist
from treadle.logprobs.prefix import shared_prefix_logps
from treadle.logprobs.tokens import token_logps
from treadle.losses import GRPOObjective, decoupled_advantages, group_advantages, grpo_aggregation, grpo_loss
from treadle.models import eval_mode, from_name, frozen_reference
from treadle.packing import position_ids
from treadle.peft import reference_of
from treadle.record import runfiles
from treadle.rewards import RewardFunction, reward_name, weighted_rewards
from treadle.trainers.grpo.config import GRPOConfig
from treadle.trainers.grpo.dynamic import check_stream, extra_rows, fill_with_signal
from treadle.trainers.grpo.health import (
    STATE_KEY,
    HealthCallback,
    check_finite_rewards,
    generation_health,
    rl_summary,
)
from treadle.trainers.grpo.metrics import completion_entries, generation_metrics
from treadle.trainers.onpolicy.data import Rollout, Sample, slice_sample
from treadle.trainers.onpolicy.inputs import seeded_generator
from treadle.trainers.onpolicy.trainer import OnPolicyTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "Sample"]


class GRPOTrainer(OnPolicyTrainer):
    """Online RL with group-relative advantages; see the module docstring for the data flow.

    ``reward_funcs``: one function or a list, each ``fn(prompts, completions, completion_ids, **columns) ->
    list[float | None]`` (see treadle.rewards). ``train_dataset`` needs a ``prompt`` column (text, or chat
    messages rendered with the tokenizer's chat template); every other column reaches the reward functions.
    ``processing_class`` is the tokenizer (required). ``ref_model`` is used when ``args.beta > 0`` (default: a
    frozen copy of ``model`` taken at construction; for a PEFT model, e.g. with ``peft_config``, the model itself
    with its adapters disabled).

    Multi-turn rollouts (treadle.rollouts, docs/agents.md): ``tools`` (annotated, docstring'd functions the model
    calls, TRL's argument) or ``env_factory`` (a callable returning a fresh ``rollouts.Environment`` per rollout).
    Observation tokens are in the context but masked out of the loss; another agent loop is a rollout sampler of
    its own (``build_rollout_sampler``; trainers/onpolicy/sampler.py).

    Sampling, the engine and evaluation are ``OnPolicyTrainer``'s (trainers/onpolicy/trainer.py). ``train`` raises
    ``TrainingStalled`` after a health check stopped the run (trainers/grpo/health.py).

    ``compute_metrics(prompts, completions, completion_ids, rewards, reward, **columns) -> dict`` adds custom
    evaluation metrics (``rewards.check_compute_metrics``).
    """

    config_class = GRPOConfig
    watched_metrics = ("reward", "reward_std", "kl", "entropy", *OnPolicyTrainer.watched_metrics)
    requires_reward_funcs = True

    def __init__(
        self,
        model=None,
        reward_funcs: RewardFunction | Sequence[RewardFunction] | None = None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        ref_model=None,
        peft_config=None,
        compute_metrics=None,
        tools=None,
        env_factory=None,
    ):
        args = self.check_args(args)
        model, processing_class = from_name(model, processing_class, args)  # a folder or Hub id (TRL's habit)
        ref_model, _ = from_name(ref_model, processing_class, args)
        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            compute_metrics=compute_metrics,
            reward_funcs=reward_funcs,
            tools=tools,
            env_factory=env_factory,
        )
        self.ref_model = self.build_reference_model(ref_model) if self.needs_reference_logps() else None
        self._completions_file_checked = False
        self.health = HealthCallback(
            args.health_checks,
            self.metrics,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
        )  # trainers/grpo/health.py
        self.add_callback(self.health)

    def needs_reference_logps(self) -> bool:
        """Whether a reference policy exists and every slice carries its log-probs: the KL term's ``beta > 0``."""
        return self.args.beta > 0

    def build_reference_model(self, ref_model=None):
        """The frozen reference policy for the KL term: ``ref_model``, or a copy of the model as it is now; None
        for a PEFT model, which is its own reference with its adapters disabled (no second copy)."""
        return frozen_reference(self.model, ref_model, device=self.args.device)

    def summary_lines(self) -> list[str]:
        """The reward, the held-out score and the health of the run, after the loop's end summary."""
        return rl_summary(self.state.log_history, self.state.stateful_callbacks.get(STATE_KEY))

    @property
    def corrects_sampling(self) -> bool:
        """Whether the sampler correction weighs the loss (trainers/grpo/correction.py): what the engine reports
        and the rollout sampler report (``exact_logps``: an asynchronous one samples from weights up to
        ``max_staleness`` steps old)."""
        return correction.corrects_sampling(self.args, exact_logps=self.rollout_sampler.exact_logps)

    # ---- data -------------------------------------------------------------------------------------------
    def get_train_dataloader(self):
        """``OnPolicyTrainer``'s; a stream cannot take dynamic sampling's extra draws (trainers/grpo/dynamic.py)."""
        check_stream(self.train_dataset, self.args)
        return super().get_train_dataloader()

    def _needs_old_logps(self) -> bool:
        """Whether the policy can change between a generation and the use of its samples: when a cycle of
        micro-steps does not fit inside one accumulation window (windows and cycles both start at epoch starts)."""
        cycle, accum = self.micro_batches_per_batch(), self.args.gradient_accumulation_steps
        return cycle > accum or accum % cycle != 0

    def train(self, resume_from_checkpoint: str | bool | None = None):
        """``OnPolicyTrainer.train``, then ``TrainingStalled`` when a health check stopped the run (its checkpoint is
        written)."""
        self._completions_file_checked = False
        output = super().train(resume_from_checkpoint=resume_from_checkpoint)
        self.health.raise_if_stopped(self.args, self.state)
        return output

    def count_items(self, inputs: Sample) -> int | None:
        """A slice's loss items: completion tokens (``dapo``) or completions (``grpo``); None for ``bnpo`` and
        ``dr_grpo``, whose per-micro-batch means the loop averages. The inherited ``get_num_items_in_batch``
        sums it over the window and the ranks."""
        aggregation = grpo_aggregation(self.args.loss_type)  # cispo counts like dapo, sapo like grpo
        mask = Sample.of(inputs).completion_mask
        if aggregation == "dapo":
            return int(mask.sum())
        return mask.shape[0] if aggregation == "grpo" else None

    def get_num_items_in_batch(self, batch_samples: list) -> int | None:
        total = super().get_num_items_in_batch(batch_samples)
        return None if total is None else max(total, 1)  # all completions masked: zero loss, not 0/0

    # ---- generation and scoring ---------------------------------------------------------------------------
    def generate_and_score(self, rows: list[dict], generation: int) -> list[Sample]:
        """Sample one completion per row, score all rows of all ranks, and return the generation's
        ``steps_per_generation`` slices (``Sample``s on the device, with ``old_logps`` / ``ref_logps`` when
        needed)."""
        args = self.args
        rollout, rewards, trained = self.sample_and_score(rows, generation)  # (N, F), (N,)
        all_rewards = dist.gather_rows(rewards)  # (W*N, F)
        total = weighted_rewards(all_rewards, self.reward_weights)  # (W*N,)
        advantages, metrics = group_advantages(
            total, args.num_generations, scale_rewards=args.scale_rewards, advantage_estimator=args.advantage_estimator
        )
        if args.multi_objective_aggregation == "normalize_then_sum":  # GDPO: each reward normalised on its own
            advantages = decoupled_advantages(all_rewards, self.reward_weights, args.num_generations)
        names = [reward_name(fn) for fn in self.reward_funcs]
        check_finite_rewards(all_rewards, total, advantages, metrics["reward_std"], names, self.state.global_step)
        rank, rows_here = dist.get_rank(), len(rows)
        local_advantages = advantages[rank * rows_here : (rank + 1) * rows_here]  # (N,)
        self.metrics.add_many(
            generation_metrics(metrics, all_rewards, rollout, self.reward_funcs, self.reward_weights)
        )
        self.metrics.add_many(
            self.health.record_generation(
                generation_health(
                    all_rewards,
                    total,
                    dist.gather_rows(rollout.generation.is_truncated.cpu()),
                    args.num_generations,
                    names,
                    self.reward_weights,
                )
            )
        )
        if args.log_completions:
            self._log_completions(rollout, rewards, local_advantages)
        loss_mask = rollout.loss_mask * trained.to(rollout.loss_mask.device, rollout.loss_mask.dtype).unsqueeze(1)
        if args.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.generation.is_truncated).unsqueeze(1).to(loss_mask.dtype)
        slices = [self._build_slice(rollout, loss_mask, local_advantages, s) for s in range(args.steps_per_generation)]
        if slices[0].importance_sampling_ratio is not None:
            self.metrics.add_many(correction.correction_metrics(slices, args.vllm_importance_sampling_mode))
        return slices

    def sample_and_score(self, rows: list[dict], generation: int) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
        """This rank's rollout of ``rows``, its rewards ``(N, F)`` and which rows to train on ``(N,)``; with
        ``dynamic_sampling``, groups of equal rewards are replaced by groups of extra prompts
        (trainers/grpo/dynamic.py)."""
        args = self.args
        rollout = self.sample_generation(rows, generation)
        if self.engine.sync_unchanged is not None:  # an engine with its own weights checked its push
            self.health.record_weight_sync(self.engine.sync_unchanged)
        rewards = self.compute_rewards(rollout)
        if not args.dynamic_sampling:
            return rollout, rewards, torch.ones(len(rows), dtype=torch.bool)

        def draw(round_: int) -> tuple[Rollout, torch.Tensor]:
            extra = extra_rows(
                self.train_dataset,
                seed=args.seed,
                generation=generation,
                round_=round_,
                group=args.num_generations,
                rows_per_rank=len(rows),
            )
            more = self.sample_rows(extra, seeded_generator(args.seed, args.device, "train", generation, round_))
            return more, self.compute_rewards(more)

        rollout, rewards, trained, metrics = fill_with_signal(
            rollout,
            rewards,
            draw,
            weights=self.reward_weights,
            group=args.num_generations,
            max_rounds=args.dynamic_sampling_max_rounds,
            pad_token_id=self.pad_token_id,
            device=args.device,
        )
        self.metrics.add_many(metrics)
        return rollout, rewards, trained

    def _build_slice(self, rollout: Rollout, loss_mask: torch.Tensor, advantages: torch.Tensor, index: int) -> Sample:
        """Rows of slice ``index``, cut to their own longest prompt and completion, with the log-probs the loss
        needs from policies other than the current one."""
        size = self.args.per_device_train_batch_size
        rows = slice(index * size, (index + 1) * size)
        sample = slice_sample(rollout.generation, loss_mask, advantages, rows)
        width = sample.completion_mask.shape[1]
        sample.model_inputs = onpolicy_vision.slice_inputs(
            self.processing_class, rollout, rows, sample.input_ids.shape[1] - width, width
        )
        sample = sample.to(self.args.device)
        corrected = (  # here; deferred, compute_loss corrects with its own forward's log-probs (grpo/correction.py)
            self.corrects_sampling
            and sample.sampling_logps is not None
            and not correction.defers_old_logps(self.micro_batches_per_batch(), self.model)
        )
        if self._needs_old_logps() or corrected:
            sample.old_logps = self.frozen_logps(self.model, sample)
        if corrected:  # the sampler correction (trainers/grpo/correction.py)
            sample.importance_sampling_ratio = correction.sampling_ratio(sample, self.args)
        if self.needs_reference_logps():
            with reference_of(self.model, self.ref_model) as reference:  # a PEFT policy: adapters disabled
                sample.ref_logps = self.frozen_logps(reference, sample)
        return sample

    @torch.no_grad()
    def frozen_logps(self, model, batch: Sample | dict) -> torch.Tensor:
        """Per-token log-probs ``(B, C)`` of ``batch``'s completions under ``model`` held still (the old policy or
        the reference): eval mode, no gradient, float32."""
        with eval_mode(model), self.autocast():
            logps = self.completion_logps(model, batch).logps
        return logps.float()

    def completion_logps(self, model, batch: Sample | dict, return_entropy: bool = False):
        """A ``logprobs.TokenLogps``: per-token log-probs ``(B, C)`` (and entropies) of the completion tokens, at the
        sampling temperature, with positions counted from the first prompt token as during sampling. ``batch``: a
        ``Sample`` or a dict of its fields (a micro-batch built by hand)."""
        batch = Sample.of(batch)
        ids, mask = batch.input_ids, batch.attention_mask
        start = ids.shape[1] - batch.completion_mask.shape[1] - 1
        shared = (
            None
            if not self.args.shared_prefix or batch.model_inputs
            else shared_prefix_logps(  # text rows
                model,
                ids,
                mask,
                prompt_width=start + 1,
                temperature=self.args.temperature,
                return_entropy=return_entropy,
            )
        )
        if (
            shared is not None
        ):  # each prompt once (treadle.logprobs.prefix); None where this model or batch does not share
            return shared
        return token_logps(
            model,
            ids,
            mask,
            start=start,
            temperature=self.args.temperature,
            return_entropy=return_entropy,
            **onpolicy_vision.logprob_options(model, batch.model_inputs, position_ids(mask), self.args.padding_free),
        )

    # ---- the loss ---------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``losses.grpo_loss`` on one slice; ``num_items_in_batch`` is the window's normaliser (``dapo``: its
        completion tokens, ``grpo``: its completions, both over all ranks)."""
        inputs = Sample.of(inputs)
        logps, entropy = self.completion_logps(model, inputs, return_entropy=True)  # (B, C) each
        if inputs.importance_sampling_ratio is None and inputs.sampling_logps is not None and self.corrects_sampling:
            inputs = self._corrected_here(logps, inputs)
        normalizer = num_items_in_batch if self.objective.aggregation in ("grpo", "dapo") else None
        loss, metrics = grpo_loss(
            logps,
            inputs.advantages,
            inputs.completion_mask,
            self.objective,
            old_logps=inputs.old_logps,
            ref_logps=inputs.ref_logps,
            normalizer=normalizer,
            importance_sampling_ratio=inputs.importance_sampling_ratio,
            entropies=entropy.detach(),
        )
        mask = inputs.completion_mask.to(entropy.dtype)
        metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1)
        self.metrics.add_many({name: (value, 1) for name, value in metrics.items()})  # means over micro-steps
        return (loss, {"logps": logps}) if return_outputs else loss

    def _corrected_here(self, logps: torch.Tensor, inputs: Sample) -> Sample:
        """The sampler correction of a generation trained in this one micro-step (``correction.defers_old_logps``):
        its old log-probs are this forward's, detached; the ratio and the generation's ``sampling/*`` metrics."""
        inputs = dataclasses.replace(inputs, old_logps=logps.detach().float())
        inputs.importance_sampling_ratio = correction.sampling_ratio(inputs, self.args)
        self.metrics.add_many(correction.correction_metrics([inputs], self.args.vllm_importance_sampling_mode))
        return inputs

    @functools.cached_property
    def objective(self) -> GRPOObjective:
        """The objective's settings (``losses.GRPOObjective``), from the config, built and checked once."""
        return self.args.objective()

    # ---- records and checkpoints ------------------------------------------------------------------------
    def _log_completions(self, rollout: Rollout, rewards: torch.Tensor, advantages: torch.Tensor) -> None:
        """Append this generation's completions (all ranks) to output_dir/completions.jsonl, from rank 0."""
        names = [reward_name(fn) for fn in self.reward_funcs]
        entries = completion_entries(rollout, rewards, advantages, names, self.state.global_step)
        if not dist.is_main_process():
            return
        path = os.path.join(self.args.output_dir, runfiles.COMPLETIONS_FILE)
        if not self._completions_file_checked:
            step = self.state.global_step  # a resumed run writes the steps from its checkpoint on again
            runfiles.cut_back(path, lambda r: r["step"] < step)
            self._completions_file_checked = True
        runfiles.append_entries(path, entries)
