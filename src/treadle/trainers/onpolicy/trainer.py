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
alike; multi-turn through the rollout sampler's environments; each prompt tokenised once, ``encode_prompts``), with
``sampling_params(mode)``; ``compute_rewards`` scores a rollout. ``evaluate`` reports what RL optimises (rewards,
pass@k) of sampled completions.

Every on-policy trainer logs TRL's ``step_time`` (``training_step`` and ``prepare_window`` are timed: the sampling,
scoring and forward-backward work of each optimizer step) and a generation's ``completions/*`` lengths and
``num_tokens`` (``onpolicy.metrics.completion_metrics``, which the subclass records with its own metrics).

The trainer samples through one object, its rollout sampler (``build_rollout_sampler``, trainers/onpolicy/
sampler.py: synchronous single-turn, multi-turn with tools or environments, or asynchronous with ``max_staleness``),
around one rollout engine (``build_engine``: any ``engines.RolloutEngine``, whose reports it reads and whose type it
never asks). ``close()`` closes both; ``train`` ends the sampler's run (a worker, threads) when it ends, however it
ends.
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
from treadle.engines.base import RolloutEngine
from treadle.engines.local import LocalEngine
from treadle.engines.vllm import vllm_engine
from treadle.engines.vllm_client import vllm_server_engine
from treadle.errors import NonFiniteLossError, PreflightError
from treadle.generation.sampling import SamplingParams, sampler_options
from treadle.generation.single import GenerationOutput, distinct_prompts
from treadle.generation.static import DecodeSettings
from treadle.metrics import means_of, nonfinite_fix
from treadle.models import from_name, max_positions
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
from treadle.trainers.onpolicy.inputs import (
    check_dataset,
    check_positions,
    check_prompt_positions,
    check_tokenizer,
    reward_list,
    reward_weights,
    seeded_generator,
    tokenize_prompts,
)
from treadle.trainers.onpolicy.metrics import StepClock, custom_eval_metrics, reward_sums
from treadle.trainers.onpolicy.sampler import AsyncSampler, MultiTurnSampler, RolloutSampler, SyncSampler
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
    Observation tokens are in the context but masked out of the loss; another agent loop is a rollout sampler of
    its own (``build_rollout_sampler``; trainers/onpolicy/sampler.py).
    """

    config_class = OnPolicyConfig
    watched_metrics = ("completions/mean_length", "eval_reward", "eval_pass@1", "eval_greedy/accuracy")
    requires_reward_funcs = False  # GRPO trains on rewards; distillation's are optional (evaluation only)

    def __init__(
        self,
        model=None,
        args: OnPolicyConfig | None = None,
        *,
        reward_funcs: RewardFunction | Sequence[RewardFunction] | None = None,
        tools=None,
        env_factory=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        **trainer_kwargs,  # the Trainer's: callbacks, optimizers, peft_config
    ):
        args = self.check_args(args)  # needed before super().__init__: the dataset check reads it
        model, processing_class = from_name(model, processing_class, args)  # a folder or Hub id (TRL's habit)
        if compute_metrics is not None:
            check_compute_metrics(compute_metrics, column_names(eval_dataset) or ())
        runner = (  # built first: a tool or an environment that cannot run is refused before the model is touched
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
            model, args, _keep_rows, train_dataset, eval_dataset, processing_class, compute_metrics, **trainer_kwargs
        )
        onpolicy_vision.check_dataset(train_dataset, self.model, processing_class)  # rows with images
        check_positions(self.model, processing_class, args, {"train": train_dataset, "eval": eval_dataset})
        self.position_limit = max_positions(self.model)  # encode_prompts checks each generation's prompts too
        self.pad_token_id = pad_token_id(tokenizer_of(processing_class))
        self.prompt_cut_noted = False  # text.cut_prompts' note is shown once a run
        self.buffer = GenerationBuffer(self.micro_batches_per_batch())
        self.step_clock = StepClock()  # step_time (TRL's): the sampling and training steps of each optimizer step
        self.multi_turn = runner is not None  # tools= or env_factory=
        self.rollout_sampler = self.build_rollout_sampler(self.build_engine(), runner)

    def build_engine(self) -> RolloutEngine:
        """The rollout engine that single-turn training and evaluation sample through: the own KV-cached sampler
        (``generation_backend``), or vLLM with ``use_vllm`` (``engines.vllm``). Override to plug in another
        ``engines.RolloutEngine``."""
        if self.args.use_vllm:
            build = vllm_server_engine if self.args.vllm_mode == "server" else vllm_engine  # engines.vllm_client
            return build(self.model, self.args, multi_turn=self.multi_turn)
        decode = DecodeSettings(self.args.cache_implementation)
        return LocalEngine(self.model, backend=self.args.generation_backend, decode=decode)

    def build_rollout_sampler(
        self, engine: RolloutEngine, runner: RolloutRunner | None = None, *, staleness: int | None = None
    ) -> RolloutSampler:
        """The one object training and evaluation sample through (trainers/onpolicy/sampler.py), around ``engine``:
        multi-turn with ``runner`` (``tools=`` / ``env_factory=``), asynchronous when ``staleness`` (default
        ``max_staleness``) is given or above 0 (docs/async.md: a rollout worker with its own copy of the policy samples
        the training generations ahead; ``staleness=0`` builds it on the synchronous schedule), else synchronous
        single-turn. Override to plug in another sampler (another agent loop)."""
        args = self.args
        asynchronous = staleness is not None or args.max_staleness > 0
        staleness = args.max_staleness if staleness is None else staleness
        if runner is not None:
            if asynchronous:
                raise PreflightError(
                    "max_staleness > 0 samples single-turn completions only: leave out tools= and "
                    "env_factory=, or set max_staleness: 0"
                )
            return MultiTurnSampler(engine, runner)
        if not asynchronous:
            return SyncSampler(engine)
        return AsyncSampler(
            engine,
            self.model,
            self.sampling_params("train"),
            staleness=staleness,
            seed=args.seed,
            backend=args.generation_backend,
            worker=args.async_worker,
            threads=args.async_worker_threads,
            timeout=args.async_timeout,
        )

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine this trainer's sampling goes through (the rollout sampler's)."""
        return self.rollout_sampler.engine

    def close(self) -> None:
        """Release the rollout sampler and its engine (a worker, threads, memory); not used again after."""
        self.rollout_sampler.close()

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
        return self.rollout_sampler.windows(windows)  # an asynchronous one reads the next generations' rows ahead

    # ---- the buffer -------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None):
        """``Trainer.train``; the rollout sampler's run (an asynchronous worker, a multi-turn runner's threads) ends
        when it ends, however it ends."""
        self.buffer.clear()  # a resumed run restores its own (load_extra_checkpoint_state)
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint)
        finally:
            self.rollout_sampler.end()

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
                self.buffer.put(ticket.generation, self.generate_and_score(ticket.rows, ticket.generation))
        window = [self.buffer.take(ticket, self.args.steps_per_generation) for ticket in batch_samples]
        self.buffer.release_consumed()
        self.step_clock.start(time.perf_counter() - started, micro_steps=len(window))
        return window

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """``Trainer.training_step``, timed: after the window's last micro-batch, ``step_time`` records the
        seconds of the window's ``prepare_window`` and training steps (``onpolicy.metrics.StepClock``). A NaN or
        infinite loss stops the run on every step (one host sync per micro-batch), not only on logged ones, unless
        ``skip_nonfinite_steps`` lets the loop skip it: the policy samples the next generation."""
        started = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not self.args.skip_nonfinite_steps:  # every step: the weights sample the next generation, and a NaN in
            self._stop_if_nonfinite(loss)  # them kills the sampler at once
        seconds = self.step_clock.add(time.perf_counter() - started)
        if seconds is not None:
            self.metrics.add("step_time", seconds, 1)
        return loss

    def _stop_if_nonfinite(self, loss: torch.Tensor) -> None:
        """NonFiniteLossError when this micro-batch's loss is NaN or infinite. Per rank, with no collective (a
        thread worker may hold the process group): under torchrun the rank's exit ends the others, as any error."""
        if not bool(torch.isfinite(loss)):
            raise NonFiniteLossError(
                f"the training loss became {float(loss)} at step {self.state.global_step + 1}, before its optimizer "
                f"step (the weights are unchanged); {nonfinite_fix()}"
            )

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
        training and evaluation alike (an asynchronous sampler's worker samples ahead through its own engine)."""
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
        """One completion per row (``mode``: see ``sampling_params``), as training and ``evaluate`` sample, through
        the rollout sampler: single-turn rows' prompts tokenised, sampled (``generate``) and decoded; rows that hold
        whole groups (the same prompt G times in a row) are sampled as distinct prompts x G, each prompt prefilled
        once. With tools or an environment, each row's multi-turn rollout instead."""
        return self.rollout_sampler.sample(self, rows, generator, mode)

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
        check_prompt_positions([len(i) for i in ids], self.args, self.position_limit, f"the {mode} prompts")
        return Prompts(*distinct_prompts(ids, group))

    def decode_rollout(self, rows: list[dict], out: GenerationOutput, chat: bool = False) -> Rollout:
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
        here), as the rollout sampler gives it: synchronously, the engine gets the policy's current weights and
        samples one completion per row (``sample_rows``) from a generator seeded by (seed, generation, rank);
        asynchronously, the batch sampled ahead (``async/staleness`` logs its age in optimizer steps)."""
        return self.rollout_sampler.training_rollout(self, rows, generation)

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
        inside a generation cycle is exact (the metrics are in the Trainer's window), and the rollout sampler's state
        (an asynchronous one's batches requested ahead)."""
        return {"buffer": self.buffer.state_dict(), **self.rollout_sampler.state_dict()}

    def load_extra_checkpoint_state(self, state: dict) -> None:
        # earlier releases saved {"buffers": ...} (their cursor in trainer_state.json); the buffer reads both
        self.buffer.load_state_dict(state.get("buffer", state), self.args.device)
        self.rollout_sampler.load_state_dict(state)

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
