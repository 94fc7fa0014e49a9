"""vLLM as a rollout engine in another process (``engines.base.RolloutEngine``): the client side of
``vllm_mode="server"``, which talks to ``treadle vllm-serve MODEL`` (its server half: ``engines.vllm_server``) over
HTTP with the standard library alone (the trainer's venv needs no vLLM; docs/vllm.md).

The wire (JSON requests; tensors as safetensors bytes, exact to the bit: ``engines.wire``):

- ``GET /health``: the server's identity (``"server": "treadle vllm-serve"`` and its ``PROTOCOL``, the model it was
  started with, its config's architecture fields, every weight's name and shape, its dtype, its context window, the
  run that holds it). The engine waits for it up to ``vllm_server_timeout`` seconds; a server that answers something
  else (TRL's ``trl vllm-serve``, vLLM's OpenAI-compatible ``vllm serve``, anything not treadle's) is refused at
  once, and a treadle server is compared with the policy (``identity_mismatch``) and the run's lengths.
- ``POST /claim`` (``{"run": RUN}``): one server serves one run. The first run claims it; another run is refused
  (HTTP 409) until the holder's ``close`` sends ``POST /release``; the same run (its output folder on this host)
  claims it again when resumed. Every other POST carries the run in the ``X-Treadle-Run`` header. A claim keeps two
  runs apart; it is no access control (docs/vllm.md: who reaches the port can replace the weights).
- ``POST /generate``: prompt ids, the ``SamplingParams`` and one seed drawn from the caller's generator; the answer is
  the ``GenerationOutput`` the server's colocated engine built (``engines.vllm.VLLMEngine``'s own code, run there).
- ``POST /score``: each completion's per-token log-probs (the weight-sync check's probe).
- ``POST /weights``: the policy's merged state dict as safetensors bytes in chunks of at most ``CHUNK_BYTES``; the
  server loads them after the last chunk (``reload_weights``, then its prefix cache is cleared).

Every wait is bounded by a setting and names it when it ends: the first ``/health`` by ``vllm_server_timeout``; a
request by ``vllm_request_timeout``, and while it waits the server must answer a ``/health`` probe every
``PROBE_EVERY`` seconds within ``vllm_server_timeout`` (a killed, stopped or hung server is found in minutes, a
long generation of a live one goes on). A request waits in slices of ``SLICE`` seconds: a SIGTERM or Ctrl-C that
arrives meanwhile (the trainer's preemption handler records it) abandons the request and stops the run at once
(``errors.Preempted``, exit 143; the checkpoints already written are intact). A server that stopped answering or
answered what treadle cannot read is a ``VLLMServerError``: one line naming the URL and the fix (the CLI exits 2).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import http.client
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
import warnings
from urllib.parse import urlsplit

import torch
from torch import nn

from treadle.engines.vllm import SINGLE_TURN_ONLY, SyncChecked, merged_state_dict
from treadle.engines.wire import (
    IDENTITY_FIELDS,
    PROTOCOL,
    RUN_HEADER,
    SERVER_NAME,
    architecture,
    identity_problem,
    pack_tensors,
    unpack_output,
)
from treadle.errors import UserError, stopped_by
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import GenerationOutput
from treadle.models import unwrapped_for_generation

__all__ = [
    "CHUNK_BYTES",
    "VLLMServerEngine",
    "VLLMServerError",
    "exchange",
    "identity_mismatch",
    "run_id",
    "server_url",
    "vllm_server_engine",
]

CHUNK_BYTES = 256 * 2**20  # a weight push travels in POSTs of at most this many bytes (bounded buffers on both ends)
SLICE = 0.5  # seconds a wait blocks before it looks again for a signal, its deadline and its probe
PROBE_EVERY = 30.0  # seconds between the /health probes while a request waits for its answer
CONNECT_TIMEOUT = 30.0  # seconds a TCP connect may take (a host that drops packets)
START_HINT = "start one with `treadle vllm-serve MODEL --port PORT` (docs/vllm.md)"


class VLLMServerError(UserError, ConnectionError):
    """No vLLM server at the URL, not treadle's, serving another model or run, or one that stopped answering."""


def server_url(args) -> str:
    """The server's base URL from a ``GRPOConfig``: ``vllm_server_base_url``, else ``http://host:port`` (TRL)."""
    if args.vllm_server_base_url:
        return args.vllm_server_base_url.rstrip("/")
    return f"http://{args.vllm_server_host}:{args.vllm_server_port}"


