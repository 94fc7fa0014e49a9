"""Idefics3 / SmolVLM: a tiny Idefics3 built in code (treadle.demos.toy_vision: transformers' Idefics3Config with a
one-layer vision tower and a two-layer Llama, Idefics3Processor around the toy tokenizer with the PIL image processor:
no hub, no torchvision) through SFT, GRPO (with LoRA too) and save -> treadle's loader -> reload."""

import pytest
import torch
import torch.nn.functional as F
from _factories import VISION_ARGS, char_sum_reward, sft_trainer, vision_grpo_trainer

from treadle import vision
from treadle.cli.loading import load_model
from treadle.demos import toy_vision as tv

pytestmark = pytest.mark.usefixtures("one_thread")
IMAGE_TOKENS = (tv.IDEFICS3_SIDE // 14) ** 2 // tv.IDEFICS3_SCALE**2  # 4 after the 2x2 pixel shuffle


@pytest.fixture(scope="module")
def processor():
    return tv.build_processor("idefics3")


def idefics3_sft(tmp_path, processor):
    """One SFT step of the tiny Idefics3 on 4 counting-task rows (the shared SFT run, _factories.sft_trainer)."""
    return sft_trainer(
        tmp_path / "sft",
        processor,
        tv.count_task("train", 4),
        tv.build_model("idefics3", processor),
        **VISION_ARGS,
        max_length=64,
    )


def test_the_processor_writes_idefics3_markup_and_none_of_it_is_a_label(processor):
    batch = vision.VisionCollator(processor, completion_only_loss=False)(tv.count_task("train", 2))
    tokens = processor.tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    markup = ["<fake_token_around_image>", "<global-img>", *["<image>"] * IMAGE_TOKENS, "<fake_token_around_image>"]
    assert tokens[1 : 1 + len(markup)] == markup
    vision_ids = vision.image_token_ids(processor)
    assert {processor.tokenizer.convert_tokens_to_ids(t) for t in set(markup)} == vision_ids
    labels = batch["labels"][0]
    assert (labels[1 : 1 + len(markup)] == -100).all() and (labels[1 + len(markup) :] != -100).all()
    assert tuple(batch["pixel_values"].shape) == (2, 1, 3, tv.IDEFICS3_SIDE, tv.IDEFICS3_SIDE)


def test_sft_loss_is_cross_entropy_on_the_answer_tokens(tmp_path, processor):
    trainer = idefics3_sft(tmp_path, processor)
    rows = tv.count_task("train", 4)
    batch = trainer.data_collator(rows)
    for b, row in enumerate(rows):
        labels = batch["labels"][b]
        assert processor.tokenizer.decode(labels[labels != -100]) == row["answer"] + "</s>"
    loss = trainer.compute_loss(trainer.model, dict(batch))
    logits = trainer.model(**{k: v for k, v in batch.items() if k != "labels"}).logits  # (B, T, V)
    start = processor.tokenizer.convert_tokens_to_ids("<|assistant|>")
    scores, targets = [], []
    for b in range(len(rows)):
        ids = batch["input_ids"][b].tolist()
        first, last = ids.index(start) + 1, ids.index(processor.tokenizer.eos_token_id)
        scores.append(logits[b, first - 1 : last])
        targets += ids[first : last + 1]
    torch.testing.assert_close(loss, F.cross_entropy(torch.cat(scores), torch.tensor(targets)), rtol=1e-5, atol=1e-6)


def test_an_sft_step_moves_the_weights_and_reloads_through_treadles_loader(tmp_path, processor):
    trainer = idefics3_sft(tmp_path, processor)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)]
    assert any("vision_model" in n for n in moved) and any("connector" in n for n in moved)
    assert any("text_model" in n for n in moved)
    trainer.save_model(str(tmp_path / "saved"))
    model, reloaded = load_model(str(tmp_path / "saved"))
    assert type(reloaded).__name__ == "Idefics3Processor"
    batch = vision.VisionCollator(reloaded)(tv.count_task("test", 3))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(**inputs).logits, trainer.model.eval()(**inputs).logits)


def plain_logps(model, sample, inputs):
    with torch.no_grad():
        logits = model.eval()(input_ids=sample.input_ids, attention_mask=sample.attention_mask, **inputs).logits
    width = sample.completion_mask.shape[1]
    return (
        torch.log_softmax(logits[:, -width - 1 : -1].float(), -1)
        .gather(-1, sample.completion_ids[..., None])
        .squeeze(-1)
    )


@pytest.mark.parametrize("lora", [False, True])
def test_grpo_scores_what_it_sampled_on_the_same_pixels_and_trains(tmp_path, processor, lora):
    """The sampler's and the trainer's log-probs equal a plain forward on the same pixels (grey pixels differ),
    no vision token is sampled, and a step moves the weights (with LoRA: only the language model's adapters)."""
    from peft import LoraConfig

    trainer = vision_grpo_trainer(
        tmp_path,
        "idefics3",
        processor,
        char_sum_reward,
        beta=0.1,
        peft_config=LoraConfig(r=4, target_modules="all-linear") if lora else None,
    )
    rows = next(iter(trainer.get_train_dataloader()))
    vision_ids = torch.tensor(sorted(vision.image_token_ids(processor)))
    for sample in trainer.generate_and_score(rows, 0):
        mask = sample.completion_mask.bool()
        assert set(sample.model_inputs) == {"pixel_values", "pixel_attention_mask"}
        assert not torch.isin(sample.completion_ids[mask], vision_ids).any()
        logps = trainer.frozen_logps(trainer.model, sample)
        expected = plain_logps(trainer.model, sample, sample.model_inputs)
        torch.testing.assert_close(logps[mask], expected[mask], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sample.ref_logps[mask], logps[mask], rtol=1e-5, atol=1e-5)
        # a grey image (Idefics3 drops an all-zero image as padding)
        blank = {**sample.model_inputs, "pixel_values": torch.full_like(sample.model_inputs["pixel_values"], 0.5)}
        assert not torch.allclose(plain_logps(trainer.model, sample, blank)[mask], expected[mask])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)}
    assert any("text_model" in n for n in moved)
    if lora:
        assert all("lora_" in n and "text_model" in n for n in moved)
    else:
        assert any("vision_model" in n for n in moved)  # the pixels got gradient
