"""The one object an on-policy trainer samples through: a :class:`RolloutSampler`, built by
``OnPolicyTrainer.build_rollout_sampler`` around the trainer's rollout engine. The trainer calls it, never asks which
kind it is:

- ``sample(trainer, rows, generator, mode)``: one completion per row (``OnPolicyTrainer.sample_rows``: evaluation,
  dynamic sampling's extra rows, a synchronous training generation);
- ``training_rollout(trainer, rows, generation)``: training generation ``generation``'s rollout of this rank's rows
  (``OnPolicyTrainer.sample_generation``);
- ``windows(windows)``: the training loop's windows, which a sampler may read ahead;
- ``exact_logps``: whether its training rollouts carry the live policy's own log-probs (GRPO's sampler correction);
- ``state_dict`` / ``load_state_dict`` (in every checkpoint), ``end`` (the run ended, however) and ``close``.

Three kinds:

- :class:`SyncSampler`: single-turn, synchronous (the default). A training generation pushes the policy's current
  weights to the engine and samples through the trainer's ``generate`` hook (text and image rows), seeded by
  (seed, generation, rank).
- :class:`MultiTurnSampler`: ``tools=`` or ``env_factory=`` (treadle.rollouts): each row rolls out an environment
  through the engine's ``generate_turns`` (``rollouts.RolloutRunner``, whose threads ``end`` stops). Subclass it, and
  return yours from ``build_rollout_sampler``, for another agent loop.
- :class:`AsyncSampler`: ``max_staleness`` > 0 (docs/async.md): a single-turn sampler whose training generations
  come from a ``RolloutProducer`` (trainers/onpolicy/producer.py), sampled up to N steps ahead by a rollout worker
  with its own copy of the policy; evaluation samples through the engine as the synchronous sampler does.

A sampler holds no trainer: the trainer hands itself to each call, for the hooks that say *what* is sampled
(``encode_prompts``, ``generate``, ``sampling_params``, ``decode_rollout``) and for the weights and step it samples
at.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from treadle.engines.base import RolloutEngine, take_turns
from treadle.rollouts.runner import RolloutRunner
from treadle.trainers.onpolicy.data import Rollout
from treadle.trainers.onpolicy.inputs import seeded_generator
from treadle.trainers.onpolicy.producer import RolloutProducer

__all__ = ["AsyncSampler", "MultiTurnSampler", "RolloutSampler", "SyncSampler"]


class RolloutSampler:
    """The interface (module docstring), with what every kind shares: the engine, a synchronous training generation,
    no state of its own. A subclass implements ``sample``."""

    exact_logps_possible = True  # whether this kind's training rollouts can come from the live policy's weights

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    @property
    def exact_logps(self) -> bool:
        """Whether the training rollouts carry the live policy's own log-probs: the engine's say, where this kind
        samples from the current weights."""
        return self.exact_logps_possible and self.engine.exact_logps

    def windows(self, windows: Iterator[list]) -> Iterator[list]:
        """The training loop's windows, as the trainer made them."""
        return windows

    def sample(self, trainer, rows: list[dict], generator: torch.Generator | None, mode: str = "train") -> Rollout:
        """One completion per row, sampled with the settings of ``mode`` (``trainer.sampling_params``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement sample(trainer, rows, generator, mode)")

    def training_rollout(self, trainer, rows: list[dict], generation: int) -> Rollout:
        """Generation ``generation`` of this rank's ``rows``: the engine gets the policy's current weights (it moved
        since the last generation), then ``trainer.sample_rows`` samples from a generator seeded by (seed,
        generation, rank)."""
        self.engine.load_weights(trainer.model_wrapped, version=trainer.state.global_step)
        generator = seeded_generator(trainer.args.seed, trainer.args.device, "train", generation)
        return trainer.sample_rows(rows, generator)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of this sampler (merged into the trainer's extra state); nothing here."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore from the trainer's extra state (what ``state_dict`` put there)."""

    def end(self) -> None:
        """The run ended, however: stop what the run started (threads, a worker); a later run starts it again."""

    def close(self) -> None:
        """Release everything, the engine included; the sampler is not used again."""
        self.end()
        self.engine.close()


