"""Tiny vision-language models and their processors, built in code (no hub), and the counting task.

``build_processor(kind)`` and ``build_model(kind, processor)`` make a Qwen2-VL (``"qwen2_vl"``), a LLaVA
(``"llava"``: a CLIP vision tower, a projector, a Llama) or an Idefics3 / SmolVLM (``"idefics3"``: a SigLIP-style
tower, a pixel-shuffle connector, a Llama) with random weights of a few tens of thousands of
parameters, and a processor around the toy character tokenizer (``treadle.toy``) plus the vision tokens and the
model's PIL image processor (the slow one: it needs no torchvision).

Task ``count``: a 42x42 canvas (a 3x3 grid of 14-pixel cells, at most one shape per cell) with 1-4 shapes of random
colours; the question "How many shapes?" (squares or circles of 10-13 pixels) or "How many squares?" (8-10 pixel
squares among 0-2 circles) and the answer, a digit. Train and held-out canvases come from disjoint seeds.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import torch

from treadle.demos import toy

VISION_TOKENS = {
    "qwen2_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "llava": ["<image>"],
    # Idefics3 / SmolVLM: the processor writes <fake_token_around_image><global-img><image>...; <end_of_utterance>
    # is its turn end (unused by the toy template)
    "idefics3": ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"],
}
IMAGE_MARKUP = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>", "llava": "<image>", "idefics3": "<image>"}
GRID = 3  # cells a side of the canvas' grid: at most one shape per cell
CANVAS = 14 * GRID  # pixels a side: one 14-pixel patch per cell (LLaVA: GRID**2 image tokens)
IDEFICS3_SIDE, IDEFICS3_SCALE = 56, 2  # Idefics3 sees a 56-pixel image: 4x4 patches, pixel-shuffled 2x2 into 4 tokens


def chat_template(kind: str) -> str:
    """The toy chat template with image parts: ``<|role|>`` then the parts (an image part is the model's image
    markup), a newline after a user turn, eos after an assistant turn."""
    return (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
        + IMAGE_MARKUP[kind]
        + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "{% if message['role'] == 'assistant' %}{{ '</s>' }}{% else %}{{ '\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )


def build_tokenizer(kind: str):
    """The toy character tokenizer with the model's vision tokens added as special tokens."""
    from tokenizers import AddedToken

    tokenizer = toy.build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": []})
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS[kind]], special_tokens=True
    )
    tokenizer.chat_template = chat_template(kind)
    return tokenizer


def _qwen2_vl_processor_class():
    from transformers import Qwen2VLProcessor

    class ToyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2-VL's processor without a video processor: transformers 5 checks (and saves) every attribute
        its ``__init__`` names, and the video processor's class needs torchvision, which this CPU build lacks.
        Images only; saves as a Qwen2VLProcessor without video."""

        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    return ToyQwen2VLProcessor


def saved_processor(path: str):
    """The toy Qwen2-VL processor saved in folder ``path`` (its ``processor_config.json`` names
    ``ToyQwen2VLProcessor``), else None. ``AutoProcessor`` cannot rebuild it: the class is not transformers', and
    ``Qwen2VLProcessor`` itself needs a video processor, hence torchvision."""
    config = os.path.join(path, "processor_config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        if json.load(f).get("processor_class") != "ToyQwen2VLProcessor":
            return None
    return _qwen2_vl_processor_class().from_pretrained(path, local_files_only=True)


def build_processor(kind: str = "qwen2_vl"):
    """The processor of a toy VLM of ``kind`` (``qwen2_vl``, ``llava`` or ``idefics3``): tokenizer, PIL image
    processor, chat template. LLaVA's images are resized to ``CANVAS`` pixels a side, Qwen2-VL's and Idefics3's
    to 56."""
    tokenizer = build_tokenizer(kind)
    template = chat_template(kind)
    if kind == "qwen2_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        pixels = 56 * 56  # any canvas becomes 4x4 patches of 14: 4 image tokens after the 2x2 merge
        images = Qwen2VLImageProcessorPil(
            min_pixels=pixels, max_pixels=pixels, patch_size=14, merge_size=2, temporal_patch_size=2
        )
        return _qwen2_vl_processor_class()(image_processor=images, tokenizer=tokenizer, chat_template=template)
    if kind == "llava":
        from transformers import LlavaProcessor
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

        images = LlavaImageProcessorPil(size={"shortest_edge": CANVAS}, crop_size={"height": CANVAS, "width": CANVAS})
        tokenizer.image_token = "<image>"
        return LlavaProcessor(
            image_processor=images,
            tokenizer=tokenizer,
            chat_template=template,
            patch_size=14,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
        )
    if kind == "idefics3":
        from transformers import Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        side = {"longest_edge": IDEFICS3_SIDE}  # one image, never split into tiles: no <row_i_col_j> markup
        images = Idefics3ImageProcessorPil(size=side, max_image_size=side, do_image_splitting=False)
        return Idefics3Processor(
            image_processor=images,
            tokenizer=tokenizer,
            chat_template=template,
            image_seq_len=(IDEFICS3_SIDE // 14) ** 2 // IDEFICS3_SCALE**2,
        )
    raise ValueError(f"unknown toy vision model {kind!r}; choose one of {sorted(VISION_TOKENS)}")


def _text_config(tokenizer, hidden: int, layers: int) -> dict[str, Any]:
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=toy.MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )


def build_model(kind: str = "qwen2_vl", processor=None, *, seed: int = 0, hidden: int = 32, layers: int = 2):
    """A randomly initialised tiny VLM of ``kind`` matching ``processor`` (built when None); the weights depend on
    ``seed`` only."""
    processor = processor if processor is not None else build_processor(kind)
    tokenizer = processor.tokenizer
    model_class, config = model_config(kind, tokenizer, hidden, layers)
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def model_config(kind: str, tokenizer, hidden: int, layers: int):
    """``(model class, config)`` of a toy VLM of ``kind``: a one-layer vision tower of width ``hidden`` and a Llama
    (Qwen2-VL: a Qwen2 with M-RoPE) of ``layers`` layers, its vocabulary the ``tokenizer``'s."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS.get(kind, ())}
    text = _text_config(tokenizer, hidden, layers)
    if kind == "qwen2_vl":
        return _qwen2_vl_config(text, ids, hidden)
    if kind == "llava":
        return _llava_config(text, ids, hidden)
    if kind == "idefics3":
        return _idefics3_config(text, ids, hidden)
    raise ValueError(f"unknown toy vision model {kind!r}; choose one of {sorted(VISION_TOKENS)}")


