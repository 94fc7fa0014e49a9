"""Checkpoints that never lose a run.

Layout of ``output_dir/checkpoint-<global_step>/``::

    model.safetensors (or the save_pretrained layout of a transformers model, config.json included;
                    for a PEFT model its adapter: adapter_model.safetensors + adapter_config.json)
    optimizer.pt  scheduler.pt      torch.save of state dicts (tensors and numbers only)
    model_sharded/ optimizer_sharded/   under FSDP2, instead of the weights and optimizer.pt: every rank's
                                    shards, written by torch.distributed.checkpoint (resume at the same world size)
    rng_state_<rank>.pth            python / numpy / torch (and CUDA) generator states of each rank
    training_args.json              the arguments, as JSON
    tokenizer files                 when the Trainer has a processing_class
    trainer_state.json              written last: its presence marks a complete checkpoint

A checkpoint is written into ``.tmp-checkpoint-<step>`` beside its final place, flushed to disk, and renamed
into place only when complete, so a process killed mid-save leaves every earlier checkpoint intact and no
folder that looks complete. Loading never unpickles arbitrary objects: safetensors for weights,
``torch.load(weights_only=True)`` for optimizer / scheduler / RNG state, JSON for the rest. Every file is read
before anything is restored: a missing, truncated or corrupt file raises ``CheckpointError`` naming the file
(and so its checkpoint) and leaves the model, optimizer and RNG untouched. Which checkpoint a run resumes from,
and whether it continues that run exactly, is ``treadle.resume``'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import sys

import torch

from treadle import distributed as dist, models, peft as treadle_peft
from treadle.errors import UserError
from treadle.record import fingerprints
from treadle.record.disk import MODEL_SCRATCH
from treadle.record.runfiles import ARGS_FILE
from treadle.state import TrainerState

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
ADAPTER_FILE = "adapter_model.safetensors"  # what a PEFT model's save_pretrained writes instead of the weights


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file and what to do."""


# ---------------------------------------------------------------------------------------------------------
# Finding checkpoints
# ---------------------------------------------------------------------------------------------------------
def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, STATE_FILE))


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints in ``output_dir`` as (step, path), oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = re.fullmatch(rf"{PREFIX}(\d+)", name)
        path = os.path.join(output_dir, name)
        if m and is_complete(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def path_for(output_dir: str, step: int) -> str:
    """Where the checkpoint of ``step`` lives: ``output_dir/checkpoint-<step>``."""
    return os.path.join(output_dir, f"{PREFIX}{step}")


WEIGHTS_FIX = (
    "load them into the model they were saved from: the run's model and peft settings (a LoRA run's "
    "checkpoint holds adapters only)"
)


def latest_checkpoint(output_dir: str) -> str | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


# ---------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------
def save_weights(model: torch.nn.Module, directory: str, state_dict: dict | None = None) -> None:
    """save_pretrained (safetensors) for transformers models, ``model.safetensors`` for any other module.
    ``state_dict``: full weights to write instead of the model's own (an FSDP2 model's, gathered on rank 0 by
    ``distributed.full_state_dict``)."""
    model = dist.unwrap_model(model)
    if hasattr(model, "save_pretrained"):
        with _no_transformers_progress_bars():  # save_pretrained empties the dict it is given: pass a copy
            model.save_pretrained(directory, state_dict=dict(state_dict) if state_dict is not None else None)
    elif state_dict is not None:
        from safetensors.torch import save_file

        save_file(_without_shared(state_dict), os.path.join(directory, WEIGHTS_FILE))
    else:
        from safetensors.torch import save_model

        save_model(model, os.path.join(directory, WEIGHTS_FILE))


def _without_shared(state_dict: dict) -> dict:
    # safetensors refuses two names for one storage (tied weights); load_weights accepts the missing twin
    seen, out = set(), {}
    for name, tensor in state_dict.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor.contiguous()
    return out


@contextlib.contextmanager
def _no_transformers_progress_bars():
    """save_pretrained draws a "Writing model shards" bar at every save: noise in a training log. Turned off
    for the save, then restored as it was (transformers is only looked up, never imported, here)."""
    hf_logging = getattr(sys.modules.get("transformers.utils"), "logging", None)
    if hf_logging is None or not hasattr(hf_logging, "disable_progress_bar"):
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_weights(model: torch.nn.Module, directory: str) -> None:
    """Load the weights saved by ``save_weights`` into ``model`` (in place), failing with the file's name.
    An FSDP2 model loads its shards of a sharded checkpoint instead (every rank must call it then)."""
    if dist.is_fsdp(model):
        _load_sharded(directory, model)
        return
    _load_state_dict(dist.unwrap_model(model), read_weights(directory), directory)


def read_weights(directory: str) -> dict[str, torch.Tensor]:
    """The tensors saved by ``save_weights`` (all shards), read with safetensors onto the CPU."""
    from safetensors.torch import load_file

    index = os.path.join(directory, WEIGHTS_INDEX)
    if os.path.isfile(index):
        files = sorted(set(read_json(index, directory)["weight_map"].values()))
    else:
        adapter_only = os.path.isfile(os.path.join(directory, ADAPTER_FILE)) and not os.path.isfile(
            os.path.join(directory, WEIGHTS_FILE)
        )
        files = [ADAPTER_FILE if adapter_only else WEIGHTS_FILE]
    state = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"checkpoint {directory!r} has no weights file {name!r}: it is incomplete or not "
                f"a checkpoint of this model; resume from another checkpoint"
            )
        try:
            state.update(load_file(path, device="cpu"))
        except Exception as e:  # safetensors raises its own error type for truncated / garbled files
            raise CheckpointError(
                f"cannot read {path!r}: {_first_line(e)}. The file is corrupt or truncated; "
                f"resume from an earlier checkpoint"
            ) from e
    return state


