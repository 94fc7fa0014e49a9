"""On-policy training: ``OnPolicyTrainer``, what GRPO and on-policy distillation share (its arguments:
``OnPolicyConfig``, trainers/onpolicy/config.py).

An on-policy trainer samples its own training data from the policy it trains. Sampling is sequential (one forward
per token), so one generation feeds several micro-steps: the dataloader yields ``per_device_train_batch_size *
steps_per_generation`` rows at once (each prompt G times in a row), once per generation; ``training_windows``
hands each optimizer step a window of tickets (generation, its rows, micro-step in its cycle), and
``prepare_window`` asks the subclass for a generation's slices when they are not in the buffer yet and hands out
one typed ``Sample`` per micro-step (trainers/onpolicy/data.py)::

    dataloader batch (one generation: RepeatSampler, each prompt G times, the same prompts on every rank)
      -> training_windows: spg * μ tickets per generation (the loop counts micro_batches_per_batch() = spg * μ
         micro-steps per batch), grouped into windows of gradient_accumulation_steps
      -> prepare_window: for each ticket, its generation's slices from the buffer, or if there are none yet
         generate_and_score(rows, generation) (the subclass: sample, then its signal) -> spg slices (Samples);
         the micro-step trains on slice (micro-step mod spg)
      -> compute_loss (the subclass) on the slice

The hooks a subclass implements: ``generate_and_score(rows, generation)`` (a generation's ``steps_per_generation``
slices), ``count_items(sample)`` and ``compute_loss``; it sets ``requires_reward_funcs`` when it trains on rewards.
What it calls to sample: ``sample_generation`` (a training generation's rollout), ``sample_rows`` (one completion
per row: single-turn through ``generate``, the one place a single-turn completion is sampled, text and image rows
alike; multi-turn through ``rollout``; each prompt tokenised once, ``encode_prompts``), with
``sampling_params(mode)``; ``compute_rewards`` scores a rollout. ``evaluate`` reports what RL optimises (rewards,
pass@k) of sampled completions.

Every on-policy trainer logs TRL's ``step_time`` (``training_step`` and ``prepare_window`` are timed: the sampling,
scoring and forward-backward work of each optimizer step) and a generation's ``completions/*`` lengths and
``num_tokens`` (``onpolicy.records.completion_metrics``, which the subclass records with its own metrics).

The trainer owns what samples: the rollout engine (``build_engine``: any ``engines.RolloutEngine``, whose reports
it reads and whose type it never asks), the producer of asynchronous generation (``build_producer``, only with
``max_staleness`` > 0: a rollout worker samples the generations ahead, each batch tagged with its policy version)
and the rollout runner of multi-turn rollouts. ``close()`` closes all three; ``train`` stops the producer's worker
and the runner's threads when it ends, however it ends.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Sequence

import torch

import treadle.trainers.onpolicy.vision as onpolicy_vision
from treadle import checkpoint as ckpt, distributed as dist
from treadle.data import RepeatSampler, column_names, require_columns
from treadle.engines.base import RolloutEngine, take_turns
from treadle.engines.local import LocalEngine
from treadle.engines.vllm import vllm_engine
from treadle.engines.vllm_server import vllm_server_engine
from treadle.generation.sampling import SamplingParams, sampler_options
from treadle.generation.single import GenerationOutput, distinct_prompts
from treadle.metrics import means_of
from treadle.models import from_name
from treadle.rewards import RewardFunction, check_compute_metrics, reward_name, score_completions
from treadle.rollouts.runner import RolloutRunner
from treadle.streaming import is_stream
from treadle.text import cut_prompts, eos_ids, is_conversation, pad_token_id
from treadle.trainer import Trainer
from treadle.trainers.onpolicy.config import OnPolicyConfig
from treadle.trainers.onpolicy.data import (
    GenerationBuffer,
    Prompts,
    Rollout,
    Sample,
    Ticket,
    generation_windows,
    prompt_stream,
)
from treadle.trainers.onpolicy.producer import RolloutProducer
from treadle.trainers.onpolicy.records import (
    StepClock,
    check_dataset,
    check_tokenizer,
    custom_eval_metrics,
    reward_list,
    reward_sums,
    reward_weights,
    seeded_generator,
    tokenize_prompts,
)
from treadle.vision import tokenizer_of

__all__ = ["OnPolicyTrainer"]


def _keep_rows(rows: list[dict]) -> list[dict]:
    """The collator: batches stay lists of dataset rows (prompts are tokenised when sampled)."""
    return rows


class OnPolicyTrainer(Trainer):
    """What every on-policy trainer shares; see the module docstring for the data flow and the hooks.

    ``train_dataset`` needs a ``prompt`` column (text, or chat messages rendered with the tokenizer's chat template);
    every other column reaches the reward functions. ``processing_class`` is the tokenizer (required).
    ``reward_funcs``: one function or a list, each ``fn(prompts, completions, completion_ids, **columns) ->
    list[float | None]`` (see treadle.rewards; required when ``requires_reward_funcs``). ``compute_metrics(prompts,
    completions, completion_ids, rewards, reward, **columns) -> dict`` adds custom evaluation metrics.

    Multi-turn rollouts (treadle.rollouts, docs/agents.md): ``tools`` (annotated, docstring'd functions the model
    calls, TRL's argument) or ``env_factory`` (a callable returning a fresh ``rollouts.Environment`` per rollout).
    Observation tokens are in the context but masked out of the loss; ``rollout`` is the hook to override.
    """

    config_class = OnPolicyConfig
    requires_reward_funcs = False  # GRPO trains on rewards; distillation's are optional (evaluation only)

    def __init__(
        self,
        model=None,
        args: OnPolicyConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        compute_metrics=None,
        reward_funcs: RewardFunction | Sequence[RewardFunction] | None = None,
        tools=None,
        env_factory=None,
    ):
        args = self.check_args(args)  # needed before super().__init__: the dataset check reads it
        model, processing_class = from_name(model, processing_class, args)  # a folder or Hub id (TRL's habit)
        if compute_metrics is not None:
            check_compute_metrics(compute_metrics, column_names(eval_dataset) or ())
        self.rollout_runner = (
            None
            if tools is None and env_factory is None
            else RolloutRunner(
                processing_class,
                tools=tools,
                env_factory=env_factory,
                call_format=args.tool_call_format,
                max_tool_calling_iterations=args.max_tool_calling_iterations,
                tool_timeout=args.tool_timeout,
                workers=args.rollout_workers,
                env_timeout=args.env_timeout,
            )
        )
        self.reward_funcs = reward_list(reward_funcs, required=self.requires_reward_funcs)
        self.reward_weights = reward_weights(args.reward_weights, self.reward_funcs)
        check_tokenizer(processing_class)
        check_dataset(train_dataset, args, processing_class)
        super().__init__(
            model=model,
            args=args,
            data_collator=_keep_rows,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            compute_metrics=compute_metrics,
        )
        onpolicy_vision.check_dataset(train_dataset, self.model, processing_class)  # rows with images
        self.pad_token_id = pad_token_id(tokenizer_of(processing_class))
        self.prompt_cut_noted = False  # text.cut_prompts' note is shown once a run
        self.buffer = GenerationBuffer(self.micro_batches_per_batch())
        self.step_clock = StepClock()  # step_time (TRL's): the sampling and training steps of each optimizer step
        self.engine = self.build_engine()
        self.producer = self.build_producer() if args.max_staleness else None  # N = 0: nothing of it is built

    def build_engine(self) -> RolloutEngine:
        """The rollout engine that single-turn training and evaluation sample through: the own KV-cached sampler
        (``generation_backend``), or vLLM with ``use_vllm`` (``engines.vllm``). Override to plug in another
        ``engines.RolloutEngine``."""
        if self.args.use_vllm:
            build = vllm_server_engine if self.args.vllm_mode == "server" else vllm_engine  # engines.vllm_server
            return build(self.model, self.args, multi_turn=self.rollout_runner is not None)
        return LocalEngine(self.model, backend=self.args.generation_backend)

    def build_producer(self, staleness: int | None = None) -> RolloutProducer:
        """Asynchronous generation (``max_staleness`` > 0; trainers/onpolicy/producer.py, docs/async.md): a
        producer that samples the training generations up to ``staleness`` (default ``max_staleness``) steps ahead
        on a rollout worker with its own copy of the policy. Built only when ``max_staleness`` > 0; evaluation
        samples through the engine all the same. An engine that samples in another process (the vLLM server) is
        shared: the worker's thread drives it with the weights pushed to it, and the trainer's evaluation takes
        turns on it with the current weights (``engines.base.take_turns``; ``self.engine`` becomes the trainer's
        side)."""
        args = self.args
        engine = None
        if self.engine.samples_elsewhere:
            self.engine, engine = take_turns(self.engine)
        return RolloutProducer(
            self.model,
            self.sampling_params("train"),
            seed=args.seed,
            staleness=args.max_staleness if staleness is None else staleness,
            backend=args.generation_backend,
            worker=args.async_worker,
            threads=args.async_worker_threads,
            timeout=args.async_timeout,
            multi_turn=self.rollout_runner is not None,
            engine=engine,
        )

    def close(self) -> None:
        """Release the engine, the producer and the rollout runner's threads (a later ``train`` or ``evaluate``
        restarts the runner's threads; a closed engine is not used again)."""
        if self.rollout_runner is not None:
            self.rollout_runner.close()
        if self.producer is not None:
            self.producer.close()
        self.engine.close()

    # ---- data -------------------------------------------------------------------------------------------
    def get_train_dataloader(self):
        """Batches of ``generation_batch_size`` rows on this rank, one per generation, each prompt
        ``num_generations`` times in a row, the same prompts on every rank. Every column is kept."""
        args = self.args
        if self.train_dataset is None:
            raise ValueError(f"{type(self).__name__}.train() needs a train_dataset with a 'prompt' column")
        if is_stream(self.train_dataset):  # each rank reads its own prompts; groups whole on the rank
            return self.build_dataloader(
                prompt_stream(self.train_dataset, args), batch_size=args.generation_batch_size, collate_fn=_keep_rows
            )
        world = dist.get_world_size()
        sampler = RepeatSampler(
            len(self.train_dataset),
            mini_repeat_count=args.num_generations,
            batch_size=args.generation_batch_size * world // args.num_generations,
            shuffle=True,
            seed=args.data_seed,
            rank=dist.get_rank(),
            world_size=world,
        )
        return self.build_dataloader(
            self.train_dataset, batch_size=args.generation_batch_size, sampler=sampler, collate_fn=_keep_rows
        )

    def micro_batches_per_batch(self) -> int:
        """Micro-steps one generation batch feeds: ``steps_per_generation * num_iterations``."""
        return self.args.steps_per_generation * self.args.num_iterations

    def training_windows(self, dataloader, epoch: int, skip_steps: int):
        """Windows of ``gradient_accumulation_steps`` tickets (``onpolicy.data.generation_windows``): each generation
        batch is drawn once and feeds a whole cycle of micro-steps; a resumed run skips whole generations
        without loading them."""
        sampler = dataloader.sampler
        per_epoch = (
            sampler.batches_per_epoch
            if isinstance(sampler, RepeatSampler)  # len() shrinks on resume
            else len(dataloader)
            if hasattr(dataloader, "__len__")
            else 0
        )  # 0: a stream, one endless epoch
        windows = generation_windows(
            dataloader,
            epoch,
            skip_steps,
            cycle=self.micro_batches_per_batch(),
            accum=self.args.gradient_accumulation_steps,
            generations_per_epoch=per_epoch,
        )
        return windows if self.producer is None else self.producer.read_ahead(windows)  # async: rows ahead

    # ---- the buffer -------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None):
        """``Trainer.train``; the producer's worker and the rollout runner's threads are stopped when it ends,
        however it ends."""
        self.buffer.clear()  # a resumed run restores its own (load_extra_checkpoint_state)
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint)
        finally:
            if self.producer is not None:
                self.producer.end()
            if self.rollout_runner is not None:
                self.rollout_runner.close()

    def prepare_window(self, batch_samples: list[Ticket]) -> list[Sample]:
        """The slices this window's micro-steps train on, one per ticket. A generation not in the buffer yet is
        generated, scored and split here (``generate_and_score``), from its ticket's rows: the policy does not
        change inside a window, so sampling every generation the window needs at its start gives the same samples
        as sampling at each micro-step (each generation has its own seeded RNG). Its time counts in ``step_time``."""
        started = time.perf_counter()
        for ticket in batch_samples:
            if ticket.generation not in self.buffer:
                if ticket.micro_step:
                    warnings.warn(
                        f"{type(self).__name__}: resuming at micro-step {ticket.micro_step} of generation "
                        f"{ticket.generation}, without its saved buffer (no extra_state file in the "
                        f"checkpoint): sampling it again from the current policy, so this run is not an "
                        f"exact continuation",
                        stacklevel=3,
                    )
                if self.producer is not None:
                    self._request_ahead(ticket.generation)
                self.buffer.put(ticket.generation, self.generate_and_score(ticket.rows, ticket.generation))
        window = [self.buffer.take(ticket, self.args.steps_per_generation) for ticket in batch_samples]
        self.buffer.release_consumed()
        self.step_clock.start(time.perf_counter() - started, micro_steps=len(window))
        return window

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """``Trainer.training_step``, timed: after the window's last micro-batch, ``step_time`` records the
        seconds of the window's ``prepare_window`` and training steps (``onpolicy.records.StepClock``)."""
        started = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        seconds = self.step_clock.add(time.perf_counter() - started)
        if seconds is not None:
            self.metrics.add("step_time", seconds, 1)
        return loss

    def _request_ahead(self, generation: int) -> None:
        """Generation ``generation`` starts (the policy is its weights): the producer gets these weights and the
        prompts, tokenised here, of every generation due now (up to ``max_staleness`` ahead)."""
        self.producer.start()
        due = self.producer.due(generation, self.state.max_steps)
        if due:
            self.producer.push_weights(self.model, version=generation)
        for ahead, rows in due:
            self.producer.request(ahead, self.encode_prompts(rows))

    def generate_and_score(self, rows: list[dict], generation: int) -> list[Sample]:
        """Generation ``generation`` of this rank's ``rows``: its ``steps_per_generation`` slices (``Sample``s on
        the device), sampled (``sample_rows``) and given the subclass's training signal."""
        raise NotImplementedError(f"{type(self).__name__} must implement generate_and_score(rows, generation)")

    # ---- sampling ---------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        num_generations: int,
        generator: torch.Generator | None = None,
        mode: str = "train",
        prompt_inputs: dict | None = None,
    ) -> GenerationOutput:
        """Sample ``num_generations`` completions for each distinct prompt (token ids) with the sampling settings
        of ``mode`` (``sampling_params``) through ``self.engine``; rows come back grouped (prompt b's completions
        are rows b*G .. b*G+G-1). ``prompt_inputs``: the prompts' vision inputs (image rows; their completions never
        sample an image token). The one place where a single-turn completion is sampled, text and image rows,
        training and evaluation alike (the asynchronous producer's worker samples ahead through its own engine)."""
        params = self.sampling_params(mode, num_generations)
        if prompt_inputs is None:
            return self.engine.generate(prompt_ids, params, generator=generator)
        params = onpolicy_vision.without_image_tokens(params, self.processing_class)
        return self.engine.generate(prompt_ids, params, generator=generator, prompt_inputs=prompt_inputs)

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
        return SamplingParams(
            num_generations=num_generations or group,
            max_new_tokens=args.max_completion_length,
            eos_token_ids=eos_ids(tokenizer_of(self.processing_class).eos_token_id),
            pad_token_id=self.pad_token_id,
            do_sample=do_sample,
            **settings,
        )

    def sample_rows(self, rows: list[dict], generator: torch.Generator | None, mode: str = "train") -> Rollout:
        """One completion per row (``mode``: see ``sampling_params``), as training and ``evaluate`` sample: the
        rows' prompts tokenised, sampled, decoded. Rows that hold whole groups (the same prompt G times in a row)
        are sampled as distinct prompts x G: each prompt is prefilled once. With tools or an environment,
        ``rollout`` samples instead."""
        if self.rollout_runner is not None:
            return self.rollout(rows, generator, mode=mode)
        prompts = self.encode_prompts(rows, mode)
        settings = {"mode": mode} if mode != "train" else {}  # an override written for training only still trains
        if prompts.inputs is not None:
            settings["prompt_inputs"] = prompts.inputs
        out = self.generate(prompts.ids, num_generations=prompts.group, generator=generator, **settings)
        return self._decoded(rows, out, chat=prompts.inputs is not None)

    def encode_prompts(self, rows: list[dict], mode: str = "train") -> Prompts:
        """The rows' prompts tokenised, once per generation: text (``text.encode_prompt``: chat messages rendered
        with a generation prompt, cut to the last ``max_prompt_length`` tokens, ``text.cut_prompts``'s note on
        stderr the first time one is) or, for rows with images, one
        processor call (trainers/onpolicy/vision.py). Rows that hold whole groups of ``mode``'s size give each
        prompt once."""
        group = self.sampling_params(mode).num_generations
        if onpolicy_vision.has_images(rows):
            distinct, group = onpolicy_vision.distinct_rows(rows, group)
            ids, inputs = onpolicy_vision.encode(
                self.processing_class, distinct, max_prompt_length=self.args.max_prompt_length
            )
            return Prompts(ids, group, inputs)
        ids, note = cut_prompts(
            tokenizer_of(self.processing_class),
            tokenize_prompts(self.processing_class, [row["prompt"] for row in rows]),
            self.args.max_prompt_length,
        )
        if note and not self.prompt_cut_noted and dist.is_main_process():
            print(f"{note}; shown once", file=sys.stderr)
        self.prompt_cut_noted |= note is not None
        return Prompts(*distinct_prompts(ids, group))

    def _decoded(self, rows: list[dict], out: GenerationOutput, chat: bool = False) -> Rollout:
        """The ``Rollout`` of one completion per row: ``out``'s completions cut at their length and decoded, as
        assistant messages for chat prompts (``chat``: every row's)."""
        lengths = out.completion_mask.sum(dim=1).tolist()
        completion_lists = [ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)]
        texts = tokenizer_of(self.processing_class).batch_decode(completion_lists, skip_special_tokens=True)
        completions = [
            [{"role": "assistant", "content": t}] if chat or is_conversation(row["prompt"]) else t
            for row, t in zip(rows, texts)
        ]
        return Rollout.of(rows, out, completions, completion_lists)

    def sample_generation(self, rows: list[dict], generation: int) -> Rollout:
        """Training generation ``generation``'s rollout of this rank's ``rows`` (``generate_and_score`` starts
        here): the producer's batch, sampled ahead (``async/staleness`` logs its age in optimizer steps); else the
        engine gets the policy's current weights and samples one completion per row (``sample_rows``) from a
        generator seeded by (seed, generation, rank)."""
        if self.producer is not None:
            produced = self.producer.take(generation)
            self.metrics.add_many({"async/staleness": (float(produced.staleness), 1)})
            return self._decoded(rows, produced.output)
        self.engine.load_weights(self.model_wrapped, version=self.state.global_step)  # the policy moved since
        return self.sample_rows(rows, seeded_generator(self.args.seed, self.args.device, "train", generation))

    def rollout(self, rows: list[dict], generator: torch.Generator | None, mode: str = "train") -> Rollout:
        """Multi-turn rollouts (``tools=`` or ``env_factory=``; treadle.rollouts), one per row, sampled as ``mode``
        says (``sampling_params``): the hook to override for another agent loop. Returns a ``Rollout`` whose
        ``loss_mask`` is 1 on sampled tokens only, with ``transcripts`` and ``rollout_metrics``; the reward
        functions also get the ``transcript`` and ``env_reward`` columns."""
        args = self.args
        out = self.rollout_runner.run(
            self.engine,
            rows,
            self.sampling_params(mode),
            max_prompt_length=args.max_prompt_length,
            generator=generator,
        )
        rollout = Rollout.of(
            rows,
            out.generation,
            out.completions,
            out.completion_lists,
            loss_mask=out.generation.sampled_mask,
            transcripts=out.transcripts,
            rollout_metrics=out.metrics,
        )
        rollout.columns.update(transcript=out.transcripts, env_reward=out.env_rewards)
        return rollout

    def compute_rewards(self, rollout: Rollout) -> torch.Tensor:
        """Every reward function's float rewards of ``rollout`` ``(N, F)`` (NaN: no opinion)."""
        return score_completions(
            self.reward_funcs,
            self.reward_weights,
            prompts=rollout.prompts,
            completions=rollout.completions,
            completion_ids=rollout.completion_lists,
            columns=rollout.columns,
            step=self.state.global_step,
        )

    # ---- checkpoints ------------------------------------------------------------------------------------
    def extra_checkpoint_state(self) -> dict:
        """This rank's generation buffer (unconsumed slices and cursor), saved in every checkpoint so that resuming
        inside a generation cycle is exact (the metrics are in the Trainer's window)."""
        extra = {} if self.producer is None else {"async": self.producer.state_dict()}  # the batches requested
        return {"buffer": self.buffer.state_dict(), **extra}

    def load_extra_checkpoint_state(self, state: dict) -> None:
        # earlier releases saved {"buffers": ...} (their cursor in trainer_state.json); the buffer reads both
        self.buffer.load_state_dict(state.get("buffer", state), self.args.device)
        if self.producer is not None and "async" in state:
            self.producer.load_state_dict(state["async"])

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
        require_columns(dataset, ["prompt"], what=f"{type(self).__name__}.evaluate")
        loader = self.build_dataloader(
            dataset,
            batch_size=self.args.per_device_eval_batch_size,
            sampler=self.build_sampler(dataset, shuffle=False),
            collate_fn=_keep_rows,
        )
        self.callback_handler.eval_dataloader = loader
        self.metrics.clear("eval")
        self.engine.load_weights(self.model_wrapped, version=self.state.global_step)
        rng = ckpt.rng_state()  # reward functions and compute_metrics may draw from the global RNGs
        try:
            samples = [self._score_eval_batch(rows, index) for index, rows in enumerate(loader)]
            custom = (
                {}
                if self.compute_metrics is None
                else custom_eval_metrics(
                    self.compute_metrics, samples, [reward_name(fn) for fn in self.reward_funcs], self.reward_weights
                )
            )
        finally:
            ckpt.set_rng_state(rng)
        recorded = {**means_of(self.metrics.reduce("eval")), **custom}  # one all-reduce for every metric
        return self.log_evaluation({f"{metric_key_prefix}_{name}": value for name, value in recorded.items()})

    def _score_eval_batch(self, rows: list[dict], index: int) -> dict | None:
        """Sample n completions per prompt of ``rows`` (and a greedy one with ``eval_greedy``), and record their
        rewards, pass@k and lengths in the "eval" window; returns the samples when ``compute_metrics`` needs them."""
        args, n, names = self.args, self.args.num_generations_eval, [reward_name(fn) for fn in self.reward_funcs]
        repeated = [row for row in rows for _ in range(n)]
        generator = seeded_generator(args.seed, args.device, "eval", index)
        rollout = self.sample_rows(repeated, generator, mode="eval")
        rewards = self.compute_rewards(rollout).double()  # (N, F)
        record = {
            "completions/mean_length": (rollout.generation.completion_mask.sum(), len(repeated)),
            **reward_sums(rewards, self.reward_weights, names, n, args.eval_pass_at_k, args.eval_success_threshold),
        }
        if args.eval_greedy:  # one function of weight 1: its own greedy keys would repeat the total's, so none
            greedy = self.compute_rewards(self.sample_rows(rows, None, mode="greedy")).double()
            own = names if self.reward_weights != [1.0] else []
            record.update(
                {
                    f"greedy/{key}": pair
                    for key, pair in reward_sums(
                        greedy, self.reward_weights, own, 1, [1], args.eval_success_threshold, "accuracy"
                    ).items()
                }
            )
        self.metrics.add_many(record, mode="eval")
        self.callback_handler.call_event("on_prediction_step", self.args, self.state, self.control)
        if self.compute_metrics is None:
            return None
        return {
            "prompts": rollout.prompts,
            "completions": rollout.completions,
            "completion_ids": rollout.completion_lists,
            "rewards": rewards.tolist(),
            "columns": rollout.columns,
        }

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        raise NotImplementedError(
            f"{type(self).__name__} has no per-batch prediction step: use trainer.evaluate() "
            f"for sampled rewards, or treadle.generation.generate_completions to sample"
        )
