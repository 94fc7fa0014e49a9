"""Supervised fine-tuning: ``SFTConfig`` + ``SFTTrainer``.

The dataset is tokenised once, before training, into ``input_ids`` and a ``completion_mask`` (1 on the tokens
that carry loss); the collator turns that into ``labels`` with -100 elsewhere, and the Trainer's own loss does
the rest. Four dataset forms, chosen by column (first match wins):

1. ``input_ids`` (already tokenised; an optional ``completion_mask`` is kept);
2. ``prompt`` + ``completion`` (strings, or chat message lists rendered with the chat template);
3. ``messages`` (a chat, rendered with the chat template);
4. ``text`` (or ``args.dataset_text_field``).

How this departs from TRL's SFTTrainer (v0.2x):

1. Prompt and completion are tokenised *separately* and concatenated, so the model trains on exactly the
   tokens it sees at inference (prompt tokenised alone, completion generated after it). TRL tokenises the
   joined text, which with a BPE tokenizer can merge tokens across the boundary.
2. eos is appended to ``text`` rows and text ``prompt``/``completion`` rows (unless already there); chat rows
   (``messages``, or prompt and completion as messages) end where the chat template ends a turn, nothing is
   appended (as TRL).
3. Packing is best-fit-decreasing of whole rows (a row longer than ``max_length`` is truncated, never split),
   with ``position_ids`` restarting at 0 in each row and no ``attention_mask``: transformers then builds a
   block-diagonal causal mask from the position ids (eager, sdpa and flash attention alike), so no token
   attends across rows, and the first token of each row is not a label (it would be predicted from the row
   before). A test checks the per-row losses of a packed forward against the rows run alone.
4. Vision rows (an ``images`` or ``image`` column with a processor, ``treadle.vision``) stay untokenised:
   ``VisionCollator`` processes each batch (pixels and the model's extras) and puts the loss on the assistant's
   tokens, never on an image token; packing is switched off for them (a note says so). No ``dataset_kwargs``. A
   streamed dataset is tokenised and packed as it is read, best-fit over each chunk of ``TOKENIZE_CHUNK`` rows. LoRA
   through ``peft_config`` (the Trainer's, docs/peft.md). A string ``model`` is a local folder or a Hub id
   (``models.from_name``).
5. ``mean_token_accuracy`` is logged for training and evaluation (argmax of the logits against the labels, over
   the label tokens of the logging window, through the Trainer's metrics window); TRL's ``num_tokens`` and
   entropy are not: packed batches have no attention mask, and the token rule's fallback (ids that are not the pad
   id, transformers' ``non_padding``) misses every eos there when eos = pad; ``include_num_input_tokens_seen``
   counts with it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from treadle import distributed as dist, vision
from treadle.arguments import TrainingArguments
from treadle.console import show_progress_bars
from treadle.data import check_text_columns, column_names, empty_texts, require_eval_dataset
from treadle.errors import first_rows
from treadle.logprobs.logsoftmax import IGNORE_INDEX, chunked_nll
from treadle.logprobs.tokens import SMALL_LOGITS, hidden_states_and_head
from treadle.metrics import mode_of
from treadle.models import from_name, max_positions, training_forward_kwargs, vocabulary_size
from treadle.packing import best_fit_bins, right_padded
from treadle.streaming import Stream, is_stream
from treadle.text import (
    apply_chat_template,
    encode_prompts,
    encode_texts,
    is_conversation,
    pad_token_id,
    split_chat_completion,
    token_id_problem,
    unknown_share,
    with_eos,
)
from treadle.trainer import Trainer

TOKENIZE_CHUNK = 1000  # rows tokenised per tokenizer call: big enough for the fast tokenizer's batching
SFT_COLUMNS = ("input_ids", "completion_mask", "position_ids")  # what prepare_dataset hands the collator
CHUNKED_INPUTS = {"input_ids", "attention_mask", "labels", "position_ids"}  # batches the chunked loss takes


@dataclass
class SFTConfig(TrainingArguments):
    learning_rate: float = 2e-5  # peak learning rate; SFT of a pretrained model wants it small (TRL's default)
    dataset_text_field: str = "text"  # column holding plain text for language-modelling rows
    max_length: int | None = 1024  # truncate tokenised rows to this many tokens (and pack up to it); None: no cap
    packing: bool = False  # pack short rows into rows of max_length tokens (no cross-row attention)
    completion_only_loss: bool | None = None  # loss on completion tokens only; None: on for prompt/completion rows
    assistant_only_loss: bool = False  # chat rows: loss on assistant turns only (template needs {% generation %})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 2):
            raise ValueError(f"max_length must be an integer >= 2 (or None for no limit), got {self.max_length!r}")
        if self.packing and self.max_length is None:
            raise ValueError("packing=True needs max_length, the length of a packed row (e.g. max_length=1024)")
        if not self.dataset_text_field:
            raise ValueError("dataset_text_field must name a column, e.g. 'text'")


class SFTTrainer(Trainer):
    """Fine-tunes a causal LM on text, prompt/completion or chat rows; see the module docstring.

    ``model`` is a model, the path of a local folder in transformers layout or a Hub id (read with
    ``args.model_init_kwargs`` and ``args.trust_remote_code``, as TRL does); ``processing_class`` the
    tokenizer (loaded from that folder when None). Datasets are ``datasets.Dataset`` objects or lists of dicts.
    """

    config_class = SFTConfig
    watched_metrics = ("mean_token_accuracy", "eval_mean_token_accuracy")

    def __init__(
        self,
        model=None,
        args: SFTConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
    ):
        args = self.check_args(args)  # needed before super().__init__: the datasets are tokenised first
        require_eval_dataset(args, eval_dataset)  # before the tokenising, which takes a while
        model, processing_class = from_name(model, processing_class, args)  # a folder or Hub id (TRL's habit)
        self.args = args = fit_max_length(args, model)
        self.processing_class = processing_class
        self.vision_model = model  # prepare_dataset checks that a model given images takes them
        self.unknown_noted = False  # the note on <unk> tokens in the rows is shown once
        train_dataset = self.prepare_dataset(train_dataset, "train") if train_dataset is not None else None
        eval_dataset = self.prepare_dataset(eval_dataset, "eval") if eval_dataset is not None else None
        if data_collator is None and vision.image_column(column_names(train_dataset)):
            data_collator = vision.VisionCollator(
                processing_class,
                completion_only_loss=args.completion_only_loss is not False,
                max_length=args.max_length,
            )
        elif data_collator is None:
            data_collator = SFTCollator(pad_token_id=pad_token_id(processing_class))
        super().__init__(
            model=model,
            args=self.args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )

    # ---- building -----------------------------------------------------------------------------------------
    def prepare_dataset(self, dataset, name: str = "train"):
        """Tokenise ``dataset`` once (with a progress bar), truncate to ``max_length`` and pack if asked.
        Returns a ``datasets.Dataset`` with ``input_ids``, ``completion_mask`` (and ``position_ids`` when
        packed)."""
        from datasets import Dataset

        if isinstance(dataset, list):
            dataset = Dataset.from_list(dataset)
        if is_stream(dataset):
            return self._stream(dataset, name)
        columns = column_names(dataset)
        if columns is None:
            raise TypeError(
                f"SFTTrainer needs a datasets.Dataset, a list of dicts or a stream for {name}, got "
                f"{type(dataset).__name__}"
            )
        if vision.image_column(columns):
            return self._prepare_vision(dataset, name)
        if "input_ids" in columns:
            rows = self._pretokenized_rows(dataset, name, first_row=0)
        else:
            rows = self._tokenize_rows(dataset, columns, name)
        return Dataset.from_dict(self._training_rows(rows, columns, name))

    def _stream(self, dataset, name: str) -> Stream:
        """A stream tokenised (and packed: best-fit over each chunk of ``TOKENIZE_CHUNK`` rows) as it is read."""
        columns = column_names(dataset) or list(next(iter(dataset)))  # a stream of unknown features: its first row

        def transform(chunk: list[dict]) -> list[dict]:
            table = {c: [row[c] for row in chunk] for c in columns}
            rows = (
                self._pretokenized_rows(table, name, first_row=None)
                if "input_ids" in columns
                else self._tokenize_chunk(table, dataset_form(columns, self.args.dataset_text_field))
            )
            made = self._training_rows(rows, columns, name)
            return [dict(zip(made, values)) for values in zip(*made.values())]

        return Stream(dataset, transform, chunk_size=TOKENIZE_CHUNK)

    def _training_rows(self, rows: list, columns: list[str], name: str) -> dict[str, list[list[int]]]:
        """Tokenised rows truncated to ``max_length``, masked as ``completion_only_loss`` says, packed if asked; the
        share of ``<unk>`` in rows the tokenizer wrote is noted (once)."""
        if "input_ids" not in columns:
            self._note_unknown_tokens(rows, name)
        rows = truncate_rows(rows, self.args.max_length, name=name)
        if self.args.completion_only_loss is False and "prompt" in columns and "input_ids" not in columns:
            # prompt/completion rows are tokenised with the prompt masked, so that truncation could find it
            rows = [(ids, [1] * len(ids)) for ids, _ in rows]
        if self.args.packing:
            return pack_rows(rows, self.args.max_length)
        return {"input_ids": [r[0] for r in rows], "completion_mask": [r[1] for r in rows]}

    def _prepare_vision(self, dataset, name: str):
        """A vision dataset as it is (the collator processes it), after checking processor, model and every row."""
        where = f"the {name} dataset"
        vision.check_images_accepted(self.vision_model, self.processing_class, where=where)
        vision.check_vision_dataset(dataset, where=where)
        if self.args.packing:
            if dist.is_main_process():
                print(
                    f"treadle: packing is off for {where}: image rows are not packed (a row's image tokens go "
                    f"with its pixels)",
                    file=sys.stderr,
                )
            self.args = self.args.replace(packing=False)
        return dataset

    def _note_unknown_tokens(self, rows: list[tuple[list[int], list[int]]], name: str) -> None:
        """One note (a run's first) when the tokenizer wrote ``<unk>`` for characters it has no token for: the model
        would learn to write ``<unk>``."""
        counts = None if self.unknown_noted else unknown_share(self.processing_class, rows)
        if counts is None or not dist.is_main_process():
            return
        unknown, in_loss, total = counts
        print(
            f"treadle: {unknown} of the {total} tokens of the {name} dataset ({unknown / total:.1%}) are "
            f"{self.processing_class.unk_token} ({in_loss} of them in the loss): the tokenizer has no token for some "
            f"characters (emoji, accents, CJK ...), so the model learns to write {self.processing_class.unk_token}; "
            f"use a tokenizer that covers the text, or clean those rows; shown once",
            file=sys.stderr,
        )
        self.unknown_noted = True

    def _pretokenized_rows(self, dataset, name: str, first_row: int | None) -> list[tuple[list[int], list[int]]]:
        """``dataset``: a datasets.Dataset or a dict of columns (``first_row``: its first row's index; None for a
        stream's chunk). An id outside the model's vocabulary is refused (ValueError naming the row), before step 1
        would fail on it."""
        ids = [list(r) for r in dataset["input_ids"]]
        size = vocabulary_size(self.vision_model)
        problem = token_id_problem(ids, size, first_row) if size is not None else None
        if problem:
            raise ValueError(
                f"the {name} dataset's input_ids: {problem}, outside the model's vocabulary of {size} ids (0 to "
                f"{size - 1}); tokenise the rows with this model's tokenizer (-100 marks ignored labels, not inputs)"
            )
        names = dataset if isinstance(dataset, dict) else column_names(dataset)
        masks = dataset["completion_mask"] if "completion_mask" in names else [None] * len(ids)
        return [(r, list(m) if m is not None else [1] * len(r)) for r, m in zip(ids, masks)]

    def _tokenize_rows(self, dataset, columns: list[str], name: str) -> list[tuple[list[int], list[int]]]:
        tokenizer = self.processing_class
        if tokenizer is None:
            raise ValueError(
                f"SFTTrainer needs processing_class (a tokenizer) to tokenise the {name} dataset, or "
                f"a dataset that is already tokenised (an input_ids column)"
            )
        form = dataset_form(columns, self.args.dataset_text_field)
        text_columns = {"prompt_completion": ("prompt", "completion"), "messages": ("messages",)}
        check_text_columns(
            dataset, text_columns.get(form, (self.args.dataset_text_field,)), source=f"the {name} dataset"
        )
        refuse_empty_rows(dataset, form, self.args.dataset_text_field, name)
        from tqdm.auto import tqdm

        rows: list[tuple[list[int], list[int]]] = []
        show = show_progress_bars(self.args) and dist.is_main_process()
        with tqdm(
            total=len(dataset), desc=f"tokenize {name}", unit=" rows", disable=not show, dynamic_ncols=True
        ) as bar:
            for start in range(0, len(dataset), TOKENIZE_CHUNK):
                chunk = dataset[start : start + TOKENIZE_CHUNK]
                rows += self._tokenize_chunk(chunk, form, start)
                bar.update(len(chunk[next(iter(chunk))]))
        return rows

    def _tokenize_chunk(
        self, chunk: dict[str, list], form: str, start: int | None = None
    ) -> list[tuple[list[int], list[int]]]:
        """A chunk's rows tokenised; ``start``: the dataset row of its first (None: a stream's, not known)."""
        if form == "prompt_completion":
            return tokenize_prompt_completion(self.processing_class, chunk["prompt"], chunk["completion"])
        if form == "messages":
            return tokenize_messages(
                self.processing_class, chunk["messages"], assistant_only=self.args.assistant_only_loss, first_row=start
            )
        return tokenize_text(self.processing_class, chunk[self.args.dataset_text_field])

    # ---- hooks --------------------------------------------------------------------------------------------
    def signature_columns(self) -> set[str] | None:
        """The model's arguments plus the columns ``prepare_dataset`` makes for the collator."""
        columns = super().signature_columns()
        return None if columns is None else columns | set(SFT_COLUMNS) | set(vision.ROW_COLUMNS)

    def get_eval_dataloader(self, eval_dataset=None):
        """The Trainer's, after tokenising a dataset handed to ``evaluate()`` that is not tokenised yet."""
        columns = column_names(eval_dataset) or []
        if eval_dataset is not None and "input_ids" not in columns and not vision.image_column(columns):
            eval_dataset = self.prepare_dataset(eval_dataset, "eval")
        return super().get_eval_dataloader(eval_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The Trainer's loss (labels from the collator); also records the label tokens that the argmax of the
        logits gets right, logged as ``mean_token_accuracy`` (training) / ``eval_mean_token_accuracy``.

        Where the logits would be large (more than ``SMALL_LOGITS``) and the model has an LM head the hidden-state
        path can use, the loss is computed from the final hidden states in chunks (``logprobs.chunked_nll``): the
        same sum over label tokens, no ``[B, T, V]`` float32 logits (TRL's default ``nll`` does the same)."""
        if not return_outputs:
            chunked = self._chunked_loss(model, inputs, num_items_in_batch)
            if chunked is not None:
                return chunked
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        logits = getattr(outputs, "logits", None)
        labels = inputs.get("labels")
        if logits is not None and labels is not None:
            with torch.no_grad():
                correct, total = token_accuracy_counts(logits, labels)  # stays on the device: no sync per step
            self.metrics.add("mean_token_accuracy", correct, total, mode=mode_of(model))
        return (loss, outputs) if return_outputs else loss

    def _chunked_loss(self, model, inputs, num_items_in_batch) -> torch.Tensor | None:
        """The loss through ``logprobs.chunked_nll``, or None where the full-logits path runs: small logits,
        inputs beyond text (images), or a model without the hidden-state seam (``fast_path_head``)."""
        labels = inputs.get("labels")
        if labels is None or not set(inputs) <= CHUNKED_INPUTS or labels.dim() != 2:
            return None
        vocab = getattr(getattr(dist.unwrap_model(model), "config", None), "vocab_size", None) or 0
        if labels.numel() * vocab <= SMALL_LOGITS:
            return None  # a few MB of logits: the model's own loss is as cheap (and the toy goldens stay bit-equal)
        forward = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "labels")}
        forward.update(training_forward_kwargs(self._forward_params, inputs))
        hidden, head = hidden_states_and_head(model, inputs["input_ids"], inputs.get("attention_mask"), **forward)
        if head is None:
            return None
        target = labels[:, 1:]  # (B, T-1): hidden[:, t] predicts labels[:, t+1]
        valid = target != IGNORE_INDEX
        nll, correct = chunked_nll(hidden[:, :-1][valid], head.weight, target[valid], bias=head.bias)
        items = valid.sum()
        self.metrics.add("mean_token_accuracy", correct.double(), items.double(), mode=mode_of(model))
        if num_items_in_batch is not None:
            return nll / num_items_in_batch
        return nll / items.clamp(min=1)  # the model's own mean; no label token: 0, no gradient


# ---------------------------------------------------------------------------------------------------------
# Tokenisation (pure functions of a tokenizer and lists of rows)
# ---------------------------------------------------------------------------------------------------------
def dataset_form(columns: list[str], text_field: str = "text") -> str:
    """Which of the SFT dataset forms ``columns`` hold: 'prompt_completion', 'messages' or 'text'."""
    if "prompt" in columns or "completion" in columns:
        missing = [c for c in ("prompt", "completion") if c not in columns]
        if missing:
            others = " or ".join(dict.fromkeys([repr(text_field), "'messages'"]))  # one name when they are the same
            raise ValueError(
                f"the dataset has {'prompt' if 'prompt' in columns else 'completion'} but no "
                f"{missing[0]!r} column (it has {columns}); SFT needs both 'prompt' and "
                f"'completion', or a {others} column"
            )
        return "prompt_completion"
    if "messages" in columns:
        return "messages"
    if text_field in columns:
        return "text"
    raise ValueError(
        f"SFTTrainer found none of its columns in the dataset (it has {columns}): give it a "
        f"'{text_field}' column (set dataset_text_field to use another), 'prompt' and 'completion' "
        f"columns, a 'messages' column, or tokenised 'input_ids'"
    )


def refuse_empty_rows(dataset, form: str, text_field: str, name: str) -> None:
    """Refuse (ValueError naming the rows) rows whose completion (or text) is empty: SFT would train them on the
    end-of-text token alone, as DPO refuses an empty response."""
    column = {"prompt_completion": "completion", "text": text_field}.get(form)
    empty = empty_texts(dataset[column]) if column else []
    if empty:
        rows = first_rows(empty)
        raise ValueError(
            f"{len(empty)} of {len(dataset)} {name} rows have an empty {column!r} (rows {rows}): SFT "
            f"would train them on the end-of-text token alone; fill or drop those rows"
        )


def tokenize_text(tokenizer, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) per text: the tokenizer's special tokens (e.g. bos), the text, eos; loss on every token."""
    rows = []
    for ids in encode_texts(tokenizer, texts, special_tokens=True):
        ids = with_eos(ids, tokenizer.eos_token_id)
        rows.append((ids, [1] * len(ids)))
    return rows


def tokenize_prompt_completion(
    tokenizer, prompts: list, completions: list, *, completion_only: bool = True
) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) per row: prompt ids (``treadle.text.encode_prompts``) + completion ids, eos appended to a text
    completion unless it ends with one.

    Chat rows (lists of messages) are rendered with the chat template: the prompt with a generation prompt, the
    completion as the rest of the full chat (``treadle.text.split_chat_completion``), which ends the way the
    template ends an assistant turn (ChatML: ``<|im_end|>`` then a newline) and gets no eos of its own, as TRL's
    SFT and treadle's DPO do: an appended eos would teach the model a token the template never renders after a turn.
    ``completion_only`` puts the loss on the completion tokens only.
    """
    chat = [is_conversation(p) for p in prompts]
    completions = [
        split_chat_completion(tokenizer, p, c)[1] if is_chat else c
        for p, c, is_chat in zip(prompts, completions, chat, strict=True)
    ]
    prompt_ids = encode_prompts(tokenizer, prompts)
    completion_ids = encode_texts(tokenizer, completions, special_tokens=False)
    rows = []
    for p, c, is_chat in zip(prompt_ids, completion_ids, chat, strict=True):
        c = c if is_chat else with_eos(c, tokenizer.eos_token_id)
        rows.append((p + c, [0 if completion_only else 1] * len(p) + [1] * len(c)))
    return rows


def tokenize_messages(
    tokenizer, conversations: list, *, assistant_only: bool = False, first_row: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) per chat, rendered by the chat template (``text.apply_chat_template``: no template, or one that
    fails on a row, is one line naming it; the first chat is row ``first_row``); with ``assistant_only`` the loss
    is on the tokens the template marks as the assistant's (``{% generation %}``)."""
    encoded = apply_chat_template(
        tokenizer,
        list(conversations),
        row=first_row,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=assistant_only,
    )
    rows = []
    for i, ids in enumerate(encoded["input_ids"]):
        mask = list(encoded["assistant_masks"][i]) if assistant_only else [1] * len(ids)
        if assistant_only and not any(mask):
            raise ValueError(
                f"assistant_only_loss=True but the chat template marks no assistant tokens in "
                f"{conversations[i]!r}; its template needs {{% generation %}} ... "
                f"{{% endgeneration %}} around assistant turns"
            )
        rows.append((list(ids), mask))
    return rows


