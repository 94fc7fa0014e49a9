"""The rollout worker of asynchronous generation (trainers/onpolicy/producer.py, docs/async.md): a process (or a
thread) that holds its own copy of the policy behind its own engine (``engines.LocalEngine``, the own KV-cached
sampler) and samples generation batches while the trainer trains.

The protocol is one request queue and one reply queue, two kinds of request: a weight push (a version and its state
dict: the worker loads it into its copy and tells its engine the version) and a :class:`SampleRequest` (a
generation, the distinct prompt ids, the ``SamplingParams`` and the generator seed to sample with). The worker
replies to each sample request ``(generation, the version its engine held, GenerationOutput)``, or ``(generation,
version, traceback text)`` when the push or the sampling raised. Requests are served in order, so the weights a
generation is sampled from depend only on the schedule, never on timing.

Nothing waits without a limit (``RolloutWorker.wait``): a reply that does not come within ``timeout`` seconds, or a
worker that dies, raises ``RolloutWorkerError`` (a ``UserError``: one line) naming what was waited for, the exit
status and the last lines the worker wrote (its stdout and stderr go to a log file). The worker process ignores
SIGINT and SIGTERM (the trainer catches them, checkpoints, which needs the worker's pending batches, then stops
it) and exits by itself when the trainer's process is gone.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import NamedTuple

import torch

from treadle.engines.local import LocalEngine
from treadle.errors import UserError
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import GenerationOutput
from treadle.trainers.onpolicy.config import WORKER_KINDS

__all__ = ["RolloutWorker", "RolloutWorkerError", "SampleRequest", "WeightPush"]

_POLL = 0.2  # seconds between liveness checks while waiting for a reply
START_TIMEOUT = 300.0  # the least a worker's start may take (a new interpreter imports torch and transformers)


def pack(tensors: dict) -> bytes:
    """A dict of tensors as bytes. Messages hold no tensors: torch would share them through file descriptors
    that the receiver must fetch from the sender, and a receiver whose sender is stopped or dead would wait for
    them without a limit (a silent hang). Bytes arrive whole or not at all."""
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


class RolloutWorkerError(UserError, RuntimeError):
    """The rollout worker died, raised, or did not answer in time: the run stops here, its checkpoints intact."""


class WeightPush(NamedTuple):
    """Weight ``version`` of the policy (a state dict as bytes): the sample requests after it are sampled from it."""

    version: int
    weights: bytes


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """Sample ``generation`` from the weights pushed last: ``params.num_generations`` completions of each distinct
    prompt, drawn from a generator seeded with ``seed`` (what the worker samples with, nothing else)."""

    generation: int
    prompt_ids: list[list[int]]
    params: SamplingParams
    seed: int


def serve(
    model, backend: str, requests, replies, threads: int | None, log_path: str | None, parent_pid: int | None
) -> None:
    """The worker's loop (the target of the process or the thread): answer requests until a ``None`` request."""
    if log_path is not None:  # a process: its output to the log file, the trainer's signals are the trainer's
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(log, 1)
        os.dup2(log, 2)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    model.eval()
    engine = LocalEngine(model, backend=backend)
    print(f"treadle rollout worker: pid {os.getpid()}, {torch.get_num_threads()} torch threads, ready", flush=True)
    replies.put(("ready", None, None))
    while True:
        try:
            request = requests.get(timeout=1.0)
        except queue.Empty:
            if parent_pid is not None and os.getppid() != parent_pid:
                return  # the trainer is gone (kill -9): nothing will read what this samples
            continue
        if request is None:
            return
        generation = request.generation if isinstance(request, SampleRequest) else None  # None: a weight push
        try:
            if isinstance(request, WeightPush):
                model.load_state_dict(unpack(request.weights))
                engine.load_weights(model, version=request.version)
                continue
            generator = torch.Generator(device=next(model.parameters()).device).manual_seed(request.seed)
            with torch.no_grad():
                out = engine.generate(request.prompt_ids, request.params, generator=generator)
            replies.put((generation, engine.policy_version, pack(dataclasses.asdict(out))))
        except Exception:  # noqa: BLE001 -- reported to the trainer (at its next wait), which stops the run with it
            text = traceback.format_exc()
            print(text, flush=True)
            replies.put((generation, engine.policy_version, text))