def run_id(output_dir: str) -> str:
    """The run a server is claimed by: this host and the run's output folder (a resumed run is the same run)."""
    return f"{socket.gethostname()}:{os.path.abspath(output_dir)}"


def vllm_server_engine(model: nn.Module, args, *, multi_turn: bool = False) -> VLLMServerEngine:
    """The engine ``GRPOTrainer.build_engine`` returns under ``use_vllm`` with ``vllm_mode="server"``."""
    if multi_turn:
        raise ValueError(SINGLE_TURN_ONLY)
    return VLLMServerEngine(
        model,
        server_url(args),
        timeout=args.vllm_server_timeout,
        request_timeout=args.vllm_request_timeout,
        run=run_id(args.output_dir),
        max_prompt_length=args.max_prompt_length,
        max_completion_length=args.max_completion_length,
    )


def identity_mismatch(identity: dict, model: nn.Module, weights: dict[str, torch.Tensor]) -> str | None:
    """What differs between the model a server says it serves and the policy (a config field both name, then the
    weights: a name the server holds that the policy lacks, or another shape), or None when they agree."""
    ours, theirs = architecture(model.config.to_dict()), identity.get("config") or {}
    for field in IDENTITY_FIELDS:
        if field in ours and field in theirs and ours[field] != theirs[field]:
            return f"{field} {theirs[field]} (the policy's: {ours[field]})"
    for name, shape in identity.get("weights", {}).items():
        if name not in weights:
            return f"a weight {name} the policy does not have"
        if list(weights[name].shape) != list(shape):
            return f"{name} of shape {tuple(shape)} (the policy's: {tuple(weights[name].shape)})"
    return None


# ---- one HTTP exchange that waits in slices -----------------------------------------------------------------
def exchange(url: str, method: str, route: str, body: bytes = b"", *, timeout: float, headers=None, on_wait=None):
    """``(status, body)`` of one HTTP request to ``url/route``. Every wait (the connection's room to send, the
    answer) blocks at most ``SLICE`` seconds at a time; between slices ``on_wait()`` runs (it may raise), and past
    ``timeout`` seconds a ``TimeoutError`` is raised. Socket errors (refused, reset) propagate as ``OSError``."""
    parts = urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    deadline = time.monotonic() + timeout
    connection = connection_class(parts.hostname, parts.port, timeout=min(CONNECT_TIMEOUT, timeout))
    try:
        connection.putrequest(method, f"{parts.path.rstrip('/')}/{route}", skip_accept_encoding=True)
        for key, value in {**(headers or {}), "Content-Length": str(len(body))}.items():
            connection.putheader(key, value)
        connection.endheaders()
        sock, view = connection.sock, memoryview(body)
        while view:
            _wait_until_ready(sock, deadline, on_wait, write=True)
            view = view[sock.send(view[: 2**20]) :]
        _wait_until_ready(sock, deadline, on_wait, write=False)
        sock.settimeout(max(SLICE, deadline - time.monotonic()))  # the answer has begun: read it whole
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _wait_until_ready(sock, deadline: float, on_wait, *, write: bool) -> None:
    while not select.select([] if write else [sock], [sock] if write else [], [], SLICE)[1 if write else 0]:
        if time.monotonic() > deadline:
            raise TimeoutError("no answer")
        if on_wait is not None:
            on_wait()


