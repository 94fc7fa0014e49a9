"""KTO: learning from unpaired desirable / undesirable completions, by overriding ``Trainer.compute_loss`` and the
collator.

Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306. Each row is one completion with a label (True:
desirable). With summed completion log-probs of the policy and of the reference, the row's log-ratio ``u`` is
compared with a reference point ``z``, a detached estimate of KL(policy || reference) taken on *mismatched*
(prompt, completion) pairs of the same batch; the maths is ``treadle.losses.kto_loss``. Data flow::

    rows {prompt, completion, label} (text or chat messages), or {prompt?, chosen, rejected} pairs (unpaired:
      every pair gives a desirable and an undesirable row)
      -> prepare_dataset(): tokenised once (prompt_input_ids, completion_input_ids, label), and for loss_type "kto"
         KL_completion_input_ids: the completions rotated by one within each run of per_device_train_batch_size
         rows, (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}), as TRL does
      -> KTOCollator: input_ids, attention_mask, completion_mask (and KL_*), label, ref_* when precomputed
      -> compute_loss(): the policy forward (with grad), the KL forward (no grad), the reference forwards
      -> losses.kto_loss(): per-row losses, summed and divided by the rows of the whole accumulation window

Departures from TRL's KTOTrainer:

1. Normalisation: the per-row losses are summed and divided by the rows of the whole accumulation window over all
   ranks (``count_items``), so accumulation and data parallelism give exactly the big batch's gradient. TRL
   averages each micro-batch (the same when micro-batches hold equal rows).
2. The KL estimate is each micro-batch's mean over its mismatched rows, averaged over ranks (an all-reduce of the
   per-rank means, as TRL's gather), then clamped at 0; it is detached (as TRL and the paper).
3. Sampling: TRL insists on ``train_sampling_strategy="sequential"`` for "kto" so that a batch's KL completions are
   its own completions; treadle keeps its seeded shuffle, so a row's KL completion is a neighbour row's completion
   of the dataset, still a mismatched pair (an unbiased sample for the KL estimate). Read the rows in order
   (override ``build_sampler``) for TRL's exact batches.
4. Tokenisation is treadle's preference rule (``text.encode_prompt_responses``, as DPO): prompt and completion
   tokenised separately, a text completion ends with eos. Rows too long are cut at tokenisation (the completion
   keeps its start); a prompt that leaves no room is an error naming the row (TRL drops it).
5. Metrics are means over the rows (logits: tokens) of the steps since the last log, over all ranks;
   ``rewards/margins`` is, like TRL's, the mean over micro-batches holding both kinds of ``rewards/chosen`` minus
   ``rewards/rejected``. ``num_tokens`` (TRL's count: every training micro-batch's attention-mask tokens, not its KL
   completions) is a run total that a resumed run continues (TRL's restarts at 0), in training logs only.
6. The reference runs in eval mode (a given ``ref_model`` or the frozen copy); a PEFT policy with adapters disabled
   runs in the policy's mode. TR-DPO's reference syncing (``sync_ref_model``) is not implemented.
"""

from __future__ import annotations

import functools
import numbers
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from treadle import distributed as dist
from treadle.arguments import LogprobChunkOption, PaddingFreeOption, TrainingArguments
from treadle.data import column_names, require_columns
from treadle.errors import shorten
from treadle.logprobs.tokens import token_logps
from treadle.losses import check_kto_options, kto_kl, kto_loss, kto_uses_kl
from treadle.metrics import mode_of
from treadle.models import frozen_reference, is_peft_model
from treadle.packing import prompt_completion_batch
from treadle.peft import reference_of
from treadle.text import encode_prompt_responses, is_conversation, pad_token_id
from treadle.trainer import Trainer
from treadle.trainers.pairs import split_implicit_prompt
from treadle.trainers.reference import PrecomputedReference

ID_COLUMNS = ("prompt_input_ids", "completion_input_ids", "label")
KL_COLUMN = "KL_completion_input_ids"
REF_COLUMNS = ("ref_logps", "ref_KL_logps")
UNPAIR_BATCH = 1000  # rows per unpairing batch: TRL's map default (chosen rows, then rejected rows, per batch)


