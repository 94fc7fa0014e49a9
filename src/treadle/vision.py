"""The vision rules: images in a dataset, image parts in chats, the processor's batch, and what never carries loss.

TRL's conventions (v1.16): a row holds an ``images`` column (a list of PIL images or paths; ``image``: one) and
chat messages whose ``content`` lists parts, ``{"type": "image"}`` where an image goes and ``{"type": "text",
"text": ...}``. ``processing_class`` is the model's processor (``AutoProcessor``): it renders the chat, expands
each image part into the model's image tokens and builds ``pixel_values`` and the model-specific extras
(``image_grid_thw``, ``mm_token_type_ids``, ``pixel_attention_mask`` ...), which pass to the forward untouched.

- :func:`row_images` opens a row's images (one-line :class:`VisionDataError` naming the file and the row),
  :func:`vision_messages` brings a row's chat to the parts form and checks placeholders against images;
- :func:`assistant_spans` finds the tokens of each assistant turn in the processed row: a suffix of the rendered
  chat is tokenised alone (with its own images, if any) and must be the tail of the row, so the rule holds for
  any processor without knowing how it expands an image;
- :class:`VisionCollator` processes a batch once (``pixel_values`` exactly as the processor makes them) and
  builds ``labels``: the assistant tokens, never padding nor an image token (:func:`image_token_ids`);
- :func:`check_images_accepted`: :func:`check_model_takes_images` (a text-only model given images, named) before
  :func:`check_processor`; :func:`lora_on_language_model` (LoRA on the language model only, unless the config names
  its modules).

Packing does not apply to image rows (a row's image tokens and pixels go together): SFT switches it off, saying so.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from treadle import distributed as dist
from treadle.errors import UserError
from treadle.models import forward_parameters
from treadle.text import is_conversation

IMAGE_COLUMNS = ("images", "image")  # TRL's names: a list of images, or one image
ROW_COLUMNS = (*IMAGE_COLUMNS, "messages", "prompt", "completion")  # what a vision row keeps until collation
VISION_TOKEN_PATTERN = re.compile(r"image|img|vision|video|<row_\d+_col_\d+>")  # added tokens of the vision markup
# Token attributes of processors / configs that name a vision token (never a label)
VISION_TOKEN_ATTRIBUTES = (
    "image_token",
    "boi_token",
    "eoi_token",
    "fake_image_token",
    "global_image_token",
    "global_image_tag",
    "vision_start_token",
    "vision_end_token",
    "image_start_token",
    "image_end_token",
)


class VisionDataError(UserError, ValueError):
    """A vision dataset that cannot be used as it is: an image that does not open, placeholders that do not match
    the images, a text-only model given images."""


# ---------------------------------------------------------------------------------------------------------
# Datasets and rows
# ---------------------------------------------------------------------------------------------------------
def image_column(columns: Sequence[str] | None) -> str | None:
    """The dataset's image column (``images`` first, then ``image``), None for a text dataset."""
    return next((c for c in IMAGE_COLUMNS if columns and c in columns), None)


def has_images(dataset) -> bool:
    """Whether ``dataset`` (a ``datasets.Dataset`` or a list of dicts) has an image column."""
    if isinstance(dataset, (list, tuple)):
        return bool(dataset) and isinstance(dataset[0], dict) and image_column(list(dataset[0])) is not None
    return image_column(getattr(dataset, "column_names", None)) is not None


def is_vision_processor(processing_class) -> bool:
    """Whether ``processing_class`` is a processor that takes images (it has an image processor)."""
    return getattr(processing_class, "image_processor", None) is not None


def tokenizer_of(processing_class):
    """The tokenizer inside a processor (the object itself when it is a tokenizer)."""
    return getattr(processing_class, "tokenizer", processing_class)


def load_image(value, *, row: int, where: str = "the dataset"):
    """One image as an RGB ``PIL.Image``: a PIL image, a path, or a ``{"path"|"bytes": ...}`` dict (datasets'
    undecoded ``Image`` feature). VisionDataError naming the file and the row when it does not open."""
    import io

    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB") if value.mode != "RGB" else value
    source = value
    if isinstance(value, dict):
        source = io.BytesIO(value["bytes"]) if value.get("bytes") else value.get("path")
    if not isinstance(source, (str, os.PathLike, io.BytesIO)):
        raise VisionDataError(
            f"row {row} of {where}: an image must be a PIL image or a file path, got "
            f"{type(value).__name__}; give the images column PIL images or paths"
        )
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as error:
        raise cannot_open(error, source if not isinstance(source, io.BytesIO) else "<bytes>", row, where) from None


