"""GRPO with images (treadle.trainers.onpolicy.vision) on tiny Qwen2-VL (sampled through transformers' generate: its
positions depend on the images) and LLaVA (the own KV-cached sampler, the images in the prefill) models."""

import functools

import pytest
import torch
from _factories import vision_grpo_trainer

from treadle import vision
from treadle.demos import toy_vision as tv
from treadle.trainers.onpolicy import vision as onpolicy_vision

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen2_vl", "llava"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def processor(kind):
    return tv.build_processor(kind)


def first_char_reward(prompts, completions, answer, images, **kwargs):
    """1 when the completion starts with the answer's digit; records what it was given."""
    first_char_reward.images = images
    return [float(c[0]["content"][:1] == a) + 0.1 * len(c[0]["content"]) for c, a in zip(completions, answer)]


trainer_for = functools.partial(vision_grpo_trainer, reward=first_char_reward)


def plain_logps(model, sample, inputs, suppress=()):
    """Completion log-probs from a plain forward with ``inputs`` (independent of treadle.logprobs); ``suppress``:
    token ids removed from the distribution first (as the sampler does)."""
    with torch.no_grad():
        logits = model.eval()(input_ids=sample.input_ids, attention_mask=sample.attention_mask, **inputs).logits
    width = sample.completion_mask.shape[1]
    logits = logits[:, -width - 1 : -1].float()  # (B, C, V) predicting the completion tokens
    if suppress:
        logits[..., list(suppress)] = -float("inf")
    return torch.log_softmax(logits, -1).gather(-1, sample.completion_ids[..., None]).squeeze(-1)


def test_the_trainer_scores_what_the_sampler_drew_from_the_same_images(tmp_path, kind, processor):
    """The sampler (images in its prefill, or generate's) and the training forward (images in
    ``Sample.model_inputs``) both match a plain forward of the model on the same pixels; zeroed pixels differ.
    The sampler never draws an image token (its distribution has them removed)."""
    trainer = trainer_for(tmp_path, kind, processor, beta=0.1)
    rows = next(iter(trainer.get_train_dataloader()))
    vision_ids = tuple(sorted(vision.image_token_ids(processor)))
    for sample in trainer.generate_and_score(rows, 0):
        assert "pixel_values" in sample.model_inputs
        mask = sample.completion_mask.bool()
        assert not torch.isin(sample.completion_ids[mask], torch.tensor(vision_ids)).any()
        logps = trainer.frozen_logps(trainer.model, sample)
        expected = plain_logps(trainer.model, sample, sample.model_inputs)
        torch.testing.assert_close(logps[mask], expected[mask], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sample.ref_logps[mask], logps[mask], rtol=1e-5, atol=1e-5)  # reference: same
        drawn_from = plain_logps(trainer.model, sample, sample.model_inputs, suppress=vision_ids)
        torch.testing.assert_close(sample.sampling_logps[mask], drawn_from[mask], rtol=1e-4, atol=1e-4)
        blank = {**sample.model_inputs, "pixel_values": torch.zeros_like(sample.model_inputs["pixel_values"])}
        assert not torch.allclose(plain_logps(trainer.model, sample, blank)[mask], expected[mask])
    images = first_char_reward.images
    assert len(images) == len(rows) and all(isinstance(i, list) and i for i in images)  # the images column


def test_a_grpo_step_trains_and_checkpoints_the_vision_inputs(tmp_path, kind, processor):
    from treadle.trainers.onpolicy.data import GenerationBuffer

    trainer = trainer_for(tmp_path, kind, processor, steps_per_generation=2, max_steps=1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)]
    assert any("language_model" in n for n in changed)
    assert any(("visual" in n or "vision" in n or "projector" in n) for n in changed)  # the images got gradient
    state = trainer.buffer.state_dict()  # the second slice of the generation is still to train on
    restored = GenerationBuffer(trainer.buffer.cycle)
    restored.load_state_dict(state, "cpu")
    (saved,) = [s for slices in trainer.buffer.slices.values() for s in slices][-1:]
    (loaded,) = [s for slices in restored.slices.values() for s in slices][-1:]
    assert set(loaded.model_inputs) == set(saved.model_inputs)
    for name, value in saved.model_inputs.items():
        assert torch.equal(loaded.model_inputs[name], value)


def test_groups_of_equal_tokens_but_other_images_are_not_merged(processor):
    rows = tv.count_task("train", 2, kind="rl")  # the same question: equal prompt ids, different canvases
    ids, _ = onpolicy_vision.encode(processor, rows)
    assert ids[0] == ids[1]
    assert onpolicy_vision.distinct_rows([rows[0], rows[0], rows[1], rows[1]], 2) == ([rows[0], rows[1]], 2)
    assert onpolicy_vision.distinct_rows([rows[0], rows[1]], 2) == ([rows[0], rows[1]], 1)


def test_a_vision_prompt_is_never_cut(processor):
    with pytest.raises(vision.VisionDataError, match="max_prompt_length=5 .* never cut"):
        onpolicy_vision.encode(processor, tv.count_task("train", 1, kind="rl"), max_prompt_length=5)


def test_evaluate_scores_held_out_images_greedily(tmp_path, kind, processor):
    """evaluate() samples held-out rows with their images (Qwen2-VL's greedy rows through generate, LLaVA's
    through the own sampler); greedy answers do not depend on the seed."""
    trainer = trainer_for(
        tmp_path, kind, processor, eval_greedy=True, num_generations_eval=2, per_device_eval_batch_size=4
    )
    test = tv.count_task("test", 4, kind="rl")
    first = trainer.evaluate(test)
    again = trainer.evaluate(test)
    assert 0.0 <= first["eval_greedy/accuracy"] <= 1.0
    assert first["eval_greedy/reward"] == again["eval_greedy/reward"]
    assert first["eval_reward"] == again["eval_reward"]  # seeded sampling: the same samples for the same weights
