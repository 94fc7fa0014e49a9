"""The LM head of a decode step, applied in slices of the vocabulary into a buffer kept across steps.

Contract: :func:`sliced_head` gives the logits ``hidden @ weight.T`` (R, V) -- the same numbers as the model's own
``lm_head`` (a test checks them bit for bit on each kernel set) -- written 1,024 vocabulary columns at a time into
``out``. Each slice's product (64 rows x 1,024 columns, 256 KiB) is written while the slice of the weight is being
read, into a buffer that the next step reuses, so the decode step allocates no (R, V) logits (transformers' head
returns a fresh (R, 1, V) tensor every step, which on CPU costs page faults on top of the product).
:func:`plain_head` says whether a model's logits are exactly its head's product (no bias, soft-cap or scale), the
condition for the decode loop to call its backbone and this head instead of the whole model.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HEAD_SLICE", "plain_head", "sliced_head"]

HEAD_SLICE = 1024  # vocabulary columns per slice: 64 x 1024 float32 outputs stay in L2 while they are written

# Causal LMs whose forward ends in exactly ``logits = self.lm_head(hidden_states)`` (no soft-cap, logit scale or
# bias); any other model keeps its own forward.
PLAIN_HEAD_MODELS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def plain_head(model) -> bool:
    """Whether ``model``'s logits are ``model.lm_head(model.model(...).last_hidden_state)`` and nothing more."""
    head = getattr(model, "lm_head", None)
    return (
        type(model).__name__ in PLAIN_HEAD_MODELS
        and type(head) is torch.nn.Linear
        and head.bias is None
        and isinstance(getattr(model, "model", None), torch.nn.Module)
    )


def sliced_head(hidden: Tensor, weight: Tensor, out: Tensor, slice_size: int = HEAD_SLICE) -> Tensor:
    """``out`` (R, V) filled with ``hidden`` (R, H) @ ``weight`` (V, H).T, ``slice_size`` columns at a time."""
    vocab = weight.shape[0]
    for start in range(0, vocab, slice_size):
        stop = min(start + slice_size, vocab)
        # out[:, start:stop] is a strided view (row stride V): BLAS writes it in place, no temporary
        torch.mm(hidden, weight[start:stop].t(), out=out[:, start:stop])
    return out