def cannot_open(error: Exception, name, row: int, where: str) -> VisionDataError:
    """The one-line error for an image file that does not open (or that PIL refuses as a decompression bomb)."""
    from PIL import Image

    if isinstance(error, Image.DecompressionBombError):  # more than 2x Image.MAX_IMAGE_PIXELS: refused by PIL
        image = "its image" if name is None else f"image {str(name)!r}"
        return VisionDataError(
            f"row {row} of {where}: {image} is too large for PIL ({str(error).rstrip('.')}); resize "
            f"it (a model sees far fewer pixels), or raise PIL.Image.MAX_IMAGE_PIXELS (PIL refuses more than twice "
            f"it) if you trust the file"
        )
    reason = "no such file" if isinstance(error, FileNotFoundError) else "not an image PIL can read"
    return VisionDataError(
        f"row {row} of {where}: cannot open image {str(name)!r} ({reason}); fix the path or drop the row"
    )


def row_images(row: dict, column: str, *, row_index: int, where: str = "the dataset") -> list:
    """A row's images, opened (:func:`load_image`): ``images`` is a list (None: no image), ``image`` one."""
    value = row.get(column)
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [load_image(v, row=row_index, where=where) for v in values]


def image_parts(messages) -> int:
    """How many ``{"type": "image"}`` parts a chat holds."""
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )


