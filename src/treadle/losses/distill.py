"""Token-level distillation divergences: the generalised Jensen-Shannon divergence of GKD / on-policy distillation,
as pure functions of tensors, and a chunked form that never holds more than one chunk of ``[rows, V]`` logits.

Agarwal et al. 2024 (GKD, on-policy distillation), https://arxiv.org/abs/2306.13649; TRL's ``DistillationTrainer``
uses the same family. With the student's distribution ``p_s`` and the teacher's ``p_t`` at one position (both from
logits divided by ``temperature``):

- ``beta = 0``: the forward KL, ``KL(p_t || p_s) = Σ p_t (log p_t - log p_s)`` (mode covering, as SFT on the
  teacher's distribution);
- ``beta = 1``: the reverse KL, ``KL(p_s || p_t)`` (mode seeking; on-policy distillation's usual choice);
- ``0 < beta < 1``: with the mixture ``m = (1 - beta) p_s + beta p_t``,
  ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` (``beta = 0.5`` is the JSD).

The two endpoints are not the limits of the middle formula (which goes to 0 at both ends); they are defined as
above, as in TRL.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from treadle.logprobs.logsoftmax import chunk_rows


def check_distill_options(beta: float, temperature: float) -> None:
    """ValueError, naming the fix, for ``beta`` outside [0, 1] or a non-positive temperature."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 0.5: JSD, 1: reverse KL), got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (1.0 leaves the logits as they are), got {temperature}")


def generalized_jsd(
    student_logits: Tensor, teacher_logits: Tensor, *, beta: float = 0.5, temperature: float = 1.0
) -> Tensor:
    """Per-position divergence ``(...)`` between the student's and the teacher's next-token distributions, from
    logits ``(..., V)`` (any float dtype; computed in float32 at least). Gradients reach the student's logits; the
    teacher's are detached.

    >>> same = torch.tensor([[1.0, 2.0, 3.0]])
    >>> generalized_jsd(same, same, beta=1.0)
    tensor([0.])
    """
    check_distill_options(beta, temperature)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student and teacher logits must have the same shape (a shared vocabulary); got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}"
        )
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_s = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)
    if beta == 0.0:
        return (log_t.exp() * (log_t - log_s)).sum(dim=-1)
    if beta == 1.0:
        return (log_s.exp() * (log_s - log_t)).sum(dim=-1)
    log_m = torch.logaddexp(log_s + math.log(1 - beta), log_t + math.log(beta))
    return (beta * log_t.exp() * (log_t - log_m) + (1 - beta) * log_s.exp() * (log_s - log_m)).sum(dim=-1)


def _chunk_divergence(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    student_weight: Tensor,
    student_bias: Tensor | None,
    teacher_weight: Tensor,
    teacher_bias: Tensor | None,
    beta: float,
    temperature: float,
) -> Tensor:
    with torch.no_grad():  # the teacher's logits are rebuilt from its hidden states, never saved
        teacher_logits = F.linear(teacher_hidden, teacher_weight, teacher_bias)  # (r, V)
    logits = F.linear(student_hidden, student_weight, student_bias)  # (r, V)
    return generalized_jsd(logits, teacher_logits, beta=beta, temperature=temperature)


def chunked_generalized_jsd(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    *,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> Tensor:
    """``generalized_jsd`` per row ``(N,)`` from final hidden states ``(N, H_s)`` / ``(N, H_t)`` and each model's
    LM head ``(V, H)``, ``chunk_size`` rows at a time (None: ``logprobs.logsoftmax.chunk_rows``' default, a fixed
    number of logits whatever the vocabulary): each chunk's logits are built inside an activation checkpoint (the
    teacher's without gradient) and rebuilt in the backward pass, so at most one chunk of each model's
    ``[chunk_size, V]`` logits (and their float32 softmaxes) is alive at once.
    """
    check_distill_options(beta, temperature)
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(
            f"student and teacher hidden states must have the same rows, got "
            f"{student_hidden.shape[0]} and {teacher_hidden.shape[0]}"
        )
    chunk_size = chunk_rows(student_weight.shape[0], chunk_size)
    pieces = []
    teacher_hidden = teacher_hidden.detach()
    for s in range(0, student_hidden.shape[0], chunk_size):
        # checkpointed: only the two chunks of hidden states are kept for the backward pass, which recomputes the
        # chunk's logits (a saved [r, V] per chunk would add up to the whole [N, V])
        pieces.append(
            checkpoint(
                _chunk_divergence,
                student_hidden[s : s + chunk_size],
                teacher_hidden[s : s + chunk_size],
                student_weight,
                student_bias,
                teacher_weight,
                teacher_bias,
                beta,
                temperature,
                use_reentrant=False,
            )
        )
    if not pieces:
        return student_hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(pieces)


__all__ = ["check_distill_options", "chunked_generalized_jsd", "generalized_jsd"]
