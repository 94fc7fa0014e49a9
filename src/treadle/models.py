"""What treadle needs to know about a model, decided in one place.

It imports torch and ``treadle.distributed`` only, never a trainer, and transformers only inside
``load_pretrained`` (a model that is a transformers model means transformers is imported already). Contracts:

- :func:`forward_signature` -- the argument names a model's ``forward`` takes, read once per class (DDP's
  ``.module`` unwrapped); :func:`forward_parameters` -- the same as the Trainer uses it to keep dataset
  columns: the names, or None when the forward takes ``**kwargs`` and is not a transformers model.
- :func:`eval_mode` -- eval mode inside a ``with`` block; every submodule gets its own flag back, also when
  the block raises.
- :func:`frozen_reference` -- a reference model for DPO / GRPO: on the device, in eval mode, no parameter
  requiring grad. :func:`is_peft_model` -- whether a policy can be its own reference (adapters disabled).
- :func:`is_causal_lm` -- whether the model predicts token t+1 at position t (so it shifts its labels);
  :func:`causal_lm_problem` -- why a model is not a transformers causal LM (generation's fast path asks it).
- :func:`enable_gradient_checkpointing` -- recompute activations in backward (transformers models only).
- :func:`unwrapped_for_generation` -- the module to sample from under DDP, FSDP2 or PEFT.
- :func:`training_forward_kwargs`, :func:`loss_of`, :func:`logits_of` -- what a training forward is given
  besides its inputs, and where the loss and the predictions are in what it returns.
- :func:`load_pretrained` -- ``(model, tokenizer)`` from a local folder or a Hub id (the HF cache, ``HF_HUB_OFFLINE``
  honoured); :func:`from_name` -- a trainer's ``model`` argument given as a name. PEFT: ``treadle.peft``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from treadle import distributed as dist
from treadle.errors import PreflightError
from treadle.modelfiles import check_model_folder, gguf_source

__all__ = [
    "ForwardSignature",
    "cache_argument",
    "causal_lm_problem",
    "check_model_folder",
    "check_loaded_weights",
    "check_vocabulary",
    "check_hub_model",
    "enable_gradient_checkpointing",
    "eval_mode",
    "forward_parameters",
    "forward_signature",
    "from_name",
    "gguf_source",
    "frozen_reference",
    "is_causal_lm",
    "is_peft_model",
    "is_transformers_model",
    "load_pretrained",
    "logits_of",
    "loss_of",
    "max_positions",
    "training_forward_kwargs",
    "unwrapped_for_generation",
    "vocabulary_size",
]


# ---------------------------------------------------------------------------------------------------------
# Forward signature
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ForwardSignature:
    """The parameters of a ``forward``: ``"use_cache" in signature`` asks whether it names one."""

    names: frozenset[str]  # the parameters it names (not ``*args`` / ``**kwargs``)
    takes_var_keyword: bool  # it also takes ``**kwargs``

    def __contains__(self, name: str) -> bool:
        return name in self.names


# Per class, not per instance: inspect.signature costs ~0.1 ms and the forward of every step asks. Weak keys,
# so classes made on the fly (tests, wrappers) are not kept alive.
_SIGNATURES: weakref.WeakKeyDictionary[type, ForwardSignature] = weakref.WeakKeyDictionary()


def forward_signature(model: nn.Module) -> ForwardSignature:
    """The signature of ``model.forward`` (of ``model.module.forward`` for a DDP wrapper, of the transformers
    model's under PEFT adapters, which pass every keyword on), cached per class.

    A forward assigned to the instance itself (as hook libraries do) is read every time: it is not its
    class's.
    """
    inner = base_model(model)
    if "forward" in getattr(inner, "__dict__", {}):
        return _read_signature(inner.forward)
    signature = _SIGNATURES.get(type(inner))
    if signature is None:
        signature = _SIGNATURES[type(inner)] = _read_signature(inner.forward)
    return signature


def cache_argument(model: nn.Module) -> str | None:
    """The forward() keyword for the KV cache: ``cache`` in transformers >= 5.x, ``past_key_values`` before; None
    for a forward that takes no cache."""
    signature = forward_signature(model)
    return next((name for name in ("cache", "past_key_values") if name in signature), None)


def base_model(model: nn.Module) -> nn.Module:
    """The model under its wrappers: DDP's ``.module`` (or a compiled model's original), then PEFT's base model
    (the transformers model with the adapters injected; PEFT's forward hands every keyword to it)."""
    inner = dist.unwrap_model(model)
    if callable(getattr(inner, "get_base_model", None)):
        inner = inner.get_base_model()
    return inner


def _read_signature(forward) -> ForwardSignature:
    params = inspect.signature(forward).parameters.values()
    return ForwardSignature(
        names=frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)),
        takes_var_keyword=any(p.kind is p.VAR_KEYWORD for p in params),
    )