def vision_messages(messages, n_images: int, *, row: int, where: str = "the dataset") -> list[dict]:
    """The chat in the parts form that VLM chat templates read: string contents become one text part; a chat
    with images and no image part gets them at the start of its first user turn (as TRL does). VisionDataError
    when the chat has more image parts than the row has images, or fewer (but not none)."""
    out = [
        {**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else dict(m)
        for m in messages
    ]
    placeholders = image_parts(out)
    if placeholders == 0 and n_images:
        first = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
        if first is None:
            raise VisionDataError(
                f"row {row} of {where}: {n_images} image(s) but no user turn to put them in; "
                f"add a user message with {{'type': 'image'}} parts"
            )
        out[first] = {**out[first], "content": [{"type": "image"}] * n_images + list(out[first]["content"])}
    elif placeholders > n_images:
        raise VisionDataError(
            f"row {row} of {where}: the chat has {placeholders} image placeholders "
            f"({{'type': 'image'}} parts) but the row has {n_images} image(s); give one image "
            f"per placeholder"
        )
    elif placeholders < n_images:
        raise VisionDataError(
            f"row {row} of {where}: the row has {n_images} images but its chat has only "
            f"{placeholders} image placeholders; add a {{'type': 'image'}} part per image"
        )
    return out


def row_conversation(
    row: dict, *, row_index: int, n_images: int, where: str = "the dataset"
) -> tuple[list[dict], int]:
    """``(messages, first)``: a vision row's chat in parts form and the index of its first message whose
    assistant turns carry loss (0 for ``messages`` rows: every assistant turn; the completion's first message for
    ``prompt`` + ``completion`` rows)."""
    if "messages" in row and row["messages"] is not None:
        chat, first = list(row["messages"]), 0
    elif "prompt" in row:
        prompt, completion = row["prompt"], row.get("completion") or []
        if not is_conversation(prompt) or not is_conversation(completion):
            raise VisionDataError(
                f"row {row_index} of {where}: image rows need chat messages (a 'messages' column, "
                f"or 'prompt'/'completion' as lists of {{'role', 'content'}} messages), got "
                f"{type(prompt).__name__}"
            )
        chat, first = list(prompt) + list(completion), len(prompt)
    else:
        raise VisionDataError(
            f"{where} has images but neither a 'messages' nor a 'prompt' column; give each row its chat"
        )
    return vision_messages(chat, n_images, row=row_index, where=where), first


def read_row(dataset, index: int, *, where: str) -> dict:
    """``dataset[index]``; a datasets ``Image`` column decodes its files here, so a file that does not open is a
    VisionDataError naming it and the row."""
    from PIL import Image

    try:
        return dataset[index]
    except (OSError, Image.DecompressionBombError) as error:  # FileNotFoundError, PIL.UnidentifiedImageError
        name = getattr(error, "filename", None) or (str(error) if isinstance(error, OSError) else None)
        raise cannot_open(error, name, index, where) from None


def check_vision_dataset(dataset, *, where: str = "the dataset") -> str:
    """Open every image once and check every chat's placeholders (before training, not at step 1000); returns
    the image column. Images are opened lazily by PIL (the header only), so this is cheap."""
    column = image_column(dataset.column_names)
    if column is None:
        raise VisionDataError(f"{where} has no 'images' (or 'image') column")
    for i in range(len(dataset)):
        row_chat(read_row(dataset, i, where=where), i, where)
    return column


# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------
def takes_images(model: nn.Module) -> bool:
    """Whether the model's forward takes ``pixel_values`` (a forward with ``**kwargs`` is given the benefit)."""
    params = forward_parameters(dist.unwrap_model(model))
    return params is None or "pixel_values" in params


def check_model_takes_images(model: nn.Module, *, where: str = "the dataset") -> None:
    """VisionDataError when a text-only model is given images, naming the model: no processor makes it take them."""
    if not takes_images(model):
        inner = dist.unwrap_model(model)
        name = getattr(inner, "name_or_path", "") or ""
        named = f"{name} ({type(inner).__name__})" if name else type(inner).__name__
        raise VisionDataError(
            f"{where} has images but the model {named} is a text-only model: its forward takes no pixel_values, so "
            f"it takes no images and no processor changes that; train a vision-language model (with its "
            f"AutoProcessor), or drop the images column"
        )


def check_images_accepted(model: nn.Module, processing_class, *, where: str = "the dataset") -> None:
    """Images go to ``model`` through ``processing_class``: the model first (a text-only model is the problem that a
    processor would not solve), then the processor."""
    check_model_takes_images(model, where=where)
    check_processor(processing_class, where=where)


def check_processor(processing_class, *, where: str = "the dataset") -> None:
    """VisionDataError when images come with a tokenizer instead of the model's processor."""
    if not is_vision_processor(processing_class):
        raise VisionDataError(
            f"{where} has images but processing_class is {type(processing_class).__name__}, "
            f"not a processor that takes images; pass AutoProcessor.from_pretrained(model)"
        )


def image_token_ids(processing_class) -> set[int]:
    """Ids of the vision tokens the processor writes (image pads, image starts and ends, tile markers): never a
    label."""
    tokenizer = tokenizer_of(processing_class)
    ids = {getattr(processing_class, "image_token_id", None)}
    for name in VISION_TOKEN_ATTRIBUTES:
        for owner in (processing_class, tokenizer):
            token = getattr(owner, name, None)
            if isinstance(token, str) and token:
                token_id = tokenizer.convert_tokens_to_ids(token)
                ids.add(token_id if token_id != tokenizer.unk_token_id else None)
    added = getattr(tokenizer, "get_added_vocab", dict)()
    ids |= {i for token, i in added.items() if VISION_TOKEN_PATTERN.search(token)}
    return {i for i in ids if isinstance(i, int)}


def language_model_prefix(model: nn.Module) -> str | None:
    """The module path of a vision-language model's language model (``model.language_model``, ``model.text_model``
    ...), None for a text-only model."""
    if not takes_images(model) or not callable(getattr(model, "get_decoder", None)):
        return None
    decoder = model.get_decoder()
    return next((name for name, module in model.named_modules() if module is decoder and name), None)


def lora_on_language_model(model: nn.Module, peft_config):
    """``peft_config`` aimed at the language model's linear layers only when it names no modules (None) or
    ``all-linear`` and ``model`` is a vision-language model: the vision tower and projector stay frozen, as
    in TRL's VLM recipes. A config that names its modules is kept as it is."""
    prefix = language_model_prefix(model)
    target = getattr(peft_config, "target_modules", "unset")
    if prefix is None or target not in (None, "all-linear"):
        return peft_config
    leaves = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if name.startswith(prefix + ".") and isinstance(module, nn.Linear)
        }
    )
    pattern = rf"^{re.escape(prefix)}\..*\.(?:{'|'.join(map(re.escape, leaves))})$"
    if dist.is_main_process():
        print(
            f"treadle: LoRA on the language model only ({prefix}); name target_modules to adapt the vision tower too",
            file=sys.stderr,
        )
    return type(peft_config)(**{**peft_config.to_dict(), "target_modules": pattern})


