"""The typed data of on-policy training (GRPO, distillation): the prompts sampling starts from (:class:`Prompts`),
what sampling returns (:class:`Rollout`), what one micro-step trains on (:class:`Sample`), the generation buffer
that owns its cursor and its checkpoint state (:class:`GenerationBuffer`), and the accumulation windows of
per-micro-step tickets that one generation batch feeds (:func:`generation_windows`).

One generation batch (``generation_batch_size`` rows on this rank: ``steps_per_generation`` slices of
``per_device_train_batch_size`` rows) feeds a cycle of ``steps_per_generation * num_iterations`` micro-steps;
micro-step m of the cycle trains on slice ``m % steps_per_generation``. The dataloader yields each generation
batch once; the loop counts ``len(dataloader) * cycle`` micro-steps per epoch (``Trainer.micro_batches_per_batch``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from treadle.data import epoch_batches
from treadle.errors import PreflightError
from treadle.generation.single import GenerationOutput
from treadle.streaming import Stream, repeat_rows

__all__ = [
    "GenerationBuffer",
    "Prompts",
    "Rollout",
    "Sample",
    "Ticket",
    "generation_windows",
    "join_rows",
    "prompt_stream",
    "slice_sample",
]


@dataclass
class Prompts:
    """A batch of rows' prompts, tokenised once (``OnPolicyTrainer.encode_prompts``): what an engine or the
    asynchronous producer samples from."""

    ids: list[list[int]]  # the distinct prompts' token ids (rows holding whole groups: each prompt once)
    group: int  # completions per distinct prompt: G when the rows hold whole groups, else 1
    inputs: dict[str, Tensor] | None = None  # a VLM's vision inputs for the distinct prompts (pixel_values ...)


@dataclass
class Rollout:
    """One generation's completions on this rank, one per dataset row, as sampling returns them (single-turn
    ``OnPolicyTrainer.sample_rows``, multi-turn ``OnPolicyTrainer.rollout``)."""

    prompts: list  # N prompts (text or chat messages), one per row
    columns: dict[str, list]  # every other dataset column, N values each (reward functions get them)
    completions: list  # N decoded completions (text, or a list of messages for chat prompts)
    completion_lists: list[list[int]]  # N completion token lists, cut at their length
    generation: GenerationOutput  # the tensors, (N, P) and (N, C)
    loss_mask: Tensor  # (N, C) 1 on tokens the loss covers: sampled tokens (multi-turn: not observations)
    transcripts: list | None = None  # multi-turn: every turn with its role
    rollout_metrics: dict = field(default_factory=dict)  # multi-turn: {name: (sum, count)}

    @classmethod
    def of(
        cls, rows: list[dict], generation: GenerationOutput, completions: list, completion_lists: list, **extra
    ) -> Rollout:
        return cls(
            prompts=[row["prompt"] for row in rows],
            columns={k: [row[k] for row in rows] for k in rows[0] if k != "prompt"},
            completions=completions,
            completion_lists=completion_lists,
            generation=generation,
            loss_mask=extra.pop("loss_mask", generation.completion_mask),
            **extra,
        )


def join_rows(parts: list[tuple[Rollout, list[int]]], pad_token_id: int) -> Rollout:
    """One Rollout of the rows ``indices`` of each ``(rollout, indices)`` in order (dynamic sampling keeps groups
    of several rounds): prompts stay left-padded and completions right-padded, to the widest of the parts."""
    first = parts[0][0]
    generation = {}
    for f in dataclasses.fields(first.generation):
        values = [getattr(r.generation, f.name) for r, _ in parts]
        if any(v is None for v in values):
            generation[f.name] = None
            continue
        value = [v[rows] for v, (_, rows) in zip(values, parts)]
        fill = pad_token_id if f.name.endswith("_ids") else 0
        generation[f.name] = _padded(value, fill, left=f.name.startswith("prompt"))
    metrics: dict = {}
    for r, _ in parts:
        for name, (total, count) in r.rollout_metrics.items():
            old = metrics.get(name, (0.0, 0))
            metrics[name] = (old[0] + total, old[1] + count)

    def pick(get) -> list:
        return [values[i] for r, rows in parts for values in [get(r)] for i in rows]

    return Rollout(
        prompts=pick(lambda r: r.prompts),
        columns={k: pick(lambda r, k=k: r.columns[k]) for k in first.columns},
        completions=pick(lambda r: r.completions),
        completion_lists=pick(lambda r: r.completion_lists),
        generation=dataclasses.replace(first.generation, **generation),
        loss_mask=_padded([r.loss_mask[rows] for r, rows in parts], 0, left=False),
        transcripts=None if first.transcripts is None else pick(lambda r: r.transcripts),
        rollout_metrics=metrics,
    )


def _padded(tensors: list[Tensor], fill, *, left: bool) -> Tensor:
    """``tensors`` (each ``(n_i,)`` or ``(n_i, L_i)``) stacked along rows, 2-D ones padded to the widest."""
    if tensors[0].dim() == 1:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    out = []
    for t in tensors:
        pad = t.new_full((t.shape[0], width - t.shape[1]), fill)
        out.append(torch.cat([pad, t] if left else [t, pad], dim=1))
    return torch.cat(out)


@dataclass
class Sample:
    """The rows one micro-step trains on: what crosses from the sampler to the loss. ``B`` rows, prompts cut to
    their own longest (``P``) and completions to theirs (``C``); ``T = P + C``."""

    input_ids: Tensor  # (B, T) left-padded prompt, then right-padded completion
    attention_mask: Tensor  # (B, T) 1 on prompt and completion tokens
    completion_mask: Tensor  # (B, C) 1 on the tokens that carry loss (sampled; not masked as truncated)
    advantages: Tensor  # (B,) group-relative advantage of each completion
    sampling_logps: Tensor | None = None  # (B, C) log-probs of the distribution sampled from; None: not known
    old_logps: Tensor | None = None  # (B, C) the policy's at generation time, when it can change before use
    ref_logps: Tensor | None = None  # (B, C) the reference policy's (beta > 0)
    importance_sampling_ratio: Tensor | None = None  # (B, C) or (B, 1) the sampler correction's weight; None: none
    model_inputs: dict[str, Tensor] | None = None  # what else the forward takes: a VLM's pixel_values ... (vision)

    @property
    def completion_ids(self) -> Tensor:  # (B, C)
        return self.input_ids[:, -self.completion_mask.shape[1] :]

    @classmethod
    def of(cls, inputs: Sample | dict) -> Sample:
        """``inputs`` itself, or a Sample of a dict with the same keys (a hand-built micro-batch)."""
        return inputs if isinstance(inputs, Sample) else cls(**inputs)

    def to(self, device) -> Sample:
        return Sample.from_tensors({k: v.to(device) for k, v in self.tensors().items()})

    def tensors(self) -> dict[str, Tensor]:
        """The fields that are set, by name (what a checkpoint keeps); ``model_inputs`` as ``model_inputs.<key>``."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None and f.name != "model_inputs"
        }
        out.update({f"model_inputs.{k}": v for k, v in (self.model_inputs or {}).items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor]) -> Sample:
        """The Sample of ``tensors()``."""
        extras = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("model_inputs.")}
        fields = {k: v for k, v in tensors.items() if not k.startswith("model_inputs.")}
        return cls(**fields, model_inputs=extras or None)


