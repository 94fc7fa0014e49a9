"""Group-relative policy optimisation: ``GRPOTrainer`` (its arguments, ``GRPOConfig``, are in trainers/grpo/config.py).

GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300) samples G completions per prompt, scores them with
reward functions, and trains on each reward minus its group's mean (optionally divided by the group's std).
Generation is sequential (one forward per token), so one generation feeds several micro-steps: the
dataloader yields ``per_device_train_batch_size * steps_per_generation`` rows at once (each prompt G times in
a row), once per generation; ``training_windows`` hands each optimizer step a window of tickets (generation,
its rows, micro-step in its cycle), and ``prepare_window`` generates and scores a generation into the buffer
when it is not there yet and hands out one typed ``Sample`` per micro-step (trainers/onpolicy/data.py)::

    dataloader batch (one generation: RepeatSampler, each prompt G times, the same prompts on every rank)
      -> training_windows: spg * μ tickets per generation (the loop counts micro_batches_per_batch() = spg * μ
         micro-steps per batch), grouped into windows of gradient_accumulation_steps
      -> prepare_window: for each ticket, its generation's slices from the buffer, or if there are none yet:
         engine.generate -> rewards -> advantages (all ranks) -> old / ref log-probs -> spg slices (Samples);
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
   A rank whose rows hold whole groups prefills each distinct prompt once (``generation.single``).
7. A ``dapo`` normaliser needs the completions of the whole window before its first micro-step, so every
   generation a window uses happens at the window's start (``prepare_window``), whatever the loss type. The
   policy does not change inside a window and each generation has its own seeded RNG, so the samples are the
   same as if generated one micro-step at a time.
8. Sampling is seeded by (``seed``, generation index, rank), and a checkpoint also stores the generation
   buffer (its unconsumed slices and its cursor, ``grpo_data.GenerationBuffer``), so that resuming continues the
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
    the micro-batch's rows packed side by side without padding (``logprobs.token_logps(padding_free=True)``,
    the packing rule of ``treadle.data``), which gives the same log-probs and gradients as the padded forward
    and skips the work on padding. It falls back to padded forwards where a one-time check finds it inexact.
    TRL's GRPO has no such option. ``shared_prefix`` (on by default) goes further: the rows of a micro-batch that
    hold the same prompt run it once, their completions after it under a 4D mask (``treadle.logprobs.prefix``; exact, and
    off by itself where the model or the batch does not fit).
15. Sampling goes through a rollout engine (``treadle.engines``; ``build_engine`` returns the own KV-cached
    sampler), which also returns the log-probs of the distribution it sampled from; they travel with each
    ``Sample`` as ``sampling_logps``. Where that distribution may differ from the trained one, the loss is weighed
    by the sampler correction (trainers/grpo/correction.py; TRL corrects only with vLLM). Multi-turn rollouts call
    the multi-turn sampler directly (``treadle.rollouts``).
"""

from __future__ import annotations

import os
import warnings
from typing import Sequence

import torch

from treadle import checkpoint as ckpt
from treadle import distributed as dist
from treadle.record import runfiles
from treadle.data import RepeatSampler, column_names, require_columns
from treadle.engines.base import RolloutEngine
from treadle.engines.local import LocalEngine
from treadle.engines.vllm import vllm_engine
from treadle.engines.vllm_server import vllm_server_engine
from treadle.generation.sampling import SamplingParams, sampler_options
from treadle.generation.single import GenerationOutput, distinct_prompts
from treadle.health import HealthCallback, generation_health
from treadle.logprobs.tokens import token_logps
from treadle.losses import decoupled_advantages, grpo_aggregation, grpo_loss, group_advantages
from treadle.metrics import means_of
from treadle.models import eval_mode, from_name, frozen_reference
from treadle.packing import position_ids
from treadle.peft import reference_of
from treadle.logprobs.prefix import shared_prefix_logps
from treadle.rewards import RewardFunction, check_compute_metrics, reward_name, score_completions, weighted_rewards
from treadle.rollouts.runner import RolloutRunner
from treadle.streaming import is_stream
from treadle.text import eos_ids, is_conversation, pad_token_id
from treadle.trainer import Trainer
from treadle.trainers.onpolicy import vision as onpolicy_vision
from treadle.trainers.onpolicy.asynchronous import (AsyncRollouts, begin_generation, end_run, load_state, saved_state,
                                                scheduled)