def _load_state_dict(model: torch.nn.Module, state: dict, directory: str) -> None:
    """Copy ``state`` into ``model`` after checking that it fits: names and shapes are checked first, so a
    mismatch leaves the model untouched. A PEFT model takes its adapter weights, named as peft saves them."""
    peft = models.is_peft_model(model)
    params = treadle_peft.adapter_state_dict(model) if peft else dict(model.state_dict(keep_vars=True))
    unexpected = [k for k in state if k not in params]
    if unexpected:
        raise CheckpointError(
            f"weights in {directory!r} do not fit this model: unexpected keys {unexpected[:5]}; {WEIGHTS_FIX}"
        )
    # save_pretrained drops tied duplicates (e.g. lm_head.weight tied to the embeddings): a missing key is
    # fine only when it shares storage with a loaded one.
    loaded = {params[k].data_ptr() for k in state}
    missing = [k for k in params if k not in state and params[k].data_ptr() not in loaded]
    if missing:
        raise CheckpointError(
            f"weights in {directory!r} do not fit this model: missing keys {missing[:5]}; {WEIGHTS_FIX}"
        )
    wrong = [
        f"{k} {tuple(v.shape)} vs {tuple(params[k].shape)}" for k, v in state.items() if v.shape != params[k].shape
    ]
    if wrong:
        raise CheckpointError(
            f"weights in {directory!r} do not fit this model: shapes differ: {wrong[:5]}; {WEIGHTS_FIX}"
        )
    if peft:
        treadle_peft.load_adapter_state_dict(model, state)
    else:
        model.load_state_dict(state, strict=False)


