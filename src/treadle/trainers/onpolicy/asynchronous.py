"""Asynchronous GRPO (``GRPOConfig(max_staleness=N)``, TRL's AsyncGRPO name; docs/async.md): a rollout worker
(trainers/onpolicy/worker.py: its own process with its own copy of the policy) samples the next generation batches while the
trainer trains on this one.

The schedule is fixed, so timing never changes a result. With one generation per optimizer step (required), the
batch trained at generation (= optimizer step) g is sampled from the weights at the start of generation
``max(g - N, e)``, ``e`` the first generation of the epoch (or of the run): exactly N steps stale once the pipeline
is full, fewer at its start. At the start of generation g (``begin``) the trainer pushes its current weights with
the requests for every generation up to g + N whose prompts it knows (the windows are read N ahead, ``windows``;
never past ``max_steps``), then waits for generation g's batch (``generate``, called where GRPO samples). The worker
seeds each generation's sampler from (seed, g), as the synchronous run does, so two runs with the same seed and N
train the same weights; a checkpoint holds the batches already requested (it waits for them), so a resumed run
continues exactly. N = 0 never builds any of this: the synchronous run, bit for bit.

The loss treats the worker's ``sampling_logps`` as the behaviour policy: the sampler correction of
trainers/grpo/correction.py applies (``vllm_importance_sampling_*``, metrics ``sampling/*``), with the old log-probs computed
from the current weights when the batch is trained. ``async/staleness`` logs each batch's age in optimizer steps.

This object is GRPO's rollout engine (``engines.RolloutEngine``): inside a generation it hands out the worker's
batch; otherwise (evaluation) it samples from the live model with the own sampler.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import torch

from treadle import distributed as dist
from treadle.engines.local import LocalEngine
from treadle.errors import PreflightError
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import GenerationOutput, distinct_prompts
from treadle.models import base_model
from treadle.trainers.onpolicy import vision as onpolicy_vision
from treadle.trainers.onpolicy.records import tokenize_prompts
from treadle.trainers.onpolicy.worker import RolloutWorker

__all__ = ["AsyncRollouts", "begin_generation", "end_run", "load_state", "saved_state",
           "scheduled", "worker_threads"]


def worker_threads(args, available: int | None = None) -> tuple[int, int]:
    """(worker, trainer) torch threads of a process worker: ``async_worker_threads`` (default: half of this
    process's threads, at least 1) for the worker, the rest (at least 1) for the trainer."""
    available = available or torch.get_num_threads()
    worker = args.async_worker_threads or max(1, available // 2)
    return worker, max(1, available - worker)


class AsyncRollouts:
    """The trainer side of the schedule (module docstring) and GRPO's engine while ``max_staleness`` > 0."""

    def __init__(self, trainer, staleness: int | None = None):
        args = trainer.args
        if trainer.rollout_runner is not None:
            raise PreflightError("max_staleness > 0 samples single-turn completions only: leave out tools= and "
                                 "env_factory=, or set max_staleness: 0")
        if dist.get_world_size() > 1:
            raise PreflightError("max_staleness > 0 runs on one process (one rollout worker): launch without "
                                 "torchrun, or set max_staleness: 0")
        self.trainer, self.args = trainer, args
        self.staleness = args.max_staleness if staleness is None else staleness
        self.local = LocalEngine(trainer.model, backend=args.generation_backend)  # evaluation: the live model
        self.worker, self.saved_threads = None, None
        self.timings = {"worker_start": 0.0, "waiting": 0.0}  # seconds the trainer spent on the worker (benchmarks)
        self._reset()

    def _reset(self) -> None:
        self.rows: dict[int, list] = {}  # generation -> its rows (read ahead from the windows)
        self.versions: dict[int, int] = {}  # requested generation -> the weight version (generation) it samples
        self.prompts: dict[int, list] = {}  # requested generation -> its distinct prompt ids (checked on take)
        self.inflight: collections.deque[int] = collections.deque()  # requested, no reply yet, in order
        self.ready: dict[int, GenerationOutput] = {}
        self.sent_version, self.current = None, None
        self.staleness_log: dict[int, int] = {}  # generation -> staleness of its batch (for tests and the docs)

    # ---- the schedule ---------------------------------------------------------------------------------------
    def windows(self, windows):
        """GRPO's windows, read ``staleness`` ahead so the rows of the next generations are known."""
        ahead = collections.deque()
        for window in windows:
            ahead.append(window)
            self.rows[window[0].generation] = window[0].rows
            if len(ahead) > self.staleness:
                yield ahead.popleft()
        yield from ahead

    def begin(self, generation: int) -> None:
        """Generation ``generation`` starts (the policy is its weights): request it and every generation up to
        ``generation + staleness`` not requested yet, from these weights."""
        if self.worker is None:
            self._start_worker()
        limit = self.trainer.state.max_steps or float("inf")
        for h in range(generation, generation + self.staleness + 1):
            if h in self.versions or h not in self.rows or (h >= limit and h != generation):
                continue
            if onpolicy_vision.has_images(self.rows[h]):
                raise PreflightError("max_staleness > 0 samples text prompts only: this dataset's rows hold images; "
                                     "set max_staleness: 0")
            self.prompts[h] = self._prompt_ids(self.rows[h])
            weights = None
            if self.sent_version != generation:
                weights = base_model(self.trainer.model).state_dict()
                self.sent_version = generation
            self.worker.submit(h, generation, weights, self.prompts[h], self._params(), self.args.seed,
                               self.args.generation_backend)
            self.versions[h] = generation
            self.inflight.append(h)
        self.current = generation

    def take(self, generation: int, prompt_ids: list[list[int]]) -> GenerationOutput:
        """Generation ``generation``'s batch (waiting for the worker), its staleness logged."""
        while generation not in self.ready:
            self._receive()
        if prompt_ids != self.prompts.pop(generation):
            raise RuntimeError(f"asynchronous GRPO: generation {generation} was requested with other prompts than "
                               f"it trains on (a bug)")
        staleness = generation - self.versions.pop(generation)
        self.staleness_log[generation] = staleness
        self.trainer.metrics.add_many({"async/staleness": (float(staleness), 1)})
        self.rows.pop(generation, None)
        return self.ready.pop(generation)

    def _receive(self) -> None:
        expected, start = self.inflight[0], time.perf_counter()
        got, version, out = self.worker.wait(f"generation {expected}'s batch")
        self.timings["waiting"] += time.perf_counter() - start
        if (got, version) != (expected, self.versions[expected]):
            raise RuntimeError(f"asynchronous GRPO: the worker answered generation {got} (weights {version}) where "
                               f"{expected} (weights {self.versions[expected]}) was due (a bug)")
        self.inflight.popleft()
        self.ready[got] = out

    def _prompt_ids(self, rows: list[dict]) -> list[list[int]]:
        """The distinct prompt ids GRPO's ``_sample`` will ask for (the same tokenisation)."""
        ids = tokenize_prompts(self.trainer.processing_class, [row["prompt"] for row in rows],
                               self.args.max_prompt_length)
        return distinct_prompts(ids, self.args.num_generations)[0]

    def _params(self) -> SamplingParams:
        return self.trainer.sampling_params("train")

    def _start_worker(self) -> None:
        args = self.args
        worker, trainer, start = *worker_threads(args), time.perf_counter()
        if args.async_worker == "process":  # the thread split (docs/async.md); a thread worker shares the threads
            self.saved_threads = torch.get_num_threads()
            torch.set_num_threads(trainer)
        self.worker = RolloutWorker(self.trainer.model, kind=args.async_worker, threads=worker,
                                    timeout=args.async_timeout)
        self.timings["worker_start"] += time.perf_counter() - start

    # ---- the engine contract --------------------------------------------------------------------------------
    def generate(self, prompt_ids, params: SamplingParams, *, generator=None, prompt_inputs=None) -> GenerationOutput:
        if self.current is None:  # evaluation, or sampling outside a training generation: the live model
            return self.local.generate(prompt_ids, params, generator=generator, prompt_inputs=prompt_inputs)
        generation, self.current = self.current, None
        return self.take(generation, prompt_ids)

    def load_weights(self, model) -> None:
        self.local.load_weights(model)

    def end(self) -> None:
        """The run ended (however): stop the worker, restore the threads, forget the schedule."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self.saved_threads is not None:
            torch.set_num_threads(self.saved_threads)
            self.saved_threads = None
        self._reset()

    def close(self) -> None:
        self.end()
        self.local.close()

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The batches already requested (waiting for those in flight) with their weight versions and prompts."""
        while self.inflight:
            self._receive()
        ready = {str(g): {"version": self.versions[g], "prompts": self.prompts[g],
                          **{f.name: getattr(out, f.name) for f in dataclasses.fields(out)
                             if getattr(out, f.name) is not None}}
                 for g, out in self.ready.items()}
        return {"max_staleness": self.staleness, "ready": ready}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; batches requested under another ``max_staleness`` are dropped (sampled again)."""
        if state.get("max_staleness") != self.staleness:
            return
        names = {f.name for f in dataclasses.fields(GenerationOutput)}
        for key, saved in state["ready"].items():
            g = int(key)
            self.versions[g], self.prompts[g] = saved["version"], saved["prompts"]
            self.ready[g] = GenerationOutput(**{k: v for k, v in saved.items() if k in names})


# ---- the hooks GRPOTrainer calls (no-ops for a synchronous engine) ---------------------------------------------
def scheduled(engine, windows):
    return engine.windows(windows) if isinstance(engine, AsyncRollouts) else windows


def begin_generation(engine, generation: int) -> None:
    if isinstance(engine, AsyncRollouts):
        engine.begin(generation)


def saved_state(engine) -> dict:
    return {"async": engine.state_dict()} if isinstance(engine, AsyncRollouts) else {}


def load_state(engine, state: dict) -> None:
    if isinstance(engine, AsyncRollouts) and "async" in state:
        engine.load_state_dict(state["async"])


def end_run(engine) -> None:
    if isinstance(engine, AsyncRollouts):
        engine.end()