from treadle.trainers.grpo.config import GRPOConfig
from treadle.trainers.onpolicy.data import (GenerationBuffer, Rollout, Sample, Ticket, generation_windows, prompt_stream,
                                        slice_sample)
from treadle.trainers.grpo.dynamic import extra_rows, fill_with_signal
from treadle.trainers.grpo.records import (check_dataset, check_tokenizer, completion_records, custom_eval_metrics,
                                           generation_metrics, reward_list, reward_sums, reward_weights,
                                           seeded_generator, tokenize_prompts)
from treadle.trainers.grpo.correction import correction_metrics, corrects_sampling, sampling_ratio
from treadle.vision import tokenizer_of

__all__ = ["GRPOConfig", "GRPOTrainer", "Sample"]


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

    Single-turn sampling (training and ``evaluate``) goes through ``self.engine`` (``build_engine``: any
    ``engines.RolloutEngine``). The trainer owns the engine and the rollout runner: ``train`` closes the runner's
    threads when it ends (a later run or ``evaluate`` starts them again) and ``close()`` closes both.

    ``compute_metrics(prompts, completions, completion_ids, rewards, reward, **columns) -> dict`` adds custom
    evaluation metrics (``rewards.check_compute_metrics``).
    """

    config_class = GRPOConfig
    requires_reward_funcs = True  # a subclass that trains on another signal (DistillationTrainer) sets False

    def __init__(self, model=None, reward_funcs: RewardFunction | Sequence[RewardFunction] | None = None,
                 args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None, processing_class=None,
                 callbacks=None, optimizers=(None, None), ref_model=None, peft_config=None, compute_metrics=None,
                 tools=None, env_factory=None):
        args = self.check_args(args)  # needed before super().__init__: the dataset check reads it
        model, processing_class = from_name(model, processing_class, args)  # a folder or Hub id (TRL's habit)
        ref_model, _ = from_name(ref_model, processing_class, args)
        if compute_metrics is not None:
            check_compute_metrics(compute_metrics, column_names(eval_dataset) or ())
        self.rollout_runner = None if tools is None and env_factory is None else RolloutRunner(
            processing_class, tools=tools, env_factory=env_factory, call_format=args.tool_call_format,
            max_tool_calling_iterations=args.max_tool_calling_iterations, tool_timeout=args.tool_timeout,
            workers=args.rollout_workers, env_timeout=args.env_timeout)
        self.reward_funcs = reward_list(reward_funcs, required=self.requires_reward_funcs)
        self.reward_weights = reward_weights(args.reward_weights, self.reward_funcs)
        check_tokenizer(processing_class)
        check_dataset(train_dataset, args)
        super().__init__(model=model, args=args, data_collator=_keep_rows, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, compute_metrics=compute_metrics)
        onpolicy_vision.check_dataset(train_dataset, self.model, processing_class)  # rows with images (trainers/onpolicy/vision.py)
        self.ref_model = self.build_reference_model(ref_model) if self.needs_reference_logps() else None
        self.pad_token_id = pad_token_id(tokenizer_of(processing_class))
        self.buffer = GenerationBuffer(self._cycle_length())
        self.engine = self.build_engine()
        self.corrects_sampling = corrects_sampling(args, own_sampler=isinstance(self.engine, LocalEngine)
                                                   or self.rollout_runner is not None)  # trainers/grpo/correction.py
        self._completions_file_checked = False
        self.health = HealthCallback(args.health_checks, self.metrics, num_generations=args.num_generations,
                                     max_completion_length=args.max_completion_length)  # treadle.health
        self.add_callback(self.health)

    def needs_reference_logps(self) -> bool:
        """Whether a reference policy exists and every slice carries its log-probs: the KL term's ``beta > 0``. A
        subclass whose ``beta`` means something else (DistillationTrainer: the JSD's mixture) overrides it."""
        return self.args.beta > 0

    def build_reference_model(self, ref_model=None):
        """The frozen reference policy for the KL term: ``ref_model``, or a copy of the model as it is now; None
        for a PEFT model, which is its own reference with its adapters disabled (no second copy)."""
        return frozen_reference(self.model, ref_model, device=self.args.device)

    def build_engine(self) -> RolloutEngine:
        """The rollout engine that single-turn training and evaluation sample through: the own KV-cached sampler
        (``generation_backend``), or vLLM with ``use_vllm`` (``engines.vllm``). Override to plug in another
        ``engines.RolloutEngine``."""
        if self.args.use_vllm:
            build = vllm_server_engine if self.args.vllm_mode == "server" else vllm_engine  # engines.vllm_server
            return build(self.model, self.args, multi_turn=self.rollout_runner is not None)
        if self.args.max_staleness:  # a rollout worker samples ahead (trainers/onpolicy/asynchronous.py)
            return AsyncRollouts(self)
        return LocalEngine(self.model, backend=self.args.generation_backend)

    def close(self) -> None:
        """Release the engine and the rollout runner's threads (a later ``train`` or ``evaluate`` restarts the
        runner's threads; a closed engine is not used again)."""
        if self.rollout_runner is not None:
            self.rollout_runner.close()
        self.engine.close()

    # ---- data -------------------------------------------------------------------------------------------
    def get_train_dataloader(self):
        """Batches of ``generation_batch_size`` rows on this rank, one per generation, each prompt
        ``num_generations`` times in a row, the same prompts on every rank. Every column is kept."""
        args = self.args
        if self.train_dataset is None:
            raise ValueError("GRPOTrainer.train() needs a train_dataset with a 'prompt' column")
        if is_stream(self.train_dataset):  # each rank reads its own prompts; groups whole on the rank
            return self.build_dataloader(prompt_stream(self.train_dataset, args), batch_size=args.generation_batch_size,
                                         collate_fn=_keep_rows)
        world = dist.get_world_size()
        sampler = RepeatSampler(len(self.train_dataset), mini_repeat_count=args.num_generations,
                                batch_size=args.generation_batch_size * world // args.num_generations,
                                shuffle=True, seed=args.data_seed, rank=dist.get_rank(), world_size=world)
        return self.build_dataloader(self.train_dataset, batch_size=args.generation_batch_size, sampler=sampler,
                                     collate_fn=_keep_rows)

    def micro_batches_per_batch(self) -> int:
        """Micro-steps one generation batch feeds: ``steps_per_generation * num_iterations``."""
        return self._cycle_length()

    def training_windows(self, dataloader, epoch: int, skip_steps: int):
        """Windows of ``gradient_accumulation_steps`` tickets (``grpo_data.generation_windows``): each generation
        batch is drawn once and feeds a whole cycle of micro-steps; a resumed run skips whole generations
        without loading them."""
        sampler = dataloader.sampler
        per_epoch = (sampler.batches_per_epoch if isinstance(sampler, RepeatSampler)  # len() shrinks on resume
                     else len(dataloader) if hasattr(dataloader, "__len__") else 0)  # 0: a stream, one endless epoch
        return scheduled(self.engine, generation_windows(  # async: read ahead (trainers/onpolicy/asynchronous.py)
            dataloader, epoch, skip_steps, cycle=self._cycle_length(), accum=self.args.gradient_accumulation_steps,
            generations_per_epoch=per_epoch))

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
        """``Trainer.train``; the rollout runner's threads are closed when it ends, however it ends."""
        self.buffer.clear()  # a resumed run restores its own (load_extra_checkpoint_state)
        self._completions_file_checked = False
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint)
            self.health.raise_if_stopped(self.args, self.state)  # a check stopped it: its checkpoint is written
            return output
        finally:
            end_run(self.engine)  # async: stop the rollout worker
            if self.rollout_runner is not None:
                self.rollout_runner.close()

    def prepare_window(self, batch_samples: list[Ticket]) -> list[Sample]:
        """The slices this window's micro-steps train on, one per ticket. A generation not in the buffer yet is
        generated, scored and split here, from its ticket's rows: the policy does not change inside a window, so
        sampling every generation the window needs at its start gives the same samples as sampling at each
        micro-step (each generation has its own seeded RNG)."""
        for ticket in batch_samples:
            if ticket.generation not in self.buffer:
                if ticket.micro_step:
                    warnings.warn(f"GRPO: resuming at micro-step {ticket.micro_step} of generation "
                                  f"{ticket.generation}, without its saved buffer (no extra_state file in the "
                                  f"checkpoint): sampling it again from the current policy, so this run is not an "
                                  f"exact continuation", stacklevel=3)
                begin_generation(self.engine, ticket.generation)  # async: request ahead (trainers/onpolicy/asynchronous.py)
                self.buffer.put(ticket.generation, self.generate_and_score(ticket.rows, ticket.generation))
        window = [self.buffer.take(ticket, self.args.steps_per_generation) for ticket in batch_samples]
        self.buffer.release_consumed()
        return window

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
    def generate(self, prompt_ids: list[list[int]], *, num_generations: int,
                 generator: torch.Generator | None = None, mode: str = "train") -> GenerationOutput:
        """Sample ``num_generations`` completions for each distinct prompt (token ids) with the sampling settings
        of ``mode`` (``sampling_params``) through ``self.engine``; rows come back grouped (prompt b's completions
        are rows b*G .. b*G+G-1). The one place where training and evaluation sample."""
        return self.engine.generate(prompt_ids, self.sampling_params(mode, num_generations), generator=generator)

    def sampling_params(self, mode: str = "train", num_generations: int | None = None) -> SamplingParams:
        """The sampling settings of ``mode``: "train" (the config's), "eval" (its ``eval_*`` fields; temperature 0
        decodes greedily) or "greedy" (argmax), then ``min_p`` and ``generation_kwargs`` (every mode, as TRL's one
        generation config); ``num_generations`` defaults to the mode's group size."""
        args = self.args
        if mode == "train":
            temperature, top_p, top_k, do_sample = args.temperature, args.top_p, args.top_k, True
        else:
            chosen = args.eval_temperature if mode == "eval" else 0.0
            temperature, top_p, top_k, do_sample = chosen or 1.0, args.eval_top_p, args.eval_top_k, chosen > 0
        group = {"train": args.num_generations, "eval": args.num_generations_eval}.get(mode, 1)
        settings = dict(temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=args.repetition_penalty)
        settings |= sampler_options(args.min_p, args.generation_kwargs)  # TRL's: they override top_p, top_k, ...
        return SamplingParams(num_generations=num_generations or group, max_new_tokens=args.max_completion_length,
                              eos_token_ids=eos_ids(tokenizer_of(self.processing_class).eos_token_id),
                              pad_token_id=self.pad_token_id, do_sample=do_sample, **settings)

    def generate_and_score(self, rows: list[dict], generation: int) -> list[Sample]:
        """Sample one completion per row, score all rows of all ranks, and return the generation's
        ``steps_per_generation`` slices (``Sample``s on the device, with ``old_logps`` / ``ref_logps`` when
        needed)."""
        args = self.args
        self.engine.load_weights(self.model_wrapped)  # the policy changed since the last generation
        if getattr(self.engine, "sync_unchanged", None) is not None:  # an engine with its own weights checked its sync
            self.health.record_weight_sync(self.engine.sync_unchanged)
        rollout, rewards, trained = self.sample_and_score(rows, generation)  # (N, F), (N,)
        all_rewards = dist.gather_rows(rewards)  # (W*N, F)
        total = weighted_rewards(all_rewards, self.reward_weights)  # (W*N,)
        advantages, metrics = group_advantages(total, args.num_generations, scale_rewards=args.scale_rewards,
                                               advantage_estimator=args.advantage_estimator)
        if args.multi_objective_aggregation == "normalize_then_sum":  # GDPO: each reward normalised on its own
            advantages = decoupled_advantages(all_rewards, self.reward_weights, args.num_generations)
        rank, rows_here = dist.get_rank(), len(rows)
        local_advantages = advantages[rank * rows_here:(rank + 1) * rows_here]  # (N,)
        self.metrics.add_many(generation_metrics(metrics, all_rewards, rollout, self.reward_funcs,
                                                 self.reward_weights))
        self.metrics.add_many(self.health.record_generation(generation_health(
            all_rewards, total, dist.gather_rows(rollout.generation.is_truncated.cpu()), args.num_generations,
            [reward_name(fn) for fn in self.reward_funcs])))
        if args.log_completions:
            self._log_completions(rollout, rewards, local_advantages)
        loss_mask = rollout.loss_mask * trained.to(rollout.loss_mask.device, rollout.loss_mask.dtype).unsqueeze(1)
        if args.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.generation.is_truncated).unsqueeze(1).to(loss_mask.dtype)
        slices = [self._build_slice(rollout, loss_mask, local_advantages, s) for s in range(args.steps_per_generation)]
        if slices[0].importance_sampling_ratio is not None:
            self.metrics.add_many(correction_metrics(slices, args.vllm_importance_sampling_mode))
        return slices

    def sample_and_score(self, rows: list[dict], generation: int) -> tuple[Rollout, torch.Tensor, torch.Tensor]:
        """This rank's rollout of ``rows``, its rewards ``(N, F)`` and which rows to train on ``(N,)``; with
        ``dynamic_sampling``, groups of equal rewards are replaced by groups of extra prompts (trainers/grpo/dynamic.py)."""
        args = self.args
        rollout = self._sample(rows, seeded_generator(args.seed, args.device, "train", generation))
        rewards = self._score(rollout)
        if not args.dynamic_sampling:
            return rollout, rewards, torch.ones(len(rows), dtype=torch.bool)

        def draw(round_: int) -> tuple[Rollout, torch.Tensor]:
            extra = extra_rows(self.train_dataset, seed=args.seed, generation=generation, round_=round_,
                               group=args.num_generations, rows_per_rank=len(rows))
            more = self._sample(extra, seeded_generator(args.seed, args.device, "train", generation, round_))
            return more, self._score(more)

        rollout, rewards, trained, metrics = fill_with_signal(
            rollout, rewards, draw, weights=self.reward_weights, group=args.num_generations,
            max_rounds=args.dynamic_sampling_max_rounds, pad_token_id=self.pad_token_id, device=args.device)
        self.metrics.add_many(metrics)
        return rollout, rewards, trained

    def _score(self, rollout: Rollout) -> torch.Tensor:
        """Every reward function's float rewards of ``rollout`` ``(N, F)`` (NaN: no opinion)."""
        return score_completions(self.reward_funcs, self.reward_weights, prompts=rollout.prompts,
                                 completions=rollout.completions, completion_ids=rollout.completion_lists,
                                 columns=rollout.columns, step=self.state.global_step)

    def _sample(self, rows: list[dict], generator: torch.Generator | None, mode: str = "train") -> Rollout:
        """Tokenise the rows' prompts, sample one completion per row (``mode``: see ``sampling_params``), decode.
        Rows that hold whole groups (the same prompt G times in a row) are sampled as distinct prompts x G: each
        prompt is prefilled once. With tools or an environment, ``rollout`` samples instead."""
        if self.rollout_runner is not None:
            return self.rollout(rows, generator, mode=mode)
        if onpolicy_vision.has_images(rows):
            return onpolicy_vision.sample(self, rows, generator, mode)
        prompts = [row["prompt"] for row in rows]
        ids = tokenize_prompts(self.processing_class, prompts, self.args.max_prompt_length)
        distinct, group = distinct_prompts(ids, self.sampling_params(mode).num_generations)
        settings = {"mode": mode} if mode != "train" else {}  # an override written for training only still trains
        out = self.generate(distinct, num_generations=group, generator=generator, **settings)
        lengths = out.completion_mask.sum(dim=1).tolist()
        completion_lists = [ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)]
        texts = self.processing_class.batch_decode(completion_lists, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if is_conversation(p) else t
                       for p, t in zip(prompts, texts)]
        return Rollout.of(rows, out, completions, completion_lists)

    def sample_rows(self, rows: list[dict], generator: torch.Generator | None, mode: str = "train") -> Rollout:
        """One completion per row (single- or multi-turn), as training and ``evaluate`` sample: for a subclass that
        trains on a rollout otherwise than by rewards (DistillationTrainer)."""
        return self._sample(rows, generator, mode)

    def rollout(self, rows: list[dict], generator: torch.Generator | None, mode: str = "train") -> Rollout:
        """Multi-turn rollouts (``tools=`` or ``env_factory=``; treadle.rollouts), one per row, sampled as ``mode``
        says (``sampling_params``): the hook to override for another agent loop. Returns a ``grpo_data.Rollout``
        whose ``loss_mask`` is 1 on sampled tokens only, with ``transcripts`` and ``rollout_metrics``; the reward
        functions also get the ``transcript`` and ``env_reward`` columns."""
        args = self.args
        out = self.rollout_runner.run(self.model_wrapped, rows, self.sampling_params(mode),
                                      max_prompt_length=args.max_prompt_length, generator=generator,
                                      backend=args.generation_backend)
        rollout = Rollout.of(rows, out.generation, out.completions, out.completion_lists,
                             loss_mask=out.generation.sampled_mask, transcripts=out.transcripts,
                             rollout_metrics=out.metrics)
        rollout.columns.update(transcript=out.transcripts, env_reward=out.env_rewards)
        return rollout

    def _build_slice(self, rollout: Rollout, loss_mask: torch.Tensor, advantages: torch.Tensor, index: int) -> Sample:
        """Rows of slice ``index``, cut to their own longest prompt and completion, with the log-probs the loss
        needs from policies other than the current one."""
        size = self.args.per_device_train_batch_size
        rows = slice(index * size, (index + 1) * size)
        sample = slice_sample(rollout.generation, loss_mask, advantages, rows)
        width = sample.completion_mask.shape[1]
        sample.model_inputs = onpolicy_vision.slice_inputs(self.processing_class, rollout, rows,
                                                       sample.input_ids.shape[1] - width, width)
        sample = sample.to(self.args.device)
        corrected = self.corrects_sampling and sample.sampling_logps is not None
        if self._needs_old_logps() or corrected:
            sample.old_logps = self.frozen_logps(self.model, sample)
        if corrected:  # the sampler correction (trainers/grpo/correction.py)
            sample.importance_sampling_ratio = sampling_ratio(sample, self.args)
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
        shared = None if not self.args.shared_prefix or batch.model_inputs else shared_prefix_logps(  # text rows
            model, ids, mask, prompt_width=start + 1, temperature=self.args.temperature, return_entropy=return_entropy)
        if shared is not None:  # each prompt once (treadle.logprobs.prefix); None where this model or batch does not share
            return shared
        return token_logps(model, ids, mask, start=start, temperature=self.args.temperature,
                           return_entropy=return_entropy, **onpolicy_vision.logprob_options(
                               model, batch.model_inputs, position_ids(mask), self.args.padding_free))

    # ---- the loss ---------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``losses.grpo_loss`` on one slice; ``num_items_in_batch`` is the window's normaliser (``dapo``: its
        completion tokens, ``grpo``: its completions, both over all ranks)."""
        args, inputs = self.args, Sample.of(inputs)
        logps, entropy = self.completion_logps(model, inputs, return_entropy=True)  # (B, C) each
        normalizer = num_items_in_batch if grpo_aggregation(args.loss_type) in ("grpo", "dapo") else None
        loss, metrics = grpo_loss(logps, inputs.advantages, inputs.completion_mask,
                                  old_logps=inputs.old_logps, ref_logps=inputs.ref_logps,
                                  beta=args.beta, epsilon_low=args.epsilon, epsilon_high=args.epsilon_high,
                                  loss_type=args.loss_type, normalizer=normalizer,
                                  max_completion_length=args.max_completion_length,
                                  importance_sampling_ratio=inputs.importance_sampling_ratio,
                                  **self.objective_options(entropy))
        mask = inputs.completion_mask.to(entropy.dtype)
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


    # ---- records and checkpoints ------------------------------------------------------------------------
    def _log_completions(self, rollout: Rollout, rewards: torch.Tensor, advantages: torch.Tensor) -> None:
        """Append this generation's completions (all ranks) to output_dir/completions.jsonl, from rank 0."""
        names = [reward_name(fn) for fn in self.reward_funcs]
        records = completion_records(rollout, rewards, advantages, names, self.state.global_step)
        if not dist.is_main_process():
            return
        path = os.path.join(self.args.output_dir, runfiles.COMPLETIONS_FILE)
        if not self._completions_file_checked:
            step = self.state.global_step  # a resumed run writes the steps from its checkpoint on again
            runfiles.cut_back(path, lambda r: r["step"] < step)
            self._completions_file_checked = True
        runfiles.append_records(path, records)

    def extra_checkpoint_state(self) -> dict:
        """This rank's generation buffer (unconsumed slices and cursor), saved in every checkpoint so that resuming
        inside a generation cycle is exact (the metrics are in the Trainer's window)."""
        return {"buffer": self.buffer.state_dict(), **saved_state(self.engine)}  # + async: batches requested

    def load_extra_checkpoint_state(self, state: dict) -> None:
        # earlier releases saved {"buffers": ...} (their cursor in trainer_state.json); the buffer reads both
        self.buffer.load_state_dict(state.get("buffer", state), self.args.device)
        load_state(self.engine, state)

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
        self.engine.load_weights(self.model_wrapped)
        rng = ckpt.rng_state()  # reward functions and compute_metrics may draw from the global RNGs
        try:
            samples = [self._score_eval_batch(rows, index) for index, rows in enumerate(loader)]
            custom = {} if self.compute_metrics is None else custom_eval_metrics(
                self.compute_metrics, samples, [reward_name(fn) for fn in self.reward_funcs], self.reward_weights)
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
        generator = seeded_generator(args.seed, args.device, "eval", index)
        rollout = self._sample(repeated, generator, mode="eval")
        rewards = self._score(rollout).double()  # (N, F)
        record = {"completions/mean_length": (rollout.generation.completion_mask.sum(), len(repeated)),
                  **reward_sums(rewards, self.reward_weights, names, n, args.eval_pass_at_k,
                                args.eval_success_threshold)}
        if args.eval_greedy:  # one function of weight 1: its own greedy keys would repeat the total's, so none
            greedy = self._score(self._sample(rows, None, mode="greedy")).double()
            own = names if self.reward_weights != [1.0] else []
            record.update({f"greedy/{key}": pair for key, pair in reward_sums(
                greedy, self.reward_weights, own, 1, [1], args.eval_success_threshold, "accuracy").items()})
        self.metrics.add_many(record, mode="eval")
        self.callback_handler.call_event("on_prediction_step", self.args, self.state, self.control)
        if self.compute_metrics is None:
            return None
        return {"prompts": rollout.prompts, "completions": rollout.completions,
                "completion_ids": rollout.completion_lists, "rewards": rewards.tolist(), "columns": rollout.columns}

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        raise NotImplementedError("GRPOTrainer has no per-batch prediction step: use trainer.evaluate() for "
                                  "sampled rewards, or treadle.generation.generate_completions to sample")
