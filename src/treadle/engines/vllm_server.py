"""vLLM as a rollout engine in another process (``engines.base.RolloutEngine``): the client side of
``vllm_mode="server"``, which talks to ``treadle vllm-serve MODEL`` (``treadle.engines.serve``) over HTTP with the
standard library alone (the trainer's venv needs no vLLM; docs/vllm.md).

The wire (JSON requests; tensors as safetensors bytes, exact to the bit):

- ``GET /health``: the server's identity (the model it was started with, its config's shape fields, every weight's
  name and shape, its dtype). The engine waits for it up to ``vllm_server_timeout`` seconds, then compares it
  with the policy's (``identity_mismatch``): a server that serves another model is refused before any step.
- ``POST /generate``: prompt ids, the ``SamplingParams`` and one seed drawn from the caller's generator; the answer is
  the ``GenerationOutput`` the server's colocated engine built (``engines.vllm.VLLMEngine``'s own code, run there).
- ``POST /score``: each completion's per-token log-probs (the weight-sync check's probe).
- ``POST /weights``: the policy's merged state dict as safetensors bytes in chunks of at most ``CHUNK_BYTES``; the
  server loads them after the last chunk (``reload_weights``, then its prefix cache is cleared).

A server that stops answering mid-run (killed, crashed, its host gone) is a ``VLLMServerError``: one line naming
the URL and the fix (the CLI exits 2; the checkpoints already written are left as they are).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import time
import urllib.error
import urllib.request

import torch
from safetensors.torch import load as load_tensors, save as save_tensors
from torch import nn

from treadle.engines.vllm import SINGLE_TURN_ONLY, SyncChecked, merged_state_dict
from treadle.errors import UserError
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import GenerationOutput
from treadle.models import unwrapped_for_generation

__all__ = [
    "CHUNK_BYTES",
    "IDENTITY_FIELDS",
    "REQUEST_TIMEOUT",
    "VLLMServerEngine",
    "VLLMServerError",
    "identity_mismatch",
    "pack_output",
    "pack_tensors",
    "server_url",
    "unpack_output",
    "vllm_server_engine",
]

CHUNK_BYTES = 256 * 2**20  # a weight push travels in POSTs of at most this many bytes (bounded buffers on both ends)
REQUEST_TIMEOUT = 1800.0  # seconds one request may wait for its answer (a long generation on a busy CPU)
# the config fields that fix a model's shapes: a server whose values differ serves another model
IDENTITY_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "tie_word_embeddings",
)
START_HINT = "start one with `treadle vllm-serve MODEL --port PORT` (docs/vllm.md)"


class VLLMServerError(UserError, ConnectionError):
    """No vLLM server at the URL, a server serving another model, or one that stopped answering: one line."""


def server_url(args) -> str:
    """The server's base URL from a ``GRPOConfig``: ``vllm_server_base_url``, else ``http://host:port`` (TRL)."""
    if args.vllm_server_base_url:
        return args.vllm_server_base_url.rstrip("/")
    return f"http://{args.vllm_server_host}:{args.vllm_server_port}"


def vllm_server_engine(model: nn.Module, args, *, multi_turn: bool = False) -> VLLMServerEngine:
    """The engine ``GRPOTrainer.build_engine`` returns under ``use_vllm`` with ``vllm_mode="server"``."""
    if multi_turn:
        raise ValueError(SINGLE_TURN_ONLY)
    return VLLMServerEngine(model, server_url(args), timeout=args.vllm_server_timeout)