# ---------------------------------------------------------------------------------------------------------
# RNG
# ---------------------------------------------------------------------------------------------------------
def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached": cached,
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------------------
# Save / load a whole checkpoint
# ---------------------------------------------------------------------------------------------------------
def save_checkpoint(
    output_dir: str,
    *,
    model,
    optimizer,
    scheduler,
    state,
    args,
    processing_class=None,
    save_only_model: bool = False,
    extra_state: dict | None = None,
) -> str:
    """Write ``checkpoint-<state.global_step>`` atomically and return its path. Every rank must call it.
    ``extra_state`` (this rank's, tensors / numbers / strings in lists and dicts) goes to
    ``extra_state_<rank>.pt`` inside the same atomic write."""
    final = os.path.join(output_dir, f"{PREFIX}{state.global_step}")
    tmp = os.path.join(output_dir, f"{TMP_PREFIX}{state.global_step}")
    main = dist.is_main_process()
    if main:
        os.makedirs(output_dir, exist_ok=True)
        _remove_stale_tmp(output_dir)
        os.makedirs(tmp)
    dist.barrier()
    fsdp = dist.is_fsdp(model)  # FSDP2: every rank writes its shards (torch.distributed.checkpoint)
    if fsdp:
        dist.save_sharded(tmp, model, None if save_only_model else optimizer)
    if main:
        if not fsdp:
            save_weights(model, tmp)
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(tmp)
        if not save_only_model and not fsdp:
            torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        if not save_only_model and scheduler is not None:
            torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
        with open(os.path.join(tmp, ARGS_FILE), "w") as f:
            f.write(args.to_json_string() + "\n")
    if not save_only_model:
        torch.save(rng_state(), os.path.join(tmp, f"rng_state_{dist.get_rank()}.pth"))
        if extra_state is not None:
            torch.save(extra_state, os.path.join(tmp, f"extra_state_{dist.get_rank()}.pt"))
    dist.barrier()
    if main:
        state.save_to_json(os.path.join(tmp, STATE_FILE))  # last: marks the folder complete
        # treadle's own: what overwrite may delete, what resume verifies
        fingerprints.write_marker(tmp, dataset=getattr(state, "dataset_fingerprint", None))
        _fsync_tree(tmp)
        _replace_dir(tmp, final)
    dist.barrier()
    return final


def save_run_checkpoint(args, state, eval_metrics: dict | None, **save_kwargs) -> str:
    """``save_checkpoint`` for a training run: record it as the best when ``eval_metrics`` (of this step) say
    so, write it, then rotate (the best and the one just written are kept, even when the latter is not the
    highest step: a run resumed from an older checkpoint while later ones exist)."""
    path = os.path.join(args.output_dir, f"{PREFIX}{state.global_step}")
    update_best(state, args, eval_metrics, path)
    save_checkpoint(args.output_dir, state=state, args=args, **save_kwargs)
    if dist.is_main_process():
        rotate(args.output_dir, args.save_total_limit, keep=(state.best_model_checkpoint, path))
    return path


def export_model(model, output_dir: str, processing_class=None, args=None) -> None:
    """Write the final weights (save_pretrained layout for transformers models; a PEFT model's adapter), the
    processing class and ``args`` (``training_args.json``) to ``output_dir``. With ``args.merge_adapters``, a
    PEFT model is also written merged, as a plain transformers model, to ``output_dir/merged``. Every rank
    must call it (FSDP2 gathers the full weights on rank 0, which writes)."""
    merge = getattr(args, "merge_adapters", False) and models.is_peft_model(model)
    if merge and dist.is_fsdp(model):
        raise ValueError(
            "merge_adapters=True cannot merge an FSDP-sharded model; train with merge_adapters=False, "
            f"then run `treadle merge {output_dir}`"
        )
    full_weights = dist.full_state_dict(model)
    if dist.is_main_process():
        os.makedirs(output_dir, exist_ok=True)
        # written whole into a scratch folder, then renamed into place: a save that fails (a full disk) leaves
        # output_dir as it was, never a config.json without its weights
        scratch = os.path.join(output_dir, f"{MODEL_SCRATCH}{os.getpid()}")
        try:
            _write_export(model, scratch, full_weights, processing_class, args, merge)
            _move_into(scratch, output_dir)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if merge:
            print(
                f"treadle: merge_adapters: the adapters merged into the base model, a plain transformers model, "
                f"in {os.path.join(output_dir, treadle_peft.MERGED_DIR)}",
                flush=True,
            )
    dist.barrier()


def _write_export(model, folder: str, full_weights, processing_class, args, merge: bool) -> None:
    """The final model's files in ``folder``: weights, ``merged/`` when ``merge``, the processing class, the args."""
    save_weights(model, folder, state_dict=full_weights)
    folders = [folder] + ([os.path.join(folder, treadle_peft.MERGED_DIR)] if merge else [])
    if merge:
        save_weights(treadle_peft.merged_model(model), folders[1])
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        for each in folders:
            processing_class.save_pretrained(each)
    if args is not None:
        with open(os.path.join(folder, ARGS_FILE), "w") as f:
            f.write(args.to_json_string() + "\n")
    _fsync_tree(folder)


