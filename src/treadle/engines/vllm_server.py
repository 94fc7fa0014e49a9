"""The server half of ``vllm_mode="server"``: vLLM serving a model to GRPO runs in other processes (the command is
``treadle vllm-serve``, treadle.cli.vllm_serve; the client is ``engines.vllm_client.VLLMServerEngine``, which
describes the routes; the wire's marks and byte format are ``engines.wire``).

The server is a small standard-library HTTP server (``ThreadingHTTPServer``; one request at a time reaches the
engine) around one in-process ``vllm.LLM``. Its generation, scoring and weight loading are the colocated engine's
own code (``ServedEngine`` is an ``engines.vllm.VLLMEngine`` started from a folder instead of a live model), so the
two modes sample alike by construction. vLLM is imported only when ``serve`` starts the engine. The server outlives
any one run: it stops on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import signal
import socket
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import torch
from safetensors import safe_open
from transformers import AutoConfig

from treadle.engines.vllm import VLLMEngine, check_head_size, require_vllm
from treadle.engines.wire import PROTOCOL, RUN_HEADER, SERVER_NAME, architecture, pack_output, unpack_tensors
from treadle.errors import UserError, one_line
from treadle.generation.sampling import SamplingParams

__all__ = ["Handler", "ServedEngine", "bind", "identity_of", "serve"]

ROUTES = b"unknown route: GET /health; POST /claim, /release, /generate, /score, /weights"


def bind(host: str, port: int) -> ThreadingHTTPServer:
    """The HTTP server listening on ``host:port`` (bound before vLLM's minutes-long start, so that a port in use is
    one line at once)."""
    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as error:
        raise UserError(
            f"cannot listen on {host}:{port} ({error.strerror or error}); {_bind_fix(host, error)}"
        ) from None
    server.host = host  # as the user wrote it: the URL printed for the runs
    return server


def _bind_fix(host: str, error: OSError) -> str:
    """What to change when ``bind`` fails: the host when it is not this machine's (or no address at all), else the
    port."""
    if isinstance(error, socket.gaierror) or error.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
        return (
            f"--host {host} is not an address of this machine; pass --host 127.0.0.1 (this machine only), "
            f"0.0.0.0 (every interface) or one of this machine's addresses (ip addr)"
        )
    return "pass another --port, or stop what holds it"


def serve(server: ThreadingHTTPServer, folder: str, *, name: str, dtype: str | None = None, **engine_options) -> None:
    """Start a ``ServedEngine`` on the model ``folder`` (``name``: what ``/health`` calls it; ``dtype``: default the
    saved config's; ``engine_options``: ``ServedEngine``'s) and answer requests until Ctrl-C or SIGTERM."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    dtype = dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
    server.engine = ServedEngine(folder, dtype=dtype, **engine_options)
    server.identity = identity_of(name, folder, dtype, server.engine)
    server.lock, server.pending, server.run = threading.Lock(), {}, None
    url = f"http://{server.host}:{server.server_address[1]}"
    print(
        f"treadle: vLLM serves {name} at {url} (GET /health; a run connects with use_vllm: true, "
        f"vllm_mode: server, vllm_server_base_url: {url})",
        flush=True,
    )
    signal.signal(signal.SIGTERM, interrupt)  # as Ctrl-C: the engine shut down, a toy's folder removed
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("treadle: vllm-serve stopped", file=sys.stderr)
    finally:
        server.engine.close()


def interrupt(signum, frame):
    raise KeyboardInterrupt


def identity_of(name: str, folder: str, dtype: str, engine: ServedEngine) -> dict:
    """What ``GET /health`` answers: the server's mark and protocol, the model's name, its config's architecture
    fields (``wire.architecture``, from the config as transformers reads it: defaults included), each weight's
    name and shape (read from the safetensors headers, no tensor loaded), the dtype and the context window."""
    weights = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            weights.update({key: list(f.get_slice(key).get_shape()) for key in f.keys()})
    return {
        "server": SERVER_NAME,
        "protocol": PROTOCOL,
        "model": name,
        "folder": folder,
        "dtype": str(dtype),
        "config": architecture(AutoConfig.from_pretrained(folder).to_dict()),
        "max_model_len": engine.llm.llm_engine.model_config.max_model_len,
        "weights": weights,
    }