def slice_sample(out: GenerationOutput, loss_mask: Tensor, advantages: Tensor, rows: slice) -> Sample:
    """The ``Sample`` of ``rows`` of a generation, cut to their own longest prompt and completion (no log-probs of
    other policies yet; on the generation's device)."""
    prompt_mask, completion_attention = out.prompt_mask[rows], out.completion_mask[rows]
    first = int(prompt_mask.any(dim=0).nonzero()[0])  # prompts are left-padded
    width = max(1, int(completion_attention.sum(dim=1).max()))
    return Sample(
        input_ids=torch.cat([out.prompt_ids[rows, first:], out.completion_ids[rows, :width]], 1),
        attention_mask=torch.cat([prompt_mask[:, first:], completion_attention[:, :width]], 1),
        completion_mask=loss_mask[rows, :width],
        advantages=advantages[rows],
        sampling_logps=None if out.sampling_logps is None else out.sampling_logps[rows, :width],
    )


class Ticket(NamedTuple):
    """One micro-step of a training window: its generation, that generation's dataset rows (this rank), and its
    position in the generation's cycle of micro-steps."""

    generation: int
    rows: list
    micro_step: int  # 0 .. cycle - 1


def generation_windows(
    dataloader, epoch: int, skip_steps: int, *, cycle: int, accum: int, generations_per_epoch: int
) -> Iterator[list[Ticket]]:
    """The accumulation windows (``accum`` tickets each, the epoch's last maybe fewer) of epoch ``epoch`` from its
    optimizer step ``skip_steps`` on. Each generation batch is drawn from the dataloader once and feeds ``cycle``
    tickets; on resume, the whole generations before the step are skipped by the sampler without loading, and the
    current generation's rows are loaded to hand out its remaining tickets (its slices come from the checkpoint's
    buffer)."""
    skip_generations, skip_micro = divmod(skip_steps * accum, cycle)
    first = epoch * generations_per_epoch + skip_generations
    batches = epoch_batches(dataloader, epoch, skip_generations)
    tickets = (Ticket(first + index, rows, m) for index, rows in enumerate(batches) for m in range(cycle))
    tickets = itertools.islice(tickets, skip_micro, None)
    while window := list(itertools.islice(tickets, accum)):
        yield window


