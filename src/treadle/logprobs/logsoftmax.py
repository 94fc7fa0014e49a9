"""The two memory-bounded log-softmax kernels behind :mod:`treadle.logprobs` (see its docstring for the why):

- :func:`selective_log_softmax`: log-probs of chosen tokens from logits that already exist, with no log-softmax
  copy and one gradient tensor in the logits' own dtype;
- :func:`chunked_token_logps`: the same from final hidden states and the LM head, ``chunk_size`` rows at a time,
  never building the ``[B, T, V]`` logits at once (the backward pass recomputes each chunk; on CPU, up to 1 GiB of
  logits, it keeps them from the forward pass instead).

The hidden-state kernels' default chunk (:func:`chunk_rows`) is 1,024 rows up to a 49,152-token vocabulary and
``CHUNK_LOGITS`` logits beyond it, so that no default chunk of a larger vocabulary costs more memory than SmolLM2's.

Pure tensor functions (custom autograd), tested against ``log_softmax(...).gather`` in tests/test_logprobs.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100
# chunked_token_logps keeps its logits for the backward pass up to this size on CPU (keeps_logits): 1 GiB holds
# 4,096 rows of a 64k vocabulary, a GRPO step's completions for a small model
KEEP_LOGITS_BYTES = 1 << 30
# The default chunk of the hidden-state kernels: CHUNK_ROWS rows, and at most CHUNK_LOGITS logits (rows x V), the
# 192 MiB of float32 of 1,024 rows of SmolLM2's 49,152-token vocabulary. Up to that vocabulary every model keeps the
# 1,024 rows it had; Gemma 3's 262,144 get 192, where 1,024 rows would be a 1 GiB block (docs/models.md measures it)
CHUNK_ROWS = 1024
CHUNK_LOGITS = CHUNK_ROWS * 49152


def chunk_rows(vocab: int, chunk_size: int | None = None) -> int:
    """Rows per chunk of a ``vocab``-wide LM head's logits: ``chunk_size`` where given (the user's
    ``logprob_chunk_size``), else ``CHUNK_ROWS`` (1,024) cut to ``CHUNK_LOGITS // vocab`` (at least 1).

    >>> chunk_rows(103), chunk_rows(49152), chunk_rows(151936), chunk_rows(262144), chunk_rows(262144, 64)
    (1024, 1024, 331, 192, 64)
    """
    if chunk_size is None:
        return max(1, min(CHUNK_ROWS, CHUNK_LOGITS // vocab))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunk_size


# ------------------------------------------------------------------------------ selective log-softmax


def selective_log_softmax(
    logits: Tensor, index: Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """``log_softmax(logits / temperature, -1)`` at ``index``, without a log-softmax copy.

    ``logits`` ``(..., V)`` in any float dtype, ``index`` ``(...)`` integer. Returns ``(...)`` in float32
    (float64 for float64 logits).
    Computed as (gathered logit - logsumexp) over ``chunk_size`` rows at a time (default: about 16M
    elements per chunk), each chunk upcast to float32 on its own, so bf16 logits cost one float32 chunk,
    not a float32 copy. The backward pass writes ``softmax - onehot`` into one gradient tensor of the
    logits' dtype. Positions where ``index == -100`` give 0 and no gradient.

    >>> logits = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    >>> selective_log_softmax(logits, torch.tensor([1, -100]))
    tensor([-0.6931,  0.0000])
    """
    if logits.shape[:-1] != index.shape:
        raise ValueError(
            f"index shape {tuple(index.shape)} must equal logits shape without the vocabulary "
            f"dimension {tuple(logits.shape[:-1])}"
        )
    check_temperature(temperature)
    vocab = logits.shape[-1]
    rows = chunk_size or max(1, (1 << 24) // vocab)
    return _SelectiveLogSoftmax.apply(logits, index, temperature, rows)


def as_blocks(x: Tensor) -> Tensor:
    """View ``(..., R, V)`` as ``(A, R, V)``; a view, not a copy, for the usual slices such as
    ``logits[:, start:-1]`` (flattening those two leading dims into one would copy)."""
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(0)
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def row_chunks(blocks: Tensor, rows: int):
    """Yield ``(flat_start, flat_end, chunk (r, V))`` over the rows of an ``(A, R, V)`` tensor."""
    per_block = blocks.shape[1]
    for a in range(blocks.shape[0]):
        for s in range(0, per_block, rows):
            e = min(s + rows, per_block)
            yield a * per_block + s, a * per_block + e, blocks[a, s:e]


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, index, temperature, rows):
        blocks = as_blocks(logits)  # (A, R, V)
        flat_index = index.reshape(-1)  # (N,)
        valid = flat_index != IGNORE_INDEX  # (N,)
        safe_index = torch.where(valid, flat_index, 0)
        dtype = upcast(logits.dtype)
        logps = torch.empty(flat_index.shape, dtype=dtype, device=logits.device)  # (N,)
        lse = torch.empty_like(logps)  # (N,)
        for s, e, chunk in row_chunks(blocks, rows):
            scaled = chunk.to(dtype) / temperature  # (r, V), at least float32, a new tensor
            picked = scaled.gather(1, safe_index[s:e, None]).squeeze(1)
            lse[s:e] = _logsumexp_inplace(scaled)
            logps[s:e] = torch.where(valid[s:e], picked - lse[s:e], 0.0)
            del scaled  # free this chunk before the next one is allocated
        ctx.save_for_backward(logits, safe_index, valid, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return logps.view(index.shape)

    @staticmethod
    def backward(ctx, grad_logps):
        logits, safe_index, valid, lse = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_blocks = as_blocks(grad)
        g_all = torch.where(valid, grad_logps.reshape(-1).to(lse.dtype), 0.0)  # (N,)
        for (s, e, chunk), (_, _, out) in zip(
            row_chunks(as_blocks(logits), ctx.rows), row_chunks(grad_blocks, ctx.rows)
        ):
            d = _dlogits(chunk.to(lse.dtype) / ctx.temperature, lse[s:e], safe_index[s:e], g_all[s:e], ctx.temperature)
            out.copy_(d)
            del d
        return grad, None, None, None


def _dlogits(scaled: Tensor, lse: Tensor, labels: Tensor, g: Tensor, temperature: float) -> Tensor:
    """d(g · logp[label]) / d(raw logits) = g (onehot - softmax) / temperature, in place on ``scaled``.

    ``scaled`` ``(r, V)`` float32 logits already divided by the temperature, ``lse``, ``labels``, ``g``
    ``(r,)``. Rows with ``g == 0`` (ignored labels) come out as zeros.
    """
    probs = scaled.sub_(lse[:, None]).exp_()  # (r, V) softmax
    d = probs.mul_(-g[:, None])
    d.scatter_add_(1, labels[:, None], g[:, None])
    if temperature != 1.0:
        d.div_(temperature)
    return d


# ------------------------------------------------------------------------ chunked hidden -> logprobs


def chunked_token_logps(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs of ``labels`` under ``softmax((hidden @ weight.T + bias) / temperature)``, chunked.

    Args:
        hidden: ``(N, H)`` final hidden states (after the last norm).
        weight: ``(V, H)`` the LM head weight; ``bias``: ``(V,)`` or None.
        labels: ``(N,)`` token ids; ``-100`` gives log-prob 0 and no gradient.
        chunk_size: rows per chunk (None: :func:`chunk_rows`' default for V); the extra memory is one
            float32 ``(chunk_size, V)`` buffer (two with ``return_entropy``, and a bf16 copy in the backward pass for
            bf16 inputs), plus, on CPU, the whole ``(N, V)`` float32 logits kept for the backward pass when they
            fit in ``KEEP_LOGITS_BYTES`` (1 GiB): the backward pass then needs no second head matmul
            (``keeps_logits``).
        return_entropy: also return the entropy of each row's distribution (detached; computed for
            every row, the caller masks).

    Returns ``logps`` ``(N,)`` float32 (float64 for float64 inputs), or ``(logps, entropy)``. Gradients
    flow to ``hidden``, ``weight`` and ``bias`` in their own dtypes (``grad_weight`` is accumulated in at
    least float32). Under ``torch.autocast`` the matmuls use the autocast dtype, as the model's own head
    would.

    >>> hidden, weight = torch.eye(2), torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    >>> chunked_token_logps(hidden, weight, torch.tensor([0, 0]))
    tensor([-0.3133, -0.6931])
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden (N, H) and weight (V, H); got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be (N,) = {tuple(hidden.shape[:1])}, got {tuple(labels.shape)}")
    chunk_size = chunk_rows(weight.shape[0], chunk_size)
    check_temperature(temperature)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # Cast outside the Function (autograd records the casts) and run it with autocast off, so
        # that the backward pass recomputes the logits in the same dtype as the forward pass.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device_type, enabled=False):
        logps, entropy = _ChunkedTokenLogps.apply(
            hidden, weight, bias, labels, temperature, chunk_size, return_entropy
        )
    return (logps, entropy) if return_entropy else logps


def chunked_nll(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None, chunk_size: int | None = None
) -> tuple[Tensor, Tensor]:
    """SFT's loss terms from final hidden states, chunked as :func:`chunked_token_logps` (temperature 1): the
    summed negative log-likelihood of ``labels`` ``(N,)`` (``-100`` rows add nothing) and, detached, how many
    rows' argmax logit is their label (the token accuracy), both 0-d tensors on ``hidden``'s device.
    The argmax is taken in the same pass over each chunk's logits, so accuracy costs no second head matmul.

    >>> hidden, weight = torch.eye(2), torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    >>> chunked_nll(hidden, weight, torch.tensor([0, 1]))
    (tensor(1.0064), tensor(1))
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # as chunked_token_logps: the casts recorded outside the Function
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if labels.shape != hidden.shape[:1] or hidden.dim() != 2:
        raise ValueError(f"need hidden (N, H) and labels (N,); got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    if not torch.is_grad_enabled():  # needs_input_grad ignores no_grad: detached, the kernel does no gradient work
        hidden, weight, bias = hidden.detach(), weight.detach(), None if bias is None else bias.detach()
    with torch.autocast(device_type, enabled=False):
        return _ChunkedNLL.apply(hidden, weight, bias, labels, chunk_rows(weight.shape[0], chunk_size))


class _ChunkedNLL(torch.autograd.Function):
    """``chunked_nll``'s kernel. The gradient of a summed NLL with respect to the logits is known in the forward
    pass (``softmax - onehot`` on each label row), so each chunk's logits are built once and serve the loss, the
    argmax and both gradient matmuls; the backward pass only scales the stored gradients by the upstream scalar.
    ``_ChunkedTokenLogps`` (any upstream gradient per row) must rebuild every chunk's logits in its backward: one more
    head matmul, about 7% of a 135M model's SFT step. Costs a float32 ``(V, H)`` gradient buffer held to the backward
    (the size of the head's own gradient) when the weight needs one."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_size):
        valid = labels != IGNORE_INDEX  # (N,)
        safe_labels = torch.where(valid, labels, 0)
        acc = dict(dtype=upcast(hidden.dtype), device=hidden.device)  # float32 (float64 for float64 inputs)
        g = valid.to(acc["dtype"])  # (N,) 1 on the rows that count
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = hidden.new_empty(hidden.shape) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, **acc) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], **acc) if need_bias else None
        nll, correct = torch.zeros((), **acc), torch.zeros((), dtype=torch.long, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk_size):
            e = min(s + chunk_size, hidden.shape[0])
            h, rows, gs = hidden[s:e], safe_labels[s:e], g[s:e]
            scaled = _scaled_logits(h, weight, bias, 1.0)  # (r, V)
            picked = scaled.gather(1, rows[:, None]).squeeze(1)
            correct += (scaled.argmax(dim=-1).eq(rows) & valid[s:e]).sum()
            row_max = scaled.amax(dim=-1)  # (r,)
            total = scaled.sub_(row_max[:, None]).exp_().sum(dim=-1)  # scaled now holds exp(logit - max)
            nll += ((total.log() + row_max - picked) * gs).sum()
            d = scaled.mul_((gs / total)[:, None])  # softmax on the rows that count, 0 elsewhere
            d.scatter_add_(1, rows[:, None], -gs[:, None])  # - onehot: d(nll) / d(logits)
            _add_chunk_grads(
                d, h, weight, grad_hidden[s:e] if grad_hidden is not None else None, grad_weight, grad_bias
            )
            del scaled, d  # free this chunk before the next one is allocated
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(correct)
        return nll, correct

    @staticmethod
    def backward(ctx, grad_nll, _grad_correct):
        grad_hidden, grad_weight, grad_bias = ctx.grads
        ctx.grads = None  # the stored gradients go with this backward (no double backward)
        weight_dtype, bias_dtype = ctx.dtypes
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_nll.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_nll).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(grad_nll).to(bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None


class _ChunkedTokenLogps(torch.autograd.Function):
    """``chunked_token_logps``' kernel. Its backward pass needs each chunk's logits again: it recomputes them (one
    more head matmul) unless the forward kept them (``keeps_logits``), in which case the forward leaves every chunk's
    logits intact (out-of-place softmax work) and the backward turns each into its gradient in place. Either way the
    gradients are the same numbers: the recomputed logits are the same product of the same chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, with_entropy):
        n = hidden.shape[0]
        valid = labels != IGNORE_INDEX  # (N,)
        safe_labels = torch.where(valid, labels, 0)
        logps = torch.empty(n, dtype=upcast(hidden.dtype), device=hidden.device)  # (N,)
        lse = torch.empty_like(logps)  # (N,)
        entropy = torch.empty(n if with_entropy else 0, dtype=logps.dtype, device=hidden.device)
        kept = [] if any(ctx.needs_input_grad[:3]) and keeps_logits(hidden, weight) else None
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            scaled = _scaled_logits(hidden[s:e], weight, bias, temperature)  # (r, V)
            picked = scaled.gather(1, safe_labels[s:e, None]).squeeze(1)
            if with_entropy:
                lse[s:e] = torch.logsumexp(scaled, dim=-1)
                log_probs = scaled.sub_(lse[s:e, None]) if kept is None else scaled - lse[s:e, None]
                entropy[s:e] = -(log_probs.exp() * log_probs).sum(dim=-1)
                del log_probs
            else:
                lse[s:e] = _logsumexp_inplace(scaled if kept is None else scaled.clone())
            logps[s:e] = torch.where(valid[s:e], picked - lse[s:e], 0.0)
            if kept is not None:
                kept.append(scaled)
            del scaled  # else it stays alive while the next chunk's logits are allocated
        ctx.save_for_backward(hidden, weight, bias, safe_labels, valid, lse)
        ctx.temperature, ctx.chunk_size, ctx.kept = temperature, chunk_size, kept
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        hidden, weight, bias, safe_labels, valid, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        acc = dict(dtype=lse.dtype, device=weight.device)  # accumulators: at least float32
        grad_hidden = hidden.new_empty(hidden.shape) if need_hidden else None  # contiguous rows
        grad_weight = torch.zeros(weight.shape, **acc) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], **acc) if need_bias else None
        g_all = torch.where(valid, grad_logps.to(lse.dtype), 0.0)  # (N,)
        n, step, kept = hidden.shape[0], ctx.chunk_size, ctx.kept
        ctx.kept = None  # the kept logits go with this backward (no double backward)
        for index, s in enumerate(range(0, n, step)):
            e = min(s + step, n)
            h = hidden[s:e]  # (r, H)
            if kept is None:
                scaled = _scaled_logits(h, weight, bias, ctx.temperature)  # (r, V)
            else:
                scaled, kept[index] = kept[index], None  # freed once this chunk's gradients are in
            d = _dlogits(scaled, lse[s:e], safe_labels[s:e], g_all[s:e], ctx.temperature)  # (r, V)
            _add_chunk_grads(
                d, h, weight, grad_hidden[s:e] if grad_hidden is not None else None, grad_weight, grad_bias
            )
            del scaled, d  # free this chunk before the next one is allocated
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _add_chunk_grads(
    d: Tensor,
    h: Tensor,
    weight: Tensor,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
    grad_bias: Tensor | None,
) -> None:
    """One chunk's share of the head's gradients from ``d`` ``(r, V)`` = d(loss)/d(logits): written into
    ``grad_hidden`` (this chunk's ``(r, H)`` rows) and added to ``grad_weight`` / ``grad_bias`` (None: not needed)."""
    if grad_bias is not None:
        grad_bias += d.sum(dim=0)
    d = d.to(h.dtype)  # the matmuls run in the model's dtype, as autograd's would
    if grad_hidden is not None:
        torch.mm(d, weight, out=grad_hidden)  # (r, V) @ (V, H)
    if grad_weight is not None and grad_weight.dtype == h.dtype:
        grad_weight.addmm_(d.t(), h)  # (V, r) @ (r, H), no temporary
    elif grad_weight is not None:
        grad_weight += d.t() @ h  # bf16 product, accumulated in float32


