"""Vision-language models after DPO and GRPO: saved, reloaded through treadle's loading path
(``treadle.cli.loading.load_model`` on the folder: ``AutoModelForImageTextToText`` and the saved processor) with the
same logits on the same pixels and text; and GRPO with LoRA on a VLM with images (adapters on the language model
only, a step moves only adapter weights, log-probs against a plain forward of the peft model)."""

import pytest
import torch
from _factories import char_sum_reward, vision_dpo_trainer, vision_grpo_trainer

from treadle import vision
from treadle.cli.loading import load_model
from treadle.demos import toy_vision as tv

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def processor(kind):
    return tv.build_processor(kind)


def assert_reloads_the_same(trainer, folder, kind, processor):
    """Save the trained model, load the folder with treadle's loader; the reloaded processor makes the same batch
    and the reloaded model gives the trained model's logits on it (and the images matter to them)."""
    trainer.save_model(str(folder))
    model, reloaded_processor = load_model(str(folder))
    assert type(model) is type(trainer.model) and vision.is_vision_processor(reloaded_processor)
    rows = tv.count_task("test", 3)
    batch = vision.VisionCollator(processor)(rows)
    again = vision.VisionCollator(reloaded_processor)(rows)
    assert batch.keys() == again.keys() and all(torch.equal(batch[k], again[k]) for k in batch)
    inputs = {k: v for k, v in again.items() if k != "labels"}
    with torch.no_grad():
        trained = trainer.model.eval()(**inputs).logits
        torch.testing.assert_close(model.eval()(**inputs).logits, trained)
        fresh = tv.build_model(kind, processor)  # the untrained weights (the same seed)
        assert not torch.allclose(fresh.eval()(**inputs).logits, trained, atol=1e-3)  # the trained weights came back


def test_a_dpo_trained_vlm_reloads_with_the_same_logits(tmp_path, kind, processor):
    trainer = vision_dpo_trainer(tmp_path, kind, processor)
    trainer.train()
    assert_reloads_the_same(trainer, tmp_path / "saved", kind, processor)


def test_a_grpo_trained_vlm_reloads_with_the_same_logits(tmp_path, kind, processor):
    trainer = vision_grpo_trainer(tmp_path, kind, processor, char_sum_reward)
    trainer.train()
    assert_reloads_the_same(trainer, tmp_path / "saved", kind, processor)


def test_grpo_with_lora_on_a_vlm_trains_the_adapters_on_the_language_model_only(tmp_path, kind, processor):
    """Adapters only on the language model; one step moves the adapter weights and nothing else; the trainer's
    log-probs of a rollout equal a plain forward of the peft model on the same pixels (and zeroed pixels change
    them)."""
    from peft import LoraConfig

    trainer = vision_grpo_trainer(
        tmp_path, kind, processor, char_sum_reward, peft_config=LoraConfig(r=4, target_modules="all-linear"), beta=0.1
    )
    model = trainer.model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("language_model" in n and "lora_" in n for n in trainable)
    rows = next(iter(trainer.get_train_dataloader()))
    for sample in trainer.generate_and_score(rows, 0):
        mask = sample.completion_mask.bool()
        logps = trainer.frozen_logps(model, sample)
        with torch.no_grad():
            logits = model.eval()(
                input_ids=sample.input_ids, attention_mask=sample.attention_mask, **sample.model_inputs
            ).logits
            blank = {**sample.model_inputs, "pixel_values": torch.zeros_like(sample.model_inputs["pixel_values"])}
            blank_logits = model(input_ids=sample.input_ids, attention_mask=sample.attention_mask, **blank).logits
        width = sample.completion_mask.shape[1]
        ids = sample.completion_ids[..., None]
        expected = torch.log_softmax(logits[:, -width - 1 : -1].float(), -1).gather(-1, ids).squeeze(-1)
        torch.testing.assert_close(logps[mask], expected[mask], rtol=1e-4, atol=1e-4)
        with_blank = torch.log_softmax(blank_logits[:, -width - 1 : -1].float(), -1).gather(-1, ids).squeeze(-1)
        assert not torch.allclose(with_blank[mask], expected[mask])
        # the reference is the model with its adapters off: equal before any step (lora_B starts at zero)
        torch.testing.assert_close(sample.ref_logps[mask], logps[mask], rtol=1e-5, atol=1e-5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert moved and all("lora_" in n and "language_model" in n for n in moved)
    assert any("lora_B" in n for n in moved)


def test_a_lora_trained_toy_vlm_merges_into_its_base_and_reloads(tmp_path):
    """``treadle merge`` on a LoRA run of ``toy:llava``: the adapter names its base, the base is rebuilt with the run's
    seed, and the merged folder reloads (with its processor) with the trained model's logits."""
    from peft import LoraConfig

    from treadle.cli.loading import merge_adapter_folder
    from treadle.trainers.sft import SFTConfig, SFTTrainer

    model, processor = load_model("toy:llava", seed=3)
    args = SFTConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        seed=3,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        max_length=64,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=tv.count_task("train", 8),
        processing_class=processor,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    trainer.train()
    trainer.save_model()
    merged, merged_processor = load_model(merge_adapter_folder(str(tmp_path / "run")))
    batch = vision.VisionCollator(merged_processor)(tv.count_task("test", 2))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        expected = trainer.model.eval()(**inputs).logits
        torch.testing.assert_close(merged.eval()(**inputs).logits, expected, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(load_model("toy:llava", seed=3)[0].eval()(**inputs).logits, expected, atol=1e-3)
