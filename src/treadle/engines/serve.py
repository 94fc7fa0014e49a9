"""``treadle vllm-serve MODEL [--host H] [--port P] ...``: vLLM serving a model to GRPO runs in other processes
(``vllm_mode="server"``; the client is ``engines.vllm_server.VLLMServerEngine``, the wire is described there).

The server is a small standard-library HTTP server (``ThreadingHTTPServer``; one request at a time reaches the
engine) around one in-process ``vllm.LLM``. Its generation, scoring and weight loading are the colocated engine's
own code (``ServedEngine`` is an ``engines.vllm.VLLMEngine`` started from a folder instead of a live model), so the
two modes sample alike by construction. ``MODEL`` is a transformers model folder (made absolute: vLLM looks a
relative path up on the Hub) or ``toy:<size>``, built and saved to a temporary folder. vLLM is imported only when
this command runs. The server outlives any one run: stop it with Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import torch
from safetensors import safe_open
from safetensors.torch import load as load_tensors
from transformers import AutoConfig

from treadle.cli.loading import load_model
from treadle.engines.vllm import VLLMEngine, check_head_size, require_vllm
from treadle.engines.vllm_server import PROTOCOL, RUN_HEADER, SERVER_NAME, architecture, pack_output
from treadle.errors import UserError, one_line
from treadle.generation.sampling import SamplingParams

__all__ = ["ServedEngine", "build_parser", "identity_of", "main", "port_number"]

ROUTES = b"unknown route: GET /health; POST /claim, /release, /generate, /score, /weights"


def port_number(text: str) -> int:
    """``--port``'s value: a TCP port (argparse's ``type``: checked before anything loads)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port must lie in 1..65535, got {text!r}; e.g. 8000 (TRL's default)")
    return port


def build_parser(parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser = parser_class(
        prog="treadle vllm-serve",
        description="Serve MODEL with vLLM to GRPO runs with "
        "use_vllm: true, vllm_mode: server (generation, scoring, a weight-update endpoint).",
    )
    parser.add_argument("model", help="a transformers model folder (the policy's architecture), or toy:<size>")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, this machine "
        "only: anyone who reaches the port can replace the weights; 0.0.0.0 for every interface)",
    )
    parser.add_argument("--port", type=port_number, default=8000, help="port (default 8000, TRL's vllm_server_port)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context window (default: the model's)")
    parser.add_argument(
        "--dtype",
        default=None,
        help="weights' dtype in vLLM (default: the saved config's dtype, as "
        "the colocated engine uses the policy's; vLLM's own 'auto' would halve float32)",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU share (TRL vllm-serve's 0.9)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str], parser_class=argparse.ArgumentParser) -> int:
    """Serve until interrupted; returns the exit status (``treadle vllm-serve``)."""
    args = build_parser(parser_class).parse_args(argv)
    owned = None
    if args.model.startswith("toy:"):
        owned = tempfile.mkdtemp(prefix="treadle-vllm-serve-")
        try:
            model, _ = load_model(args.model, seed=args.seed)
        except ValueError as error:
            raise UserError(str(error)) from None
        model.save_pretrained(owned, safe_serialization=True)  # vLLM runs without the tokenizer (treadle tokenises)
    folder = owned or os.path.abspath(args.model)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise UserError(
            f"{args.model} is not a model folder (no config.json); pass a folder written by "
            f"save_pretrained, or toy:<size>"
        )
    try:
        server = ThreadingHTTPServer((args.host, args.port), Handler)  # bound before vLLM's minutes-long start
    except OSError as error:
        raise UserError(
            f"cannot listen on {args.host}:{args.port} ({error.strerror or error}); pass another "
            f"--port, or stop what holds it"
        ) from None
    try:
        serve(server, folder, args)
    finally:
        server.server_close()
        if owned:
            shutil.rmtree(owned, ignore_errors=True)
    return 0


def serve(server: ThreadingHTTPServer, folder: str, args: argparse.Namespace) -> None:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    dtype = args.dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
    server.engine = ServedEngine(
        folder,
        dtype=dtype,
        max_model_length=args.max_model_len,
        seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    server.identity = identity_of(args.model, folder, dtype, server.engine)
    server.lock, server.pending, server.run = threading.Lock(), {}, None
    url = f"http://{args.host}:{server.server_address[1]}"
    print(
        f"treadle: vLLM serves {args.model} at {url} (GET /health; a run connects with use_vllm: true, "
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
    fields (``vllm_server.architecture``, from the config as transformers reads it: defaults included), each weight's
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
        self.folder, self.device, self._vllm = folder, torch.device("cpu"), vllm
        self.sleep_mode = self.sleeping = False
        self.lora = self.lora_request = None  # the server is sent merged weights (engines.vllm_lora: colocated only)
        self.llm = vllm.LLM(
            model=folder,
            skip_tokenizer_init=True,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_length,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            logprobs_mode="processed_logprobs",
            max_logprobs=0,
            worker_extension_cls="treadle.engines.vllm.WeightLoader",
        )

    def close(self) -> None:
        self.shutdown()  # the folder is the user's (or the toy folder vllm_serve.main removes)


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
            self.server.pending.update(load_tensors(body))
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
