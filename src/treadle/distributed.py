"""torchrun integration on PyTorch's own engine: process group, DDP / FSDP2 wrapping, sharded checkpoints
through ``torch.distributed.checkpoint``, and small collective helpers.

One process per device, launched by ``torchrun --nproc_per_node N``; the process group is read from the
environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), with
nccl on GPUs and gloo on CPUs. Every helper is a no-op (or the identity) in a single process, so the Trainer
calls them unconditionally. Collectives (``all_reduce_sum``, ``gather_objects``, ``any_rank`` ...) must be
called by every rank in the same order; a rank that never arrives makes the others fail after
``TREADLE_DDP_TIMEOUT`` seconds (default 1800) instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 1800.0  # as torch's own default: long enough for a slow checkpoint write or evaluation
TIMEOUT_ENV = "TREADLE_DDP_TIMEOUT"
MODEL_SHARDS = "model_sharded"  # checkpoint sub-folders written by torch.distributed.checkpoint under FSDP
OPTIMIZER_SHARDS = "optimizer_sharded"


# ---------------------------------------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------------------------------------
def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size() -> int:
    """Processes in the process group (1 without one). Before the group exists: ``launched()``."""
    return dist.get_world_size() if is_initialized() else 1


def get_rank() -> int:
    """This process's rank in the process group (0 without one)."""
    return dist.get_rank() if is_initialized() else 0


def launched(name: str = "WORLD_SIZE") -> int:
    """What torchrun launched, read from its environment before any process group exists (configs are checked,
    and the CLI claims its run folder, before the Trainer joins the group): ``"WORLD_SIZE"`` (1 without
    torchrun), ``"RANK"`` or ``"LOCAL_RANK"`` (0 without torchrun)."""
    return int(os.environ.get(name, "1" if name == "WORLD_SIZE" else "0"))


def is_main_process() -> bool:
    return get_rank() == 0


def collective_timeout_s() -> float:
    """Seconds a collective waits for the other ranks before failing (``TREADLE_DDP_TIMEOUT``, default 1800)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; set e.g. {TIMEOUT_ENV}=600") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be > 0 seconds, got {value}")
    return value


def init_distributed(device: torch.device, timeout_s: float | None = None, *, force: bool = False) -> None:
    """Join the process group that torchrun describes in the environment (nccl on GPU, gloo on CPU).

    A no-op without torchrun (``WORLD_SIZE`` unset or 1) or when a group exists already. ``force=True``
    creates a group even for one process (rendezvous on a free local port when torchrun set none): that is
    how one device runs through DDP or FSDP2 exactly as N devices would (``python -m benchmarks.gpu_check``).
    """
    if is_initialized() or (not force and launched("WORLD_SIZE") <= 1):
        return
    if force:
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(name, value)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else collective_timeout_s())
    store = _attempt_store(timeout)
    where = {} if store is None else {"store": store, "rank": launched("RANK"), "world_size": launched("WORLD_SIZE")}
    dist.init_process_group(
        backend="nccl" if cuda else "gloo", timeout=timeout, device_id=device if cuda else None, **where
    )


def finish() -> None:
    """Leave the process group at the end of a run (a no-op without one), as torch asks of a normal exit (NCCL
    warns otherwise). The trainer's DDP reducer or FSDP state sits in reference cycles that hold the group:
    they are collected first, while the group and the interpreter are alive; freed in the interpreter's
    finalisation instead, gloo's threads have aborted a finished process (pytorch/pytorch#190489)."""
    if is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _attempt_store(timeout: datetime.timedelta):
    """torchrun's agent store seen under a prefix of this attempt (``TORCHELASTIC_RESTART_COUNT``), None outside
    torchrun's agent. The agent's store outlives a restart (``--max-restarts``): read without a prefix, the
    restarted workers found the gloo addresses of the attempt before and failed to connect (torch 2.13)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        launched("WORLD_SIZE"),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"treadle/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_errors(fn):
    """Decorator: an exception escaping ``fn`` in a multi-process run carries a note naming the rank, so the
    launcher's log says which process failed first (its peers then fail on a closed connection or time out
    after ``TREADLE_DDP_TIMEOUT`` seconds; torchrun stops the rest)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            if is_initialized() and get_world_size() > 1 and not isinstance(e, (SystemExit, KeyboardInterrupt)):
                note = f"treadle: raised on rank {get_rank()} of {get_world_size()} (pid {os.getpid()})"
                if note not in getattr(e, "__notes__", ()):
                    e.add_note(note)
            raise

    return wrapper


# ---------------------------------------------------------------------------------------------------------
# Collectives (every rank must call them, in the same order)
# ---------------------------------------------------------------------------------------------------------
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


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate a CPU tensor's rows from every rank, in rank order (the tensor itself in one process)."""
    if get_world_size() == 1:
        return tensor
    return torch.cat(gather_objects(tensor))


def gather_padded(tensors: list[torch.Tensor]):
    """Concatenate this rank's per-batch tensors with every other rank's, in rank order, as one numpy array.
    Ragged sequence dimensions (dim 1) are padded with -100 (the label ignore index). Every rank must call it."""
    tensors = [t for part in gather_objects(tensors) for t in part]
    if tensors[0].dim() <= 1 or all(t.shape[1:] == tensors[0].shape[1:] for t in tensors):
        out = torch.cat(tensors)
    else:
        length = max(t.shape[1] for t in tensors)
        out = torch.cat(
            [
                torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, length - t.shape[1]), value=-100)
                for t in tensors
            ]
        )
    return (out.float() if out.dtype == torch.bfloat16 else out).numpy()