def forward_parameters(model: nn.Module) -> set[str] | None:
    """Names the model's forward accepts, or None when it takes ``**kwargs`` (anything goes).

    A transformers model's ``**kwargs`` carries attention-backend options, not dataset columns, so its named
    parameters are the answer even though it has ``**kwargs``.
    """
    signature = forward_signature(model)
    if signature.takes_var_keyword and not is_transformers_model(base_model(model)):
        return None
    return set(signature.names)


def is_transformers_model(model) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (checked without importing transformers)."""
    return any(
        c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(model).__mro__
    )


# ---------------------------------------------------------------------------------------------------------
# Modes and copies
# ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block; afterwards (also after an exception) every submodule has its
    own previous flag back, so a submodule kept in eval on purpose (a frozen part) stays there."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


def is_peft_model(model: nn.Module) -> bool:
    """Whether the (unwrapped) model can act as its own reference: it has a ``disable_adapter()`` context
    manager, as PEFT models do."""
    return callable(getattr(dist.unwrap_model(model), "disable_adapter", None))


def frozen_reference(model: nn.Module, ref_model: nn.Module | None = None, *, device) -> nn.Module | None:
    """The reference model of DPO / GRPO: ``ref_model``, or a deep copy of the unwrapped ``model`` as it is
    now; moved to ``device``, in eval mode (no dropout) and with no parameter requiring grad. None for a PEFT
    ``model`` without ``ref_model``: it is its own reference (:func:`disable_adapter`), no copy is held."""
    if ref_model is None and is_peft_model(model):
        return None
    reference = ref_model if ref_model is not None else copy.deepcopy(dist.unwrap_model(model))
    reference = reference.to(device).eval()
    reference.requires_grad_(False)
    return reference


# ---------------------------------------------------------------------------------------------------------
# Kind of model
# ---------------------------------------------------------------------------------------------------------
def training_forward_kwargs(forward_params, inputs: dict, num_items_in_batch: int | None = None) -> dict:
    """Keyword arguments a training forward adds to its inputs: ``use_cache=False`` where the forward takes it
    (a training forward has no use for a KV cache), and ``num_items_in_batch`` when given."""
    kwargs = {}
    if forward_params is not None and "use_cache" in forward_params and "use_cache" not in inputs:
        kwargs["use_cache"] = False
    if num_items_in_batch is not None:
        kwargs["num_items_in_batch"] = num_items_in_batch
    return kwargs


def loss_of(outputs, inputs=None) -> torch.Tensor:
    """The loss in a model's outputs: a 0-d tensor, a ``loss`` key or attribute, or a 0-d first element.
    ValueError (naming the inputs) when there is none: the model was given no labels."""
    if isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        return outputs
    if isinstance(outputs, dict) or hasattr(outputs, "keys"):
        loss = outputs.get("loss") if hasattr(outputs, "get") else None
    elif (
        isinstance(outputs, (tuple, list))
        and outputs
        and isinstance(outputs[0], torch.Tensor)
        and outputs[0].dim() == 0
    ):
        loss = outputs[0]
    else:
        loss = getattr(outputs, "loss", None)
    if loss is None:
        keys = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
        raise ValueError(
            f"the model returned no loss (inputs: {keys}); pass labels (a 'labels' column) or "
            f"override Trainer.compute_loss to compute it"
        )
    return loss


def logits_of(outputs, ignore_keys=None):
    """The prediction tensors in a model's outputs: everything but the loss, caches, hidden states, attentions
    and ``ignore_keys``; one tensor, a tuple of them, or None."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    ignore = {"loss", "past_key_values", "hidden_states", "attentions"} | set(ignore_keys or ())
    if hasattr(outputs, "items"):
        values = [v for k, v in outputs.items() if k not in ignore and isinstance(v, torch.Tensor)]
    else:
        values = [v for v in outputs if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def is_causal_lm(model: nn.Module) -> bool:
    """Whether the model predicts token t+1 at position t, i.e. shifts its labels inside its own loss.

    From the config where there is one: a transformers model (inside DDP, ``torch.compile`` or PEFT) whose
    config is not encoder-decoder and that can generate. A plain module has no config to ask; it opts in by
    following transformers' naming convention (a class named ``...ForCausalLM`` or ``...LMHeadModel``), or
    its trainer overrides ``Trainer.count_items``.
    """
    inner = base_model(model)
    if not is_transformers_model(inner):
        return type(inner).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    return causal_lm_problem(inner) is None


def causal_lm_problem(model: nn.Module) -> str | None:
    """Why ``model`` is not a transformers causal LM (a decoder that can generate), or None when it is."""
    if not is_transformers_model(model):
        return f"{type(model).__name__} is not a transformers PreTrainedModel"
    if getattr(model.config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    if not model.can_generate():
        return f"{type(model).__name__} has no language-modelling head (can_generate() is False)"
    return None


def max_positions(model: nn.Module) -> int | None:
    """The longest sequence the model's config says it takes (``max_position_embeddings`` or GPT-2's
    ``n_positions``), None when it names none."""
    config = getattr(dist.unwrap_model(model), "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def enable_gradient_checkpointing(model: nn.Module, kwargs: dict | None = None) -> None:
    """Recompute activations in backward instead of storing them; turns the KV cache off. ``kwargs`` (the
    ``gradient_checkpointing_kwargs`` argument) go to ``torch.utils.checkpoint``; by default non-reentrant.

    Raises ValueError for a model without transformers' checkpointing switch.
    """
    model = dist.unwrap_model(model)
    if kwargs is None:
        kwargs = {"use_reentrant": False}  # the non-reentrant form needs no input that requires grad
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2 name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise ValueError(
            f"gradient_checkpointing=True needs a transformers model; {type(model).__name__} has "
            f"no activation_checkpointing_enable() — wrap its blocks with "
            f"torch.utils.checkpoint.checkpoint yourself"
        )
    if hasattr(model, "config"):
        model.config.use_cache = False
    if is_peft_model(model):  # frozen embeddings: a reentrant checkpoint (set by the user) would see no grad
        model.enable_input_require_grads()


# ---------------------------------------------------------------------------------------------------------
# Generation context
# ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def unwrapped_for_generation(model: nn.Module) -> Iterator[nn.Module]:
    """The module to generate with.

    * DDP: its ``module``. DDP only adds gradient all-reduce hooks to backward; generation runs no backward,
      so the inner module gives the same tokens without touching the reducer.
    * FSDP2 (``fully_shard``): parameters are all-gathered once for the whole call and kept gathered. Left
      alone, every forward would all-gather and reshard, and ranks that stop early (all rows hit EOS) would
      leave the others waiting in a collective. The cost is one full copy of the weights per rank during
      the call. ``reshard_after_forward`` is restored to FSDP2's default afterwards (True for inner modules,
      False for the root, as ``treadle.distributed.shard_model`` leaves them): torch has no public getter
      for a custom setting.
    * PEFT: ``get_base_model()`` -- the transformers model with the adapters injected and active.
    * FSDP1 (``FullyShardedDataParallel``) is refused: its forward cannot run inside
      ``summon_full_params``; wrap with FSDP2 instead.
    """
    if type(model).__name__ == "FullyShardedDataParallel":  # before unwrapping: FSDP1 has a .module too
        raise ValueError(
            "FSDP1 (FullyShardedDataParallel) models are not supported for generation; "
            "shard with FSDP2 (torch.distributed.fsdp.fully_shard) instead"
        )
    inner = dist.unwrap_model(model)
    if callable(getattr(inner, "get_base_model", None)):
        inner = inner.get_base_model()
    fsdp_modules = _fsdp2_modules(inner)
    if not fsdp_modules:
        yield inner
        return
    inner.set_reshard_after_forward(False)
    for module in fsdp_modules:
        module.unshard()
    try:
        yield inner
    finally:
        for module in fsdp_modules:
            module.reshard()
        inner.set_reshard_after_forward(True)
        inner.set_reshard_after_forward(False, recurse=False)


def _fsdp2_modules(model: nn.Module) -> list:
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def load_pretrained(
    name_or_path: str,
    *,
    tokenizer=None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    model_class=None,
    **model_kwargs,
):
    """``(model, tokenizer)`` from a local folder in transformers layout, a GGUF file, else from a Hugging Face Hub
    model id (``org/name``) through transformers' ``from_pretrained``: the user's cache (``HF_HOME``), ``revision``
    (a branch, tag or commit), ``HF_HUB_OFFLINE=1`` honoured. An existing folder always wins over an id of the same
    spelling. The tokenizer is read from the same place unless one is given. Code shipped with the model runs only
    with ``trust_remote_code=True``. ``model_class`` defaults to ``AutoModelForCausalLM``; ``model_kwargs`` go to
    its ``from_pretrained`` (TRL's ``model_init_kwargs``); a vision-language model (:func:`is_vision_language`) loads
    with ``AutoModelForImageTextToText`` and its ``AutoProcessor``. A ``.gguf`` path (or a folder or Hub id with
    ``gguf_file=``) is dequantised into an ordinary model (:func:`gguf_source`) that trains and saves as any other.
    A model some of whose weights are not in its files, or whose files hold weights it has no place for, is refused
    (:func:`check_loaded_weights`) unless ``strict=False`` (torch's ``load_state_dict`` name) is among
    ``model_kwargs``. ValueError names what is wrong in one line. (``toy:<size>`` specs: ``treadle.cli.loading``.)"""
    source, gguf_file = gguf_source(os.fspath(name_or_path), model_kwargs.pop("gguf_file", None))
    strict = model_kwargs.pop("strict", True)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers' model classes load ~5 s

    if os.path.isdir(source):
        if revision is not None:  # a folder holds one version: a revision would be recorded and ignored
            raise ValueError(
                f"revision {revision!r} picks a version of a Hugging Face Hub model, but {name_or_path} is a local "
                f"{'file' if gguf_file else 'folder'}, which holds one version; drop revision, or name the Hub id "
                f"(org/name) to load that revision"
            )
        check_model_folder(source, needs_tokenizer=tokenizer is None and gguf_file is None, gguf_file=gguf_file)
        options = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    else:
        check_hub_model(source, revision, filename=gguf_file or "config.json")
        options = dict(revision=revision, trust_remote_code=trust_remote_code)
    if gguf_file:
        options["gguf_file"] = gguf_file
        model_kwargs.setdefault("quantization_config", _dequantized_gguf())
        if "dtype" not in model_kwargs and "torch_dtype" not in model_kwargs:  # not the file's own (a 4-bit one's)
            model_kwargs["dtype"] = torch.float32
    try:
        vision = model_class is None and is_vision_language(source, options)
        if tokenizer is None:
            tokenizer = (vision_classes()[1] if vision else AutoTokenizer).from_pretrained(source, **options)
        head = model_class is not None  # a class of the caller's: a head of its own, new (a reward model's score)
        model_class = model_class or (vision_classes()[0] if vision else AutoModelForCausalLM)
        model, report = model_class.from_pretrained(source, **options, **model_kwargs, output_loading_info=True)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot load a model and tokenizer from {source}: {str(error).splitlines()[0]}") from None
    if strict:
        check_loaded_weights(model, report, os.path.join(source, gguf_file) if gguf_file else source, new_head=head)
    if gguf_file:  # records, adapters (their base_model_name_or_path) and `treadle merge` name the file itself
        # both: from_pretrained copied the config's into the model's own attribute, which PEFT reads
        name = os.path.join(source, gguf_file) if os.path.isdir(source) else source
        model.name_or_path = model.config._name_or_path = name
    check_vocabulary(model, tokenizer, source)
    return model, tokenizer


def check_loaded_weights(model: nn.Module, report: dict, where: str, *, new_head: bool = False) -> None:
    """Refuse (ValueError, one line) a model that transformers built with weights its files do not hold (they would
    train from random values: a GGUF whose header names another architecture, a folder missing tensors) or from files
    holding weights it has no place for. ``report``: ``from_pretrained(..., output_loading_info=True)``'s;
    ``new_head``: weights outside the base model (a classification head the caller asked for) may be new."""
    missing = sorted(report.get("missing_keys") or ())
    if new_head:
        prefix = getattr(model, "base_model_prefix", "") + "."
        missing = [key for key in missing if key.startswith(prefix)]
    unexpected = sorted(report.get("unexpected_keys") or ())
    if not missing and not unexpected:
        return
    total = len(model.state_dict())
    problems = []
    if missing:
        problems.append(f"{len(missing)} of its {total} weights are not in the files ({_some(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} weights in the files have no place in it ({_some(unexpected)})")
    raise ValueError(
        f"{where} does not fit the {type(model).__name__} transformers built from it: {'; '.join(problems)}; use "
        f"the files saved with this model (a GGUF header or config naming another architecture is a wrong file), or "
        f"pass model_init_kwargs: {{strict: false}} to train the missing weights from random values"
    )


def _some(keys: list[str], shown: int = 3) -> str:
    return ", ".join(keys[:shown]) + (", ..." if len(keys) > shown else "")


def _dequantized_gguf():
    """The quantization config that has transformers unpack every GGUF weight into an ordinary dense tensor at load:
    the model then trains (a packed GGUF weight is not trainable) and ``save_pretrained`` writes plain safetensors
    (transformers refuses to serialise a model that keeps its GGUF quantizer)."""
    from transformers import GgufConfig

    return GgufConfig(dequantize=True)


def is_vision_language(source: str, options: dict) -> bool:
    """Whether the model at ``source`` is a vision-language model (its config has a ``vision_config``): it loads
    with ``AutoModelForImageTextToText`` and ``AutoProcessor`` rather than the causal-LM and tokenizer classes."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(source, **options), "vision_config", None) is not None


def vision_classes():
    """``(AutoModelForImageTextToText, AutoProcessor)``; imported here, as the causal-LM classes are (~5 s)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText, AutoProcessor


def check_hub_model(name: str, revision: str | None = None, *, filename: str = "config.json") -> None:
    """Refuse (ValueError, one line) a model name that is neither an existing folder nor a Hub id, and, with
    ``HF_HUB_OFFLINE`` set, an id whose ``filename`` (its config, or the GGUF file named) is not in the local cache
    (naming the id and the cache folder)."""
    from huggingface_hub import constants, try_to_load_from_cache  # transformers' own dependency
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ValueError(
            f"model folder {name} not found, and it is not a Hugging Face model id (org/name); use a "
            f"local folder in transformers layout (written by save_pretrained), a .gguf file, a Hub id, or toy:tiny"
        ) from None
    if not constants.HF_HUB_OFFLINE:
        return
    if not isinstance(try_to_load_from_cache(name, filename, revision=revision), str):
        at = f" at revision {revision}" if revision else ""
        raise ValueError(
            f"model {name}{at} is not a local folder nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE=1 forbids downloading it; unset "
            f"HF_HUB_OFFLINE to download it, or point HF_HOME at a cache that holds it"
        )


def from_name(model, processing_class, args, *, model_class=None, **model_kwargs):
    """``(model, processing_class)``: as given, or loaded when ``model`` is a folder path or Hub id (a str), with
    ``args.model_init_kwargs`` (its ``revision`` also picks the tokenizer's) and ``args.trust_remote_code``, as
    TRL's trainers read them; ``model_kwargs`` are the trainer's own (a reward head's ``num_labels=1``)."""
    if not isinstance(model, (str, os.PathLike)):
        return model, processing_class
    kwargs = {**(getattr(args, "model_init_kwargs", None) or {}), **model_kwargs}
    revision = kwargs.pop("revision", None)
    return load_pretrained(
        model,
        tokenizer=processing_class,
        revision=revision,
        model_class=model_class,
        trust_remote_code=getattr(args, "trust_remote_code", False),
        **kwargs,
    )


def check_vocabulary(model: nn.Module, tokenizer, where: str | None = None) -> None:
    """Refuse (PreflightError, a ValueError) a tokenizer whose ids go past the model's input embedding (an
    IndexError at the first forward): ``load_model`` for the CLI, ``Trainer.__init__`` for Python alike."""
    where = where or getattr(model, "name_or_path", None) or type(dist.unwrap_model(model)).__name__
    rows = vocabulary_size(model)
    if rows is not None and hasattr(tokenizer, "__len__") and len(tokenizer) > rows:
        raise PreflightError(
            f"the tokenizer of {where} has {len(tokenizer)} tokens but the model's embedding has "
            f"{rows} rows; use the tokenizer saved with this model, or resize the embedding "
            f"(model.resize_token_embeddings(len(tokenizer))) and save both"
        )


def vocabulary_size(model: nn.Module) -> int | None:
    """The rows of the model's input embedding: every token id it is given must be below it. None when the model has
    no ``get_input_embeddings`` (a plain module)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None)