WEIGHT_FILES = re.compile(r"model\.safetensors(\.index\.json)?|model-\d+-of-\d+\.safetensors")


def _move_into(scratch: str, output_dir: str) -> None:
    """Rename each entry of ``scratch`` into ``output_dir`` (a folder replaces the one of its name): renames take
    no space, so a full disk cannot stop them half-way. Weight files of an earlier save that this one does not
    replace (its shards, when this one is a single file, or the other way round) go, as save_pretrained's own."""
    new = set(os.listdir(scratch))
    for name in os.listdir(output_dir) if any(WEIGHT_FILES.fullmatch(n) for n in new) else ():
        if name not in new and WEIGHT_FILES.fullmatch(name) and os.path.isfile(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))
    for name in sorted(new):
        target = os.path.join(output_dir, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        os.replace(os.path.join(scratch, name), target)
    _fsync_dir(output_dir)


TRANSFORMERS_ARGS = "training_args.bin"  # transformers' Trainer (and TRL's) pickles its arguments there; treadle never


def check_own_checkpoint(path: str) -> None:
    """Refuse (CheckpointError) to resume checkpoint ``path`` when transformers' Trainer wrote it (its
    ``training_args.bin``, no treadle marker): its optimizer, scheduler and RNG files are that Trainer's, so treadle
    cannot continue its run exactly; its weights can start a new one."""
    if os.path.isfile(os.path.join(path, TRANSFORMERS_ARGS)) and fingerprints.read_marker(path) is None:
        raise CheckpointError(
            f"checkpoint {path} was written by transformers' Trainer (it holds {TRANSFORMERS_ARGS} and no "
            f"{fingerprints.MARKER}), not by treadle, which cannot continue that run exactly; its weights can start "
            f"a new run: model: {path}, in a new output_dir (or resume it with transformers' Trainer)"
        )


def read_state(path: str):
    """The TrainerState saved in checkpoint ``path`` (its ``trainer_state.json``), without loading anything else."""
    try:
        return TrainerState.load_from_json(os.path.join(path, STATE_FILE))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"cannot read {os.path.join(path, STATE_FILE)!r} in checkpoint {path!r}: "
            f"{_first_line(e)}; the file is corrupt: resume from an earlier checkpoint"
        ) from e


def load_checkpoint(path: str, *, model, optimizer=None, scheduler=None, load_rng: bool = True):
    """Restore weights, optimizer, scheduler and this rank's RNG from ``path``; return its TrainerState.

    Every file is read (and checked) before anything is restored, so a corrupt checkpoint raises a
    CheckpointError and leaves the model, optimizer and RNG exactly as they were."""
    state = read_state(path)
    if dist.is_fsdp(model):
        return _load_sharded_checkpoint(path, model, optimizer, scheduler, load_rng, state)
    weights = read_weights(path)
    optimizer_state = _torch_load(path, "optimizer.pt") if optimizer is not None else None
    scheduler_state = _torch_load(path, "scheduler.pt") if scheduler is not None else None
    rng = _torch_load(path, f"rng_state_{dist.get_rank()}.pth") if load_rng else None
    _load_state_dict(dist.unwrap_model(model), weights, path)
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state)
    if scheduler is not None:
        scheduler.load_state_dict(scheduler_state)
    if load_rng:
        set_rng_state(rng)
    return state


def load_extra_state(path: str) -> dict | None:
    """This rank's ``extra_state_<rank>.pt`` from checkpoint ``path`` (None when the trainer saved none)."""
    name = f"extra_state_{dist.get_rank()}.pt"
    return _torch_load(path, name) if os.path.isfile(os.path.join(path, name)) else None


