"""The sampler correction (losses.sampling_importance_ratio, trainers/grpo/correction.py; TRL 1.16's
``vllm_importance_sampling_*``): the ratio and its metrics by hand and against a plain-PyTorch re-derivation of
TRL's code, the config's names and defaults against TRL's, when the trainer applies it, and that the ratios it
applies with the own sampler's top-k are each token's kept probability mass."""

import dataclasses
import functools
import math

import pytest
import torch
from _factories import grpo_trainer, length_reward

import treadle.trainers.grpo.correction as correction
import treadle.trainers.grpo.trainer as grpo_module
from treadle.demos import toy
from treadle.engines.local import LocalEngine
from treadle.losses import (
    SAMPLING_CORRECTION_MODES,
    GRPOObjective,
    grpo_loss,
    sampling_correction_metrics,
    sampling_correction_values,
    sampling_importance_ratio,
)
from treadle.trainers.grpo.correction import corrects_sampling
from treadle.trainers.grpo.trainer import GRPOConfig

pytestmark = pytest.mark.usefixtures("one_thread")

LOG = torch.log
TRAINER = LOG(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.6, 0.1]], dtype=torch.float64))
SAMPLER = LOG(torch.tensor([[0.25, 0.4, 0.9], [0.3, 0.1, 0.5]], dtype=torch.float64))
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])  # row 0's last token is padding


# ------------------------------------------------------------------------------------------------ the maths
def test_ratio_by_hand_in_every_mode():
    # per-token ratios: row 0: 2, 0.5, (padding: 1); row 1: 1, 6, 0.2; per sequence: 1 and 1.2
    def ratio(mode, **bounds):
        return sampling_importance_ratio(TRAINER, SAMPLER, MASK, mode=mode, **bounds).flatten().tolist()

    assert ratio("token_truncate", clip_max=3.0) == pytest.approx([2, 0.5, 1, 1, 3, 0.2])
    assert ratio("token_truncate", clip_min=0.4, clip_max=1.5) == pytest.approx([1.5, 0.5, 1, 1, 1.5, 0.4])
    assert ratio("token_mask", clip_max=3.0) == pytest.approx([2, 0.5, 1, 1, 0, 0.2])
    assert ratio("token_mask", clip_min=0.6, clip_max=None) == pytest.approx([2, 0, 1, 1, 6, 0])
    assert ratio("sequence_truncate", clip_max=1.1) == pytest.approx([1.0, 1.1])
    assert ratio("sequence_mask", clip_max=1.1) == pytest.approx([1.0, 0.0])
    assert ratio("sequence_mask", clip_min=1.1, clip_max=None) == pytest.approx([0.0, 1.2])


def test_padding_infinities_and_unscored_tokens_count_as_no_gap():
    trainer = torch.tensor([[-1.0, -float("inf")], [-1.0, -2.0]])
    sampler = torch.tensor([[-1.5, -float("inf")], [float("nan"), -2.5]])
    mask = torch.tensor([[1, 0], [1, 1]])
    ratio = sampling_importance_ratio(trainer, sampler, mask, mode="token_truncate", clip_max=3.0)
    assert ratio.flatten().tolist() == pytest.approx([math.exp(0.5), 1.0, 1.0, math.exp(0.5)])
    gaps, ratios = sampling_correction_values(trainer, sampler, ratio, mask, "token_truncate")
    assert gaps.tolist() == [0.5, 0.5]  # padding and the NaN left out, as TRL
    assert ratios.tolist() == pytest.approx([math.exp(0.5), 1.0, math.exp(0.5)])