def _qwen2_vl_config(text: dict[str, Any], ids: dict[str, int], hidden: int):
    """Qwen2-VL around the ``text`` settings (given M-RoPE here), the vision token ``ids`` and a tower of width
    ``hidden``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    head = hidden // 4
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [head // 4, head // 8, head // 8]}
    return Qwen2VLForConditionalGeneration, Qwen2VLConfig(
        text_config=text,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        vision_config=dict(
            depth=1,
            embed_dim=hidden,
            hidden_size=hidden,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
    )


def _llava_config(text: dict[str, Any], ids: dict[str, int], hidden: int):
    """LLaVA: a CLIP tower of width ``hidden`` seeing the whole canvas, and a Llama of the ``text`` settings."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    return LlavaForConditionalGeneration, LlavaConfig(
        text_config={"model_type": "llama", **text},
        image_token_id=ids["<image>"],
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=CANVAS,
            patch_size=14,
            projection_dim=hidden,
        ),
    )


def _idefics3_config(text: dict[str, Any], ids: dict[str, int], hidden: int):
    """Idefics3: a tower of width ``hidden`` seeing an ``IDEFICS3_SIDE`` image, pixel-shuffled by
    ``IDEFICS3_SCALE``, and a Llama of the ``text`` settings."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    return Idefics3ForConditionalGeneration, Idefics3Config(
        text_config={"model_type": "llama", **text},
        image_token_id=ids["<image>"],
        scale_factor=IDEFICS3_SCALE,
        vision_config=dict(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=IDEFICS3_SIDE,
            patch_size=14,
        ),
    )


# ----------------------------------------------------------------------------------------------------
# The counting task
# ----------------------------------------------------------------------------------------------------
COLOURS = ["red", "green", "blue", "orange", "purple", "black"]
SPLIT_SEEDS = {"train": 1, "test": 2}  # disjoint canvases: the held-out split is drawn from its own seed
QUESTIONS = {"squares": "How many squares?", "shapes": "How many shapes?"}
SIDES = {"squares": (8, 10), "shapes": (10, 13)}  # pixels a side of a shape, by what is counted


def draw_canvas(rng: random.Random, squares: int, circles: int, size: int = CANVAS, sides: tuple = (8, 10)):
    """A white ``size`` x ``size`` canvas with ``squares`` squares and ``circles`` circles (side ``sides[0]`` to
    ``sides[1]`` pixels) in random colours, one per cell of a ``GRID`` x ``GRID`` grid, so that no two shapes
    overlap."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    cell = size // GRID
    cells = rng.sample(range(GRID * GRID), squares + circles)
    for k, c in enumerate(cells):
        side = rng.randint(*sides)
        x = (c % GRID) * cell + rng.randint(0, cell - side)
        y = (c // GRID) * cell + rng.randint(0, cell - side)
        box = (x, y, x + side - 1, y + side - 1)
        colour = rng.choice(COLOURS)
        (draw.rectangle if k < squares else draw.ellipse)(box, fill=colour)
    return image


def count_reward(prompts: list, completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the completion is exactly the count (spaces stripped), else 0.0: the counting task's reward."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t.strip() == a) for t, a in zip(texts, answer)]


def count_task(
    split: str = "train",
    n: int = 200,
    *,
    kind: str = "sft",
    max_squares: int = 4,
    max_circles: int = 2,
    what: str = "squares",
) -> list[dict]:
    """``n`` rows of the counting task: ``images`` (one canvas), ``prompt`` (a user turn: the image and the
    question), ``answer`` (the digit) and, by ``kind``: ``"sft"`` a ``completion`` (the assistant's digit),
    ``"preference"`` ``chosen`` (the digit) and ``rejected`` (another count), ``"rl"`` nothing more.
    ``what="squares"``: 1 .. ``max_squares`` squares (8-10 pixels) among 0 .. ``max_circles`` circles, "How many
    squares?"; ``what="shapes"``: 1 .. ``max_squares`` shapes (10-13 pixels), each a square or a circle, "How many
    shapes?" (``max_circles`` unused)."""
    if what not in QUESTIONS:
        raise ValueError(f"count what={what!r}: choose one of {sorted(QUESTIONS)}")
    rng = random.Random(SPLIT_SEEDS[split])
    rows = []
    for _ in range(n):
        count = rng.randint(1, max_squares)
        squares, circles = (count, rng.randint(0, max_circles)) if what == "squares" else (rng.randint(0, count), 0)
        image = draw_canvas(rng, squares, circles if what == "squares" else count - squares, sides=SIDES[what])
        row = {
            "images": [image],
            "answer": str(count),
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[what]}]}],
        }
        if kind == "sft":
            row["completion"] = [{"role": "assistant", "content": [{"type": "text", "text": str(count)}]}]
        elif kind == "preference":
            row.update(chosen=str(count), rejected=str(count % max_squares + 1))
        rows.append(row)
    return rows
