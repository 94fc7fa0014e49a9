"""PEFT (LoRA) in treadle: the optional ``peft`` library (``pip install 'treadle[peft]'``), imported only when a
``peft_config`` or a PEFT model is used.

:func:`apply_peft` wraps a model for a ``peft_config`` (what every trainer's ``peft_config`` does),
:func:`lora_config` builds a ``LoraConfig`` from a YAML mapping, :func:`disable_adapter` is the policy as its own
reference and :func:`reference_of` picks the reference model, :func:`adapter_state_dict` /
:func:`load_adapter_state_dict` are what a checkpoint holds of it, :func:`merged_model` gives a plain transformers
model with the adapters merged in, :func:`parameter_counts` the trainable / total parameters.
(``treadle.cli.loading.merge_adapter_folder`` merges a saved adapter into its base model.)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from treadle import distributed as dist
from treadle.models import is_causal_lm, is_peft_model
from treadle.vision import lora_on_language_model

PEFT_INSTALL = "pip install 'treadle[peft]'"
MERGED_DIR = "merged"  # where merge_adapters / `treadle merge` write the merged model, inside the run folder


def require_peft():
    try:
        import peft
    except ImportError:
        raise ImportError(f"peft_config needs the peft library, which is not installed: {PEFT_INSTALL}") from None
    return peft


def apply_peft(model: nn.Module, peft_config, *, seed: int = 0, args=None) -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` for ``peft_config`` (only the adapters train), as TRL's
    trainers do; ``model`` itself when ``peft_config`` is None. The adapters' initial weights depend on
    ``seed`` (``args.seed`` when ``args`` is given) only (the caller's RNG is left as it was). Prints trainable /
    total parameters. Refused: ``args.merge_adapters`` without adapters to merge (it would write nothing, silently),
    and a ``task_type`` other than CAUSAL_LM on a causal LM (SEQ_CLS would train a classifier wrapper instead)."""
    seed = args.seed if args is not None else seed
    if getattr(args, "merge_adapters", False) and peft_config is None and not is_peft_model(model):
        raise ValueError(
            "merge_adapters=True but the model has no adapters to merge (no peft: / peft_config); add a "
            "peft: mapping (peft_config=LoraConfig(...)) or drop merge_adapters"
        )
    if peft_config is None:
        return model
    peft = require_peft()
    if not isinstance(peft_config, peft.PeftConfig):
        raise TypeError(
            f"peft_config must be a peft config (e.g. peft.LoraConfig(r=8, target_modules='all-linear')), "
            f"got {type(peft_config).__name__}; a YAML mapping goes through treadle.peft.lora_config"
        )
    task = getattr(peft_config.task_type, "value", peft_config.task_type)
    if task not in (None, "CAUSAL_LM") and is_causal_lm(model):
        raise ValueError(
            f"peft task_type {task!r} does not fit {type(model).__name__}, a causal LM whose next-token "
            f"head this trainer trains (PEFT would wrap it as another task); set task_type: CAUSAL_LM or "
            f"leave it out"
        )
    if is_peft_model(model):
        raise ValueError(
            "the model is already a PEFT model and peft_config was given too; pass the base model "
            "with peft_config, or the PEFT model with peft_config=None"
        )
    peft_config = lora_on_language_model(model, peft_config)  # a VLM: the language model's layers, by default
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
        # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing`: noise at every LoRA start-up
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        model = peft.get_peft_model(model, peft_config)
    if dist.is_main_process():
        trainable, total = parameter_counts(model)
        print(
            f"treadle: {peft_config.peft_type.value} adapters: {trainable:,} trainable of {total:,} parameters "
            f"({100 * trainable / total:.2f}%)",
            flush=True,
        )
    return model


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of the unwrapped ``model``; a tied weight counts once."""
    params = {id(p): p for p in dist.unwrap_model(model).parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def lora_config(mapping: dict):
    """A ``peft.LoraConfig`` for a causal LM from a YAML mapping (``r``, ``lora_alpha``, ``lora_dropout``,
    ``target_modules`` -- a list or ``all-linear`` --, ``modules_to_save``, any other LoraConfig field)."""
    peft = require_peft()
    if not isinstance(mapping, dict):
        raise ValueError(
            f"peft: must be a mapping (r: 8, lora_alpha: 16, target_modules: all-linear), got {type(mapping).__name__}"
        )
    known = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    unknown = sorted(set(mapping) - known)
    if unknown:
        raise ValueError(
            f"peft: unknown LoraConfig key(s) {unknown}; common keys are r, lora_alpha, lora_dropout, "
            f"target_modules (a list or all-linear) and modules_to_save"
        )
    try:
        return peft.LoraConfig(**{"task_type": "CAUSAL_LM", **mapping})
    except (TypeError, ValueError) as error:
        raise ValueError(f"peft: {error}") from None


@contextlib.contextmanager
def disable_adapter(model: nn.Module) -> Iterator[nn.Module]:
    """The (unwrapped) PEFT ``model`` with its adapters disabled inside the block: the base model, used as the
    DPO / GRPO reference without a second copy of the weights. Gradients are the caller's business."""
    inner = dist.unwrap_model(model)
    if not is_peft_model(inner):
        raise ValueError(f"{type(inner).__name__} has no adapters to disable; pass a ref_model or a PEFT model")
    with inner.disable_adapter():
        yield inner


@contextlib.contextmanager
def reference_of(model: nn.Module, ref_model: nn.Module | None = None) -> Iterator[nn.Module]:
    """The model that scores reference log-probs: ``ref_model`` when there is one, else the PEFT ``model``
    with its adapters disabled (:func:`disable_adapter`)."""
    if ref_model is not None:
        yield ref_model
        return
    with disable_adapter(model) as base:
        yield base


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights of a PEFT model (and its ``modules_to_save``), named as peft saves them."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(dist.unwrap_model(model))


def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter weights named as :func:`adapter_state_dict` names them into the PEFT ``model``."""
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(dist.unwrap_model(model), state)


def merged_model(model: nn.Module) -> nn.Module:
    """A plain transformers model with the adapters merged into the base weights, built from a copy: the PEFT
    ``model`` keeps training as it was (the copy costs one model's memory for as long as it is kept)."""
    return copy.deepcopy(dist.unwrap_model(model)).merge_and_unload()
