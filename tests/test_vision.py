"""Vision-language SFT: the vision rules (treadle.vision) and SFTTrainer on tiny Qwen2-VL and LLaVA models built
locally (treadle.demos.toy_vision: random weights, the toy character tokenizer plus vision tokens, PIL image
processors)."""

import struct
import zlib

import pytest
import torch
import torch.nn.functional as F
from _factories import vision_dpo_trainer, vision_preference_rows

from treadle import vision
from treadle.demos import toy_vision as tv
from treadle.trainers.dpo import ChosenRejected
from treadle.trainers.sft import SFTConfig, SFTTrainer

pytestmark = pytest.mark.usefixtures("one_thread")
KINDS = ["qwen2_vl", "llava"]


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def processor(kind):
    return tv.build_processor(kind)


def user(*parts):
    return {"role": "user", "content": list(parts)}


def assistant(text):
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


IMAGE = {"type": "image"}


def text(value):
    return {"type": "text", "text": value}


def canvas(squares=2):
    import random

    return tv.draw_canvas(random.Random(squares), squares, 1)


def labelled_text(processor, batch, row=0):
    labels = batch["labels"][row]
    return processor.tokenizer.decode(labels[labels != -100])


def config(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        max_length=64,
    )
    return SFTConfig(**{**defaults, **kwargs})


# ---- the loss mask ---------------------------------------------------------------------------------------
def test_labels_are_the_assistant_tokens_only(processor):
    rows = tv.count_task("train", 3)
    batch = vision.VisionCollator(processor)(rows)
    for b, row in enumerate(rows):
        assert labelled_text(processor, batch, b) == row["answer"] + "</s>"
    assert set(batch) >= {"input_ids", "attention_mask", "pixel_values", "labels"}


def test_every_assistant_turn_carries_loss_and_no_user_turn(processor):
    rows = [
        {
            "images": [canvas(2), canvas(3)],
            "messages": [
                user(IMAGE, text("How many?")),
                assistant("2"),
                user(IMAGE, text("And here?")),
                assistant("3"),
            ],
        }
    ]
    batch = vision.VisionCollator(processor)(rows)
    assert labelled_text(processor, batch) == "2</s>3</s>"


def test_image_tokens_never_carry_loss_even_on_whole_rows(processor):
    batch = vision.VisionCollator(processor, completion_only_loss=False)(tv.count_task("train", 2))
    vision_ids = torch.tensor(sorted(vision.image_token_ids(processor)))
    ids, labels = batch["input_ids"], batch["labels"]
    assert torch.isin(ids, vision_ids).any()  # the rows do hold image tokens
    assert not torch.isin(labels, vision_ids).any()
    keep = batch["attention_mask"].bool() & ~torch.isin(ids, vision_ids)
    assert torch.equal(labels[keep], ids[keep]) and (labels[~keep] == -100).all()


def test_images_without_placeholders_go_to_the_first_user_turn(processor):
    rows = [{"images": [canvas()], "messages": [{"role": "user", "content": "How many squares?"}, assistant("2")]}]
    batch = vision.VisionCollator(processor)(rows)
    decoded = processor.tokenizer.decode(batch["input_ids"][0])
    assert decoded.index(tv.VISION_TOKENS[processor_kind(processor)][0]) < decoded.index("How many")


def processor_kind(processor):
    return "qwen2_vl" if "Qwen2VL" in type(processor).__name__ else "llava"


