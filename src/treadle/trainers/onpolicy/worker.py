"""The rollout worker of asynchronous generation (trainers/onpolicy/producer.py, docs/async.md): a process (or a
thread) that holds its own copy of the policy behind its own engine (``engines.LocalEngine``, the own KV-cached
sampler) and samples generation batches while the trainer trains. Given an engine that samples in another process
(the vLLM server: ``RolloutEngine.samples_elsewhere``), the worker is a thread that drives that engine, pushing the
weights of its copy to it, while the trainer trains.

The protocol is one request queue and one reply queue, two kinds of request: a weight push (a version and its state
dict: the worker loads it into its copy and tells its engine the version) and a :class:`SampleRequest` (a
generation, the distinct prompt ids, the ``SamplingParams`` and the generator seed to sample with). The worker
replies to each sample request ``(generation, the version its engine held, GenerationOutput)``, or ``(generation,
version, traceback text)`` when the push or the sampling raised. Tensors cross as safetensors bytes
(``engines.wire``, as to the vLLM server), never as tensors: torch would share those through file descriptors that
the receiver fetches from the sender, and a receiver whose sender is stopped or dead would wait for them without a
limit (a silent hang); bytes arrive whole or not at all, and reading them runs no code. Requests are served in
order, so the weights a generation is sampled from depend only on the schedule, never on timing. (The worker's copy
of the model itself reaches a process worker once, at its start, as ``multiprocessing`` sends a target's
arguments.)

Nothing waits without a limit (``RolloutWorker.wait``): a reply that does not come within ``timeout`` seconds, or a
worker that dies, raises ``RolloutWorkerError`` (a ``UserError``: one line) naming what was waited for, the exit
status and the last lines the worker wrote (its stdout and stderr go to a log file). The worker's copy counts its
forward passes (``_watch``), so a late reply is told slow (raise ``async_timeout``) from hung, and raises at its
next forward pass once stopped: a thread worker, which cannot be killed, ends instead of sampling on inside torch
while the interpreter exits (an abort). A process worker's model is checked to pickle before it starts
(``check_picklable``). The worker process ignores
SIGINT and SIGTERM (the trainer catches them, checkpoints, which needs the worker's pending batches, then stops
it) and exits by itself when the trainer's process is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
from multiprocessing.reduction import ForkingPickler
from typing import NamedTuple

import torch

from treadle.engines.local import LocalEngine
from treadle.engines.wire import pack_output, pack_tensors, unpack_output, unpack_tensors
from treadle.errors import PreflightError, UserError, resume_hint
from treadle.generation.sampling import SamplingParams
from treadle.trainers.onpolicy.config import WORKER_KINDS

__all__ = ["RolloutWorker", "RolloutWorkerError", "SampleRequest", "WeightPush", "check_picklable"]

_POLL = 0.2  # seconds between liveness checks while waiting for a reply
START_TIMEOUT = 300.0  # the least a worker's start may take (a new interpreter imports torch and transformers)


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


def load_pushed(model, weights: dict) -> None:
    """Load a weight push into the worker's copy: the weights that can change (``producer.pushed_weights``), every
    one of them a weight of the copy; the others stay as copied at the start."""
    unexpected = model.load_state_dict(weights, strict=False).unexpected_keys
    if unexpected:
        raise RuntimeError(
            f"the weight push names {len(unexpected)} weights the worker's copy does not have, e.g. "
            f"{unexpected[0]!r}: the copy and the push come from different models (a bug)"
        )


class _Stopped(Exception):
    """The trainer asked the worker to stop (``RolloutWorker.close``): raised at the copy's next forward pass."""


def _watch(model, progress, stop) -> None:
    """Every forward pass of the worker's copy counts in ``progress`` (a shared counter: what tells a slow worker
    from a hung one) and raises ``_Stopped`` once ``stop`` is set: a thread cannot be killed, so a thread worker
    ends at its next forward instead of sampling on inside torch while the interpreter exits (an abort). The hook
    sits on the input embeddings, which every forward passes through: the own sampler's decode steps call the
    backbone, not the model (a hook on the model saw the prefill alone, so a stopped thread sampled on to the end
    of its generation, and the process could exit under it)."""

    def hook(module, args):
        progress.value += 1
        if stop.is_set():
            raise _Stopped

    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a module of one's own: its own forward is the one there is
        embeddings = None
    (embeddings if isinstance(embeddings, torch.nn.Module) else model).register_forward_pre_hook(hook)


