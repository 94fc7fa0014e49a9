"""``treadle vllm-serve MODEL [--host H] [--port P] ...``: vLLM serving a model to GRPO runs in other processes
(``vllm_mode="server"``). This is the command: its flags, the model it is given (a transformers model folder, made
absolute because vLLM looks a relative path up on the Hub, or ``toy:<size>``, built and saved to a temporary
folder that is removed when the server stops) and the port; the server itself is ``engines.vllm_server``. vLLM is
imported only once the server starts."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile

from treadle.cli.loading import load_model
from treadle.engines import vllm_server
from treadle.errors import UserError

__all__ = ["build_parser", "main", "port_number"]


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
    """Serve until interrupted; returns the exit status (``treadle vllm-serve``). The address is bound first: a
    host that is not this machine's, or a port in use, is one line before any model is built."""
    args = build_parser(parser_class).parse_args(argv)
    server = vllm_server.bind(args.host, args.port)
    try:
        with model_folder(args.model, args.seed) as folder:
            vllm_server.serve(
                server,
                folder,
                name=args.model,
                dtype=args.dtype,
                max_model_length=args.max_model_len,
                seed=args.seed,
                gpu_memory_utilization=args.gpu_memory_utilization,
                tensor_parallel_size=args.tensor_parallel_size,
            )
    finally:
        server.server_close()
    return 0


@contextlib.contextmanager
def model_folder(model: str, seed: int):
    """The folder vLLM serves ``model`` from: a transformers model folder (absolute), or ``toy:<size>`` built and
    saved to a temporary folder, removed when the block ends."""
    owned = None
    if model.startswith("toy:"):
        owned = tempfile.mkdtemp(prefix="treadle-vllm-serve-")
        try:
            built, _ = load_model(model, seed=seed)
        except ValueError as error:
            shutil.rmtree(owned, ignore_errors=True)
            raise UserError(str(error)) from None
        built.save_pretrained(owned, safe_serialization=True)  # vLLM runs without the tokenizer (treadle tokenises)
    folder = owned or os.path.abspath(model)
    try:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise UserError(
                f"{model} is not a model folder (no config.json); pass a folder written by save_pretrained, or "
                f"toy:<size>"
            )
        yield folder
    finally:
        if owned:
            shutil.rmtree(owned, ignore_errors=True)