@dataclass
class KTOConfig(LogprobChunkOption, PaddingFreeOption, TrainingArguments):
    """TrainingArguments plus the KTO fields (names and defaults as in TRL 1.16's KTOConfig); the log-prob forwards'
    options (``padding_free``, ``logprob_chunk_size``) are treadle.arguments'."""

    beta: float = 0.1  # β: strength of the implicit KL to the reference; 0.1 typical
    loss_type: str = "kto"  # "kto" (Eq. 7 of the paper, with the KL reference point) or "apo_zero_unpaired"
    desirable_weight: float = 1.0  # λ_D: weight of desirable rows (raise it when they are the rarer kind)
    undesirable_weight: float = 1.0  # λ_U: weight of undesirable rows; the paper keeps λ_D n_D / (λ_U n_U) in [1, 4/3]
    max_length: int | None = 1024  # prompt + completion tokens kept per row (the completion is cut); None keeps all
    precompute_ref_log_probs: bool = False  # reference log-probs once before training, then free the reference
    dataset_num_proc: int | None = None  # processes for tokenising datasets; None tokenises in this process
    padding_value: int | None = None  # input_ids padding; None uses the tokenizer's pad (or eos) token id

    def __post_init__(self) -> None:
        super().__post_init__()
        check_kto_options(self.loss_type, self.beta, self.desirable_weight, self.undesirable_weight)
        if kto_uses_kl(self.loss_type) and self.per_device_train_batch_size < 2:
            raise ValueError(
                "loss_type='kto' estimates the KL term from mismatched completions of the same batch, "
                "so per_device_train_batch_size must be >= 2 (or use loss_type='apo_zero_unpaired')"
            )
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"max_length must be >= 2 (a prompt token and a completion token) or None, got {self.max_length}"
            )
        if self.dataset_num_proc is not None and self.dataset_num_proc < 1:
            raise ValueError(f"dataset_num_proc must be >= 1 or None, got {self.dataset_num_proc}")


# ---------------------------------------------------------------------------------------------------------
# Collator
# ---------------------------------------------------------------------------------------------------------
class KTOCollator:
    """Pads B tokenised rows into a batch: ``input_ids``, ``attention_mask``, ``completion_mask`` ``(B, T)``
    (right-padded, the mask 1 on completion tokens only), ``label`` ``(B,)`` bool; ``KL_input_ids``,
    ``KL_attention_mask``, ``KL_completion_mask`` ``(B, T')`` for the mismatched pairs when the rows hold
    ``KL_completion_input_ids``; ``ref_logps`` / ``ref_KL_logps`` ``(B,)`` float32 when every row has them."""

    def __init__(self, pad_token_id: int = 0):
        self.pad_token_id = pad_token_id

    def pad(self, pairs: list[tuple[list[int], list[int]]], prefix: str) -> dict[str, Tensor]:
        """``packing.prompt_completion_batch`` of ``pairs``, its keys prefixed with ``prefix``."""
        return {prefix + key: value for key, value in prompt_completion_batch(pairs, self.pad_token_id).items()}

    def __call__(self, rows: list[dict]) -> dict[str, Tensor]:
        if not rows:
            raise ValueError("cannot collate an empty list of rows")
        prompts = [list(row["prompt_input_ids"]) for row in rows]
        batch = self.pad([(p, list(row["completion_input_ids"])) for p, row in zip(prompts, rows)], "")
        if all(row.get(KL_COLUMN) is not None for row in rows):
            batch.update(self.pad([(p, list(row[KL_COLUMN])) for p, row in zip(prompts, rows)], "KL_"))
        batch["label"] = torch.tensor([bool(row["label"]) for row in rows], dtype=torch.bool)  # (B,)
        for key in REF_COLUMNS:
            if all(row.get(key) is not None for row in rows):
                batch[key] = torch.tensor([float(row[key]) for row in rows], dtype=torch.float32)  # (B,)
        return batch