def serve(
    model,
    backend: str,
    requests,
    replies,
    threads: int | None,
    log_path: str | None,
    parent_pid: int | None,
    progress=None,
    stop=None,
    engine=None,
) -> None:
    """The worker's loop (the target of the process or the thread): answer requests until a ``None`` request (or
    ``stop``). ``engine``: the engine to sample through (a thread worker's; default: the own sampler on the copy)."""
    if log_path is not None:  # a process: its output to the log file, the trainer's signals are the trainer's
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(log, 1)
        os.dup2(log, 2)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    model.eval()
    if progress is not None:
        _watch(model, progress, stop)
    engine = engine or LocalEngine(model, backend=backend)
    print(f"treadle rollout worker: pid {os.getpid()}, {torch.get_num_threads()} torch threads, ready", flush=True)
    replies.put(("ready", None, None))
    while True:
        try:
            request = requests.get(timeout=1.0)
        except queue.Empty:
            if parent_pid is not None and os.getppid() != parent_pid:
                return  # the trainer is gone (kill -9): nothing will read what this samples
            continue
        if request is None or (stop is not None and stop.is_set()):
            return
        generation = request.generation if isinstance(request, SampleRequest) else None  # None: a weight push
        try:
            if isinstance(request, WeightPush):
                load_pushed(model, unpack_tensors(request.weights))
                engine.load_weights(model, version=request.version)
                continue
            generator = torch.Generator(device=next(model.parameters()).device).manual_seed(request.seed)
            with torch.no_grad():
                out = engine.generate(request.prompt_ids, request.params, generator=generator)
            replies.put((generation, engine.policy_version, pack_output(out)))
        except _Stopped:
            return
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


class _Counter:
    """A thread worker's forward-pass counter (a process worker's is a shared ``multiprocessing.Value``)."""

    value = 0


class _FromMain(Exception):
    """A class or function the model refers to lives in ``__main__`` (the training script)."""


class _ModelPickler(ForkingPickler):
    """Pickles a model as the spawned worker receives it (multiprocessing's pickler, its reducers), without its
    tensors' data (``persistent_id``), and stops at a class or function of ``__main__``: pickled by name, which the
    worker's interpreter cannot look up."""

    def reducer_override(self, obj):
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            raise _FromMain(obj)
        return NotImplemented

    def persistent_id(self, obj):
        return id(obj) if isinstance(obj, torch.Tensor) else None


class _Discard:
    def write(self, data) -> int:
        return len(data)


def check_picklable(model) -> None:
    """A process worker receives its copy of the model pickled: refuse, in one line before the worker starts, a
    model whose class or hooks cannot be pickled or are defined in the training script (``__main__``)."""
    pickler = _ModelPickler(_Discard(), pickle.HIGHEST_PROTOCOL)
    try:
        pickler.dump(model)
        return
    except _FromMain as found:
        thing = found.args[0]
        what = (
            f"{'class' if isinstance(thing, type) else 'function'} {thing.__qualname__!r} is defined in the "
            f"training script (__main__), which the worker's new interpreter does not run"
        )
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        what = f"it cannot be pickled ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
    raise PreflightError(
        f"async_worker='process' sends the rollout worker a pickled copy of the model ({type(model).__name__}), "
        f"its modules and hooks, but {what}: set async_worker: thread (no pickling), or define the class or "
        f"hook at module level in an importable module"
    )


EXIT_JOIN = 300.0  # seconds the interpreter's exit waits for a stopped thread worker to end (its next forward pass)
_still_running: list[threading.Thread] = []
_exit_hook: list = []  # registered with atexit once, when a thread worker first outlives its close


def _join_at_exit(thread: threading.Thread) -> None:
    """Have the interpreter's exit wait for ``thread``, a thread worker told to stop that is still inside torch (a
    forward pass of a loaded machine outlasts ``close``'s wait). A thread cannot be killed, and one still running
    torch's code while the interpreter finalises aborts the process ("terminate called without an active
    exception", SIGABRT): joined first, it ends at its copy's next forward pass (``_watch``) and the exit is the
    run's own. One that does not end within ``EXIT_JOIN`` seconds (hung in a user's code) is left, with a line."""
    if not _exit_hook:
        atexit.register(_join_still_running)
        _exit_hook.append(_join_still_running)
    _still_running[:] = [*(t for t in _still_running if t.is_alive()), thread]


def _join_still_running() -> None:
    deadline = time.monotonic() + EXIT_JOIN
    for thread in _still_running:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in _still_running):
        print(
            f"treadle: the rollout worker thread did not end within {EXIT_JOIN:g} s of the run's end (hung outside "
            f"torch's forward passes); the interpreter exits under it",
            file=sys.stderr,
            flush=True,
        )
    _still_running.clear()