def test_metrics_by_hand():
    ratio = sampling_importance_ratio(TRAINER, SAMPLER, MASK, mode="token_truncate", clip_max=3.0)
    m = sampling_correction_metrics(*sampling_correction_values(TRAINER, SAMPLER, ratio, MASK, "token_truncate"))
    gaps = [math.log(2), math.log(2), 0.0, math.log(6), math.log(5)]
    assert m["sampling/sampling_logp_difference/mean"].item() == pytest.approx(sum(gaps) / 5)
    assert m["sampling/sampling_logp_difference/max"].item() == pytest.approx(math.log(6))
    assert [m[f"sampling/importance_sampling_ratio/{k}"].item() for k in ("min", "mean", "max")] == pytest.approx(
        [0.2, (2 + 0.5 + 1 + 3 + 0.2) / 5, 3.0]
    )  # after truncation, over completion tokens
    seq = sampling_importance_ratio(TRAINER, SAMPLER, MASK, mode="sequence_mask", clip_max=1.1)
    m = sampling_correction_metrics(*sampling_correction_values(TRAINER, SAMPLER, seq, MASK, "sequence_mask"))
    assert [m[f"sampling/importance_sampling_ratio/{k}"].item() for k in ("min", "mean", "max")] == pytest.approx(
        [0.0, 0.5, 1.0]
    )  # per sequence, after masking
    empty = sampling_correction_metrics(torch.zeros(0), torch.zeros(0))
    assert all(v.item() == 0 for v in empty.values())


def trl_reference(trainer, sampler, mask, mode, clip_min, clip_max):
    """TRL 1.16's GRPOTrainer._generate_and_score_completions, the vLLM importance-sampling block, re-derived."""
    diff = torch.nan_to_num((trainer - sampler) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low, high = (-math.inf if clip_min is None else clip_min), (math.inf if clip_max is None else clip_max)
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@pytest.mark.parametrize("mode", SAMPLING_CORRECTION_MODES)
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0), (0.9, None)])
def test_ratio_equals_trls_formula_on_random_tensors(mode, bounds):
    g = torch.Generator().manual_seed(3)
    trainer = -torch.rand(6, 7, generator=g, dtype=torch.float64) * 3
    sampler = trainer + torch.randn(6, 7, generator=g, dtype=torch.float64) * 0.3
    mask = (torch.rand(6, 7, generator=g) > 0.2).long()
    ours = sampling_importance_ratio(trainer, sampler, mask, mode=mode, clip_min=bounds[0], clip_max=bounds[1])
    torch.testing.assert_close(ours, trl_reference(trainer, sampler, mask, mode, *bounds))


def test_the_loss_weighs_each_tokens_policy_term_and_not_the_kl():
    g = torch.Generator().manual_seed(0)
    logps = (-torch.rand(2, 3, generator=g, dtype=torch.float64)).requires_grad_()
    ref = logps.detach() + 0.1
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ratio = torch.tensor([[2.0, 0.5, 7.0], [1.0, 0.0, 3.0]], dtype=torch.float64)
    loss, _ = grpo_loss(logps, adv, mask, GRPOObjective(beta=0.1), ref_logps=ref, importance_sampling_ratio=ratio)
    # on-policy (old = logps): the policy term is -A per token; the k3 term (times r = 1) is added after the weight
    kl = torch.exp(ref - logps.detach()) - (ref - logps.detach()) - 1
    expected = ((-adv[:, None] * ratio + 0.1 * kl) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item())
    with pytest.raises(ValueError, match=r"importance_sampling_ratio must be \(B, T\)"):
        grpo_loss(logps, adv, mask, GRPOObjective(), importance_sampling_ratio=ratio[:, :2])


# ------------------------------------------------------------------------------------------------ the config
def test_config_names_and_defaults_are_trls():
    trl_config = pytest.importorskip("trl.trainer.grpo_config").GRPOConfig
    theirs = {f.name: f.default for f in dataclasses.fields(trl_config)}
    ours = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    names = [n for n in theirs if n.startswith("vllm_importance_sampling")]
    assert sorted(names) == sorted(n for n in ours if n.startswith("vllm_importance_sampling"))
    assert {n: ours[n] for n in names} == {n: theirs[n] for n in names}


def test_config_refuses_what_trl_refuses_and_keeps_the_deprecated_cap(tmp_path):
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap is deprecated"):
        assert (
            GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_cap=2.0).vllm_importance_sampling_clip_max
            == 2.0
        )
    with pytest.raises(ValueError, match=r"clip_min \(3.0\) must be less than vllm_importance_sampling_clip_max"):
        GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_clip_min=3.0)
    with pytest.raises(ValueError, match="clamps the ratio: set vllm_importance_sampling_clip_max"):
        GRPOConfig(
            output_dir=str(tmp_path),
            vllm_importance_sampling_mode="token_truncate",
            vllm_importance_sampling_clip_max=None,
        )
    GRPOConfig(
        output_dir=str(tmp_path),
        vllm_importance_sampling_mode="token_truncate",  # off: not checked (TRL)
        vllm_importance_sampling_clip_max=None,
        vllm_importance_sampling_correction=False,
    )
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='token' is not supported"):
        GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_mode="token")