# ---------------------------------------------------------------------------------------------------------
# Dataset preparation (module-level functions, so that dataset_num_proc workers can pickle them)
# ---------------------------------------------------------------------------------------------------------
def unpair_rows(batch: dict[str, list]) -> dict[str, list]:
    """A batch of preference pairs ``{prompt?, chosen, rejected}`` as unpaired rows: every chosen completion
    (label True), then every rejected one (label False), each with its prompt (the implicit prompt when absent)."""
    prompts, chosen, rejected = [], [], []
    for i, (c, r) in enumerate(zip(batch["chosen"], batch["rejected"])):
        prompt = batch["prompt"][i] if "prompt" in batch else None
        if prompt is None:
            prompt, c, r = split_implicit_prompt(c, r)
        prompts.append(prompt)
        chosen.append(c)
        rejected.append(r)
    return {
        "prompt": prompts + prompts,
        "completion": chosen + rejected,
        "label": [True] * len(chosen) + [False] * len(rejected),
    }


LABEL_WORDS = {"true": True, "1": True, "false": False, "0": False}  # a label read from text (a CSV), stripped


def desirable(label, index: int) -> bool:
    """A row's ``label`` as a bool: True / False, the numbers 1 / 0 and -1 (ints or floats equal to them), or the
    strings "true" / "false" / "1" / "0" (any case, spaces around). Anything else is a ValueError naming the row:
    ``bool("False")`` and ``bool(-1)`` are True, so a lenient cast would push the undesirable completions up.

    >>> [desirable(x, 0) for x in (True, 0, -1, 1.0, " False ", "TRUE")]
    [True, False, False, True, False, True]
    """
    if isinstance(label, (bool, np.bool_)):
        return bool(label)
    if isinstance(label, numbers.Real) and label in (1, 0, -1):  # numpy's numbers and floats equal to them too
        return label == 1
    if isinstance(label, str) and label.strip().lower() in LABEL_WORDS:
        return LABEL_WORDS[label.strip().lower()]
    raise ValueError(
        f"row {index}: label {shorten(repr(label), 60)} is neither desirable nor undesirable; give each row's label "
        f'as True / False (or 1 / 0, 1 / -1, "true" / "false")'
    )


def tokenize_row(row: dict, index: int, *, tokenizer, max_length: int | None) -> dict:
    """One row ``{prompt, completion, label}`` -> ``{prompt_input_ids, completion_input_ids, label}``, the
    completion cut to fit ``max_length``, the label a bool (:func:`desirable`). Raises ValueError, naming the row,
    for a label that is not one, an empty prompt or completion, mixed text and chat, or a prompt that leaves no
    room within ``max_length``."""
    label = desirable(row.get("label"), index)  # a wrong label is named before the text is tokenised
    if row.get("prompt_input_ids") is not None and row.get("completion_input_ids") is not None:
        prompt, completion = list(row["prompt_input_ids"]), list(row["completion_input_ids"])
    else:
        if tokenizer is None:
            raise ValueError(
                "KTOTrainer needs a tokenizer (processing_class=...) to tokenise text or chat rows, or "
                "rows that already hold prompt_input_ids and completion_input_ids"
            )
        prompt, completion = row["prompt"], row["completion"]
        if is_conversation(prompt) != is_conversation(completion):
            raise ValueError(
                f"row {index}: prompt and completion must both be text or both be chat messages, got "
                f"{type(prompt).__name__} and {type(completion).__name__}"
            )
        if not completion:
            raise ValueError(f"row {index}: the completion is empty; drop or fix this row")
        prompt, (completion,) = encode_prompt_responses(tokenizer, prompt, [completion])
    if not prompt:
        raise ValueError(
            f"row {index}: the prompt has no tokens, so the first completion token has nothing to be "
            f"predicted from; give a non-empty prompt (or a tokenizer that adds a bos token)"
        )
    if max_length is not None:
        if len(prompt) >= max_length:
            raise ValueError(
                f"row {index}: the prompt has {len(prompt)} tokens, which leaves no room for the "
                f"completion within max_length={max_length}; raise max_length or shorten the prompt"
            )
        completion = completion[: max_length - len(prompt)]
    if not completion:
        raise ValueError(f"row {index}: the completion has no tokens; drop or fix this row")
    return {"prompt_input_ids": prompt, "completion_input_ids": completion, "label": label}


