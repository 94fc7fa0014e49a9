"""Asynchronous generation (``max_staleness=N``, TRL's AsyncGRPO name; docs/async.md): a producer of rollouts. A
rollout worker (trainers/onpolicy/worker.py: its own process with its own copy of the policy and its own engine)
samples the next generation batches while the trainer trains on this one; each batch comes back tagged with the
policy version it was sampled from.

The schedule is fixed, so timing never changes a result. With one generation per optimizer step (required), the
batch trained at generation (= optimizer step) g is sampled from the weights at the start of generation
``max(g - N, e)``, ``e`` the first generation of the epoch (or of the run): exactly N steps stale once the pipeline
is full, fewer at its start. The trainer reads its windows N ahead (``read_ahead``) so that the rows of the next
generations are known; at the start of generation g it asks which generations are ``due`` (every one up to g + N
whose rows are known and that was not requested yet; never past ``max_steps``), pushes its current weights once
(``push_weights``: the weight push is its own message, and its own role) and ``request``s each due generation with
the prompt ids it tokenised (the producer never tokenises; its worker starts at the run's first generation). Then
it ``take``s generation g's batch. Each request carries the ``SamplingParams`` and the generator seed the worker
uses: the seed of (seed, g), as the synchronous run seeds generation g, so two runs with the same seed and N train
the same weights; the worker's reply names the policy version its engine held, checked against the schedule. A
checkpoint holds the batches already requested (it waits for them), so a resumed run continues exactly. N = 0
builds none of this: the synchronous run, bit for bit.

The producer holds no trainer: the model to copy, the training ``SamplingParams`` and explicit settings (the seed,
the sampler backend, the worker's kind, threads and timeout) are all it is given. Given an ``engine`` that samples
in another process (the vLLM server), its worker is a thread that drives that engine (one side of it,
``engines.base.take_turns``: the trainer's evaluation takes turns on it) and the trainer keeps its threads.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import NamedTuple

import torch

from treadle import distributed as dist
from treadle.errors import PreflightError
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import GenerationOutput
from treadle.models import base_model
from treadle.trainers.onpolicy.data import Prompts
from treadle.trainers.onpolicy.inputs import generator_seed
from treadle.trainers.onpolicy.worker import RolloutWorker, SampleRequest

__all__ = ["Produced", "RolloutProducer", "pushed_weights", "worker_threads"]


def worker_threads(requested: int | None, available: int | None = None) -> tuple[int, int]:
    """(worker, trainer) torch threads of a process worker: ``requested`` (``async_worker_threads``; default: half
    of this process's threads, at least 1) for the worker, the rest (at least 1) for the trainer."""
    available = available or torch.get_num_threads()
    worker = requested or max(1, available // 2)
    return worker, max(1, available - worker)


def pushed_weights(model) -> dict:
    """What a weight push sends: the weights training can change (the trainable parameters, and the buffers), named
    as in the worker's copy, ``models.base_model(model)``. A LoRA policy pushes its adapters (and
    ``modules_to_save``) alone: its base weights are frozen, copied once when the worker starts."""
    base = base_model(model)
    names = {n for n, p in base.named_parameters() if p.requires_grad} | {n for n, _ in base.named_buffers()}
    return {name: tensor for name, tensor in base.state_dict().items() if name in names}


class Produced(NamedTuple):
    """One generation's batch as the producer sampled it, tagged with the policy version it was sampled from."""

    generation: int
    version: int  # the generation whose starting weights sampled it
    output: GenerationOutput

    @property
    def staleness(self) -> int:
        """Optimizer steps between the weights that sampled the batch and those that train on it."""
        return self.generation - self.version


class RolloutProducer:
    """The trainer's side of the schedule (module docstring): requests ahead, weight pushes, batches in order."""

    def __init__(
        self,
        model,
        params: SamplingParams,
        *,
        staleness: int,
        seed: int,
        backend: str = "auto",
        worker: str = "process",
        threads: int | None = None,
        timeout: float = 600.0,
        engine=None,
    ):
        if dist.get_world_size() > 1:
            raise PreflightError(
                "max_staleness > 0 runs on one process (one rollout worker): launch without "
                "torchrun, or set max_staleness: 0"
            )
        self.model, self.params, self.staleness, self.seed = model, params, staleness, seed
        self.backend, self.threads, self.timeout, self.engine = backend, threads, timeout, engine
        self.kind = "thread" if engine is not None else worker  # the engine samples elsewhere: a thread waits on it
        self.worker, self.saved_threads = None, None
        self.timings = {"worker_start": 0.0, "waiting": 0.0}  # seconds the trainer spent on the worker (benchmarks)
        self._reset()

    def _reset(self) -> None:
        self.rows: dict[int, list] = {}  # generation -> its rows (read ahead from the windows)
        self.versions: dict[int, int] = {}  # requested generation -> the weight version (generation) it samples
        self.inflight: collections.deque[int] = collections.deque()  # requested, no reply yet, in order
        self.ready: dict[int, GenerationOutput] = {}
        self.pushed_version: int | None = None  # the weights the worker holds (or will, when it reads the push)
        self.staleness_log: dict[int, int] = {}  # generation -> staleness of its batch (for tests and the docs)

    # ---- the schedule ---------------------------------------------------------------------------------------
    def read_ahead(self, windows):
        """The trainer's windows, read ``staleness`` ahead so the rows of the next generations are known."""
        ahead = collections.deque()
        for window in windows:
            ahead.append(window)
            self.rows[window[0].generation] = window[0].rows
            if len(ahead) > self.staleness:
                yield ahead.popleft()
        yield from ahead

    def due(self, generation: int, max_steps: int | None = None) -> list[tuple[int, list]]:
        """``(generation, rows)`` of every generation to request at the start of ``generation``: up to
        ``generation + staleness``, its rows known, not requested yet, and before ``max_steps`` (but ``generation``
        itself always)."""
        limit = max_steps or float("inf")
        known = sorted(h for h in self.rows if generation <= h <= generation + self.staleness)  # rows read ahead
        return [(h, self.rows[h]) for h in known if h not in self.versions and (h < limit or h == generation)]

    def start(self) -> None:
        """Start the rollout worker, once (from the run's first generation on, the threads are split)."""
        if self.worker is None:
            self._start_worker()

    def push_weights(self, model, version: int) -> None:
        """The weight push: the worker samples every later request from ``model``'s weights, named ``version``
        (sent once per version; ``pushed_weights``: what training can change, a LoRA policy's adapters)."""
        if self.pushed_version != version:
            self.worker.load_weights(version, pushed_weights(model))
            self.pushed_version = version

    def request(self, generation: int, prompts: Prompts) -> None:
        """Sample ``generation`` (``prompts``: its distinct prompt ids, as the trainer tokenised them) from the
        weights pushed last, seeded as the synchronous run seeds that generation."""
        if prompts.inputs is not None:
            raise PreflightError(
                "max_staleness > 0 samples text prompts only: this dataset's rows hold images; set max_staleness: 0"
            )
        params = dataclasses.replace(self.params, num_generations=prompts.group)
        seed = generator_seed(self.seed, "train", generation)  # the synchronous run's seed of this generation
        self.worker.sample(SampleRequest(generation, prompts.ids, params, seed))
        self.versions[generation] = self.pushed_version
        self.inflight.append(generation)

    def take(self, generation: int) -> Produced:
        """Generation ``generation``'s batch (waiting for the worker), tagged with its policy version."""
        while generation not in self.ready:
            self._receive()
        produced = Produced(generation, self.versions.pop(generation), self.ready.pop(generation))
        self.staleness_log[generation] = produced.staleness
        self.rows.pop(generation, None)
        return produced

    def _receive(self) -> None:
        expected, start = self.inflight[0], time.perf_counter()
        got, version, out = self.worker.wait(f"generation {expected}'s batch")
        self.timings["waiting"] += time.perf_counter() - start
        if (got, version) != (expected, self.versions[expected]):
            raise RuntimeError(
                f"asynchronous generation: the worker answered generation {got} (weights {version}) "
                f"where {expected} (weights {self.versions[expected]}) was due (a bug)"
            )
        self.inflight.popleft()
        self.ready[got] = out

    def _start_worker(self) -> None:
        worker, trainer, start = *worker_threads(self.threads), time.perf_counter()
        if self.kind == "process":  # the thread split (docs/async.md); a thread worker shares the threads
            self.saved_threads = torch.get_num_threads()
            torch.set_num_threads(trainer)
        self.worker = RolloutWorker(
            base_model(self.model),
            kind=self.kind,
            threads=worker,
            timeout=self.timeout,
            backend=self.backend,
            engine=self.engine,
        )  # the model the pushes name: PEFT's base model with its adapters injected (models.base_model)
        self.timings["worker_start"] += time.perf_counter() - start

    # ---- the lifecycle --------------------------------------------------------------------------------------
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

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The batches already requested (waiting for those in flight) with their weight versions."""
        while self.inflight:
            self._receive()
        ready = {
            str(g): {
                "version": self.versions[g],
                **{f.name: getattr(out, f.name) for f in dataclasses.fields(out) if getattr(out, f.name) is not None},
            }
            for g, out in self.ready.items()
        }
        return {"max_staleness": self.staleness, "ready": ready}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; batches requested under another ``max_staleness`` are dropped (sampled again).
        (Earlier releases also saved each batch's prompts, to compare; they are not read.)"""
        if state.get("max_staleness") != self.staleness:
            return
        names = {f.name for f in dataclasses.fields(GenerationOutput)}
        for key, saved in state["ready"].items():
            self.versions[int(key)] = saved["version"]
            self.ready[int(key)] = GenerationOutput(**{k: v for k, v in saved.items() if k in names})