# ---------------------------------------------------------------------------------------------------------
# Wrapping: DDP or FSDP2
# ---------------------------------------------------------------------------------------------------------
def wrap_model(model: torch.nn.Module, args) -> torch.nn.Module:
    """FSDP2 when ``args.fsdp == "full_shard"``, else DDP, whenever a process group exists; the model
    unchanged in a plain single process. FSDP2 shards ``model`` in place and returns it (the same object)."""
    if not is_initialized():
        return model
    if args.fsdp == "full_shard":
        return shard_model(model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [args.device.index] if args.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, find_unused_parameters=args.ddp_find_unused_parameters)


def shard_model(model: torch.nn.Module, **fully_shard_kwargs) -> torch.nn.Module:
    """Apply ``fully_shard`` to every transformer block, then to the root (which keeps the embeddings, the
    final norm and the LM head, so tied weights stay in one parameter group). Blocks are the modules whose
    class a transformers model lists in ``_no_split_modules``, else the entries of every ``nn.ModuleList``.
    Sharding per block lets FSDP2 all-gather one block at a time: peak memory ~ one block's full weights."""
    from torch.distributed.fsdp import fully_shard

    for block in transformer_blocks(model):
        fully_shard(block, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return model


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of ``model`` (see ``shard_model``), outermost first, none nested in another."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    else:
        found = [child for m in model.modules() if isinstance(m, torch.nn.ModuleList) for child in m]
    inner = {id(sub) for block in found for sub in block.modules() if sub is not block}
    return [block for block in found if id(block) not in inner]


def is_fsdp(model: torch.nn.Module) -> bool:
    """True for a model sharded with FSDP2 (``fully_shard``)."""
    if not dist.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside a DDP (or compiled) wrapper. An FSDP2 model is its own unwrapped model (its
    parameters are sharded DTensors; use ``full_state_dict`` for plain tensors)."""
    return _wrapper_chain(model)[-1]


def is_ddp(model: torch.nn.Module) -> bool:
    """True when a DDP wrapper is among ``model``'s wrappers (the chain ``unwrap_model`` walks)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return any(isinstance(wrapper, DDP) for wrapper in _wrapper_chain(model))


def _wrapper_chain(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model`` and each module it wraps (DDP's ``.module``, a compiled model's ``._orig_mod``), outermost first."""
    chain = [model]
    while (inner := getattr(chain[-1], "module", None) or getattr(chain[-1], "_orig_mod", None)) is not None:
        chain.append(inner)
    return chain


def no_sync(model: torch.nn.Module, skip_sync: bool):
    """Skip the gradient reduction for the micro-batches before the last of an accumulation window: DDP's
    ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``. Gradients are reduced once, on the last."""
    if not skip_sync:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if is_fsdp(model):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ---------------------------------------------------------------------------------------------------------
# FSDP2 state: consolidated export and sharded checkpoints (torch.distributed.checkpoint)
# ---------------------------------------------------------------------------------------------------------
def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """For an FSDP2 model, the full (unsharded) state dict as CPU tensors on rank 0 and ``{}`` on the other
    ranks -- a collective: every rank must call it. None for any other model (its own state_dict is full)."""
    if not is_fsdp(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # gathered copies no longer share storage: drop the second name of a tied parameter (lm_head tied to the
    # embeddings), as save_pretrained does for an unsharded model, so both exports have the same keys
    tied = _tied_duplicates(model)
    return {name: tensor for name, tensor in state.items() if name not in tied}


def _tied_duplicates(model: torch.nn.Module) -> set[str]:
    first_name: dict[int, str] = {}
    duplicates = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            duplicates.add(name)
        else:
            first_name[id(param)] = name
    return duplicates


def save_sharded(directory: str, model: torch.nn.Module, optimizer=None) -> None:
    """Write each rank's shards of the model (and optimizer) with ``torch.distributed.checkpoint`` into
    ``directory/model_sharded`` (and ``optimizer_sharded``). Every rank must call it; ``directory`` must exist."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(directory, MODEL_SHARDS))
    if optimizer is not None:
        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=os.path.join(directory, OPTIMIZER_SHARDS))


def has_sharded_model(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MODEL_SHARDS, ".metadata"))


def has_sharded_optimizer(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, OPTIMIZER_SHARDS, ".metadata"))


def load_sharded(directory: str, model: torch.nn.Module, optimizer=None) -> None:
    """Load what ``save_sharded`` wrote into an FSDP2 ``model`` (and ``optimizer``), in place. Every rank
    must call it. torch.distributed.checkpoint can reshard, but treadle resumes only at the same world size
    (the data order depends on it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=os.path.join(directory, MODEL_SHARDS))
    set_model_state_dict(model, state)
    if optimizer is not None:
        optim_state = get_optimizer_state_dict(model, optimizer)
        dcp.load(optim_state, checkpoint_id=os.path.join(directory, OPTIMIZER_SHARDS))
        set_optimizer_state_dict(model, optimizer, optim_state)