@contextlib.contextmanager
def noting_signals():
    """A list that SIGTERM and SIGINT append themselves to while the block runs, after the handler in place has
    run (the trainer's preemption handler records the signal and returns; the default Ctrl-C handler raises). Only
    the main thread installs handlers; a signal whose handler is not Python's (SIG_DFL, SIG_IGN) is left alone."""
    noted: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            handler = signal.getsignal(signum)
            if callable(handler):

                def note(number, frame, handler=handler):
                    handler(number, frame)
                    noted.append(number)

                previous[signum] = signal.signal(signum, note)
    try:
        yield noted
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class VLLMServerEngine(SyncChecked):
    """A ``treadle vllm-serve`` server behind the engine contract, claimed for one run (``run``: ``run_id``; a fresh
    id by default). The server outlives the engine: ``close`` releases the claim (start and stop the server
    yourself, as with TRL's ``trl vllm-serve``). ``max_prompt_length`` / ``max_completion_length`` (the run's) must
    fit in the server's context window; each request is checked against it too."""

    samples_elsewhere = True  # the server's process samples; a thread that drives it waits on a socket

    def __init__(
        self,
        model: nn.Module,
        url: str,
        *,
        timeout: float = 240.0,
        request_timeout: float = 1800.0,
        run: str | None = None,
        max_prompt_length: int | None = None,
        max_completion_length: int | None = None,
    ):
        self.url, self.timeout, self.request_timeout = url.rstrip("/"), timeout, request_timeout
        self.run, self.claimed = run or f"{socket.gethostname()}:{uuid.uuid4().hex}", False
        with unwrapped_for_generation(model) as inner:
            self.device = next(inner.parameters()).device
            identity = self.wait_for_server(timeout)
            problem = identity_mismatch(identity, inner, merged_state_dict(inner))
        if problem:
            raise VLLMServerError(
                f"the vLLM server at {self.url} serves another model ({identity.get('model')!r}: "
                f"{problem}); restart it with the policy's model: treadle vllm-serve MODEL "
                f"--port PORT, or point vllm_server_base_url at a server of the policy's model"
            )
        self.identity, self.max_model_len = identity, identity.get("max_model_len")
        self.check_lengths(max_prompt_length, max_completion_length)
        self.claim()

    def wait_for_server(self, timeout: float) -> dict:
        """The server's identity (``GET /health``), polled until it answers or ``timeout`` seconds have passed;
        an answer that is not a treadle server's is refused at once (``treadle_identity``)."""
        deadline, pause = time.monotonic() + timeout, 0.1
        with noting_signals() as noted:
            while True:
                try:
                    left = max(SLICE, deadline - time.monotonic())  # a port that accepts, never answers
                    answer = exchange(self.url, "GET", "health", timeout=left, on_wait=lambda: self.stop_if(noted))
                except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out: not yet up
                    if time.monotonic() + pause > deadline:
                        raise VLLMServerError(
                            f"no vLLM server answered at {self.url}/health within vllm_server_timeout="
                            f"{timeout:g} s ({reason(error)}); {START_HINT}, or set vllm_server_base_url (or "
                            f"vllm_server_host / vllm_server_port) to where it runs, and "
                            f"vllm_server_timeout to wait longer for its start"
                        ) from None
                else:
                    return self.treadle_identity(*answer)
                time.sleep(pause)
                self.stop_if(noted)
                pause = min(2.0, pause * 2)

    def treadle_identity(self, status: int, body: bytes) -> dict:
        """``/health``'s answer as a treadle server's identity, or one line naming what answered instead."""
        try:
            identity = json.loads(body) if status == 200 else None
        except ValueError:
            identity = None
        if not isinstance(identity, dict) or identity.get("server") != SERVER_NAME:
            said = f"HTTP {status}" + (f": {shown(body)}" if body.strip() else " with an empty body")
            raise VLLMServerError(
                f"the server at {self.url} is not treadle's vLLM server: GET /health answered {said} "
                f"(TRL's `trl vllm-serve` and vLLM's OpenAI-compatible `vllm serve` speak other protocols); "
                f"{START_HINT} and point vllm_server_base_url at it"
            )
        if identity.get("protocol") != PROTOCOL:
            raise VLLMServerError(
                f"the treadle vLLM server at {self.url} speaks protocol {identity.get('protocol', 1)}, this "
                f"treadle {PROTOCOL}: restart it with this treadle's `treadle vllm-serve`"
            )
        problem = identity_problem(identity)
        if problem is not None:
            raise VLLMServerError(
                f"the treadle vLLM server at {self.url} answered GET /health with an identity that does not read: "
                f"{problem}; restart it with this treadle's `treadle vllm-serve`"
            )
        return identity

    def check_lengths(self, max_prompt_length: int | None, max_completion_length: int | None) -> None:
        """Refuse a server whose context window cannot hold even a one-token prompt and a whole completion; warn
        when a prompt of ``max_prompt_length`` (or unbounded) would not fit: such a prompt is refused when it comes
        (``check_context``), where vLLM would cut its completion short without a word."""
        window = self.max_model_len
        if window is None or max_completion_length is None:
            return
        if 1 + max_completion_length > window:
            raise VLLMServerError(
                f"the vLLM server at {self.url} holds {window} tokens per sequence (its max_model_len), too few for "
                f"a prompt and max_completion_length={max_completion_length}: its completions would be cut short; "
                f"restart it with a larger --max-model-len, or lower max_completion_length"
            )
        if max_prompt_length is None or max_prompt_length + max_completion_length > window:
            prompts = (
                "prompts are not cut (max_prompt_length=None)"
                if max_prompt_length is None
                else (
                    f"max_prompt_length={max_prompt_length} + max_completion_length={max_completion_length} = "
                    f"{max_prompt_length + max_completion_length}"
                )
            )
            warnings.warn(
                f"the vLLM server at {self.url} holds {window} tokens per sequence (its max_model_len) and "
                f"{prompts}: a prompt longer than {window - max_completion_length} tokens will stop the run "
                f"(vLLM would cut its completion short); set max_prompt_length to at most "
                f"{window - max_completion_length}, or restart the server with a larger --max-model-len",
                stacklevel=2,
            )

    def claim(self) -> None:
        """Claim the server for this run (another run's claim is one line); released by ``close``, or when this
        process exits (a run that ends, fails or is preempted frees the server; one killed with SIGKILL does not)."""
        self.request("claim", json.dumps({"run": self.run}).encode())
        self.claimed = True
        atexit.register(self.close)

    # ---- the contract ------------------------------------------------------------------------------------
    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, seed: int | None) -> GenerationOutput:
        self.check_context(prompt_ids, params.max_new_tokens)
        body = {
            "prompt_ids": [list(map(int, p)) for p in prompt_ids],
            "params": dataclasses.asdict(params),
            "seed": seed,
        }
        data = self.request("generate", json.dumps(body).encode())
        output = self.decoded("generate", data, lambda: unpack_output(data, self.device))
        rows = len(prompt_ids) * params.num_generations
        if output.completion_ids.dim() != 2 or output.completion_ids.shape[0] != rows:
            self.unreadable("generate", data, f"{tuple(output.completion_ids.shape)} completions for {rows} rows")
        return output

    def check_context(self, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
        """A prompt whose completion would not fit in the server's context window: one line (vLLM cuts it)."""
        longest = max((len(p) for p in prompt_ids), default=0)
        if self.max_model_len is not None and longest + max_new_tokens > self.max_model_len:
            raise VLLMServerError(
                f"a prompt of {longest} tokens + max_completion_length={max_new_tokens} does not fit in the "
                f"{self.max_model_len} tokens the vLLM server at {self.url} holds (its max_model_len): the "
                f"completion would be cut short; set max_prompt_length to at most "
                f"{self.max_model_len - max_new_tokens}, or restart the server with a larger --max-model-len"
            )

    def load_weights(self, model, version: int | None = None) -> None:
        """Push the policy's merged weights and check the push (``sync_unchanged``), as the colocated engine does:
        when they differ from the last push, the server's log-probs of one probe completion must change."""
        with unwrapped_for_generation(model) as inner:
            self.checked_push([(name, tensor.detach()) for name, tensor in merged_state_dict(inner).items()])
        self.policy_version = version

    def push(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Send ``weights`` in chunks of at most ``CHUNK_BYTES``; the server loads them after the last one."""
        chunks, size = [[]], 0
        for name, tensor in weights:
            nbytes = tensor.numel() * tensor.element_size()
            if chunks[-1] and size + nbytes > CHUNK_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append((name, tensor))
            size += nbytes
        for i, chunk in enumerate(chunks):
            self.request(f"weights?last={int(i == len(chunks) - 1)}", pack_tensors(dict(chunk)))

    def close(self) -> None:
        """Release the server for other runs (a server gone already needs no release)."""
        if self.claimed:
            self.claimed = False
            atexit.unregister(self.close)
            with contextlib.suppress(OSError, http.client.HTTPException):
                body = json.dumps({"run": self.run}).encode()
                exchange(self.url, "POST", "release", body, timeout=min(self.timeout, 10.0))

    # ---- beyond the contract -----------------------------------------------------------------------------
    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[torch.Tensor]:
        """Each completion's per-token log-probs under the server's current weights (temperature 1)."""
        body = {
            "prompt_ids": [list(map(int, p)) for p in prompt_ids],
            "completion_ids": [list(map(int, c)) for c in completion_ids],
        }
        data = self.request("score", json.dumps(body).encode())
        logps = self.decoded("score", data, lambda: json.loads(data)["logps"])
        if not isinstance(logps, list) or len(logps) != len(completion_ids):
            self.unreadable("score", data, f"not {len(completion_ids)} rows of log-probs")
        return [self.decoded("score", data, lambda row=row: torch.tensor(row, dtype=torch.float32)) for row in logps]

    def request(self, route: str, body: bytes) -> bytes:
        """POST ``body`` to ``route``; the answer's bytes. Bounded by ``vllm_request_timeout``, with the server's
        liveness probed meanwhile (``check_alive``); a signal abandons it (``stop_if``); any other end is one line."""
        name, started = route.partition("?")[0], time.monotonic()
        probed = [started]

        def on_wait():
            self.stop_if(noted, name)
            if time.monotonic() - probed[0] >= PROBE_EVERY:
                self.check_alive(noted, name, started)
                probed[0] = time.monotonic()

        with noting_signals() as noted:
            try:
                status, data = exchange(
                    self.url,
                    "POST",
                    route,
                    body,
                    timeout=self.request_timeout,
                    headers={RUN_HEADER: self.run},
                    on_wait=on_wait,
                )
            except VLLMServerError:  # the probe's verdict (a ConnectionError, and so an OSError too)
                raise
            except TimeoutError:
                raise VLLMServerError(
                    f"the vLLM server at {self.url} did not answer /{name} within vllm_request_timeout="
                    f"{self.request_timeout:g} s: raise vllm_request_timeout for "
                    f"longer generations, or restart the server and resume (treadle train CONFIG --resume)"
                ) from None
            except (OSError, http.client.HTTPException) as error:  # refused, reset, cut off: gone
                raise self.gone(reason(error)) from None
        if status != 200:  # the server answered with an error: its one line says what
            raise VLLMServerError(
                f"the vLLM server at {self.url} refused /{name} (HTTP {status}: {shown(data, quote=False)})"
            )
        return data

    def check_alive(self, noted: list[int], name: str, started: float) -> None:
        """The server must answer ``GET /health`` within ``vllm_server_timeout`` while a request waits. (Not named
        ``probe``: that is ``SyncChecked``'s weight-sync probe, a tuple set by the first generation, which hid the
        method and failed every request slower than ``PROBE_EVERY`` after it.)"""
        try:
            exchange(self.url, "GET", "health", timeout=self.timeout, on_wait=lambda: self.stop_if(noted, name))
        except (OSError, http.client.HTTPException) as error:
            waited = time.monotonic() - started
            raise self.gone(
                f"/health gave no answer within vllm_server_timeout={self.timeout:g} s while /{name} waited "
                f"{waited:.0f} s: a stopped or hung server"
                if isinstance(error, TimeoutError)
                else reason(error)
            ) from None

    def gone(self, why: str) -> VLLMServerError:
        return VLLMServerError(
            f"the vLLM server at {self.url} stopped answering ({why}); the checkpoints written so far are intact: "
            f"restart the server ({START_HINT}) and resume the run (treadle train CONFIG --resume)"
        )

    def stop_if(self, noted: list[int], name: str = "health") -> None:
        """A signal arrived while a request waited: abandon it and stop the run (exit 143 for SIGTERM)."""
        if noted:
            print(
                f"treadle: {signal.Signals(noted[0]).name} while waiting for the vLLM server at {self.url} "
                f"(/{name}): the request is abandoned; the run saves the steps it finished and stops",
                file=sys.stderr,
                flush=True,
            )
            raise stopped_by(noted[0], self.policy_version or 0, None)

    def decoded(self, route: str, data: bytes, decode):
        """``decode()``, or one line naming the server and what it answered when it cannot be read."""
        try:
            return decode()
        except Exception as error:  # noqa: BLE001 -- anything the bytes of a foreign or broken server raise
            self.unreadable(route, data, f"{type(error).__name__}: {error}")

    def unreadable(self, route: str, data: bytes, problem: str):
        problem = " ".join(problem.split())[:200]
        raise VLLMServerError(
            f"the vLLM server at {self.url} answered /{route} with what treadle cannot read ({problem}; it "
            f"sent {shown(data)}); point vllm_server_base_url at a `treadle vllm-serve` of this treadle"
        )


def reason(error: BaseException) -> str:
    """A socket error in a few words (``URLError`` wraps the ``OSError`` that says what happened)."""
    inner = getattr(error, "reason", None)
    inner = inner if isinstance(inner, BaseException) else error
    return getattr(inner, "strerror", None) or str(inner) or type(inner).__name__


def shown(data: bytes, limit: int = 200, *, quote: bool = True) -> str:
    """The start of what a server sent, on one line (quoted: it may be anything)."""
    text = " ".join(data.decode(errors="replace").split())
    text = text[:limit] + ("..." if len(text) > limit else "")
    return repr(text) if quote else text
