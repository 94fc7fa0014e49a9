"""DPO: preference optimisation against a reference model, by overriding ``Trainer.compute_loss``.

Rafailov et al. 2023, https://arxiv.org/abs/2305.18290. For each pair, with summed completion log-probs of
the policy (``pc``, ``pr``) and of the reference (``rc``, ``rr``) on the chosen / rejected responses, the
loss is ``-logsigmoid(beta * ((pc - rc) - (pr - rr)))`` (``loss_type="sigmoid"``); the other losses live
beside it in ``treadle.losses.dpo_loss``. Data flow::

    rows {prompt, chosen, rejected} (text or chat messages; or {chosen, rejected} sharing a prompt prefix)
      -> prepare_dataset(): tokenised once (trainers.pairs), truncated, checked (prompt_input_ids, chosen_input_ids...)
      -> DPOCollator: the B chosen sequences then the B rejected ones (input_ids, attention_mask, completion_mask)
      -> compute_loss(): ONE policy forward over the 2B rows, one reference forward (or precomputed columns)
      -> pair_losses(): per-pair losses, summed and divided by the pairs of the whole accumulation window

Departures from the paper and from TRL's DPOTrainer:

1. Normalisation: the per-pair losses are summed and divided by the number of pairs in the whole
   accumulation window over all ranks (``count_items`` = pairs, so ``get_num_items_in_batch`` counts them),
   so accumulation and data parallelism give exactly the big batch's gradient. TRL averages each
   micro-batch and then the micro-batches.
2. IPO uses per-token averaged log-probs (as TRL does; the IPO paper's margin ``1/(2 beta)`` is on the
   scale of one token). The other losses use sums, as the DPO paper. For ``ipo`` the reported rewards are
   on the averaged scale too.
3. The RPO term (``rpo_alpha``, Pang et al. 2024) is each pair's per-token NLL of its chosen response,
   then averaged over pairs like the DPO term; TRL takes one token mean over the whole batch.
4. Truncation happens once, at tokenisation: the prompt is cut to ``max_prompt_length`` when set (which end is
   kept is ``truncation_mode``; TRL 1.16 has no such setting, so the default None sets no cap of its own and
   ``max_length`` alone bounds a row, as in TRL), then the responses are cut to fit ``max_length``, keeping
   their start. A prompt that leaves no room for a response is an error naming the row, where TRL drops the
   row silently.
5. Text responses get the tokenizer's eos appended unless they end with it (the model learns to stop);
   chat responses end the way the chat template ends an assistant turn. Text prompts are tokenised with the
   tokenizer's own special tokens (a bos for Llama-style tokenizers), rendered chat prompts without (the
   template has them). Prompt and responses are tokenised separately (as SFTTrainer does).
6. Implicit prompts: for ``{chosen, rejected}`` rows the prompt is their longest common prefix — of whole
   messages for conversations, of characters for text.
7. ``logits/chosen`` / ``logits/rejected`` (the mean logit over completion tokens and the vocabulary) come
   from the same forward as the log-probs (``token_logps(return_mean_logits=True)``): from the final hidden
   state as ``h . mean(W) + mean(b)`` on the fast path, so no ``[B, T, V]`` tensor is built; from the logits
   on the fallback path.
8. Metrics are averaged over the pairs (logits: the tokens) of the steps since the last log, over all ranks,
   not as a mean of per-step means. ``num_tokens`` (TRL's count: every training micro-batch's attention-mask tokens)
   is a run total that a resumed run continues (TRL's restarts at 0), in training logs only.
9. The reference model (a given ``ref_model`` or the frozen copy) always runs in eval mode (no dropout);
   a PEFT policy with adapters disabled runs in the policy's mode. ``precompute_ref_log_probs`` runs on every
   rank over the whole dataset (no sharding) and always in eval mode.
10. ``loss_type`` is a list after ``__post_init__`` (as TRL). The ``sft`` entry is each pair's per-token NLL of its
    chosen response averaged over pairs (TRL: one token mean over the batch), like ``rpo_alpha``; ``sigmoid``
    keeps cDPO's ``label_smoothing`` (TRL 1.16's ignores it). WPO (``use_weighting``) takes its weights from one
    extra no-grad forward with full logits; TRL's fused head returns them from the training forward.
11. ``padding_free`` (TRL's name) is on by default, where TRL's is off: the policy and reference forwards run on
    the chosen and rejected sequences packed side by side without padding (``logprobs.token_logps``), which gives
    the same log-probs and gradients as the padded forward with no work on padding, on any attention
    implementation (TRL's needs flash attention). It falls back to padded forwards where a one-time check finds
    it inexact. ``shared_prefix`` (TRL has none) runs each pair's prompt once, chosen and rejected after it
    (``treadle.logprobs.prefix``), where that is exact and saves work.
12. Vision rows (``images`` with a chat ``prompt``; ``treadle.vision``) stay untokenised: the processor runs per
    batch over the chosen and the rejected chats, each with the row's images, and the policy and reference
    forwards take the same pixels; these forwards are padded (not padding-free).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from treadle import distributed as dist, vision
from treadle.arguments import LogprobChunkOption, PaddingFreeOption, SharedPrefixOption, TrainingArguments
from treadle.data import column_names, require_columns
from treadle.errors import first_rows
from treadle.logprobs.prefix import prompt_first_layout, shared_prefix_logps
from treadle.logprobs.tokens import token_logps
from treadle.losses import check_dpo_options, dpo_loss, dpo_loss_types, ld_token_weights, sft_loss, wpo_weights
from treadle.metrics import mode_of
from treadle.models import from_name, frozen_reference, is_peft_model
from treadle.packing import prompt_completion_batch
from treadle.peft import disable_adapter
from treadle.text import pad_token_id
from treadle.trainer import Trainer
from treadle.trainers.pairs import ID_COLUMNS, tokenize_row
from treadle.trainers.reference import PrecomputedReference

TRUNCATION_MODES = ("keep_start", "keep_end")
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


class ChosenRejected(NamedTuple):
    """One value per pair for the chosen and for the rejected responses, each ``(B,)``."""

    chosen: Tensor
    rejected: Tensor

    @classmethod
    def split(cls, rows: Tensor) -> ChosenRejected:
        """The halves of a ``(2B,)`` per-row tensor laid out as DPOCollator stacks rows: chosen, then rejected."""
        pairs = pair_count(rows.shape[0])
        return cls(rows[:pairs], rows[pairs:])


def pair_count(rows: int) -> int:
    """Pairs in a batch of ``rows`` sequences (the B chosen, then the B rejected): the one rule of the layout."""
    if rows % 2:
        raise ValueError(
            f"a DPO batch holds the chosen sequences then the rejected ones, an even number of rows; "
            f"got {rows} (a custom data_collator must stack both halves, as DPOCollator does)"
        )
    return rows // 2


class PairScores(NamedTuple):
    """``DPOTrainer.completion_logps`` of a batch of B pairs."""

    logps: ChosenRejected  # summed completion log-probs
    counts: ChosenRejected  # completion tokens
    logit_sums: ChosenRejected | None  # summed vocabulary-mean logits of the completion tokens (detached)


@dataclass
class DPOConfig(LogprobChunkOption, SharedPrefixOption, PaddingFreeOption, TrainingArguments):
    """TrainingArguments plus the DPO fields (names as in TRL's DPOConfig); the log-prob forwards' options
    (``padding_free``, ``shared_prefix``, ``logprob_chunk_size``) are treadle.arguments'."""

    beta: float = 0.1  # β: strength of the implicit KL to the reference; 0.1 typical, smaller drifts further
    loss_type: str | list[str] = "sigmoid"  # a name or a list of names (MPO); stored as a list, as TRL (docs/dpo.md)
    label_smoothing: float = 0.0  # ε, assumed rate of flipped labels (cDPO / robust); 0 trusts the labels
    rpo_alpha: float = 0.0  # α, weight of an NLL term on the chosen response (RPO uses 1.0); 0 disables it
    max_length: int | None = 1024  # prompt + response tokens kept per sequence; None keeps everything
    max_prompt_length: int | None = None  # prompt tokens kept (< max_length); None: no own cap, as TRL 1.16 (none)
    truncation_mode: str = "keep_end"  # which end of a too-long prompt survives: "keep_end" or "keep_start"
    padding_value: int | None = None  # input_ids padding; None uses the tokenizer's pad (or eos) token id
    precompute_ref_log_probs: bool = False  # reference log-probs once before training, then free the reference
    dataset_num_proc: int | None = None  # processes for tokenising datasets; None tokenises in this process

    # --- objective table (issue 17): names and defaults of TRL 1.16's DPOConfig; see docs/dpo.md
    loss_weights: list[float] | None = None  # one weight per entry of loss_type (MPO: [0.8, 0.2, 1.0]); None: 1.0 each
    ld_alpha: float | None = None  # LD-DPO: weight in [0, 1] of tokens past the shorter response; None: plain sums
    use_weighting: bool = False  # WPO: weigh each pair by the policy's probability of it (one extra no-grad forward)
    discopop_tau: float = 0.05  # τ of loss_type="discopop" (the paper's 0.05)
    f_divergence_type: str = "reverse_kl"  # f-DPO: reverse_kl (DPO), forward_kl, js_divergence, alpha_divergence
    f_alpha_divergence_coef: float = 0.5  # α of "alpha_divergence"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.loss_type = list(dpo_loss_types(self.loss_type))  # one name or a list; a list from here on, as TRL
        check_dpo_options(
            self.beta,
            self.loss_type,
            self.label_smoothing,
            loss_weights=self.loss_weights,
            ld_alpha=self.ld_alpha,
            discopop_tau=self.discopop_tau,
            use_weighting=self.use_weighting,
            f_divergence_type=self.f_divergence_type,
            f_alpha_divergence_coef=self.f_alpha_divergence_coef,
        )  # the rules dpo_loss applies too
        if self.rpo_alpha < 0:
            raise ValueError(f"rpo_alpha must be >= 0 (0 disables the NLL term, RPO uses 1.0), got {self.rpo_alpha}")
        self._validate_lengths()
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ValueError(
                f"truncation_mode={self.truncation_mode!r} is not supported; use one of {list(TRUNCATION_MODES)}"
            )
        if self.padding_value is not None and self.padding_value < 0:
            raise ValueError(
                f"padding_value must be a token id >= 0 (or None for the tokenizer's), got {self.padding_value}"
            )
        if self.dataset_num_proc is not None and self.dataset_num_proc < 1:
            raise ValueError(f"dataset_num_proc must be >= 1 or None, got {self.dataset_num_proc}")

    def _validate_lengths(self) -> None:
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(
                f"max_length must be >= 2 (a prompt token and a response token) or None, got {self.max_length}"
            )
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or None, got {self.max_prompt_length}")
        if (
            self.max_length is not None
            and self.max_prompt_length is not None
            and self.max_prompt_length >= self.max_length
        ):
            raise ValueError(
                f"max_prompt_length ({self.max_prompt_length}) must be < max_length "
                f"({self.max_length}) to leave room for the response; e.g. max_prompt_length="
                f"{self.max_length // 2}"
            )


# ---------------------------------------------------------------------------------------------------------
# Collator
# ---------------------------------------------------------------------------------------------------------
class DPOCollator:
    """Pads B tokenised pairs into one batch of 2B sequences: the chosen ones (prompt + chosen), then the
    rejected ones (prompt + rejected), so that one forward scores both.

    Rows hold ``prompt_input_ids``, ``chosen_input_ids``, ``rejected_input_ids`` (lists of ints) and optionally
    ``ref_chosen_logps`` / ``ref_rejected_logps`` (floats). The batch holds ``input_ids`` ``(2B, T)``,
    right-padded with ``pad_token_id``; ``attention_mask`` ``(2B, T)``; ``completion_mask`` ``(2B, T)``, 1 on
    response tokens only (the prompt never counts in the loss); and ``ref_*`` ``(B,)`` float32 when every
    row has them.
    """

    def __init__(self, pad_token_id: int = 0):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        if not rows:
            raise ValueError("cannot collate an empty list of rows")
        sequences = [
            (row["prompt_input_ids"], row[key]) for key in ("chosen_input_ids", "rejected_input_ids") for row in rows
        ]
        batch = prompt_completion_batch(sequences, self.pad_token_id)  # (2B, T) each
        for key in REF_COLUMNS:
            if all(row.get(key) is not None for row in rows):
                batch[key] = torch.tensor([float(row[key]) for row in rows], dtype=torch.float32)  # (B,)
        return batch


# ---------------------------------------------------------------------------------------------------------
# Checks of the tokenised pairs
# ---------------------------------------------------------------------------------------------------------
def check_identical_pairs(dataset, split: str) -> None:
    """Refuse a dataset whose every pair has chosen == rejected (as tokens, after truncation): the loss is log 2
    whatever the model, its gradient zero, so the run would learn nothing; note how many when only some are."""
    same = [i for i, (c, r) in enumerate(zip(dataset["chosen_input_ids"], dataset["rejected_input_ids"])) if c == r]
    if not same:
        return
    rows = first_rows(same)
    if len(same) == len(dataset):
        raise ValueError(
            f"every one of the {len(same)} {split} pairs has chosen identical to rejected (after "
            f"tokenization and truncation): DPO learns nothing from a pair without a preference (loss "
            f"log 2, gradient 0); give pairs whose chosen and rejected differ"
        )
    if dist.is_main_process():
        print(
            f"treadle: {len(same)} of {len(dataset)} {split} pairs have chosen identical to rejected (rows {rows}): "
            f"they add log 2 to the loss and nothing to its gradient",
            file=sys.stderr,
        )


# ---------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------
class DPOTrainer(PrecomputedReference, Trainer):
    """Trains ``model`` on preference pairs with DPO (and its variants, see ``DPOConfig.loss_type``).

    The reference is ``ref_model``; when None, a frozen copy of ``model`` made here — or, for a PEFT model
    (one with a ``disable_adapter()`` context manager), the model itself with its adapters disabled, so no
    second copy is held. The model never receives labels: ``compute_loss`` scores the completion tokens.
    """

    config_class = DPOConfig
    watched_metrics = ("rewards/accuracies", "rewards/margins", "eval_rewards/accuracies")
    logs_num_tokens = True  # TRL's num_tokens: the attention-mask tokens of every training micro-batch
    scored_only = True  # evaluation scores the model (its mean loss per batch), it asks for no predictions

    def __init__(
        self,
        model=None,
        ref_model=None,
        args: DPOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        args = self.check_args(args)  # needed before super().__init__: the collator's pad id
        model, processing_class = from_name(model, processing_class, args)  # a folder or Hub id (TRL's habit)
        ref_model, _ = from_name(ref_model, processing_class, args)
        if model is not None and ref_model is model:
            raise ValueError(
                "ref_model is the policy model itself; pass ref_model=None (a frozen copy is made) or a separate model"
            )
        collator = data_collator
        if collator is None and vision.has_images(train_dataset):  # images: processed per batch
            collator = vision.VisionPreferenceCollator(processing_class, max_length=args.max_length)
        elif collator is None:
            collator = DPOCollator(pad_token_id(processing_class, args.padding_value))
        super().__init__(
            model, args, collator, None, None, processing_class, compute_metrics, callbacks, optimizers, peft_config
        )
        self.train_dataset = None if train_dataset is None else self.prepare_dataset(train_dataset, "train")
        self.eval_dataset = None if eval_dataset is None else self.prepare_dataset(eval_dataset, "eval")
        self.ref_model = self.build_reference_model(ref_model)

    # ---- reference model ----------------------------------------------------------------------------------
    def is_peft_model(self) -> bool:
        """True when the policy can act as its own reference: it has a ``disable_adapter()`` context manager."""
        return is_peft_model(self.model)

    def build_reference_model(self, ref_model):
        """The given ``ref_model``, None for a PEFT policy, else a frozen copy of the policy (eval mode)."""
        return frozen_reference(self.model, ref_model, device=self.args.device)

    @torch.no_grad()
    def reference_logps(self, inputs: dict[str, Tensor]) -> ChosenRejected:
        """Summed reference log-probs ``(B,)`` of the chosen and of the rejected completions of a batch."""
        if self.ref_model is not None:
            return self.completion_logps(self.ref_model, inputs).logps
        if self.is_peft_model():
            with disable_adapter(self.model) as base:
                return self.completion_logps(base, inputs).logps
        else:
            raise RuntimeError(
                "no reference model: precompute_ref_log_probs=True freed it after computing the "
                "training (and evaluation) datasets' reference log-probs. Give datasets with "
                f"{list(REF_COLUMNS)} columns, pass them to DPOTrainer before training, or use "
                "precompute_ref_log_probs=False"
            )

    # ---- data ---------------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, split: str):
        """Tokenise, truncate and check every row once (a progress bar per dataset); see ``tokenize_row``.

        Accepts a ``datasets.Dataset`` (or a list of dicts) with ``prompt``/``chosen``/``rejected`` as text or
        chat messages, ``chosen``/``rejected`` conversations sharing a prompt prefix, or already tokenised
        ``*_input_ids`` columns. Reference log-prob columns, if present, are kept; other columns are dropped.
        """
        from datasets import Dataset

        if isinstance(dataset, (list, tuple)):
            dataset = Dataset.from_list(list(dataset))
        names = column_names(dataset)
        if vision.image_column(names):
            return self.prepare_vision_dataset(dataset, split)
        if names is not None and not all(c in names for c in ID_COLUMNS):
            require_columns(
                dataset,
                ["chosen", "rejected"],
                what=f"DPOTrainer's {split} dataset",
                fix="Give rows {prompt, chosen, rejected} (text or chat messages), or {chosen, "
                "rejected} conversations that share the prompt as a prefix.",
            )
        fn = functools.partial(
            tokenize_row,
            tokenizer=self.processing_class,
            max_length=self.args.max_length,
            max_prompt_length=self.args.max_prompt_length,
            truncation_mode=self.args.truncation_mode,
        )
        drop = [c for c in names or [] if c not in REF_COLUMNS]
        kwargs = {}
        if isinstance(dataset, Dataset):
            kwargs = dict(num_proc=self.args.dataset_num_proc, desc=f"Tokenizing {split} dataset")
        tokenized = dataset.map(fn, with_indices=True, remove_columns=drop or None, **kwargs)
        check_identical_pairs(tokenized, split)
        return tokenized

    def prepare_vision_dataset(self, dataset, split: str):
        """A vision dataset as it is (``vision.VisionPreferenceCollator`` processes each batch), checked first:
        the processor, a model that takes images, every image and both chats of every row."""
        where = f"the {split} dataset"
        vision.check_images_accepted(self.model, self.processing_class, where=where)
        vision.check_preference_dataset(dataset, where=where)
        return dataset

    def signature_columns(self) -> set[str]:
        """The tokenised columns (the model takes none of them directly: the collator builds its inputs); the raw
        columns of a vision dataset."""
        return set(ID_COLUMNS) | set(REF_COLUMNS) | set(vision.ROW_COLUMNS) | {"chosen", "rejected"}

    def count_items(self, inputs: dict) -> int:
        """A DPO loss item is a pair: half the rows of a batch. The inherited ``get_num_items_in_batch`` sums
        this over the accumulation window and over ranks, and ``compute_loss`` divides by that."""
        return pair_count(inputs["input_ids"].shape[0])

    def reference_columns(self) -> tuple[str, ...]:
        return REF_COLUMNS

    def get_test_dataloader(self, test_dataset):
        return super().get_test_dataloader(self.prepare_dataset(test_dataset, "test"))

    # ---- the loss -----------------------------------------------------------------------------------------
    def completion_logps(self, model, inputs: dict[str, Tensor], *, with_logits: bool = False) -> PairScores:
        """One forward over all ``2B`` rows, split into the chosen and the rejected halves (``(B,)`` each):
        ``logps`` sums log p(token) over each row's completion tokens (memory-bounded, treadle.logprobs),
        ``counts`` counts those tokens, ``logit_sums`` (``with_logits``, else None) sums over them the mean
        logit over the vocabulary, detached, from the same forward."""
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]  # (2B, T)
        completion_mask = inputs["completion_mask"]  # (2B, T)
        extras = vision.forward_extras(inputs)  # pixel_values and the like: the same images for both responses
        shared = self.args.shared_prefix and not extras  # treadle.logprobs.prefix takes text rows only
        laid = prompt_first_layout(input_ids, attention_mask, completion_mask) if shared else None
        out = (
            None
            if laid is None
            else shared_prefix_logps(  # each pair's prompt once (treadle.logprobs.prefix), or None
                model,
                laid[0],
                laid[1],
                prompt_width=laid[2],
                chunk_size=self.args.logprob_chunk_size,
                return_mean_logits=with_logits,
            )
        )
        if out is not None:
            mask = laid[1][:, laid[2] :].to(out.logps.dtype)  # (2B, R): the responses, right-padded
        else:
            # Predictions before the earliest response token are never needed: skip their log-softmax.
            start = int(completion_mask.argmax(dim=1).min()) - 1
            out = token_logps(
                model,
                input_ids,
                attention_mask,
                start=start,
                chunk_size=self.args.logprob_chunk_size,
                return_mean_logits=with_logits,
                padding_free=self.args.padding_free and not extras,
                **extras,
            )  # (2B, T-1-start)
            mask = completion_mask[:, start + 1 :].to(out.logps.dtype)  # (2B, T-1-start)
        logit_sums = ChosenRejected.split((out.mean_logits * mask).sum(dim=1)) if with_logits else None
        weights = mask
        if self.args.ld_alpha is not None:  # LD-DPO: the tail past the shorter response weighs ld_alpha
            weights = torch.cat(ld_token_weights(*ChosenRejected.split(mask), self.args.ld_alpha)).to(mask.dtype)
        return PairScores(
            ChosenRejected.split((out.logps * weights).sum(dim=1)), ChosenRejected.split(mask.sum(dim=1)), logit_sums
        )

    def pair_losses(
        self,
        chosen_logps: Tensor,
        rejected_logps: Tensor,
        ref_chosen_logps: Tensor,
        ref_rejected_logps: Tensor,
        chosen_counts: Tensor,
        rejected_counts: Tensor,
        pair_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-pair losses ``(B,)`` and detached ``(B,)`` metrics from summed completion log-probs ``(B,)`` and
        completion token counts ``(B,)``: ``losses.dpo_loss`` (every type of the ``loss_type`` list, weighted by
        ``loss_weights``), times ``pair_weights`` ``(B,)`` (WPO) when given, plus ``rpo_alpha`` times the chosen
        response's per-token NLL (``losses.sft_loss``)."""
        args = self.args
        types = dpo_loss_types(args.loss_type)
        losses, metrics = dpo_loss(
            chosen_logps,
            rejected_logps,
            ref_chosen_logps,
            ref_rejected_logps,
            beta=args.beta,
            loss_type=types,
            label_smoothing=args.label_smoothing,
            loss_weights=args.loss_weights,
            chosen_counts=chosen_counts,
            rejected_counts=rejected_counts,
            discopop_tau=args.discopop_tau,
            f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef,
        )
        if "ipo" in types:  # rewards on IPO's per-token scale (module docstring, 2)
            metrics["chosen_rewards"] = metrics["chosen_rewards"] / chosen_counts.clamp(min=1)
            metrics["rejected_rewards"] = metrics["rejected_rewards"] / rejected_counts.clamp(min=1)
        if pair_weights is not None:
            losses = losses * pair_weights
        if args.rpo_alpha > 0:
            nll = sft_loss(chosen_logps, chosen_counts)  # (B,)
            losses = losses + args.rpo_alpha * nll
            metrics["nll_loss"] = nll.detach()
        return losses, metrics

    @torch.no_grad()
    def wpo_pair_weights(self, model, inputs: dict[str, Tensor]) -> Tensor:
        """WPO's per-pair weights ``(B,)`` (``losses.wpo_weights``). Needs ``log Σ_v p(v)²`` at every completion
        position, so this runs one extra forward without gradient and holds its full ``(2B, T, V)`` logits."""
        ids, completion_mask = inputs["input_ids"], inputs["completion_mask"]  # (2B, T)
        logits = model(input_ids=ids, attention_mask=inputs["attention_mask"]).logits[:, :-1].float()  # (2B, T-1, V)
        log_probs = torch.log_softmax(logits, dim=-1)
        token = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (2B, T-1)
        aligned = token - torch.logsumexp(2 * log_probs, dim=-1)  # log p(y_t) - log sum_v p(v)^2
        mask = completion_mask[:, 1:].to(aligned.dtype)
        means = (aligned * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (2B,)
        return wpo_weights(*ChosenRejected.split(means))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Sum of the per-pair losses of this micro-batch divided by ``num_items_in_batch`` (the pairs of the
        whole window, all ranks), or their mean when it is None. Records the DPO metrics."""
        policy = self.completion_logps(model, inputs, with_logits=True)
        if all(k in inputs for k in REF_COLUMNS):
            reference = ChosenRejected(*(inputs[k].to(policy.logps.chosen.dtype) for k in REF_COLUMNS))
        else:
            reference = self.reference_logps(inputs)
        pair_weights = self.wpo_pair_weights(model, inputs) if self.args.use_weighting else None
        losses, metrics = self.pair_losses(*policy.logps, *reference, *policy.counts, pair_weights=pair_weights)
        self.record_metrics(policy, metrics, mode=mode_of(model))
        loss = losses.sum() / (num_items_in_batch if num_items_in_batch is not None else len(losses))
        return (loss, metrics) if return_outputs else loss

    def record_metrics(self, policy: PairScores, metrics: dict[str, Tensor], mode: str) -> None:
        """Record one batch's metrics in the Trainer's metrics window: rewards, accuracies, margins and log-probs
        as means over pairs, ``logits/*`` as means over completion tokens."""
        chosen, rejected = metrics["chosen_rewards"], metrics["rejected_rewards"]  # (B,)
        pairs = float(chosen.shape[0])
        sums = {
            "rewards/chosen": (chosen.sum(), pairs),
            "rewards/rejected": (rejected.sum(), pairs),
            "rewards/accuracies": ((chosen > rejected).sum(), pairs),
            "rewards/margins": ((chosen - rejected).sum(), pairs),
            "logps/chosen": (policy.logps.chosen.detach().sum(), pairs),
            "logps/rejected": (policy.logps.rejected.detach().sum(), pairs),
        }
        if "nll_loss" in metrics:
            sums["nll_loss"] = (metrics["nll_loss"].sum(), pairs)
        if policy.logit_sums is not None:  # a token mean: weighted by completion tokens, not pairs
            sums["logits/chosen"] = (policy.logit_sums.chosen.sum(), policy.counts.chosen.sum())
            sums["logits/rejected"] = (policy.logit_sums.rejected.sum(), policy.counts.rejected.sum())
        self.metrics.add_many(sums, mode)


__all__ = ["DPOConfig", "DPOTrainer", "DPOCollator"]
