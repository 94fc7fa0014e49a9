"""What crosses a process boundary, in one byte format: tensors as safetensors bytes (exact to the bit, and no code
runs when they are read, unlike a pickle), and the vLLM server protocol's marks.

- ``pack_tensors`` / ``unpack_tensors``: a dict of tensors. The weight pushes to the vLLM server
  (``engines.vllm_client``) and to the rollout worker of asynchronous generation (``trainers.onpolicy.worker``), and
  the batches both send back (``pack_output`` / ``unpack_output``: a ``GenerationOutput``'s tensors), travel so.
- The marks of ``treadle vllm-serve`` (``engines.vllm_server``) that its client (``engines.vllm_client``) checks:
  ``SERVER_NAME`` and ``PROTOCOL`` in ``GET /health``, the run a request comes from (``RUN_HEADER``), and the config
  fields that fix what model a server serves (``IDENTITY_FIELDS``, read by ``architecture``).
"""

from __future__ import annotations

import dataclasses
import json

import torch
from safetensors.torch import load as load_tensors, save as save_tensors

from treadle.errors import shorten
from treadle.generation.single import GenerationOutput

__all__ = [
    "IDENTITY_FIELDS",
    "PROTOCOL",
    "RUN_HEADER",
    "SERVER_NAME",
    "architecture",
    "identity_problem",
    "pack_output",
    "pack_tensors",
    "unpack_output",
    "unpack_tensors",
]

SERVER_NAME = "treadle vllm-serve"  # what /health says in "server": the mark of treadle's server
PROTOCOL = 2  # the wire's version in /health ("protocol"): 2 added the claim and the architecture fields
RUN_HEADER = "X-Treadle-Run"  # the run a request comes from (the one that claimed the server)
# the config fields that fix a model's shapes and its outputs (``architecture``; rope's settings are "rope"):
# a server whose values differ serves another model, even where every weight has the policy's shape
IDENTITY_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "tie_word_embeddings",
    "hidden_act",
    "hidden_activation",
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "rope",
    "partial_rotary_factor",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "logit_scale",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "quantization_config",
)


def pack_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """``tensors`` as safetensors bytes, on the CPU (a tensor that shares storage with an earlier one, tied
    embeddings, is copied: safetensors stores each storage once)."""
    seen, plain = set(), {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        plain[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return save_tensors(plain)


def unpack_tensors(data: bytes, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors ``pack_tensors`` wrote, on ``device``."""
    return {name: tensor.to(device) for name, tensor in load_tensors(data).items()}


def pack_output(output: GenerationOutput) -> bytes:
    """A ``GenerationOutput``'s tensors (its fields that are not None) as bytes."""
    return pack_tensors(
        {f.name: getattr(output, f.name) for f in dataclasses.fields(output) if getattr(output, f.name) is not None}
    )


def unpack_output(data: bytes, device: torch.device | str = "cpu") -> GenerationOutput:
    return GenerationOutput(**unpack_tensors(data, device))


def architecture(config: dict) -> dict:
    """The ``IDENTITY_FIELDS`` a config dict (``PretrainedConfig.to_dict()``) holds, rope's settings gathered in
    one dict under "rope" (transformers 5's ``rope_parameters``, or 4's ``rope_theta`` and ``rope_scaling``), as
    JSON would carry them."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if config.get("rope_theta") is not None:
        rope.setdefault("rope_theta", config["rope_theta"])
    if "type" in rope:  # transformers 4's older spelling
        rope.setdefault("rope_type", rope.pop("type"))
    if rope:
        rope.setdefault("rope_type", "default")
    fields = {**config, "rope": rope or None}
    return json.loads(json.dumps({f: fields[f] for f in IDENTITY_FIELDS if f in fields}, default=str))


def identity_problem(identity: dict) -> str | None:
    """What is wrong with a treadle server's ``/health`` identity (``engines.vllm_server.identity_of``'s shape:
    ``model`` and ``dtype`` strings, ``config`` a dict, ``max_model_len`` a positive whole number or null,
    ``weights`` a dict of name to a list of whole numbers), None when it is whole: a server of another build, or an
    answer changed on its way, is refused in one line before a field of it is used."""

    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    length, weights = identity.get("max_model_len"), identity.get("weights", {})
    if length is not None and not (whole(length) and length > 0):
        return f"its max_model_len is {shorten(json.dumps(length), 60)}, not a positive whole number"
    if not isinstance(weights, dict):
        return f"its weights are a {type(weights).__name__}, not a mapping of each weight's name to its shape"
    bad = next(
        (n for n, s in weights.items() if not (isinstance(s, list) and all(whole(d) and d >= 0 for d in s))), None
    )
    if bad is not None:
        shape = shorten(json.dumps(weights[bad]), 60)
        return f"the shape of its weight {shorten(bad, 80)} is {shape}, not a list of sizes"
    for name, kind in (("model", str), ("dtype", str), ("config", dict)):
        if name in identity and not isinstance(identity[name], kind):
            return f"its {name} is {shorten(json.dumps(identity[name]), 60)}, not a {kind.__name__}"
    return None