class ServedEngine(VLLMEngine):
    """The colocated engine started from a model folder: the same ``vllm.LLM`` settings, generation, scoring and
    weight loading, its outputs on the CPU (they travel as bytes). The folder is not its own: ``close`` keeps it."""

    def __init__(
        self,
        folder: str,
        *,
        dtype,
        max_model_length: int | None,
        gpu_memory_utilization: float,
        tensor_parallel_size: int,
        seed: int,
    ):  # not the parent's __init__, which saves a live model
        vllm = require_vllm()
        check_head_size(AutoConfig.from_pretrained(folder), vllm)
        self.lora = None  # the server is sent merged weights (engines.vllm_lora: colocated only)
        self.start(
            vllm,
            folder,
            device=torch.device("cpu"),
            dtype=dtype,
            seed=seed,
            max_model_length=max_model_length,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
        )

    def close(self) -> None:
        self.shutdown()  # the folder is the user's (or the toy folder cli.vllm_serve.main removes)


class Handler(BaseHTTPRequestHandler):
    """The routes (engines.vllm_server's docstring): GET /health; POST /claim, /release, /generate, /score,
    /weights?last=0|1. One run holds the server (``server.run``): its claim first, then its header on each POST."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if urlsplit(self.path).path.rstrip("/") != "/health":
            return self.answer(404, ROUTES)
        self.answer(200, json.dumps({**self.server.identity, "run": self.server.run}).encode(), "application/json")

    def do_POST(self) -> None:
        route = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        path = route.path.rstrip("/")
        try:
            with self.server.lock:  # one request at a time reaches the engine
                if path in ("/claim", "/release"):
                    return self.answer(*self.claim(path, json.loads(body)))
                if self.headers.get(RUN_HEADER) != self.server.run:
                    return self.answer(*self.refusal(self.headers.get(RUN_HEADER)))
                answer = self.route(path, parse_qs(route.query), body)
        except (UserError, ValueError, KeyError) as error:  # a request the engine cannot serve: one line back
            return self.answer(400, one_line(error).encode())
        except Exception as error:  # a bug, or the engine failed: the traceback here, one line to the client
            traceback.print_exc()
            return self.answer(500, one_line(error).encode())
        if answer is None:
            return self.answer(404, ROUTES)
        self.answer(200, *answer)

    def claim(self, path: str, request) -> tuple[int, bytes, str]:
        """``/claim``: the server is this run's unless another holds it; ``/release``: the holder lets it go."""
        run = request.get("run") if isinstance(request, dict) else None
        if not isinstance(run, str) or not run:
            raise ValueError(f"a claim names its run as {{'run': RUN}}, got {request!r:.80}")
        if path == "/release":
            if self.server.run == run:
                self.server.run = None
                print(f"treadle: vllm-serve released by {run}", flush=True)
            return 200, json.dumps({"run": self.server.run}).encode(), "application/json"
        if self.server.run not in (None, run):
            return self.refusal(run)
        if self.server.run is None:
            print(f"treadle: vllm-serve claimed by {run}", flush=True)
        self.server.run = run
        return 200, json.dumps({"run": run}).encode(), "application/json"

    def refusal(self, run: str | None) -> tuple[int, bytes, str]:
        holder = self.server.run
        if holder is None:
            message = (
                f"this server holds no run's claim (was it restarted?), so it does not serve the run {run}: "
                f"resume the run (treadle train CONFIG --resume), which claims it when it connects"
            )
        else:
            message = (
                f"this server serves the run {holder} (one server serves one run: two would sample from each "
                f"other's weights); start another `treadle vllm-serve` (another --port) for the run {run}, or end "
                f"that run first (its close releases the server; restart the server to free it from a crashed run)"
            )
        return 409, message.encode(), "text/plain"

    def route(self, path: str, query: dict, body: bytes) -> tuple[bytes, str] | None:
        engine = self.server.engine
        if path == "/generate":
            request = json.loads(body)
            params = request["params"]
            params = SamplingParams(
                **{
                    **params,
                    "eos_token_ids": tuple(params["eos_token_ids"]),
                    "suppress_token_ids": tuple(params.get("suppress_token_ids", ())),
                }
            )
            seed = request.get("seed")
            generator = None if seed is None else torch.Generator().manual_seed(int(seed))
            output = engine.generate(request["prompt_ids"], params, generator=generator)
            return pack_output(output), "application/octet-stream"
        if path == "/score":
            request = json.loads(body)
            logps = engine.score(request["prompt_ids"], request["completion_ids"])
            return json.dumps({"logps": [row.tolist() for row in logps]}).encode(), "application/json"
        if path == "/weights":
            self.server.pending.update(unpack_tensors(body))
            if query.get("last", ["1"])[0] == "1":
                weights, self.server.pending = list(self.server.pending.items()), {}
                engine.push(weights)  # the prefix cache is cleared with it
                return json.dumps({"loaded": len(weights)}).encode(), "application/json"
            return json.dumps({"received": len(self.server.pending)}).encode(), "application/json"
        return None

    def answer(self, status: int, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