def test_when_the_correction_applies(tmp_path):
    def args(**kw):
        return GRPOConfig(output_dir=str(tmp_path), **kw)

    assert not corrects_sampling(args(), exact_logps=True)  # samples the trained distribution itself
    assert corrects_sampling(args(), exact_logps=False)  # another engine: always
    for reshaped in (
        {"top_k": 5},
        {"top_p": 0.9},
        {"repetition_penalty": 1.2},
        {"min_p": 0.05},
        {"generation_kwargs": {"min_p": 0.05}},
        {"generation_kwargs": {"suppress_tokens": [7]}},
    ):
        assert corrects_sampling(args(**reshaped), exact_logps=True), reshaped
    assert not corrects_sampling(args(min_p=0.0), exact_logps=True)
    assert not corrects_sampling(args(top_k=5, vllm_importance_sampling_correction=False), exact_logps=False)


# ------------------------------------------------------------------------------------------------ the trainer
@pytest.fixture(scope="module")
def dataset():
    return toy.load_task("addition", kind="rl", n=16)  # conftest's dataset holds 32 prompts


# this module's runs: the shared GRPO run (_factories.grpo_trainer), 2 groups a generation, health checks off
trainer_for = functools.partial(
    grpo_trainer,
    reward=length_reward,
    per_device_train_batch_size=8,
    max_completion_length=6,
    logging_steps=1,
    health_checks=False,
)


def kept_mass(model, sample, temperature: float, top_k: int) -> torch.Tensor:
    """Independently: the probability mass of the top-k tokens at each completion position ``(B, C)``."""
    with torch.no_grad():
        logits = model(
            input_ids=sample.input_ids,
            attention_mask=sample.attention_mask,
            position_ids=(sample.attention_mask.cumsum(1) - 1).clamp(min=0),
        ).logits.float()
    width = sample.completion_mask.shape[1]
    probs = torch.softmax(logits[:, -width - 1 : -1] / temperature, dim=-1)
    return probs.topk(top_k, dim=-1).values.sum(-1)


@pytest.mark.parametrize("layout", [{}, {"steps_per_generation": 2, "gradient_accumulation_steps": 2}])
def test_the_own_samplers_top_k_is_corrected_by_each_tokens_kept_mass(tmp_path, tok, dataset, monkeypatch, layout):
    """One micro-step per generation (the default): the old log-probs are the loss forward's own, no extra forward;
    two: one more forward at generation time. The ratio the loss gets is each token's kept mass either way."""
    trainer = trainer_for(
        tmp_path, tok, dataset, top_k=4, temperature=0.9, vllm_importance_sampling_mode="token_truncate", **layout
    )
    checked, frozen, given = [], [], {}
    original, loss, frozen_logps = trainer.compute_loss, grpo_module.grpo_loss, trainer.frozen_logps

    def check(model, inputs, *args, **kwargs):  # the first window: the policy is the one that sampled
        out = original(model, inputs, *args, **kwargs)
        if trainer.state.global_step == 0:
            mask = inputs.completion_mask.bool()
            ratio = given["importance_sampling_ratio"]
            assert given["old_logps"] is not None and ratio.shape == mask.shape
            want = kept_mass(trainer.model, inputs, 0.9, 4)
            torch.testing.assert_close(ratio[mask], want[mask], atol=1e-4, rtol=1e-4)
            assert (ratio[mask] < 1).all()
            checked.append(int(mask.sum()))
        return out

    def spy(*args, **kwargs):
        given.update(kwargs)
        return loss(*args, **kwargs)

    monkeypatch.setattr(grpo_module, "grpo_loss", spy)
    trainer.frozen_logps = lambda *a, **k: frozen.append(1) or frozen_logps(*a, **k)
    trainer.compute_loss = check
    trainer.train()
    assert checked and sum(checked) > 8
    assert bool(frozen) == bool(layout)  # the extra forward only where a generation spans micro-steps
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(
        0
        < h["sampling/importance_sampling_ratio/min"]
        <= h["sampling/importance_sampling_ratio/mean"]
        <= h["sampling/importance_sampling_ratio/max"]
        < 1
        for h in logs
    )
    assert all(h["sampling/sampling_logp_difference/max"] > 0 for h in logs)