# ---------------------------------------------------------------------------------------------------------
# Tokens that carry loss
# ---------------------------------------------------------------------------------------------------------
def render(processing_class, messages, *, generation_prompt: bool = False) -> str:
    return processing_class.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=generation_prompt
    )


def turn_boundaries(processing_class, messages, first: int = 0) -> tuple[str, list[tuple[int, int, int, int]]]:
    """``(text, spans)``: the whole chat's text and, per assistant turn from message ``first`` on,
    ``(start_char, end_char, images_after_start, images_after_end)``: the turn's text is ``text[start:end]``
    (after the generation prompt, up to the end of the turn) and the counts say how many of the row's images
    come after each boundary. ValueError when the template renders a prefix differently from the whole chat."""
    text = render(processing_class, messages)
    spans = []
    for i in range(first, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        before = render(processing_class, messages[:i], generation_prompt=True) if i else ""
        through = render(processing_class, messages[: i + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(
                f"the chat template renders the chat up to message {i} as a text that does not begin "
                f"the whole chat's, so the assistant's tokens cannot be found; use a template whose "
                f"earlier turns render the same once later turns follow"
            )
        spans.append((len(before), len(through), image_parts(messages[i:]), image_parts(messages[i + 1 :])))
    return text, spans


def suffix_length(processing_class, text: str, images: list) -> int:
    """Tokens of a chat's tail ``text`` with its ``images`` (the processor's expansion), no special tokens added."""
    if not text:
        return 0
    if images:
        return len(processing_class(text=[text], images=images, add_special_tokens=False)["input_ids"][0])
    return len(tokenizer_of(processing_class)(text, add_special_tokens=False)["input_ids"])


def assistant_mask(processing_class, ids: list[int], text: str, spans, images: list, *, row: int) -> list[int]:
    """1 on the tokens of each assistant turn of a processed row (``ids``, no padding), 0 elsewhere. Each
    boundary is found from the end: the chat's tail after it, tokenised alone, must be the row's tail."""
    mask = [0] * len(ids)
    for start, end, images_after_start, images_after_end in spans:
        cuts = []
        for char, count in ((start, images_after_start), (end, images_after_end)):
            tail = suffix_length(processing_class, text[char:], images[len(images) - count :])
            cuts.append(len(ids) - tail)
        if cuts[0] < 0 or cuts[1] < cuts[0]:
            raise ValueError(
                f"row {row}: the assistant turn's tokens could not be located in the processed row; "
                f"the tokenizer merges tokens across the turn's boundary"
            )
        mask[cuts[0] : cuts[1]] = [1] * (cuts[1] - cuts[0])
    return mask


Chat = tuple  # (messages in parts form, first message that carries loss, the chat's images)


def row_chat(row: dict, index: int, where: str) -> Chat:
    """A vision row (``messages``, or ``prompt`` + ``completion``) as a chat with its opened images."""
    images = row_images(row, image_column(list(row)) or "images", row_index=index, where=where)
    messages, first = row_conversation(row, row_index=index, n_images=len(images), where=where)
    return messages, first, images


def encode_chats(
    processing_class,
    chats: list[Chat],
    *,
    completion_only_loss: bool = True,
    max_length: int | None = None,
    where: str = "a batch",
) -> dict[str, torch.Tensor]:
    """One processor call over ``chats`` (right-padded): the model's inputs plus ``completion_mask`` ``(B, T)``,
    1 on the tokens that carry loss: the assistant turns from each chat's first loss message
    (``completion_only_loss``; every token otherwise), never padding nor a vision token. A row longer than
    ``max_length`` is an error naming it (cutting it could cut its image tokens from their pixels)."""
    rendered = [turn_boundaries(processing_class, messages, first) for messages, first, _ in chats]
    flat = [image for _, _, images in chats for image in images]
    batch = dict(
        processing_class(
            text=[text for text, _ in rendered],
            images=flat or None,
            padding=True,
            padding_side="right",
            return_tensors="pt",
        )
    )
    input_ids = batch["input_ids"]  # (B, T)
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    completion_mask = torch.zeros_like(input_ids)
    for b, (row_ids, n, (text, spans), (_, _, images)) in enumerate(zip(input_ids.tolist(), lengths, rendered, chats)):
        if max_length is not None and n > max_length:
            raise VisionDataError(
                f"row {b} of {where}: {n} tokens with its image tokens, more than "
                f"max_length={max_length}; raise max_length or use smaller images"
            )
        mask = (
            assistant_mask(processing_class, row_ids[:n], text, spans, images, row=b)
            if completion_only_loss
            else [1] * n
        )
        completion_mask[b, :n] = torch.tensor(mask)
    vision_ids = torch.tensor(sorted(image_token_ids(processing_class)), dtype=torch.long)
    keep = batch["attention_mask"].bool() & ~torch.isin(input_ids, vision_ids)
    batch["completion_mask"] = completion_mask * keep
    return batch


def forward_extras(inputs: dict) -> dict:
    """What a vision batch adds to ``input_ids`` / ``attention_mask`` for the forward (``pixel_values``,
    ``image_grid_thw`` ...): every tensor but the token columns and labels."""
    skip = {"input_ids", "attention_mask", "labels", "completion_mask", "ref_chosen_logps", "ref_rejected_logps"}
    return {k: v for k, v in inputs.items() if k not in skip and isinstance(v, torch.Tensor)}


class VisionCollator:
    """SFT's vision rows -> :func:`encode_chats` -> the model's inputs plus ``labels`` (the input ids where the
    completion mask is 1, else -100)."""

    def __init__(
        self,
        processing_class,
        *,
        completion_only_loss: bool = True,
        max_length: int | None = None,
        where: str = "the dataset",
    ):
        self.processing_class = processing_class
        self.completion_only_loss = completion_only_loss
        self.max_length = max_length
        self.where = f"a batch of {where}"  # rows were checked at preparation: an error here is rare

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        chats = [row_chat(row, i, self.where) for i, row in enumerate(rows)]
        batch = encode_chats(
            self.processing_class,
            chats,
            completion_only_loss=self.completion_only_loss,
            max_length=self.max_length,
            where=self.where,
        )
        completion_mask = batch.pop("completion_mask")
        batch["labels"] = batch["input_ids"].masked_fill(completion_mask == 0, -100)
        return batch


class VisionPreferenceCollator:
    """DPO's vision rows (``images``, a chat ``prompt``, ``chosen`` and ``rejected`` assistant turns) -> one batch
    of 2B rows, the chosen chats then the rejected ones, each with the row's images (the same pixels for both):
    the model's inputs plus ``completion_mask``, 1 on the response's tokens (as ``DPOCollator``)."""

    def __init__(self, processing_class, *, max_length: int | None = None, where: str = "the dataset"):
        self.processing_class = processing_class
        self.max_length = max_length
        self.where = f"a batch of {where}"

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        chats = []
        for key in ("chosen", "rejected"):
            for i, row in enumerate(rows):
                chats.append(row_chat(preference_chat(row, key, i, self.where), i, self.where))
        batch = encode_chats(self.processing_class, chats, max_length=self.max_length, where=self.where)
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if all(row.get(key) is not None for row in rows):
                batch[key] = torch.tensor([float(row[key]) for row in rows], dtype=torch.float32)  # (B,)
        return batch


def preference_chat(row: dict, key: str, index: int, where: str) -> dict:
    """A preference row as a ``prompt`` + ``completion`` vision row for its ``chosen`` or ``rejected`` response
    (a string becomes one assistant turn)."""
    response = row[key]
    if isinstance(response, str):
        response = [{"role": "assistant", "content": response}]
    if not is_conversation(response):
        raise VisionDataError(
            f"row {index} of {where}: {key!r} must be a string or assistant messages, got {type(response).__name__}"
        )
    column = image_column(list(row)) or "images"
    return {column: row.get(column), "prompt": row["prompt"], "completion": response}


def check_preference_dataset(dataset, *, where: str = "the dataset") -> None:
    """:func:`check_vision_dataset` for DPO rows: every image opens, both chats' placeholders match the images."""
    for i in range(len(dataset)):
        row = read_row(dataset, i, where=where)
        for key in ("chosen", "rejected"):
            row_chat(preference_chat(row, key, i, where), i, where)
