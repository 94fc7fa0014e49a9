"""What made a run, beside its arguments: the model, the datasets, the reward functions, the LoRA settings.

``training_args.json`` holds the arguments; it cannot say which model or data a run trained, so an overlay of two
runs could not show the one real difference. :func:`describe_run` reads a trainer's public attributes into a
JSON-able mapping, which the Trainer writes to ``output_dir/run.json`` when training begins
(``callbacks.RunInfoCallback``, ``runfiles.write_run_info``) and ``treadle report`` shows:

- ``trainer`` and ``config``: the class names (the report compares the arguments against that config's defaults);
- ``model``: class, ``name_or_path`` (the folder or hub id it was loaded from; "" for a model built in memory),
  parameters and trainable parameters, dtype; ``ref_model`` and ``reward_model`` likewise where a trainer has one;
- ``train_dataset`` / ``eval_dataset``, as the trainer holds it (SFT, DPO, KTO, reward: tokenised): rows, columns,
  where it was read from (the hub name or files ``datasets`` records, when it does), the builder that read it and
  its ``datasets`` fingerprint (the same data in the same order reads the same);
- ``reward_funcs`` and ``reward_weights`` (GRPO): each function's logged name;
- ``peft``: the adapters' settings (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules`` ...), or None.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from torch import nn

from treadle import distributed as dist
from treadle.models import base_model, is_peft_model
from treadle.peft import parameter_counts
from treadle.rewards import reward_name
from treadle.streaming import is_stream

__all__ = ["describe_dataset", "describe_model", "describe_run"]

PEFT_FIELDS = (
    "peft_type",
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "modules_to_save",
    "bias",
    "use_rslora",
    "use_dora",
    "init_lora_weights",
)


def describe_run(trainer) -> dict[str, Any]:
    """The record of ``trainer``'s run (see the module docstring); a part the trainer lacks is left out."""
    record: dict[str, Any] = {
        "trainer": type(trainer).__name__,
        "config": type(trainer.args).__name__,
        "model": describe_model(trainer.model),
        "peft": describe_peft(trainer.model),
    }
    for name in ("ref_model", "reward_model"):
        if isinstance(getattr(trainer, name, None), nn.Module):
            record[name] = describe_model(getattr(trainer, name))
    for name in ("train_dataset", "eval_dataset"):
        if getattr(trainer, name, None) is not None:
            record[name] = describe_dataset(getattr(trainer, name))
    if getattr(trainer, "reward_funcs", None):
        record["reward_funcs"] = [_reward_label(fn) for fn in trainer.reward_funcs]
        record["reward_weights"] = list(getattr(trainer, "reward_weights", []) or [])
    return json.loads(json.dumps(record, default=str))  # sets, dtypes, paths: as they read


def describe_model(model: nn.Module | None) -> dict[str, Any] | None:
    if model is None:
        return None
    model, base = dist.unwrap_model(model), base_model(model)
    trainable, total = parameter_counts(model)
    config = getattr(base, "config", None)
    first = next(iter(base.parameters()), None)
    return {
        "class": type(base).__name__,
        "name_or_path": getattr(config, "_name_or_path", "") or "",
        "parameters": total,
        "trainable": trainable,
        "dtype": str(first.dtype) if first is not None else None,
    }


def describe_peft(model: nn.Module | None) -> dict[str, Any] | None:
    """The adapters' settings of a PEFT model (its first adapter's), None for a plain model."""
    if model is None or not is_peft_model(model):
        return None
    configs = getattr(dist.unwrap_model(model), "peft_config", None) or {}
    if not configs:
        return None
    name, config = next(iter(configs.items()))
    values = config.to_dict() if callable(getattr(config, "to_dict", None)) else vars(config)
    picked = {key: values[key] for key in PEFT_FIELDS if key in values}
    if isinstance(picked.get("target_modules"), (set, frozenset)):
        picked["target_modules"] = sorted(picked["target_modules"])
    return {"adapter": name, **picked}


def describe_dataset(dataset) -> dict[str, Any]:
    """Rows, columns, source and fingerprint of a ``datasets.Dataset`` (rows only for another sized dataset; a
    stream: ``"streaming": true`` and its columns when it knows them)."""
    record: dict[str, Any] = {"rows": len(dataset) if hasattr(dataset, "__len__") else None}
    if is_stream(dataset):
        record["streaming"] = True
    if getattr(dataset, "column_names", None) is not None:  # an IterableDataset may not know its columns: None
        record["columns"] = list(dataset.column_names)
    info = getattr(dataset, "info", None)
    sources = sorted((getattr(info, "download_checksums", None) or {}).keys())
    hub = getattr(info, "dataset_name", None)
    builder = getattr(info, "builder_name", None)
    if sources:
        record["source"] = sources if len(sources) > 1 else sources[0]
    elif hub and hub != builder:
        config = getattr(info, "config_name", None)
        record["source"] = hub + (f" ({config})" if config not in (None, "default") else "")
    if builder:
        record["builder"] = builder  # the datasets builder that read it: json, csv, parquet, a hub script ...
    fingerprint = getattr(dataset, "_fingerprint", None)
    if fingerprint:
        record["fingerprint"] = fingerprint
    return record


def _reward_label(fn) -> str:
    """A reward function's logged name, after its module when that says where it came from (not ``__main__``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name, module = reward_name(fn), getattr(fn, "__module__", None)
    return f"{module}.{name}" if isinstance(module, str) and module != "__main__" else name