# ---------------------------------------------------------------------------------------------------------
# Length
# ---------------------------------------------------------------------------------------------------------
def fit_max_length(args: SFTConfig, model) -> SFTConfig:
    """``args`` with ``max_length`` capped at the model's maximum positions (a note says so)."""
    limit = max_positions(model)
    if limit is None or args.max_length is None or args.max_length <= limit:
        return args
    if dist.is_main_process():
        print(
            f"treadle: max_length={args.max_length} is more than the {limit} positions {type(model).__name__} "
            f"takes; using max_length={limit}",
            file=sys.stderr,
        )
    return args.replace(max_length=limit)


def truncate_rows(
    rows: list[tuple[list[int], list[int]]], max_length: int | None, *, name: str = "train"
) -> list[tuple[list[int], list[int]]]:
    """Rows of at most ``max_length`` tokens. A row that begins with tokens without loss (a prompt) loses tokens
    from the prompt's left, so that what carries the loss survives whole; a row whose loss part alone is longer
    than ``max_length`` is refused (ValueError naming it). Other rows (text) keep their start. One note on
    stderr counts the rows cut."""
    if max_length is None:
        return rows
    out, cut, too_long = [], 0, []
    for i, (ids, mask) in enumerate(rows):
        if len(ids) <= max_length:
            out.append((ids, mask))
            continue
        cut += 1
        prompt = next((j for j, m in enumerate(mask) if m), 0)  # leading tokens without loss; 0: none (or no loss)
        start = len(ids) - max_length if prompt else 0
        if prompt and start > prompt:
            too_long.append(f"row {i}: {len(ids) - prompt} completion tokens")
        out.append((ids[start : start + max_length], mask[start : start + max_length]))
    if too_long:
        raise ValueError(
            f"{len(too_long)} {name} rows have a completion longer than max_length={max_length} by "
            f"itself ({'; '.join(too_long[:3])}); raise max_length or shorten those completions"
        )
    if cut and dist.is_main_process():
        print(
            f"treadle: {cut} of {len(rows)} {name} rows are longer than max_length={max_length}: cut to it, prompts "
            f"from the left (the completion stays whole), text rows at the end",
            file=sys.stderr,
        )
    return out