@contextlib.contextmanager
def _main_not_rerun():
    """A spawned child runs the parent's ``__main__`` script again before its target (``multiprocessing``'s spawn),
    which a training script without an ``if __name__ == "__main__"`` guard cannot survive (it would train again):
    the worker needs nothing from it (its target and the model's classes come from installed modules), so the
    script's path is hidden while the child starts."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class RolloutWorker:
    """The trainer's handle on one worker: ``load_weights`` and ``sample`` requests, ``wait`` for replies (in order),
    ``close``.

    ``kind``: "process" (spawned, its own interpreter and ``threads`` torch threads) or "thread" (the same loop on a
    thread of this process, sharing its torch threads). ``model``: the policy, copied once at start; ``backend``:
    its engine's sampler backend ("fast", "hf" or "auto")."""

    def __init__(
        self,
        model,
        *,
        kind: str = "process",
        threads: int | None = None,
        timeout: float = 600.0,
        backend: str = "auto",
    ):
        if kind not in WORKER_KINDS:
            raise ValueError(f"async_worker must be one of {WORKER_KINDS}, got {kind!r}")
        self.kind, self.timeout = kind, timeout
        copied = copy.deepcopy(model)
        if kind == "process":
            context = mp.get_context("spawn")
            self.requests, self.replies = context.Queue(), context.Queue()
            handle, self.log_path = tempfile.mkstemp(prefix="treadle-rollout-worker-", suffix=".log")
            os.close(handle)
            self.handle = context.Process(
                target=serve,
                daemon=True,
                name="treadle-rollout-worker",
                args=(copied, backend, self.requests, self.replies, threads, self.log_path, os.getpid()),
            )
        else:
            self.requests, self.replies, self.log_path = queue.Queue(), queue.Queue(), None
            self.handle = threading.Thread(
                target=serve,
                daemon=True,
                name="treadle-rollout-worker",
                args=(copied, backend, self.requests, self.replies, None, None, None),
            )
        if kind == "process":
            with _main_not_rerun():
                self.handle.start()
        else:
            self.handle.start()
        self.wait("its start (importing torch, loading the model copy)", max(timeout, START_TIMEOUT))

    def load_weights(self, version: int, weights: dict) -> None:
        """Push weight ``version`` (a state dict): the requests after this one are sampled from it."""
        self.requests.put(WeightPush(version, pack(weights)))

    def sample(self, request: SampleRequest) -> None:
        """Request one generation's batch; its reply comes, in order, from ``wait``."""
        self.requests.put(request)

    def wait(self, what: str, timeout: float | None = None) -> tuple:
        """The next reply; ``what`` names it in the error when the worker dies, raises or does not answer within
        ``timeout`` seconds (default: the worker's)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = self.replies.get(timeout=_POLL)
                break
            except (queue.Empty, OSError, EOFError):  # a dead worker's tensors cannot be received (OSError)
                if not self.handle.is_alive():
                    self._fail(
                        f"the rollout worker {self._name()} died with exit status {self._status()} while the "
                        f"trainer waited for {what}"
                    )
                if time.monotonic() > deadline:
                    self._fail(
                        f"the rollout worker {self._name()} did not answer within async_timeout="
                        f"{timeout:g} s while the trainer waited for {what} (a hung worker)"
                    )
        if reply[2] is None:  # its start
            return reply
        if isinstance(reply[2], str):
            self._fail(f"the rollout worker {self._name()} raised while sampling {what}")
        return reply[0], reply[1], GenerationOutput(**unpack(reply[2]))

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker: a stop request, then (a process) terminate and kill if it does not exit in time."""
        if self.handle is None:
            return
        handle, self.handle = self.handle, None
        if handle.is_alive():
            self.requests.put(None)
            handle.join(timeout)
        if self.kind == "process":
            if handle.is_alive():
                handle.kill()
                handle.join(timeout)
            self.requests.cancel_join_thread()
            self.replies.cancel_join_thread()
            if self.log_path and os.path.exists(self.log_path):
                os.remove(self.log_path)

    def _name(self) -> str:
        return f"(pid {self.handle.pid})" if self.kind == "process" else "(thread)"

    def _status(self):
        return self.handle.exitcode if self.kind == "process" else "unknown (a thread)"

    def _last_lines(self, most: int = 5) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as log:
            lines = [line.strip() for line in log.read().splitlines() if line.strip()]
        return " | ".join(lines[-most:])

    def _fail(self, message: str):
        tail = self._last_lines()
        self.close(timeout=2.0)
        raise RolloutWorkerError(
            f"{message}; its last output: {tail or '(none)'}; the run stopped with its "
            f"checkpoints intact: resume with resume_from_checkpoint=True (--resume auto)"
        )