class GenerationBuffer:
    """The slices of the generations that the next micro-steps train on (this rank's rows), and the cursor: the
    next micro-step of the run, counted over every generation (``generation * cycle + micro_step``).

    ``state_dict()`` holds both (tensors on the CPU) and is saved in every checkpoint, so that a run resumed in the
    middle of a generation trains on the very slices it would have."""

    def __init__(self, cycle: int):
        self.cycle = cycle
        self.cursor = 0
        self.slices: dict[int, list[Sample]] = {}  # generation index -> its steps_per_generation slices

    def __contains__(self, generation: int) -> bool:
        return generation in self.slices

    def put(self, generation: int, slices: list[Sample]) -> None:
        self.slices[generation] = slices

    def take(self, ticket: Ticket, steps_per_generation: int) -> Sample:
        """The slice ``ticket`` trains on; moves the cursor past it and forgets the generations it has passed."""
        sample = self.slices[ticket.generation][ticket.micro_step % steps_per_generation]
        self.cursor = ticket.generation * self.cycle + ticket.micro_step + 1
        return sample

    def release_consumed(self) -> None:
        """Forget the generations whose every micro-step is behind the cursor (called after a window)."""
        current = self.cursor // self.cycle
        self.slices = {g: s for g, s in self.slices.items() if g >= current}

    def clear(self) -> None:
        self.cursor, self.slices = 0, {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "slices": {
                str(g): [{k: v.cpu() for k, v in s.tensors().items()} for s in slices]
                for g, slices in self.slices.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any], device) -> None:
        """Restore ``state_dict()``, or the layout of earlier releases (``{"buffers": ...}``, whose cursor lived in
        ``trainer_state.json``: then the cursor is left to the next ticket)."""
        slices = state["slices"] if "slices" in state else state["buffers"]
        self.cursor = int(state.get("cursor", 0))
        self.slices = {
            int(g): [Sample.from_tensors({k: v.to(device) for k, v in s.items()}) for s in saved]
            for g, saved in slices.items()
        }


def prompt_stream(dataset, args) -> Stream:
    """A stream of prompts as an on-policy trainer trains on them: each rank reads its own prompts
    (``treadle.streaming``) and repeats each ``num_generations`` times in a row, so that its groups are whole on it
    (rewards are still gathered from every rank for the logs and the health checks). A generation's batch must hold
    whole groups: refused otherwise, in one line."""
    if args.generation_batch_size % args.num_generations:
        raise PreflightError(
            f"a streamed dataset gives each rank whole groups: generation_batch_size "
            f"{args.generation_batch_size} (per rank) must be a multiple of num_generations "
            f"{args.num_generations}; change per_device_train_batch_size or steps_per_generation"
        )
    return Stream(dataset, repeat_rows(args.num_generations))