# ---- one-line errors -------------------------------------------------------------------------------------
def test_an_image_that_does_not_open_names_file_and_row(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_text("not a png")
    rows = tv.count_task("train", 3)
    rows[2]["images"] = [str(bad)]
    rows[1]["images"] = [str(tmp_path / "missing.png")]
    from datasets import Dataset

    with pytest.raises(
        vision.VisionDataError,
        match=r"row 1 of the train set: cannot open image .*missing\.png.*no "
        r"such file",
    ):
        vision.check_vision_dataset(Dataset.from_list(rows[:2]), where="the train set")
    with pytest.raises(vision.VisionDataError, match=r"row 1 .*bad\.png.*not an image"):
        vision.check_vision_dataset(Dataset.from_list([rows[0], rows[2]]), where="the train set")
    with pytest.raises(vision.VisionDataError, match=r"row 7 of x: cannot open image .*bad\.png"):
        vision.load_image(str(bad), row=7, where="x")


def test_an_image_path_loads_like_the_image(tmp_path, processor):
    rows = tv.count_task("train", 1)
    path = tmp_path / "canvas.png"
    rows[0]["images"][0].save(path)
    from_image = vision.VisionCollator(processor)(rows)
    from_path = vision.VisionCollator(processor)([{**rows[0], "images": [str(path)]}])
    assert torch.equal(from_image["pixel_values"], from_path["pixel_values"])


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` pixels (PIL reads the size from the header alone)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def test_a_huge_image_is_one_line_naming_the_row_and_the_limit(tmp_path):
    from datasets import Dataset

    huge = tmp_path / "huge.png"
    huge.write_bytes(png_header(20000, 20000))
    with pytest.raises(vision.VisionDataError, match=r"row 5 of x: image .*huge\.png' is too large for PIL .*"):
        vision.load_image(str(huge), row=5, where="x")
    rows = tv.count_task("train", 2)
    rows[1]["images"] = [str(huge)]
    with pytest.raises(vision.VisionDataError, match="row 1 of the dataset: .* raise PIL.Image.MAX_IMAGE_PIXELS"):
        vision.check_vision_dataset(Dataset.from_list(rows))


def test_more_placeholders_than_images_is_one_line():
    messages = [user(IMAGE, IMAGE, text("compare")), assistant("same")]
    with pytest.raises(
        vision.VisionDataError, match="row 4 of the dataset: the chat has 2 image placeholders .* 1 image"
    ):
        vision.vision_messages(messages, 1, row=4)
    with pytest.raises(vision.VisionDataError, match="3 images but its chat has only 2"):
        vision.vision_messages(messages, 3, row=0)


def test_images_given_to_a_text_only_model_with_its_tokenizer_name_the_model_not_a_processor(tmp_path, tok):
    """Regression (issue 59): a text-only model given images with its own tokenizer said "pass
    AutoProcessor.from_pretrained(model)", which cannot help: the model takes no images."""
    from treadle.demos import toy
    from treadle.trainers.onpolicy import vision as onpolicy_vision

    model = toy.build_model()
    model.name_or_path = "toy:tiny"
    for build in (
        lambda: SFTTrainer(model=model, args=config(tmp_path), train_dataset=tv.count_task("train", 4),
                           processing_class=tok),
        lambda: onpolicy_vision.check_dataset(tv.count_task("train", 4, kind="grpo"), model, tok),
    ):  # fmt: skip
        with pytest.raises(vision.VisionDataError) as error:
            build()
        message = str(error.value)
        assert "the model toy:tiny (LlamaForCausalLM) is a text-only model" in message
        assert "no processor changes that" in message and "AutoProcessor.from_pretrained" not in message


def test_a_text_only_model_given_images_is_refused(tmp_path, tok):
    from treadle.demos import toy

    with pytest.raises(vision.VisionDataError, match="LlamaForCausalLM is a text-only model"):
        SFTTrainer(
            model=toy.build_model(),
            args=config(tmp_path),
            train_dataset=tv.count_task("train", 4),
            processing_class=tv.build_processor("llava"),
        )
    with pytest.raises(vision.VisionDataError, match="not a processor that takes images"):
        SFTTrainer(
            model=tv.build_model("llava"),
            args=config(tmp_path),
            train_dataset=tv.count_task("train", 4),
            processing_class=tok,
        )


# ---- training --------------------------------------------------------------------------------------------
def test_the_loss_is_cross_entropy_on_the_answer_tokens(tmp_path, kind, processor):
    """An independent reference: cross-entropy of the model's logits at the tokens after ``<|assistant|>``."""
    model = tv.build_model(kind, processor)
    trainer = SFTTrainer(
        model=model, args=config(tmp_path), train_dataset=tv.count_task("train", 4), processing_class=processor
    )
    batch = trainer.data_collator(tv.count_task("train", 4))
    loss = trainer.compute_loss(trainer.model, dict(batch))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits  # (B, T, V)
    start = processor.tokenizer.convert_tokens_to_ids("<|assistant|>")
    scores, targets = [], []
    for b in range(len(batch["input_ids"])):
        ids = batch["input_ids"][b].tolist()
        first = ids.index(start) + 1
        last = ids.index(processor.tokenizer.eos_token_id)
        scores.append(logits[b, first - 1 : last])  # predicts first .. last
        targets += ids[first : last + 1]
    expected = F.cross_entropy(torch.cat(scores), torch.tensor(targets))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_a_training_step_moves_every_weight_and_reloads_with_the_same_logits(tmp_path, kind, processor):
    model = tv.build_model(kind, processor)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = SFTTrainer(
        model=model,
        args=config(tmp_path, max_steps=1, packing=True),
        train_dataset=tv.count_task("train", 4),
        processing_class=processor,
    )
    assert trainer.args.packing is False  # switched off for image rows
    trainer.train()
    # LLaVA reads the vision tower's last hidden states before its post_layernorm, which takes no gradient
    unchanged = [n for n, p in model.named_parameters() if torch.equal(before[n], p)]
    assert unchanged == (
        []
        if kind == "qwen2_vl"
        else ["model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"]
    )
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = type(model).from_pretrained(str(tmp_path / "saved")).eval()
    batch = vision.VisionCollator(processor)(tv.count_task("test", 3))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model.eval()(**inputs).logits)


def test_lora_adapts_the_language_model_only_by_default(tmp_path, kind, processor):
    from peft import LoraConfig

    trainer = SFTTrainer(
        model=tv.build_model(kind, processor),
        args=config(tmp_path, max_steps=1),
        train_dataset=tv.count_task("train", 4),
        processing_class=processor,
        peft_config=LoraConfig(r=4, target_modules="all-linear"),
    )
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("language_model" in n and "lora_" in n for n in trainable)
    assert any("mlp" in n for n in trainable) and any("self_attn" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert all(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)
    named = LoraConfig(r=4, target_modules=["q_proj"])  # a config naming its modules is kept as it is
    assert vision.lora_on_language_model(tv.build_model(kind, processor), named) is named


# ---- DPO -------------------------------------------------------------------------------------------------
def plain_completion_logps(model, batch):
    """Summed log-probs of the completion tokens from the model's full logits (an independent reference)."""
    inputs = {k: v for k, v in batch.items() if k not in ("completion_mask",)}
    logits = model(**inputs).logits[:, :-1].float()  # (2B, T-1, V)
    token = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return (token * batch["completion_mask"][:, 1:]).sum(dim=1)  # (2B,)


def test_dpo_pairs_share_their_images_and_score_the_response_only(tmp_path, kind, processor):
    model = tv.build_model(kind, processor)
    trainer = vision_dpo_trainer(tmp_path, kind, processor, model)
    rows = vision_preference_rows()
    batch = trainer.data_collator(rows)
    half = len(rows)
    pixels = batch["pixel_values"]
    torch.testing.assert_close(pixels[: len(pixels) // 2], pixels[len(pixels) // 2 :])  # chosen rows, then rejected
    for b, row in enumerate(rows):
        for offset, key in ((0, "chosen"), (half, "rejected")):
            ids = batch["input_ids"][offset + b][batch["completion_mask"][offset + b].bool()]
            assert processor.tokenizer.decode(ids) == row[key] + "</s>"
    with torch.no_grad():
        scores = trainer.completion_logps(model, batch).logps
        expected = plain_completion_logps(model, batch)
        blank = plain_completion_logps(model, {**batch, "pixel_values": torch.zeros_like(pixels)})
    torch.testing.assert_close(torch.cat(scores), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, blank)  # the images do change the scores


@pytest.mark.parametrize("reference", ["copy", "lora", "precomputed"])
def test_dpo_reference_sees_the_same_images(tmp_path, kind, processor, reference):
    from peft import LoraConfig

    model = tv.build_model(kind, processor)
    kwargs = {
        "lora": {"peft_config": LoraConfig(r=4, target_modules="all-linear")},
        "precomputed": {"precompute_ref_log_probs": True},
    }.get(reference, {})
    trainer = vision_dpo_trainer(tmp_path, kind, processor, model, **kwargs)
    trainer.prepare_training()
    batch = trainer.data_collator(vision_preference_rows())
    if reference == "precomputed":
        batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        policy = torch.cat(trainer.completion_logps(trainer.model, batch).logps)
        ref = (
            torch.cat(ChosenRejected(batch["ref_chosen_logps"], batch["ref_rejected_logps"]))
            if reference == "precomputed"
            else torch.cat(trainer.reference_logps(batch))
        )
    torch.testing.assert_close(ref, policy, rtol=1e-5, atol=1e-5)  # before training, policy == reference
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    output = trainer.train()
    assert output.training_loss == pytest.approx(0.6931, abs=1e-3)  # log 2 at the first step
    assert all(
        not torch.equal(before[n], p)
        for n, p in trainer.model.named_parameters()
        if n in before and "post_layernorm" not in n and "lora_A" not in n
    )


# ---- configs and the demo --------------------------------------------------------------------------------
def test_toy_vision_models_and_the_count_task_load_by_name():
    from treadle.cli.loading import load_dataset, load_model

    model, processor = load_model("toy:llava", seed=3)
    assert vision.takes_images(model) and vision.is_vision_processor(processor)
    again, _ = load_model("toy:llava", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    rows = load_dataset("toy:count:6", kind="preference", split="test")
    assert len(rows) == 6 and {"images", "prompt", "chosen", "rejected", "answer"} <= set(rows.column_names)
    assert all(r["chosen"] == r["answer"] != r["rejected"] for r in rows)
    train, test = tv.count_task("train", 50), tv.count_task("test", 50)
    assert {r["images"][0].tobytes() for r in train}.isdisjoint(r["images"][0].tobytes() for r in test)


def test_count_reward_is_exact_match():
    completions = [[{"role": "assistant", "content": c}] for c in ("3", " 3 ", "33", "2")]
    assert tv.count_reward(None, completions, answer=["3"] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_the_count_demo_refuses_bad_settings():
    from treadle.demos.count import CountDemoSettings

    with pytest.raises(ValueError, match="--sft-steps"):
        CountDemoSettings(sft_steps=0)
    with pytest.raises(ValueError, match="kind must be one of"):
        CountDemoSettings(kind="gpt")
    with pytest.raises(ValueError, match="what must be one of"):
        CountDemoSettings(what="circles")


@pytest.mark.parametrize("what", ["shapes", "squares"])
def test_the_answer_is_the_number_of_shapes_or_of_squares_on_the_canvas(what):
    """Counted from the pixels: the grid cells holding any colour (shapes), or the cells whose shape fills its
    bounding box (squares; a circle leaves the box's corners white)."""
    import numpy as np

    question = {"shapes": "How many shapes?", "squares": "How many squares?"}[what]
    for row in tv.count_task("test", 40, what=what):
        pixels = np.asarray(row["images"][0]).min(axis=2)  # (H, W): 255 where white
        cells = [pixels[y : y + 14, x : x + 14] for y in range(0, tv.CANVAS, 14) for x in range(0, tv.CANVAS, 14)]
        shapes = [c < 255 for c in cells if (c < 255).any()]
        full = [s[np.ix_(s.any(1), s.any(0))].all() for s in shapes]  # the shape fills its bounding box
        assert row["answer"] == str(len(shapes) if what == "shapes" else sum(full))
        assert row["prompt"][0]["content"][1]["text"] == question


def test_the_probe_scores_are_argmax_accuracy_and_the_answers_probability():
    """Hand-computed: logits that are log-probabilities. Row 0 answers tokens 1, 2 with p = 0.5 (the argmax) then
    0.8: 0.4; row 1 answers token 1 with p = 0.3 (the argmax is 0): 0.3. Accuracy 1/2, expected reward 0.35."""
    from treadle.demos.count import probe_scores

    probs = torch.full((2, 4, 3), 1 / 3)
    probs[0, 1], probs[0, 2] = torch.tensor([0.2, 0.5, 0.3]), torch.tensor([0.1, 0.1, 0.8])
    probs[1, 2] = torch.tensor([0.6, 0.3, 0.1])

    class Fixed(torch.nn.Module):
        def forward(self, input_ids):
            return type("Out", (), {"logits": probs.log()})()

    batch = {
        "input_ids": torch.zeros(2, 4, dtype=torch.long),
        "labels": torch.tensor([[-100, -100, 1, 2], [-100, -100, -100, 1]]),
    }
    accuracy, reward = probe_scores(Fixed(), batch)
    assert accuracy == 0.5 and reward == pytest.approx(0.35)


@pytest.mark.slow
def test_the_count_demo_runs_end_to_end(tmp_path):
    import json

    from treadle.demos.count import CountDemoSettings, run_count_demo

    settings = CountDemoSettings(
        train_size=32,
        eval_size=8,
        sft_steps=2,
        sft_batch_size=8,
        sft_probe_size=8,
        grpo_steps=1,
        num_generations=4,
        grpo_batch_size=8,
        hidden=32,
    )
    assert run_count_demo(settings, str(tmp_path / "demo")) == 0
    stages = json.loads((tmp_path / "demo" / "results.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["untrained", "after SFT", "after GRPO"]
    assert [s["steps"] for s in stages] == [0, 2, 1] and all(0 <= s["accuracy"] <= 1 for s in stages)
    # the KL term's reference is the SFT start: at GRPO's first step the policy is that model, so the KL is 0
    # (a reference copied before SFT, the untrained model, read 3.25 at step 5 on seed 1)
    kl = [row["kl"] for row in map(json.loads, (tmp_path / "demo" / "grpo" / "metrics.jsonl").open()) if "kl" in row]
    assert kl and abs(kl[0]) < 1e-5
