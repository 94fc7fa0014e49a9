"""The on-policy vision path: prompts with images, sampled and scored with their pixels (``treadle.vision``'s
conventions).

A row holds ``images`` (or ``image``) and a chat ``prompt`` whose user turn has ``{"type": "image"}`` parts. The
processor renders each prompt with its generation prompt and builds the vision inputs; the engine gets them with
the distinct prompts (``RolloutEngine.generate(prompt_inputs=...)``: the own sampler puts them in the prefill, or
samples through transformers' ``generate`` for a model whose positions depend on the images); each training
slice carries its rows' inputs (``Sample.model_inputs``), so the policy's, the old policy's and the reference's
log-probs all see the same images. Reward functions receive the ``images`` column like any other.

Departures: a vision prompt is never cut to ``max_prompt_length`` (cutting could cut its image tokens): a longer
one is an error naming it. The vision tokens are never sampled (``SamplingParams.suppress_token_ids``): the
sampler's log-probs are of that renormalised distribution, which the importance-sampling ratio accounts for.
Log-prob forwards of vision slices are padded (not padding-free), and a model with image-dependent positions
(M-RoPE) computes its own positions from the attention mask.
"""

from __future__ import annotations

import dataclasses

import torch

from treadle import vision
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import positions_need_images
from treadle.models import base_model
from treadle.trainers.onpolicy.data import Rollout


def has_images(rows: list[dict]) -> bool:
    """Whether dataset rows carry images (an ``images`` / ``image`` column)."""
    return bool(rows) and vision.image_column(list(rows[0])) is not None


def check_dataset(dataset, model, processing_class, *, where: str = "the train dataset") -> None:
    """Before training: a processor, a model that takes images, every image opening, placeholders matching."""
    if dataset is None or not vision.has_images(dataset):
        return
    vision.check_images_accepted(model, processing_class, where=where)
    if isinstance(dataset, (list, tuple)):
        for i, row in enumerate(dataset):
            vision.row_chat(row, i, where)
    else:
        vision.check_vision_dataset(dataset, where=where)


def encode(
    processing_class, rows: list[dict], *, max_prompt_length: int | None = None, where: str = "a batch of prompts"
) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """``(prompt ids per row, vision inputs)``: one processor call over the rows' rendered prompts (left-padded),
    the ids without their padding, and every other tensor it made (``pixel_values`` ...)."""
    texts, images = [], []
    for i, row in enumerate(rows):
        messages, _, row_images = vision.row_chat({**row, "completion": []}, i, where)
        texts.append(vision.render(processing_class, messages, generation_prompt=True))
        images += row_images
    batch = processing_class(text=texts, images=images or None, padding=True, padding_side="left", return_tensors="pt")
    ids = [row[mask.bool()].tolist() for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    too_long = [i for i, row in enumerate(ids) if max_prompt_length and len(row) > max_prompt_length]
    if too_long:
        raise vision.VisionDataError(
            f"row {too_long[0]} of {where}: a prompt of {len(ids[too_long[0]])} tokens with "
            f"its image tokens, more than max_prompt_length={max_prompt_length} (a vision "
            f"prompt is never cut); raise max_prompt_length or use smaller images"
        )
    return ids, vision.forward_extras(dict(batch))


def distinct_rows(rows: list[dict], group: int) -> tuple[list[dict], int]:
    """``(distinct rows, completions per row)``: when every run of ``group`` rows repeats one prompt AND its images
    (compared by pixels: two canvases can share every token), each once and ``group``; else every row and 1."""

    def key(row):
        column = vision.image_column(list(row))
        pixels = tuple(image.tobytes() for image in vision.row_images(row, column, row_index=0))
        return repr(row["prompt"]), pixels

    keys = [key(row) for row in rows]
    grouped = len(rows) % group == 0 and all(keys[i] == keys[i - i % group] for i in range(len(rows)))
    return (rows[::group], group) if grouped else (rows, 1)


def without_image_tokens(params: SamplingParams, processing_class) -> SamplingParams:
    """``params`` that never sample an image token (with ``generation_kwargs``' suppressed tokens, if any): one in a
    completion would have no pixels behind it in the training forward."""
    suppressed = set(vision.image_token_ids(processing_class)) | set(params.suppress_token_ids)
    return dataclasses.replace(params, suppress_token_ids=tuple(sorted(suppressed)))


def slice_inputs(
    processing_class, rollout: Rollout, rows: slice, prompt_width: int, completion_width: int
) -> dict[str, torch.Tensor] | None:
    """The vision inputs of a training slice (``rollout``'s rows ``rows``), None for a text rollout. The processor
    runs again on the slice's prompts (the same tokens as sampled); a per-token input (Qwen's
    ``mm_token_type_ids``) is laid out as the slice's ``input_ids``: ``prompt_width`` prompt positions (left-padded)
    then ``completion_width`` completion positions (0: text)."""
    column = vision.image_column(list(rollout.columns))
    if column is None:
        return None
    picked = [{"prompt": p, column: c} for p, c in zip(rollout.prompts[rows], rollout.columns[column][rows])]
    ids, extras = encode(processing_class, picked)
    width = max(len(row) for row in ids)
    for name, value in extras.items():
        if value.dim() == 2 and value.shape == (len(picked), width):  # per token, left-padded
            value = value[:, max(0, width - prompt_width) :]
            pad = value.new_zeros((value.shape[0], prompt_width - value.shape[1]))
            extras[name] = torch.cat([pad, value, value.new_zeros((value.shape[0], completion_width))], dim=1)
    return extras


def logprob_options(model, sample_inputs: dict | None, positions: torch.Tensor, padding_free: bool) -> dict:
    """The ``token_logps`` keywords of a slice: its vision inputs, padded forwards, and the model's own positions
    where they depend on the images (M-RoPE); a text slice keeps ``positions`` and ``padding_free``."""
    if not sample_inputs:
        return {"position_ids": positions, "padding_free": padding_free}
    own = positions_need_images(base_model(model))
    return {**sample_inputs, "position_ids": None if own else positions, "padding_free": False}