def _load_sharded_checkpoint(path: str, model, optimizer, scheduler, load_rng: bool, state):
    """load_checkpoint for an FSDP2 model: shards through torch.distributed.checkpoint (same world size)."""
    scheduler_state = _torch_load(path, "scheduler.pt") if scheduler is not None else None
    rng = _torch_load(path, f"rng_state_{dist.get_rank()}.pth") if load_rng else None
    if optimizer is not None and not dist.has_sharded_optimizer(path):
        raise CheckpointError(
            f"checkpoint {path!r} has no sharded optimizer state ({dist.OPTIMIZER_SHARDS}/): it "
            f"was saved with save_only_model=True or is incomplete; load it as weights only"
        )
    _load_sharded(path, model, optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(scheduler_state)
    if load_rng:
        set_rng_state(rng)
    return state


def _load_sharded(directory: str, model, optimizer=None) -> None:
    if not dist.has_sharded_model(directory):
        raise CheckpointError(
            f"{directory!r} holds no sharded weights ({dist.MODEL_SHARDS}/.metadata) for this "
            f"FSDP2 model: it was saved without fsdp='full_shard' (load it before sharding) or "
            f"is incomplete"
        )
    try:
        dist.load_sharded(directory, model, optimizer)
    except Exception as e:  # DCP wraps every rank's failure in one CheckpointException
        raise CheckpointError(
            f"cannot load the sharded checkpoint {directory!r}: {e}. Resume with the same "
            f"model and number of processes, or from an earlier checkpoint"
        ) from e


def _torch_load(directory: str, name: str):
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"checkpoint {directory!r} has no {name!r} (saved with save_only_model=True, or "
            f"incomplete); it cannot be resumed from, only loaded as weights"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"cannot read {path!r}: {_first_line(e)}. The file is corrupt or truncated, or holds "
            f"Python objects that treadle never unpickles; resume from an earlier "
            f"checkpoint"
        ) from e


def _first_line(error: Exception) -> str:
    """The gist of a loader's error on one line. torch's weights-only refusal is a paragraph advising
    ``weights_only=False``, which is the wrong advice for a damaged file: keep its detail line only."""
    text = str(error)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = "not a weights-only torch file: " + text.split(marker, 1)[1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}"[:300] if lines else type(error).__name__


def read_json(path: str, directory: str) -> dict:
    """The JSON file ``path`` of checkpoint ``directory``; a CheckpointError naming both when it cannot be read."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"cannot read {path!r} in checkpoint {directory!r}: {_first_line(e)}; the file is "
            f"corrupt: resume from an earlier checkpoint"
        ) from e


# ---------------------------------------------------------------------------------------------------------
# The best checkpoint and rotation
# ---------------------------------------------------------------------------------------------------------
def update_best(state, args, metrics: dict | None, path: str) -> None:
    """Record checkpoint ``path`` (about to be written at ``state.global_step``) as the best when its
    evaluation ``metrics`` beat ``state.best_metric`` on ``args.metric_for_best_model``."""
    key = args.metric_for_best_model
    if key is None or not metrics:
        return
    key = key if key.startswith("eval_") else f"eval_{key}"
    if key not in metrics:
        raise KeyError(
            f"metric_for_best_model={args.metric_for_best_model!r} is not among the evaluation "
            f"metrics {sorted(metrics)}"
        )
    value, best = metrics[key], state.best_metric
    if best is None or (value > best if args.greater_is_better else value < best):
        state.best_metric, state.best_global_step = value, state.global_step
        state.best_model_checkpoint = path


def rotate(output_dir: str, limit: int | None, *, keep: tuple[str | None, ...] = ()) -> list[str]:
    """Delete the oldest complete checkpoints beyond ``limit``, never the newest nor any in ``keep`` (the best).
    Returns the deleted paths."""
    if limit is None:
        return []
    found = [p for _, p in list_checkpoints(output_dir)]
    protected = {os.path.abspath(p) for p in keep if p} | ({os.path.abspath(found[-1])} if found else set())
    deletable = [p for p in found if os.path.abspath(p) not in protected]
    excess = len(found) - limit
    deleted = deletable[: max(0, excess)]
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    return deleted


def _remove_stale_tmp(output_dir: str) -> None:
    for name in os.listdir(output_dir):
        if name.startswith(TMP_PREFIX) or name.startswith(".old-" + PREFIX):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)


def _replace_dir(tmp: str, final: str) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (same step saved again) is moved aside first."""
    old = None
    if os.path.exists(final):
        old = os.path.join(os.path.dirname(final), ".old-" + os.path.basename(final))
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(root: str) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(folder)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