def _logsumexp_inplace(x: Tensor) -> Tensor:
    """Row logsumexp of ``x`` ``(r, V)``, overwriting ``x``: ``torch.logsumexp`` would allocate a second
    ``(r, V)`` buffer, doubling the forward pass's peak."""
    row_max = x.amax(dim=-1)  # (r,)
    return x.sub_(row_max[:, None]).exp_().sum(dim=-1).log_().add_(row_max)


def keeps_logits(hidden: Tensor, weight: Tensor) -> bool:
    """Whether :func:`chunked_token_logps` keeps its float32 logits from the forward pass for the backward pass
    instead of recomputing them: on CPU, when all of them fit in ``KEEP_LOGITS_BYTES``. A CPU step is bound by its
    matmuls and its memory is plentiful (the recomputation is one more head matmul, about 5% of a 135M model's GRPO
    step); an accelerator's step is bound by memory, where the chunking's bound matters and the matmul is cheap."""
    size = hidden.shape[0] * weight.shape[0] * upcast(hidden.dtype).itemsize
    return hidden.device.type == "cpu" and size <= KEEP_LOGITS_BYTES


def upcast(dtype: torch.dtype) -> torch.dtype:
    """The dtype the softmax is computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _scaled_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    scaled = F.linear(h, weight, bias).to(upcast(h.dtype))  # (r, V)
    if temperature != 1.0:
        scaled.div_(temperature)
    return scaled


def check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
