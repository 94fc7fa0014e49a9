"""A PEFT LoRA policy in the colocated vLLM engine (engines/vllm.py): the base weights once, then the adapters alone.

- ``lora_plan(model)``: the policy's one active LoRA adapter as (PEFT model, adapter name, its ``LoraConfig``) when
  vLLM can serve it as a LoRA request, else None (the engine then syncs merged weights, as before): vLLM 0.32 has
  no DoRA, no ``modules_to_save`` (beyond classification heads), no LoRA biases, no layer replication, one adapter
  per request.
- At start the engine loads the base weights (the adapters left out) with ``enable_lora=True`` and
  ``max_lora_rank`` the smallest rank vLLM allows at or above the adapter's (``lora_rank_bound``); the adapter's
  ``adapter_config.json`` is written once.
- Each sync writes the adapter's tensors (``adapter_tensors``: peft's file format, gathered under FSDP2) to
  ``adapter_model.safetensors`` and registers them under a fresh ``lora_int_id`` (a new adapter to vLLM: its
  prefix-cache blocks and loaded weights are keyed by the id); the previous id is removed. vLLM 0.32's
  ``LoRARequest`` loads from a folder only (no in-memory tensors), hence the file.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from torch import nn

from treadle import distributed as dist

__all__ = ["LORA_RANKS", "adapter_tensors", "lora_plan", "lora_rank_bound", "write_adapter"]

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's allowed max_lora_rank values (config/lora.py)


def lora_plan(model: nn.Module):
    """(PEFT model, adapter name, ``LoraConfig``) of a policy vLLM can serve as a LoRA request, else None."""
    peft_model = dist.unwrap_model(model)
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict) or not callable(getattr(peft_model, "get_base_model", None)):
        return None
    active = list(getattr(peft_model, "active_adapters", []) or [])
    if len(active) != 1 or active[0] not in configs:
        return None
    config = configs[active[0]]
    unsupported = (
        getattr(config, "peft_type", None) != "LORA"
        or getattr(config, "use_dora", False)
        or getattr(config, "modules_to_save", None)
        or getattr(config, "bias", "none") != "none"
        or getattr(config, "lora_bias", False)
        or getattr(config, "layer_replication", None)
        or max([config.r, *(config.rank_pattern or {}).values()]) > LORA_RANKS[-1]
    )
    return None if unsupported else (peft_model, active[0], config)


def lora_rank_bound(config) -> int:
    """vLLM's ``max_lora_rank`` for ``config``: the smallest allowed value at or above its largest rank."""
    rank = max([config.r, *(config.rank_pattern or {}).values()])
    return next(bound for bound in LORA_RANKS if bound >= rank)


def adapter_tensors(inner: nn.Module, peft_model: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors as peft saves them (``base_model.model.<module>.lora_A.weight``), read from ``inner``
    (the base model with the adapters injected, gathered: ``models.unwrapped_for_generation``)."""
    from peft import get_peft_model_state_dict  # optional: PEFT policies only

    state = {
        f"base_model.model.{key}": tensor.detach() for key, tensor in inner.state_dict().items() if "lora_" in key
    }
    return {
        key: tensor.contiguous()
        for key, tensor in get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=adapter).items()
    }


def write_adapter(folder: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as ``folder/adapter_model.safetensors`` (replacing the last sync's file)."""
    partial = os.path.join(folder, "adapter_model.safetensors.partial")
    save_file({key: tensor.cpu() for key, tensor in tensors.items()}, partial)
    os.replace(partial, os.path.join(folder, "adapter_model.safetensors"))