class SyncSampler(RolloutSampler):
    """Single-turn rows through the trainer's ``generate`` hook (the one place a single-turn completion is sampled,
    text and image rows alike): the rows' prompts tokenised once (``encode_prompts``), sampled, decoded."""

    def sample(self, trainer, rows: list[dict], generator: torch.Generator | None, mode: str = "train") -> Rollout:
        prompts = trainer.encode_prompts(rows, mode)
        settings = {"mode": mode} if mode != "train" else {}  # an override written for training only still trains
        if prompts.inputs is not None:
            settings["prompt_inputs"] = prompts.inputs
        out = trainer.generate(prompts.ids, num_generations=prompts.group, generator=generator, **settings)
        return trainer.decode_rollout(rows, out, chat=prompts.inputs is not None)


class MultiTurnSampler(RolloutSampler):
    """Multi-turn rollouts (``tools=`` or ``env_factory=``): one environment per row, stepped by ``runner`` (its
    threads: ``end`` stops them, the next ``sample`` starts them), sampled through the engine's ``generate_turns``.
    The rollout's ``loss_mask`` is 1 on sampled tokens only; it carries ``transcripts`` and ``rollout_metrics``, and
    the reward functions also get the ``transcript`` and ``env_reward`` columns."""

    def __init__(self, engine: RolloutEngine, runner: RolloutRunner):
        super().__init__(engine)
        self.runner = runner

    def sample(self, trainer, rows: list[dict], generator: torch.Generator | None, mode: str = "train") -> Rollout:
        out = self.runner.run(
            self.engine,
            rows,
            trainer.sampling_params(mode),
            max_prompt_length=trainer.args.max_prompt_length,
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

    def end(self) -> None:
        self.runner.close()


class AsyncSampler(SyncSampler):
    """Asynchronous generation (``max_staleness`` > 0): training generations come from ``producer`` (a
    ``RolloutProducer``), sampled ahead from weights up to its ``staleness`` steps old, so their log-probs are never
    the live policy's (``exact_logps`` is False); evaluation samples through the engine. An engine that samples in
    another process (the vLLM server) is shared (``engines.base.take_turns``): the producer's worker thread drives
    one side with the weights pushed to it, this sampler's engine is the trainer's side."""

    exact_logps_possible = False

    def __init__(self, engine: RolloutEngine, model, params, *, staleness: int, **producer_settings):
        worker_engine = None
        if engine.samples_elsewhere:
            engine, worker_engine = take_turns(engine)
        super().__init__(engine)
        self.producer = RolloutProducer(model, params, staleness=staleness, engine=worker_engine, **producer_settings)

    def windows(self, windows: Iterator[list]) -> Iterator[list]:
        return self.producer.read_ahead(windows)  # the rows of the next generations, to request them ahead

    def training_rollout(self, trainer, rows: list[dict], generation: int) -> Rollout:
        """Generation ``generation`` starts (the policy is its weights): the producer gets these weights and the
        prompts, tokenised here, of every generation due now (up to ``staleness`` ahead); then it hands over this
        generation's batch, whose age in optimizer steps ``async/staleness`` logs."""
        producer = self.producer
        producer.start()
        due = producer.due(generation, trainer.state.max_steps)
        if due:
            producer.push_weights(trainer.model, version=generation)
        for ahead, ahead_rows in due:
            producer.request(ahead, trainer.encode_prompts(ahead_rows))
        produced = producer.take(generation)
        trainer.metrics.add_many({"async/staleness": (float(produced.staleness), 1)})
        return trainer.decode_rollout(rows, produced.output)

    def state_dict(self) -> dict:
        return {"async": self.producer.state_dict()}  # the batches requested, waiting for those in flight

    def load_state_dict(self, state: dict) -> None:
        if "async" in state:
            self.producer.load_state_dict(state["async"])

    def end(self) -> None:
        self.producer.end()