# ---- the wire: tensors as safetensors bytes --------------------------------------------------------------
def pack_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """``tensors`` as safetensors bytes (a tensor that shares storage with an earlier one, tied embeddings, is
    copied: safetensors stores each storage once)."""
    seen, plain = set(), {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        plain[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return save_tensors(plain)


def pack_output(output: GenerationOutput) -> bytes:
    return pack_tensors(
        {f.name: getattr(output, f.name) for f in dataclasses.fields(output) if getattr(output, f.name) is not None}
    )


def unpack_output(data: bytes, device: torch.device | str = "cpu") -> GenerationOutput:
    return GenerationOutput(**{name: t.to(device) for name, t in load_tensors(data).items()})


def identity_mismatch(identity: dict, model: nn.Module, weights: dict[str, torch.Tensor]) -> str | None:
    """What differs between the model a server says it serves and the policy (config fields, then weights: a name
    the server holds that the policy lacks, or another shape), or None when the policy's weights fit it."""
    config = model.config.to_dict()
    for field in IDENTITY_FIELDS:
        theirs = identity.get("config", {}).get(field)
        if theirs is not None and config.get(field) is not None and theirs != config[field]:
            return f"{field} {theirs} (the policy's: {config[field]})"
    for name, shape in identity.get("weights", {}).items():
        if name not in weights:
            return f"a weight {name} the policy does not have"
        if list(weights[name].shape) != list(shape):
            return f"{name} of shape {tuple(shape)} (the policy's: {tuple(weights[name].shape)})"
    return None


class VLLMServerEngine(SyncChecked):
    """A ``treadle vllm-serve`` server behind the engine contract. The server outlives the engine: ``close`` only
    stops using it (start and stop the server yourself, as with TRL's ``trl vllm-serve``)."""

    def __init__(self, model: nn.Module, url: str, *, timeout: float = 240.0):
        self.url = url.rstrip("/")
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
        self.identity = identity

    def wait_for_server(self, timeout: float) -> dict:
        """The server's identity (``GET /health``), polled until it answers or ``timeout`` seconds have passed."""
        deadline, pause = time.monotonic() + timeout, 0.1
        while True:
            try:
                left = max(1.0, deadline - time.monotonic())  # a port that accepts, never answers
                with urllib.request.urlopen(f"{self.url}/health", timeout=left) as response:
                    return json.loads(response.read())
            except (OSError, http.client.HTTPException, ValueError) as error:  # refused, reset, not JSON: not yet up
                if time.monotonic() + pause > deadline:
                    raise VLLMServerError(
                        f"no vLLM server answered at {self.url}/health within {timeout:g} s "
                        f"({reason(error)}); {START_HINT}, or set vllm_server_base_url (or "
                        f"vllm_server_host / vllm_server_port) to where it runs, and "
                        f"vllm_server_timeout to wait longer for its start"
                    ) from None
            time.sleep(pause)
            pause = min(2.0, pause * 2)

    # ---- the contract ------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        prompt_inputs: dict | None = None,
    ) -> GenerationOutput:
        seed = self.check_request(prompt_ids, prompt_inputs, generator)
        body = {
            "prompt_ids": [list(map(int, p)) for p in prompt_ids],
            "params": dataclasses.asdict(params),
            "seed": seed,
        }
        output = unpack_output(self.request("generate", json.dumps(body).encode()), self.device)
        self.remember_probe(prompt_ids, output)
        return output

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
        pass  # nothing held here: the server is the user's process, and requests open no lasting connection

    # ---- beyond the contract -----------------------------------------------------------------------------
    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[torch.Tensor]:
        """Each completion's per-token log-probs under the server's current weights (temperature 1)."""
        body = {
            "prompt_ids": [list(map(int, p)) for p in prompt_ids],
            "completion_ids": [list(map(int, c)) for c in completion_ids],
        }
        logps = json.loads(self.request("score", json.dumps(body).encode()))["logps"]
        return [torch.tensor(row, dtype=torch.float32) for row in logps]

    def request(self, route: str, body: bytes) -> bytes:
        """POST ``body`` to ``route``; the answer's bytes. A server that stopped answering is one line."""
        try:
            with urllib.request.urlopen(
                urllib.request.Request(f"{self.url}/{route}", data=body, method="POST"), timeout=REQUEST_TIMEOUT
            ) as response:
                return response.read()
        except urllib.error.HTTPError as error:  # the server answered with an error: its one line says what
            detail = error.read().decode(errors="replace").strip()
            raise VLLMServerError(
                f"the vLLM server at {self.url} refused /{route.partition('?')[0]} (HTTP "
                f"{error.code}: {detail or error.reason})"
            ) from None
        except (OSError, http.client.HTTPException) as error:  # refused, reset, cut off, timed out: gone or hung
            raise VLLMServerError(
                f"the vLLM server at {self.url} stopped answering ({reason(error)}); the "
                f"checkpoints written so far are intact: restart the server ({START_HINT}) and "
                f"resume the run (treadle train CONFIG --resume)"
            ) from None


def reason(error: BaseException) -> str:
    """A socket error in a few words (``URLError`` wraps the ``OSError`` that says what happened)."""
    inner = getattr(error, "reason", None)
    inner = inner if isinstance(inner, BaseException) else error
    return getattr(inner, "strerror", None) or str(inner) or type(inner).__name__
