"""torchrun integration on PyTorch's own engine: process group, DDP wrapping, and small collective helpers.

Every helper is a no-op (or the identity) in a single process, so the Trainer calls them unconditionally.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def is_main_process() -> bool:
    return get_rank() == 0


def init_distributed(device: torch.device) -> None:
    """Join the process group that torchrun describes in the environment (nccl on GPU, gloo on CPU)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place and returned); the identity in one process."""
    if is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def any_rank(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is true on at least one rank (every rank must call it)."""
    if not is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (picklable objects); ``[obj]`` in one process."""
    if not is_initialized():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def wrap_model(model: torch.nn.Module, args) -> torch.nn.Module:
    """DDP when world size > 1; the model unchanged otherwise."""
    if get_world_size() <= 1:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [args.device.index] if args.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, find_unused_parameters=args.ddp_find_unused_parameters)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a DDP (or compiled) wrapper."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def no_sync(model: torch.nn.Module, skip_sync: bool):
    """DDP's ``no_sync`` for the micro-batches before the last of an accumulation window (saves all-reduces)."""
    if skip_sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()