def test_old_logps_from_the_loss_forward_train_what_the_extra_forward_trains(tmp_path, tok, dataset, monkeypatch):
    """The deferred correction (one micro-step per generation) against the same run made to spend the extra eval-mode
    forward: the same metrics and weights up to float rounding; a model that draws dropout keeps the extra forward."""
    runs = {}
    for deferred in (True, False):
        if not deferred:
            monkeypatch.setattr(correction, "defers_old_logps", lambda cycle, model: False)
        trainer = trainer_for(tmp_path / str(deferred), tok, dataset, top_k=4, max_steps=3)
        trainer.train()
        runs[deferred] = trainer
    for name in ("sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/max", "loss"):
        a, b = ([h[name] for h in runs[d].state.log_history if name in h] for d in (True, False))
        assert len(a) == 3 and a == pytest.approx(b, rel=1e-4, abs=1e-6)
    for (name, a), b in zip(runs[True].model.state_dict().items(), runs[False].model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
    monkeypatch.undo()
    model = runs[True].model
    assert not correction.draws_dropout(model) and correction.defers_old_logps(1, model)
    model.config.attention_dropout = 0.1
    assert correction.draws_dropout(model) and not correction.defers_old_logps(1, model)
    model.config.attention_dropout = 0.0
    model.model.layers[0].add_module("drop", torch.nn.Dropout(0.05))  # as a LoRA adapter's lora_dropout
    assert not correction.defers_old_logps(1, model) and not correction.defers_old_logps(2, toy.build_model("tiny"))


def test_the_own_sampler_at_plain_settings_spends_nothing_on_it(tmp_path, tok, dataset):
    trainer = trainer_for(tmp_path, tok, dataset)
    assert isinstance(trainer.engine, LocalEngine) and not trainer.corrects_sampling
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert not any(k.startswith("sampling/") for h in logs for k in h)


# ------------------------------------------------------------------------------------- min_p, generation_kwargs
def test_min_p_and_generation_kwargs_are_trls_fields_and_reach_the_sampler(tmp_path, tok, dataset):
    trl_config = pytest.importorskip("trl.trainer.grpo_config").GRPOConfig
    theirs = {f.name: f.default for f in dataclasses.fields(trl_config)}
    ours = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    names = ("min_p", "generation_kwargs")
    assert {n: ours[n] for n in names} == {n: theirs[n] for n in names}
    trainer = trainer_for(
        tmp_path, tok, dataset, min_p=0.2, top_p=0.95, generation_kwargs={"top_p": 0.9, "suppress_tokens": [7, 9]}
    )
    for mode in ("train", "eval"):  # as TRL's one generation config: generation_kwargs override the fields
        params = trainer.sampling_params(mode)
        assert (params.min_p, params.top_p, params.suppress_token_ids) == (0.2, 0.9, (7, 9)), mode
    overridden = trainer_for(tmp_path, tok, dataset, min_p=0.2, generation_kwargs={"min_p": 0.1})
    assert overridden.sampling_params().min_p == 0.1
    assert trainer_for(tmp_path, tok, dataset).sampling_params().min_p == 0.0


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"generation_kwargs": {"num_beams": 4}}, r"generation_kwargs\['num_beams'\] has no counterpart"),
        ({"generation_kwargs": {"temperature": 0.5}}, r"generation_kwargs\['temperature'\] is not taken: the trained"),
        ({"generation_kwargs": {"max_new_tokens": 9}}, "set the config's max_completion_length"),
        ({"generation_kwargs": "min_p=0.1"}, "generation_kwargs must be a dict"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"generation_kwargs": {"min_p": -0.1}}, r"min_p must be in \[0, 1\]"),
        (
            {"generation_kwargs": {"suppress_tokens": [7]}, "use_vllm": True},
            "suppress_tokens reach treadle's own sampler only",
        ),
    ],
)
def test_sampling_settings_the_own_sampler_cannot_honour_are_refused(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(output_dir=str(tmp_path), **settings)
