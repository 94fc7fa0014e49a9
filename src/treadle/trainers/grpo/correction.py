"""GRPO's sampler correction (TRL 1.16's ``vllm_importance_sampling_*`` fields): when the distribution the rollout
engine sampled from is not the one the trainer trains, each token's policy loss is weighed by
``π_trainer / π_sampler`` (``losses.sampling_importance_ratio``), and how far apart the two are is logged.

When it applies (``corrects_sampling``): ``vllm_importance_sampling_correction`` is on, the engine returned
``sampling_logps`` (the log-probs of the distribution it actually drew from), and either

- the log-probs are not exact (the engine does not report ``exact_logps``: vLLM, with its own copy of the weights
  and its own kernels, where the ratio catches a stale or unsynced copy as well as numeric drift; or an
  asynchronous producer, whose batches were sampled from weights up to ``max_staleness`` steps old), or
- the own sampler draws from a truncated or penalised distribution: ``top_k`` > 0, ``top_p`` < 1,
  ``repetition_penalty`` != 1, ``min_p`` > 0 or ``generation_kwargs``' ``suppress_tokens`` (its ``sampling_logps``
  are exact for that distribution, so the ratio is each token's kept probability mass, ≤ 1).

The own sampler without those draws from the trained distribution itself (the live model at the trained
temperature): the ratio would be 1 up to rounding, so neither it nor the forward pass for the trainer's log-probs is
spent. TRL applies the correction only with vLLM (its ``transformers`` sampler reports no sampling log-probs).

The ratio uses the old log-probs (the trained policy at generation time) and is fixed for the generation's whole
cycle. Its metrics are one value per generation over every rank's rows, as TRL's. Where the old log-probs come from
(``defers_old_logps``):

- a generation trained in one micro-step (``steps_per_generation x num_iterations`` = 1: the default layout, and
  asynchronous runs with one micro-step per generation) whose model draws no dropout: from the loss's own forward
  pass, detached. The weights cannot change between the generation and that micro-step, and with no dropout the
  training forward computes the log-probs the eval-mode one would (up to kernel rounding), so the ratio is computed
  in ``compute_loss`` at no cost. TRL instead runs one more forward pass for ``old_per_token_logps`` whenever it
  corrects (with vLLM): a quarter of the training FLOPs (2N of 8N per token) spent on numbers it already has;
- otherwise (several micro-steps per generation, or dropout): one more forward pass at generation time, in eval
  mode, for every slice.
"""

from __future__ import annotations

import torch
from torch import nn

from treadle import distributed as dist
from treadle.generation.sampling import sampler_options
from treadle.losses import sampling_correction_metrics, sampling_correction_values, sampling_importance_ratio
from treadle.trainers.onpolicy.data import Sample

__all__ = ["corrects_sampling", "correction_metrics", "defers_old_logps", "draws_dropout", "sampling_ratio"]


def corrects_sampling(args, *, exact_logps: bool) -> bool:
    """Whether the sampler correction applies to the rollouts of an engine (see the module docstring);
    ``exact_logps``: its log-probs are the live policy's own (``RolloutEngine.exact_logps``: the own sampler)."""
    if not args.vllm_importance_sampling_correction:
        return False
    options = {
        "top_k": args.top_k or 0,
        "top_p": args.top_p,
        "repetition_penalty": args.repetition_penalty,
        **sampler_options(args.min_p, args.generation_kwargs),
    }  # generation_kwargs override, as when sampling
    reshaped = (
        options["top_k"] > 0
        or options["top_p"] < 1
        or options["repetition_penalty"] != 1
        or options.get("min_p", 0) > 0
        or bool(options.get("suppress_token_ids"))
    )
    return reshaped or not exact_logps


def draws_dropout(model: nn.Module) -> bool:
    """Whether ``model`` in training mode draws dropout: a dropout module with p > 0 (a LoRA adapter's
    ``lora_dropout``), or a dropout probability above 0 in its config (``attention_dropout``, ``hidden_dropout``,
    ... of a transformers model)."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    values = vars(config).items() if config is not None and hasattr(config, "__dict__") else ()
    return any(("dropout" in name or name.endswith("pdrop")) and isinstance(v, float) and v > 0 for name, v in values)


def defers_old_logps(micro_steps_per_generation: int, model: nn.Module) -> bool:
    """Whether the correction's old log-probs are the loss forward's own, detached (the module docstring): one
    micro-step per generation, and no dropout."""
    return micro_steps_per_generation == 1 and not draws_dropout(model)


def sampling_ratio(sample: Sample, args) -> torch.Tensor:
    """The correction weight of ``sample`` ``(B, C)`` or ``(B, 1)``, from its old and sampling log-probs."""
    return sampling_importance_ratio(
        sample.old_logps,
        sample.sampling_logps,
        sample.completion_mask,
        mode=args.vllm_importance_sampling_mode,
        clip_min=args.vllm_importance_sampling_clip_min,
        clip_max=args.vllm_importance_sampling_clip_max,
    )


def correction_metrics(slices: list[Sample], mode: str) -> dict[str, tuple[float, int]]:
    """TRL's ``sampling/*`` metrics of one generation (this rank's slices, then every rank as TRL: the mean of the
    ranks' means, the max of their maxima, the min of their minima), as window pairs. Every rank must call it."""
    parts = [
        sampling_correction_values(s.old_logps, s.sampling_logps, s.importance_sampling_ratio, s.completion_mask, mode)
        for s in slices
    ]
    local = sampling_correction_metrics(torch.cat([g for g, _ in parts]), torch.cat([r for _, r in parts]))
    names = list(local)
    every = dist.gather_rows(torch.stack([local[n].float() for n in names]).cpu().unsqueeze(0))  # (W, 5)
    out = {}
    for j, name in enumerate(names):
        column = every[:, j]
        value = column.max() if name.endswith("/max") else column.min() if name.endswith("/min") else column.mean()
        out[name] = (float(value), 1)
    return out