# ---------------------------------------------------------------------------------------------------------
# Packing and collation
# ---------------------------------------------------------------------------------------------------------
def pack_rows(rows: list[tuple[list[int], list[int]]], max_length: int) -> dict[str, list[list[int]]]:
    """Best-fit-decreasing packing of whole rows into rows of at most ``max_length`` tokens.

    Returns columns ``input_ids``, ``completion_mask`` and ``position_ids`` (0, 1, ... restarting at each
    packed row). The first token of every packed row gets mask 0: its label would be predicted from the end of
    the row before it. Rows must already be at most ``max_length`` long. The bins and the position rule are
    ``treadle.data``'s (``best_fit_bins``; the packing rule), shared with GRPO's and DPO's padding-free forwards.
    """
    bins = best_fit_bins([len(ids) for ids, _ in rows], max_length)
    packed: dict[str, list[list[int]]] = {"input_ids": [], "completion_mask": [], "position_ids": []}
    for members in bins:
        ids, mask, positions = [], [], []
        for i in members:
            row_ids, row_mask = rows[i]
            ids += row_ids
            mask += [0] + list(row_mask[1:])
            positions += list(range(len(row_ids)))
        packed["input_ids"].append(ids)
        packed["completion_mask"].append(mask)
        packed["position_ids"].append(positions)
    return packed


