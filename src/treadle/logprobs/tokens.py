"""Memory-bounded per-token log-probabilities, shared by DPO, GRPO and SFT evaluation.

The plain recipe ``log_softmax(model(ids).logits.float(), -1).gather(...)`` holds several float32
``[B, T, V]`` tensors at once (the logits, their log-softmax, and in the backward pass the gradients of
both). At V = 128k, B x T = 8 x 1024 each one is 4.2 GB. This module never builds them:

- :func:`chunked_token_logps` takes the final hidden states and the LM head weight and works through
  ``chunk_size`` rows at a time. The forward pass keeps only one logsumexp per row; the backward pass
  recomputes each chunk's logits and accumulates ``grad_hidden`` and ``grad_weight`` from
  ``softmax - onehot``. Peak extra memory is a few ``[chunk_size, V]`` float32 buffers (on CPU, where a step
  is bound by its matmuls, logits up to 1 GiB are kept from the forward pass instead of recomputed).
- :func:`selective_log_softmax` is the same idea for logits that already exist (models that do not fit
  the fast path): no log-softmax copy, one gradient tensor in the logits' own dtype.
- :func:`token_logps` runs a causal LM and returns log p(token t+1 | tokens ≤ t), choosing between them.

The seam (how :func:`token_logps` gets hidden states without logits), for transformers causal LMs:
a forward hook on ``model.get_decoder()`` captures ``last_hidden_state`` while the top-level model is
called through its normal ``__call__`` (so a DDP wrapper's forward and its gradient hooks run) with
``logits_to_keep=1``, which makes the LM head project a single position. The head's ``weight`` (the
input embedding when ``tie_word_embeddings``) and ``bias`` then feed :func:`chunked_token_logps`; the
gradient reaches the parameter through autograd like any other use. The fast path is taken only when
the model has an ``nn.Linear`` output embedding, a decoder distinct from itself, a ``logits_to_keep``
argument and no known logit transform in its config (final softcapping, logit scaling); the first call
on each model also checks numerically that the head applied to the captured state reproduces the
model's own last-position logits. Anything else (a plain module returning logits, Gemma-style softcaps,
custom heads) runs the full forward and :func:`selective_log_softmax`, which is exact but holds the
model's logits.

Under FSDP2 the head's weight is read after the forward returns: it must still be unsharded then, which
is FSDP2's default for the root module's parameters (``reshard_after_forward`` is not applied to the
root). A wrapping that reshards the LM head after forward needs the fallback.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from treadle import distributed as dist
from treadle.logprobs.logsoftmax import (
    IGNORE_INDEX,
    as_blocks,
    check_temperature,
    chunk_rows,
    chunked_token_logps,
    row_chunks,
    selective_log_softmax,
    upcast,
)
from treadle.models import eval_mode, forward_signature, is_transformers_model
from treadle.packing import pack_padded_batch, position_ids

# Config attributes of transformers models that transform logits after the LM head.
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,
    "logit_scale": None,
    "logits_scaling": 1.0,
    "output_logits_scale": 1.0,
}
# Up to this many logits (rows x V; 4 MB in float32) token_logps skips the chunking (see _small_token_logps).
SMALL_LOGITS = 1 << 20
# Result of the one-time numeric check of the fast path, per model (weak: does not keep models alive).
_FAST_PATH_CHECKED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
# Result of the one-time check that a padding-free forward reproduces the padded one, per model (weak).
_PADDING_FREE_CHECKED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------------------------- causal LM driver


class TokenLogps(tuple):
    """What :func:`token_logps` returns, each ``(B, T - 1 - start)`` aligned with ``input_ids[:, start+1:]``.

    It unpacks as ``(logps, entropy)``, as it always has; ``mean_logits`` is an attribute beside them:

    - ``logps``: log p(token t+1 | tokens <= t), float32 at least; 0 at padded targets;
    - ``entropy``: of each position's distribution (detached), with ``return_entropy``, else None;
    - ``mean_logits``: each position's logit averaged over the vocabulary (detached, float32), with
      ``return_mean_logits`` (DPO's ``logits/*`` metrics), else None.
    """

    def __new__(cls, logps: Tensor, entropy: Tensor | None = None, mean_logits: Tensor | None = None):
        out = super().__new__(cls, (logps, entropy))
        out.mean_logits = mean_logits
        return out

    @property
    def logps(self) -> Tensor:
        return self[0]

    @property
    def entropy(self) -> Tensor | None:
        return self[1]


def token_logps(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    start: int = 0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    return_mean_logits: bool = False,
    padding_free: bool = False,
    **forward_kwargs: Any,
) -> TokenLogps:
    """Per-token log-probs of a causal LM's own input: ``log p(input_ids[:, t+1] | input_ids[:, :t+1])``.

    Args:
        model: a transformers causal LM (possibly DDP-wrapped) or any module whose output is logits or
            has ``.logits``. It is called through ``__call__``.
        input_ids: ``(B, T)``; attention_mask: ``(B, T)`` or None.
        temperature: divides the logits (use the sampling temperature for GRPO's log-probs).
        start: skip the first ``start`` predictions; the result covers targets ``input_ids[:, start+1:]``
            (e.g. ``start = prompt_length - 1`` for completion tokens only). ``0 <= start < T - 1``.
        chunk_size: rows per chunk of :func:`chunked_token_logps` (None: ``logsoftmax.chunk_rows``' default, a
            fixed number of logits whatever the vocabulary). At most ``chunk_size`` rows with at most
            ``SMALL_LOGITS`` logits in all are computed in one piece through plain autograd instead.
        return_entropy: also return the per-position entropy (detached).
        return_mean_logits: also return the per-position mean logit over the vocabulary (detached), taken
            from the same forward: ``h . mean(W) + mean(b)`` on the fast path, no ``[B, T, V]`` tensor built.
        padding_free: run the forward on the real tokens only (``attention_mask == 1``), the rows packed side by
            side without padding (``data.pack_padded_batch``; position ids restart in each row, attention cannot
            cross rows), and compute log-probs only at the targets that count. Same results as the padded
            forward; taken where that is exact (see ``_padding_free_logps``), else the padded forward runs.
        forward_kwargs: passed to the model (``position_ids``, ...).

    Returns a :class:`TokenLogps`: ``(logps, entropy or None)`` and ``.mean_logits``, float32 (at least)
    ``(B, T - 1 - start)`` aligned with ``input_ids[:, start+1:]``. Targets that are padding
    (``attention_mask == 0``) get log-prob 0 and no gradient; entropy and mean logits are reported for every
    position (0 at padded targets when the forward was padding-free).
    """
    seq_len = input_ids.shape[1]
    if not 0 <= start < seq_len - 1:
        raise ValueError(f"start must satisfy 0 <= start < T - 1 = {seq_len - 1}, got {start}")
    check_temperature(temperature)
    if padding_free and attention_mask is not None and attention_mask.dim() == 2:
        packed = _padding_free_logps(
            model,
            input_ids,
            attention_mask,
            start,
            (temperature, chunk_size, return_entropy, return_mean_logits),
            forward_kwargs,
        )
        if packed is not None:
            return packed
    labels = input_ids[:, start + 1 :]  # (B, T-1-start)
    if attention_mask is not None and attention_mask.dim() == 2:
        labels = labels.masked_fill(attention_mask[:, start + 1 :] == 0, IGNORE_INDEX)
    base = dist.unwrap_model(model)
    head = fast_path_head(base)
    hidden = None
    if head is not None:
        hidden = _final_hidden_states(model, base, head, input_ids, attention_mask, forward_kwargs)
    if hidden is None:  # the fallback: the model's full logits
        logits = _output_logits(model(input_ids, **_model_kwargs(base, attention_mask, forward_kwargs)))
        return _logps_from_logits(logits[:, start:-1], labels, temperature, return_entropy, return_mean_logits)
    hidden = hidden[:, start:-1]  # (B, T-1-start, H)
    mean_logits = _mean_logits(hidden, head) if return_mean_logits else None
    logps, entropy = _hidden_token_logps(
        hidden.reshape(-1, hidden.shape[-1]), head, labels.reshape(-1), temperature, chunk_size, return_entropy
    )
    entropy = None if entropy is None else entropy.view(labels.shape)
    return TokenLogps(logps.view(labels.shape), entropy, mean_logits)


def _hidden_token_logps(
    hidden: Tensor,
    head: nn.Linear,
    labels: Tensor,
    temperature: float,
    chunk_size: int | None,
    return_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """``(N, H)`` final hidden states and ``(N,)`` labels -> ``(N,)`` log-probs (and entropies): in one piece
    (``_small_token_logps``) up to ``chunk_size`` rows (None: ``chunk_rows``' default) and ``SMALL_LOGITS`` logits,
    else chunked."""
    chunk_size = chunk_rows(head.weight.shape[0], chunk_size)
    rows = labels.numel()
    if rows <= chunk_size and rows * head.weight.shape[0] <= SMALL_LOGITS:
        return _small_token_logps(hidden, head, labels, temperature, return_entropy)
    result = chunked_token_logps(
        hidden,
        head.weight,
        labels,
        bias=head.bias,
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=return_entropy,
    )
    return result if return_entropy else (result, None)


# ------------------------------------------------------------------------------- padding-free forwards


def _padding_free_logps(
    model, input_ids: Tensor, attention_mask: Tensor, start: int, options: tuple, forward_kwargs: dict
) -> TokenLogps | None:
    """:func:`token_logps` through a padding-free forward, or None where the padded forward must run.

    Exact (the same attention, positions and targets as the padded forward) when: the model takes
    ``position_ids`` and separates rows by them (checked numerically once per model, in eval mode, against the
    padded forward on the first batch; under FSDP2, where the check's forwards would be collectives, a
    transformers model is trusted to); the positions the padded forward would use count from each row's first
    real token (the given ``position_ids``, or no left padding when none are given); and every target that
    counts has a real token before it. A batch without padding runs padded: there is nothing to remove.
    """
    base = dist.unwrap_model(model)
    if _PADDING_FREE_CHECKED.get(base) is False or "position_ids" not in forward_signature(base):
        return None
    real = attention_mask.bool()  # (B, T)
    if bool(real.all()) or bool((real[:, start + 1 :] & ~real[:, start:-1]).any()):
        return None
    given = forward_kwargs.get("position_ids")
    ranks = position_ids(real)  # (B, T): the position of each real token in its row
    if given is None and not bool(real[:, 0].all()) or given is not None and not bool((given == ranks)[real].all()):
        return None
    kwargs = {k: v for k, v in forward_kwargs.items() if k != "position_ids"}
    if base not in _PADDING_FREE_CHECKED and dist.is_fsdp(base):
        # the check's extra forwards gather shards: a rank whose first batch had no padding would skip them and
        # hang the others. Sharded, trust transformers' rule (rows separated by their position ids).
        _PADDING_FREE_CHECKED[base] = is_transformers_model(base)
    if base not in _PADDING_FREE_CHECKED:
        _PADDING_FREE_CHECKED[base] = _padding_free_is_exact(
            base, input_ids, attention_mask, start, options, forward_kwargs
        )
        if not _PADDING_FREE_CHECKED[base]:
            warnings.warn(
                f"{type(base).__name__}: a padding-free forward (rows packed with restarting position "
                "ids) does not reproduce the padded one; using padded forwards",
                stacklevel=3,
            )
            return None
    return _packed_token_logps(model, base, input_ids, real, start, options, kwargs)


def _packed_token_logps(
    model, base, input_ids: Tensor, real: Tensor, start: int, options: tuple, kwargs: dict
) -> TokenLogps:
    """One forward over ``data.pack_padded_batch(input_ids, real)``; log-probs only at the real targets of
    ``input_ids[:, start+1:]``, each predicted from the real token before it in its own row, scattered back into
    the padded ``(B, T-1-start)`` layout (0 elsewhere)."""
    packed = pack_padded_batch(input_ids, real)
    targets = real[:, start + 1 :]  # (B, T') the targets that count
    labels = input_ids[:, start + 1 :][targets]  # (M,)
    rows = packed.index[:, start:-1][targets]  # (M,) where each target's predicting token sits, flat
    kwargs = {**kwargs, "position_ids": packed.position_ids}
    logps, entropy, mean_logits = logps_at_rows(model, base, packed.input_ids, kwargs, rows, labels, options)

    def unpack(values: Tensor | None) -> Tensor | None:  # (M,) -> (B, T'), zeros at the other targets
        return None if values is None else values.new_zeros(targets.shape).masked_scatter(targets, values)

    return TokenLogps(unpack(logps), unpack(entropy), unpack(mean_logits))


def logps_at_rows(
    model, base, input_ids: Tensor, forward_kwargs: dict, rows: Tensor, labels: Tensor, options: tuple
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One forward of ``model`` over a packed ``input_ids`` ``(K, W)`` (``forward_kwargs``: its ``position_ids``,
    and an ``attention_mask`` when the packing needs one), then log-probs of ``labels`` ``(M,)`` at the flat
    positions ``rows`` ``(M,)`` of ``input_ids.view(-1)`` only: the hidden-state fast path in chunks where the head
    allows it, else the model's logits and :func:`selective_log_softmax`. ``options``: ``(temperature, chunk_size,
    return_entropy, return_mean_logits)``. Returns ``(logps, entropy or None, mean_logits or None)``, each ``(M,)``.
    The padding-free and shared-prefix forwards (``treadle.logprobs.prefix``) share it."""
    kwargs = dict(forward_kwargs)
    attention_mask = kwargs.pop("attention_mask", None)
    states, head = _states_and_head(model, base, input_ids, attention_mask, kwargs)
    return logps_from_states(states.reshape(-1, states.shape[-1]).index_select(0, rows), head, labels, options)


def logps_from_states(
    states: Tensor, head: nn.Linear | None, labels: Tensor, options: tuple
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Log-probs of ``labels`` ``(M,)`` from the states at their targets: final hidden states ``(M, H)`` through
    ``head`` (in chunks where large), or the model's logits ``(M, V)`` when ``head`` is None. ``options`` as
    :func:`logps_at_rows`'s; returns ``(logps, entropy or None, mean_logits or None)``, each ``(M,)``."""
    temperature, chunk_size, return_entropy, return_mean_logits = options
    if head is not None:
        logps, entropy = _hidden_token_logps(states, head, labels, temperature, chunk_size, return_entropy)
        return logps, entropy, _mean_logits(states, head) if return_mean_logits else None
    logps = selective_log_softmax(states, labels, temperature=temperature)
    entropy = _entropy(states, temperature) if return_entropy else None
    mean_logits = states.detach().mean(dim=-1, dtype=torch.float32) if return_mean_logits else None
    return logps, entropy, mean_logits


@torch.no_grad()
def _padding_free_is_exact(
    base, input_ids: Tensor, attention_mask: Tensor, start: int, options: tuple, forward_kwargs: dict
) -> bool:
    """Whether ``base`` gives the same log-probs packed as padded on this batch (eval mode: no dropout)."""
    temperature, chunk_size = options[:2]
    kwargs = {k: v for k, v in forward_kwargs.items() if k != "position_ids"}
    with eval_mode(base):
        padded = token_logps(
            base,
            input_ids,
            attention_mask,
            start=start,
            temperature=temperature,
            chunk_size=chunk_size,
            **forward_kwargs,
        ).logps
        packed = _packed_token_logps(
            base, base, input_ids, attention_mask.bool(), start, (temperature, chunk_size, False, False), kwargs
        ).logps
    low_precision = torch.is_autocast_enabled(input_ids.device.type) or any(
        p.dtype != torch.float32 and p.is_floating_point() for p in base.parameters()
    )
    tolerance = 5e-2 if low_precision else 1e-4
    return torch.allclose(packed.float(), padded.float(), rtol=tolerance, atol=tolerance)


@torch.no_grad()
def _mean_logits(hidden: Tensor, head: nn.Linear) -> Tensor:
    """``(B, T, H)`` final hidden states -> ``(B, T)`` logits averaged over the vocabulary, in float32."""
    mean_logits = hidden.float() @ head.weight.float().mean(dim=0)
    return mean_logits + head.bias.float().mean() if head.bias is not None else mean_logits


def _small_token_logps(
    hidden: Tensor, head: nn.Linear, labels: Tensor, temperature: float, return_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """:func:`chunked_token_logps` for at most ``SMALL_LOGITS`` logits, through plain autograd: a one-chunk
    custom Function costs more in Python than a small model's whole head (a few % of a tiny model's step),
    and a few MB of logits held for backward do not matter. Same results, dtypes and -100 handling."""
    logits = F.linear(hidden, head.weight, head.bias)  # (N, V); under autocast, in the autocast dtype
    logits = logits.to(upcast(logits.dtype))
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)  # (N, V)
    valid = labels != IGNORE_INDEX  # (N,)
    picked = log_probs.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)  # (N,)
    logps = torch.where(valid, picked, 0.0)
    entropy = None
    if return_entropy:
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(dim=-1)  # (N,)
    return logps, entropy


def fast_path_verified(base: nn.Module) -> bool | None:
    """Whether the fast path's one-time check against ``base``'s own logits passed (None: not checked yet)."""
    return _FAST_PATH_CHECKED.get(base)


def fast_path_head(base: nn.Module) -> nn.Linear | None:
    """The LM head if ``base`` fits the hidden-state fast path (log-probs from the hidden states in chunks), else
    None: then ``token_logps`` takes the exact full-logits path."""
    if _FAST_PATH_CHECKED.get(base) is False:
        return None
    get_head, get_decoder = getattr(base, "get_output_embeddings", None), getattr(base, "get_decoder", None)
    if not callable(get_head) or not callable(get_decoder):
        return None
    head = get_head()
    if not isinstance(head, nn.Linear) or get_decoder() is base:
        return None
    if "logits_to_keep" not in forward_signature(base):
        return None
    config = getattr(base, "config", None)
    for name, neutral in _LOGIT_TRANSFORMS.items():
        if getattr(config, name, neutral) not in (neutral, None):
            return None
    return head


def hidden_states_and_head(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None, **forward_kwargs: Any
) -> tuple[Tensor, nn.Linear | None]:
    """For losses over the whole vocabulary (distillation): the decoder's last hidden states ``(B, T, H)`` and the
    LM head through the fast path's seam (no ``[B, T, V]`` logits), or ``(logits (B, T, V), None)`` elsewhere."""
    return _states_and_head(model, dist.unwrap_model(model), input_ids, attention_mask, forward_kwargs)


def _states_and_head(
    model, base, input_ids: Tensor, attention_mask: Tensor | None, forward_kwargs: dict
) -> tuple[Tensor, nn.Linear | None]:
    """:func:`forward_states` through the fast path where ``base`` allows it, else (or where its head's one-time
    check fails: a second forward) through the logits."""
    out = forward_states(model, base, fast_path_head(base), input_ids, attention_mask, forward_kwargs)
    return out if out is not None else forward_states(model, base, None, input_ids, attention_mask, forward_kwargs)


def forward_states(
    model, base, head: nn.Linear | None, input_ids: Tensor, attention_mask: Tensor | None, forward_kwargs: dict
) -> tuple[Tensor, nn.Linear | None] | None:
    """One forward of ``model``: ``(final hidden states (B, T, H), head)`` where ``head`` (the fast path's, from
    :func:`fast_path_head`) is given, ``(logits (B, T, V), None)`` where it is None; None where the head's one-time
    check finds it does not reproduce the logits (the forward ran: run it again without the head)."""
    if head is None:
        return _output_logits(model(input_ids, **_model_kwargs(base, attention_mask, forward_kwargs))), None
    hidden = _final_hidden_states(model, base, head, input_ids, attention_mask, forward_kwargs)
    return None if hidden is None else (hidden, head)


def _final_hidden_states(model, base, head, input_ids, attention_mask, forward_kwargs) -> Tensor | None:
    """Run ``model`` with ``logits_to_keep=1`` and return the decoder's last hidden state ``(B, T, H)``,
    or None if the one-time check finds that the head does not reproduce the model's logits."""
    captured = []

    def capture(_module, _args, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = base.get_decoder().register_forward_hook(capture)
    try:
        outputs = model(input_ids, **_model_kwargs(base, attention_mask, forward_kwargs), logits_to_keep=1)
    finally:
        handle.remove()
    if len(captured) != 1:
        return None  # the decoder ran zero or several times: not the structure this path assumes
    hidden = captured[0]
    if base not in _FAST_PATH_CHECKED:
        _FAST_PATH_CHECKED[base] = _head_reproduces_logits(hidden, head, outputs.logits)
        if not _FAST_PATH_CHECKED[base]:
            warnings.warn(
                f"{type(base).__name__}: the LM head applied to the decoder output does not match "
                "the model's logits; using the full-logits path (more memory)",
                stacklevel=3,
            )
            return None
    return hidden


def _head_reproduces_logits(hidden: Tensor, head: nn.Linear, logits: Tensor) -> bool:
    with torch.no_grad():
        expected = F.linear(hidden[:, -1:], head.weight, head.bias).float()
        got = logits[:, -1:].float()
        tolerance = 1e-4 if hidden.dtype == torch.float32 else 2e-2
        return got.shape == expected.shape and torch.allclose(got, expected, rtol=tolerance, atol=tolerance)


def _model_kwargs(base: nn.Module, attention_mask: Tensor | None, forward_kwargs: dict) -> dict:
    kwargs = dict(forward_kwargs)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if "use_cache" in forward_signature(base):
        kwargs.setdefault("use_cache", False)  # a training forward has no use for a KV cache
    return kwargs


def _logps_from_logits(
    logits: Tensor, labels: Tensor, temperature: float, return_entropy: bool, return_mean_logits: bool
) -> TokenLogps:
    """The fallback's log-probs from the model's full logits ``(B, T-1-start, V)`` (a view) through
    :func:`selective_log_softmax` (no log-softmax copy)."""
    logps = selective_log_softmax(logits, labels, temperature=temperature)
    entropy = _entropy(logits, temperature) if return_entropy else None
    mean_logits = logits.detach().mean(dim=-1, dtype=torch.float32) if return_mean_logits else None
    return TokenLogps(logps, entropy, mean_logits)


def _output_logits(outputs) -> Tensor:
    """The logits of a model's output: the tensor itself, ``.logits``, ``["logits"]`` or the first element."""
    logits = outputs if isinstance(outputs, Tensor) else getattr(outputs, "logits", None)
    if logits is None:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    return logits


@torch.no_grad()
def _entropy(logits: Tensor, temperature: float, chunk_rows: int | None = None) -> Tensor:
    """Row entropies of ``softmax(logits / temperature)``, ``logits.shape[:-1]``, chunked."""
    blocks = as_blocks(logits)
    rows = chunk_rows or max(1, (1 << 24) // logits.shape[-1])
    dtype = upcast(logits.dtype)
    out = torch.empty(blocks.shape[0] * blocks.shape[1], dtype=dtype, device=logits.device)
    for s, e, chunk in row_chunks(blocks, rows):
        log_probs = torch.log_softmax(chunk.to(dtype) / temperature, dim=-1)  # (r, V)
        out[s:e] = -(log_probs.exp() * log_probs).sum(dim=-1)
    return out.view(logits.shape[:-1])