class RolloutWorker:
    """The trainer's handle on one worker: ``load_weights`` and ``sample`` requests, ``wait`` for replies (in order),
    ``close``.

    ``kind``: "process" (spawned, its own interpreter and ``threads`` torch threads) or "thread" (the same loop on a
    thread of this process, sharing its torch threads). ``model``: the policy, copied once at start; ``backend``:
    its engine's sampler backend ("fast", "hf" or "auto"); ``engine``: a thread worker's engine instead (one that
    samples elsewhere, ``engines.base.take_turns``' side), to which the copy's weights are pushed."""

    def __init__(
        self,
        model,
        *,
        kind: str = "process",
        threads: int | None = None,
        timeout: float = 600.0,
        backend: str = "auto",
        engine=None,
    ):
        if kind not in WORKER_KINDS:
            raise ValueError(f"async_worker must be one of {WORKER_KINDS}, got {kind!r}")
        if engine is not None and kind != "thread":
            raise ValueError("a rollout worker given an engine is a thread (the engine cannot be sent to a process)")
        self.kind, self.timeout, self.remote = kind, timeout, engine is not None
        copied = copy.deepcopy(model)
        self.device = next(copied.parameters()).device  # where the replies' tensors go (they travel on the CPU)
        if kind == "process":
            check_picklable(copied)
            context = mp.get_context("spawn")
            self.progress, self.stop = context.Value("q", 0, lock=False), context.Event()
            self.requests, self.replies = context.Queue(), context.Queue()
            handle, self.log_path = tempfile.mkstemp(prefix="treadle-rollout-worker-", suffix=".log")
            os.close(handle)
            self.handle = context.Process(
                target=serve,
                daemon=True,
                name="treadle-rollout-worker",
                args=(copied, backend, self.requests, self.replies, threads, self.log_path, os.getpid()),
                kwargs={"progress": self.progress, "stop": self.stop},
            )
        else:
            self.progress, self.stop = _Counter(), threading.Event()
            self.requests, self.replies, self.log_path = queue.Queue(), queue.Queue(), None
            self.handle = threading.Thread(
                target=serve,
                daemon=True,
                name="treadle-rollout-worker",
                args=(copied, backend, self.requests, self.replies, None, None, None),
                kwargs={"progress": self.progress, "stop": self.stop, "engine": engine},
            )
        if kind == "process":
            with _main_not_rerun():
                self.handle.start()
        else:
            self.handle.start()
        self.wait("its start (importing torch, loading the model copy)", max(timeout, START_TIMEOUT))

    def load_weights(self, version: int, weights: dict) -> None:
        """Push weight ``version`` (a state dict): the requests after this one are sampled from it."""
        self.requests.put(WeightPush(version, pack_tensors(weights)))

    def sample(self, request: SampleRequest) -> None:
        """Request one generation's batch; its reply comes, in order, from ``wait``."""
        self.requests.put(request)

    def wait(self, what: str, timeout: float | None = None) -> tuple:
        """The next reply; ``what`` names it in the error when the worker dies, raises or does not answer within
        ``timeout`` seconds (default: the worker's)."""
        timeout = self.timeout if timeout is None else timeout
        deadline, forwards = time.monotonic() + timeout, self.progress.value
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
                    self._fail(*self._late(what, timeout, self.progress.value - forwards))
        if reply[2] is None:  # its start
            return reply
        if isinstance(reply[2], str):
            last = next((line.strip() for line in reversed(reply[2].splitlines()) if line.strip()), "")
            self._fail(f"the rollout worker {self._name()} raised while sampling {what}: {last}")
        return reply[0], reply[1], unpack_output(reply[2], self.device)

    def _late(self, what: str, timeout: float, forwards: int) -> tuple[str, str]:
        """(what, when to resume) of a wait that ran out. A slow worker (its copy ran forward passes during the wait)
        needs a larger ``async_timeout``, which a resume alone would not give it; a hung one ran none."""
        late = (
            f"the rollout worker {self._name()} did not answer within async_timeout={timeout:g} s while the trainer "
            f"waited for {what}"
        )
        if what.startswith("its start"):  # START_TIMEOUT at least: no forward pass to count yet
            return f"{late} (the start waits max(async_timeout, {START_TIMEOUT:g}) s)", ""
        if self.remote:  # its engine samples in another process: no forward pass here to count
            return (
                f"{late}, its engine sampling in another process (its own waits name a server that stopped "
                f"answering); raise async_timeout above {timeout:g} s to what sampling one generation takes",
                "once async_timeout is raised (resumed as it is, it times out again)",
            )
        if forwards:
            passes = f"{forwards} forward pass{'es' if forwards > 1 else ''}"
            return (
                f"{late}: it is slow, not hung (its model ran {passes} in that time); raise "
                f"async_timeout above {timeout:g} s to what sampling one generation takes, or lower "
                f"max_completion_length or the batch",
                "once async_timeout is raised (resumed as it is, it times out again)",
            )
        return (
            f"{late}, and its model ran no forward pass in that time (a hung worker, or one forward pass takes "
            f"longer than async_timeout)",
            "",
        )

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker: the stop flag (a thread ends at its copy's next forward pass) and a stop request, then (a
        process) kill it if it does not exit in time."""
        if self.handle is None:
            return
        handle, self.handle = self.handle, None
        self.stop.set()
        if handle.is_alive():
            self.requests.put(None)
            handle.join(timeout)
        if self.kind == "thread" and not self.remote and handle.is_alive():  # (remote: waiting on HTTP, not torch)
            _join_at_exit(handle)  # it ends at its copy's next forward pass: before the interpreter finalises
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

    def _fail(self, message: str, when: str = ""):
        tail = self._last_lines()
        self.close(timeout=2.0)
        raise RolloutWorkerError(
            f"{message}; its last output: {tail or '(none)'}; the run stopped with its "
            f"checkpoints intact: {resume_hint()}{' ' + when if when else ''}"
        )