class SFTCollator:
    """Pads SFT rows into a batch: ``input_ids``, ``labels`` (input ids where ``completion_mask`` is 1, else
    -100) and ``attention_mask`` -- or, for packed rows, ``position_ids`` and no attention mask, so that
    transformers separates the packed rows by their position ids."""

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        # One torch.tensor per column, from right-padded Python lists: a tensor per row plus a copy into the batch
        # cost more than a tiny model's forward pass (``python -m benchmarks.trainers``).
        ids = [_as_list(row["input_ids"]) for row in rows]
        lengths = [len(r) for r in ids]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        masks = [
            _as_list(row["completion_mask"]) if "completion_mask" in row else [1] * n for row, n in zip(rows, lengths)
        ]
        input_ids = right_padded(ids, width, self.pad_token_id)  # (B, T)
        completion_mask = right_padded(masks, width, 0)  # (B, T)
        batch = {"input_ids": input_ids, "labels": input_ids.masked_fill(completion_mask == 0, -100)}
        if "position_ids" in rows[0]:
            batch["position_ids"] = right_padded([_as_list(row["position_ids"]) for row in rows], width, 0)
        else:
            batch["attention_mask"] = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()  # (B, T)
        return batch


def _as_list(values) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def token_accuracy_counts(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(correct, total) label tokens as a float64 tensor on the logits' device: argmax of ``logits[:, t]`` against
    ``labels[:, t+1]``."""
    scores, target = logits[:, :-1], labels[:, 1:]  # (B, T-1, V), (B, T-1)
    valid = target != -100
    total = valid.sum()
    if scores.device.type == "cpu" and 2 * int(total) < valid.numel():
        # The CPU argmax runs at ~4 ns an element, 1% of a tiny model's step: with few label tokens (completion-only
        # loss) take it at those positions only. (On an accelerator, selecting them would wait for the device.)
        correct = scores[valid].argmax(dim=-1).eq(target[valid]).sum()
    else:
        correct = (scores.argmax(dim=-1).eq(target) & valid).sum()
    return torch.stack([correct, total]).double()