def warn_one_class(labels) -> None:
    """A UserWarning when every training row has the same label (TRL warns of unbalanced classes too): KTO then
    pushes one kind of completion only, which a label column read wrongly (all "1", say) also gives."""
    desirable_rows = sum(bool(label) for label in labels)
    if len(labels) and desirable_rows in (0, len(labels)):
        kind = "desirable (True)" if desirable_rows else "undesirable (False)"
        warnings.warn(
            f"treadle: every one of the {len(labels)} KTO training rows is labelled {kind}: KTO learns from "
            f"desirable and undesirable completions together; check the label column, or add rows of the other kind",
            UserWarning,
            stacklevel=3,
        )


def rotate_completions(batch: dict[str, list]) -> dict[str, list]:
    """KTO's mismatched pairs within a batch of rows: each prompt gets the previous row's completion (the first
    gets the last's): ``(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})``."""
    completions = batch["completion_input_ids"]
    return {KL_COLUMN: completions[-1:] + completions[:-1]}


# ---------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------
class KTOTrainer(PrecomputedReference, Trainer):
    """Trains ``model`` on labelled, unpaired completions with KTO (or unpaired APO-zero, see
    ``KTOConfig.loss_type``). The reference is ``ref_model``; when None, a frozen copy of ``model`` — or, for a
    PEFT model, the model itself with its adapters disabled. The model never receives labels."""

    config_class = KTOConfig
    watched_metrics = ("kl", "entropy", "rewards/margins")
    logs_num_tokens = True  # TRL's num_tokens: the attention-mask tokens of every training micro-batch
    scored_only = True  # evaluation scores the model (its mean loss per batch), it asks for no predictions

    def __init__(
        self,
        model=None,
        ref_model=None,
        args: KTOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        args = self.check_args(args)
        if model is not None and ref_model is model:
            raise ValueError(
                "ref_model is the policy model itself; pass ref_model=None (a frozen copy is made) or a separate model"
            )
        collator = (
            data_collator
            if data_collator is not None
            else KTOCollator(pad_token_id(processing_class, args.padding_value))
        )
        super().__init__(
            model, args, collator, None, None, processing_class, compute_metrics, callbacks, optimizers, peft_config
        )
        self.train_dataset = None if train_dataset is None else self.prepare_dataset(train_dataset, "train")
        self.eval_dataset = None if eval_dataset is None else self.prepare_dataset(eval_dataset, "eval")
        self.ref_model = frozen_reference(self.model, ref_model, device=self.args.device)

    # ---- data ---------------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, split: str):
        """Unpair preference pairs, tokenise every row once, and add the KL completions ("kto"). Accepts a
        ``datasets.Dataset`` or a list of dicts: ``{prompt, completion, label}`` (text or chat messages),
        ``{prompt?, chosen, rejected}`` pairs, or already tokenised rows. Reference columns are kept."""
        from datasets import Dataset, Value

        if isinstance(dataset, (list, tuple)):
            dataset = Dataset.from_list(list(dataset))

        def kwargs(desc: str) -> dict:  # a stream (IterableDataset) maps lazily: no processes, no progress bar
            return dict(num_proc=self.args.dataset_num_proc, desc=desc) if isinstance(dataset, Dataset) else {}

        names = column_names(dataset) or []
        if "chosen" in names and "rejected" in names:
            dataset = dataset.map(
                unpair_rows,
                batched=True,
                batch_size=UNPAIR_BATCH,
                remove_columns=names,
                **kwargs(f"Unpairing {split} dataset"),
            )
        elif not all(c in names for c in ID_COLUMNS):
            require_columns(
                dataset,
                ["prompt", "completion", "label"],
                what=f"KTOTrainer's {split} dataset",
                fix="Give rows {prompt, completion, label} (text or chat messages; label True for a "
                "desirable completion), or preference pairs {prompt, chosen, rejected}.",
            )
        fn = functools.partial(tokenize_row, tokenizer=self.processing_class, max_length=self.args.max_length)
        drop = [c for c in column_names(dataset) or [] if c not in REF_COLUMNS + (KL_COLUMN,)]
        dataset = dataset.map(
            fn, with_indices=True, remove_columns=drop or None, **kwargs(f"Tokenizing {split} dataset")
        )
        if isinstance(dataset, Dataset) and getattr(dataset.features["label"], "dtype", "bool") != "bool":
            # datasets keeps a column's recorded type over what the map returned (a CSV's text labels: "false"
            # would be read back as a desirable label); the map wrote True / False, which the cast restores
            dataset = dataset.cast_column("label", Value("bool"))
        if kto_uses_kl(self.args.loss_type) and KL_COLUMN not in (column_names(dataset) or ()):
            # runs of per_device_train_batch_size rows, for evaluation too (as TRL)
            dataset = dataset.map(
                rotate_completions,
                batched=True,
                batch_size=self.args.per_device_train_batch_size,
                **kwargs(f"KL completions of the {split} dataset"),
            )
        if split == "train" and isinstance(dataset, Dataset):  # a stream's labels are not known ahead (as TRL)
            warn_one_class(dataset["label"])
        return dataset

    def signature_columns(self) -> set[str]:
        return set(ID_COLUMNS) | {KL_COLUMN} | set(REF_COLUMNS)

    def count_items(self, inputs: dict) -> int:
        """A KTO loss item is a row; ``get_num_items_in_batch`` sums this over the window and the ranks."""
        return int(inputs["label"].shape[0])

    def reference_columns(self) -> tuple[str, ...]:
        """``ref_logps``, and for the "kto" loss ``ref_KL_logps`` (``reference_logps`` fills it only then)."""
        return REF_COLUMNS if kto_uses_kl(self.args.loss_type) else REF_COLUMNS[:1]

    # ---- the loss -----------------------------------------------------------------------------------------
    def completion_logps(
        self, model, ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, *, with_stats: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Summed log-probs ``(B,)`` of each row's completion tokens (memory-bounded, ``logprobs.token_logps``),
        and with ``with_stats`` a dict of detached ``(B,)`` per-row sums: ``logits`` (the vocabulary-mean logit),
        ``entropy`` and ``tokens`` over the completion."""
        start = int(completion_mask.argmax(dim=1).min()) - 1  # nothing before the first completion token counts
        out = token_logps(
            model,
            ids,
            attention_mask,
            start=start,
            chunk_size=self.args.logprob_chunk_size,
            return_entropy=with_stats,
            return_mean_logits=with_stats,
            padding_free=self.args.padding_free,
        )  # (B, T-1-start)
        mask = completion_mask[:, start + 1 :].to(out.logps.dtype)
        if not with_stats:
            return (out.logps * mask).sum(dim=1), None
        stats = {
            "logits": (out.mean_logits * mask).sum(dim=1),
            "entropy": (out.entropy * mask).sum(dim=1),
            "tokens": mask.sum(dim=1),
        }
        return (out.logps * mask).sum(dim=1), stats

    def kl_logps(self, model, inputs: dict[str, Tensor]) -> Tensor:
        """Summed log-probs ``(B,)`` of the mismatched (KL) completions, without gradient."""
        with torch.no_grad():
            return self.completion_logps(
                model, inputs["KL_input_ids"], inputs["KL_attention_mask"], inputs["KL_completion_mask"]
            )[0]

    @torch.no_grad()
    def reference_logps(self, inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        """The reference's summed log-probs ``(B,)`` of the completions and (for "kto") of the KL completions."""
        if self.ref_model is None and not is_peft_model(self.model):
            raise RuntimeError(
                "no reference model: precompute_ref_log_probs=True freed it after computing the "
                "training (and evaluation) datasets' reference log-probs; give datasets with "
                f"{list(REF_COLUMNS)} columns before training, or use precompute_ref_log_probs=False"
            )
        with reference_of(self.model, self.ref_model) as reference:
            ref = self.completion_logps(
                reference, inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
            )[0]
            ref_kl = self.kl_logps(reference, inputs) if "KL_input_ids" in inputs else None
        return ref, ref_kl

    def kl_estimate(self, model, inputs: dict[str, Tensor], ref_kl: Tensor | None) -> Tensor:
        """KTO's reference point z: the batch's mean log-ratio on mismatched pairs, averaged over ranks, clamped
        at 0, detached (0 for losses without it)."""
        device = inputs["input_ids"].device
        if not kto_uses_kl(self.args.loss_type):
            return torch.zeros((), device=device)
        if "KL_input_ids" not in inputs or ref_kl is None:
            raise ValueError(
                "loss_type='kto' needs the KL completions (KL_input_ids) in every batch: prepare the "
                "dataset with KTOTrainer.prepare_dataset and collate it with KTOCollator"
            )
        local = kto_kl(self.kl_logps(model, inputs), ref_kl.to(device))
        summed = dist.all_reduce_sum(torch.stack([local.float(), torch.ones((), device=device)]))
        return (summed[0] / summed[1]).clamp(min=0)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Sum of the per-row losses of this micro-batch divided by ``num_items_in_batch`` (the rows of the whole
        window, all ranks), or their mean when it is None. Records TRL's KTO metrics."""
        logps, stats = self.completion_logps(
            model, inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"], with_stats=True
        )
        if REF_COLUMNS[0] in inputs:
            ref, ref_kl = inputs[REF_COLUMNS[0]].to(logps.dtype), inputs.get(REF_COLUMNS[1])
        else:
            ref, ref_kl = self.reference_logps(inputs)
        kl = self.kl_estimate(model, inputs, ref_kl)
        args = self.args
        losses, rewards = kto_loss(
            logps,
            ref,
            inputs["label"],
            kl,
            beta=args.beta,
            loss_type=args.loss_type,
            desirable_weight=args.desirable_weight,
            undesirable_weight=args.undesirable_weight,
        )
        self.record_metrics(inputs["label"], logps.detach(), rewards, kl, stats, mode=mode_of(model))
        loss = losses.sum() / (num_items_in_batch if num_items_in_batch is not None else len(losses))
        return (loss, {"rewards": rewards, "kl": kl}) if return_outputs else loss

    def record_metrics(
        self, labels: Tensor, logps: Tensor, rewards: Tensor, kl: Tensor, stats: dict, mode: str
    ) -> None:
        """TRL's names: ``kl``, ``entropy``, ``rewards/*`` and ``logps/*`` (means over rows of each kind),
        ``rewards/margins``, ``logits/*`` (means over completion tokens of each kind)."""
        chosen, rejected = labels.bool(), ~labels.bool()
        sums = {"kl": (kl.detach(), 1), "entropy": (stats["entropy"].sum(), stats["tokens"].sum())}
        for kind, rows in (("chosen", chosen), ("rejected", rejected)):
            count = rows.sum()
            sums[f"rewards/{kind}"] = (rewards[rows].sum(), count)
            sums[f"logps/{kind}"] = (logps[rows].sum(), count)
            sums[f"logits/{kind}"] = (stats["logits"][rows].sum(), stats["tokens"][rows].sum())
        if bool(chosen.any()) and bool(rejected.any()):
            margin = rewards[chosen].mean() - rewards[rejected].mean()
            sums["rewards/margins"] = (margin, 1)
        self.metrics.add_many(sums, mode)


__all__ = ["KTOConfig", "KTOTrainer", "KTOCollator", "tokenize_row", "unpair_rows", "rotate_completions"]
