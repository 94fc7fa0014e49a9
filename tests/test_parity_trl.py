"""Same name, same behaviour: treadle's SFT, DPO and GRPO trainers against TRL's (1.x) on the same toy model
(treadle.toy, nothing downloaded), the same rows in the same order and the same seed. Losses and logged metrics
at every step and the final weights agree to 1e-4, for every DPO and GRPO loss type both libraries have. GRPO
samples nothing: both trainers train on the same fixed completions (treadle: a ``generate`` override; TRL: a
``rollout_func``). Departures are listed in docs/coming-from-transformers-and-trl.md."""

import copy

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")  # rollout_func, use_bias_correction_kl
pytest.importorskip("accelerate")

from _factories import TRL_ONLY, FixedCompletions, cycled, in_order, train_logs, trl_rollout  # noqa: E402

import treadle  # noqa: E402
from treadle import losses  # noqa: E402
from treadle.demos import toy  # noqa: E402
from treadle.engines.base import RolloutEngine  # noqa: E402
from treadle.text import encode_prompt  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # each test trains two tiny models for a few steps (seconds each)
    pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning"),
]

# lr 1e-3: AdamW turns float-rounding differences in tiny gradients into steps of up to lr, so a larger lr would
# move a few weights apart by more than 1e-4 although every logged loss and metric agrees
COMMON = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=3,
    learning_rate=1e-3,
    warmup_steps=0,
    lr_scheduler_type="linear",
    weight_decay=0.0,
    max_grad_norm=1.0,
    seed=0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    dataloader_pin_memory=False,
    optim="adamw_torch",
)


def assert_same_logs(theirs, ours, keys, atol=1e-4):
    assert [h["step"] for h in ours] == [h["step"] for h in theirs]
    for key in keys:
        assert [h[key] for h in ours] == pytest.approx([h[key] for h in theirs], abs=atol), key


def assert_same_weights(theirs, ours, atol=1e-4):
    a, b = theirs.model.state_dict(), ours.model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=atol, rtol=0, msg=key)


@pytest.fixture(scope="module")
def tokenizer():
    return toy.build_tokenizer()


# ---- SFT --------------------------------------------------------------------------------------------------------
def test_sft_completion_only_loss_matches_trl(tmp_path, tokenizer):
    rows = toy.load_task("addition", kind="sft", n=24)  # prompt / completion: loss on completion + EOS only
    model = toy.build_model("tiny", tokenizer=tokenizer)
    kwargs = dict(COMMON, max_length=64)
    theirs = trl.SFTTrainer(
        model=copy.deepcopy(model),
        processing_class=tokenizer,
        train_dataset=rows,
        args=trl.SFTConfig(
            output_dir=str(tmp_path / "trl"), train_sampling_strategy="sequential", **TRL_ONLY, **kwargs
        ),
    )
    theirs.train()
    ours = in_order(treadle.SFTTrainer)(
        copy.deepcopy(model),
        treadle.SFTConfig(output_dir=str(tmp_path / "t"), **kwargs),
        train_dataset=rows,
        processing_class=tokenizer,
    )
    ours.train()
    # mean_token_accuracy: treadle's counts every token of the window alike, TRL's averages per-micro-batch
    # accuracies (documented); both are the same only when micro-batches hold equal token counts
    assert_same_logs(train_logs(theirs), train_logs(ours), ["loss", "grad_norm", "learning_rate"])
    assert_same_weights(theirs, ours)


# ---- DPO --------------------------------------------------------------------------------------------------------
TRL_DPO_LOSSES = {
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
}
REWARD_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]


# "sft" alone is RPO's NLL term: treadle averages it per pair, TRL over the batch's tokens (documented)
@pytest.mark.parametrize("loss_type", sorted(set(losses.DPO_LOSS_TYPES) & TRL_DPO_LOSSES - {"sft"}))
def test_dpo_losses_and_reward_metrics_match_trl(tmp_path, tokenizer, loss_type):
    rows = toy.load_task("addition", kind="preference", n=16)
    model = toy.build_model("tiny", tokenizer=tokenizer)
    # label_smoothing only where TRL reads it (robust, exo_pair); cDPO through sigmoid is a documented departure
    kwargs = dict(
        COMMON,
        beta=0.5,
        loss_type=loss_type,
        max_length=64,
        max_steps=2,
        label_smoothing={"robust": 0.1, "exo_pair": 1e-3}.get(loss_type, 0.0),
    )
    theirs = trl.DPOTrainer(
        model=copy.deepcopy(model),
        ref_model=copy.deepcopy(model),
        processing_class=tokenizer,
        train_dataset=rows,
        args=trl.DPOConfig(
            output_dir=str(tmp_path / "trl"),
            train_sampling_strategy="sequential",
            **TRL_ONLY,
            **{**kwargs, "loss_type": [loss_type]},
        ),
    )
    theirs.train()
    ours = in_order(treadle.DPOTrainer)(
        copy.deepcopy(model),
        args=treadle.DPOConfig(output_dir=str(tmp_path / "t"), max_prompt_length=None, **kwargs),
        train_dataset=rows,
        processing_class=tokenizer,
    )
    ours.train()
    # IPO's rewards are on the length-averaged scale in treadle and token sums in TRL (documented): loss only
    keys = ["loss", "grad_norm", "learning_rate", "num_tokens"] + (REWARD_METRICS if loss_type != "ipo" else [])
    assert_same_logs(train_logs(theirs), train_logs(ours), keys)
    assert_same_weights(theirs, ours)


# ---- GRPO -------------------------------------------------------------------------------------------------------
TRL_GRPO_LOSSES = {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"}
GROUP, MAX_COMPLETION = 4, 6
# the completions both trainers train on, in order: EOS (id 2) ends some; the others are cut at MAX_COMPLETION
FIXED = [
    [14, 15, 2],
    [16, 2],
    [20, 21, 22, 23, 24, 25],
    [17, 18, 19, 2],
    [14, 14, 2],
    [30, 31, 2],
    [15, 2],
    [40, 41, 42, 43, 44, 45],
    [16, 2],
    [16, 2],
    [16, 2],
    [16, 2],
]  # the last group: zero std
GRPO_METRICS = [
    "loss",
    "grad_norm",
    "learning_rate",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "rewards/fixed_reward/mean",
    "rewards/fixed_reward/std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
    "num_tokens",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "cispo_clip_ratio",
]


def fixed_reward(completion_ids, **kwargs):
    return [float(len(ids) % 3) + 0.5 * (ids[0] % 2) for ids in completion_ids]


class FixedToy(FixedCompletions):
    """treadle's GRPO trainer sampling nothing: ``generate`` hands out the FIXED completions in order."""

    completions = FIXED


def fixed_rollout(tokenizer):
    """TRL's ``rollout_func`` handing out the same FIXED completions in the same order."""
    return trl_rollout(FIXED, lambda prompt: encode_prompt(tokenizer, prompt))


GRPO_CASES = [(loss_type, {}) for loss_type in sorted(set(losses.GRPO_LOSS_TYPES) & TRL_GRPO_LOSSES)] + [
    ("dapo", {"use_bias_correction_kl": False}),  # the plain k3 term (TRL's default is the ratio-weighted one)
    ("dapo", {"importance_sampling_level": "sequence", "delta": 1.5}),  # GSPO's ratio, two-sided clipping
]


@pytest.mark.parametrize(
    "loss_type, extra", GRPO_CASES, ids=[f"{t}-{'-'.join(e) or 'defaults'}" for t, e in GRPO_CASES]
)
def test_grpo_losses_and_metrics_match_trl_on_fixed_completions(tmp_path, tokenizer, loss_type, extra, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    # TRL shuffles the rows of a generation before cutting it into micro-batches; treadle keeps them in order (a
    # documented departure: it changes which rows share a micro-batch, so per-micro-batch means, not the gradient of
    # dapo / grpo). Keep TRL's order too, so that every micro-batch holds the same rows in both.
    monkeypatch.setattr("trl.trainer.grpo_trainer.shuffle_sequence_dict", lambda batch: batch)
    # one prompt repeated: the order in which either trainer draws its rows cannot matter
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt": "12+34="}] * 8)
    toy.build_model("tiny", tokenizer=tokenizer).save_pretrained(tmp_path / "init")  # TRL loads its reference
    kwargs = dict(
        COMMON,
        per_device_train_batch_size=GROUP,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        num_iterations=2,
        num_generations=GROUP,
        max_completion_length=MAX_COMPLETION,
        beta=0.1,
        epsilon=0.02,
        loss_type=loss_type,
        scale_rewards="group",
        temperature=1.0,
        max_steps=3,
        **extra,
    )
    ours_args = treadle.GRPOConfig(output_dir=str(tmp_path / "t"), max_prompt_length=None, **kwargs)
    bias_correction = getattr(ours_args, "use_bias_correction_kl", False)  # treadle without it: the plain term
    theirs = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tmp_path / "init"),
        reward_funcs=fixed_reward,
        processing_class=tokenizer,
        train_dataset=rows,
        rollout_func=fixed_rollout(tokenizer),
        args=trl.GRPOConfig(
            output_dir=str(tmp_path / "trl"), **TRL_ONLY, **{**kwargs, "use_bias_correction_kl": bias_correction}
        ),
    )
    theirs.train()
    ours = FixedToy(
        AutoModelForCausalLM.from_pretrained(tmp_path / "init"),
        reward_funcs=fixed_reward,
        args=ours_args,
        train_dataset=rows,
        processing_class=tokenizer,
    )
    ours.train()
    mine, trls = train_logs(ours), train_logs(theirs)
    assert [h["step"] for h in mine] == [h["step"] for h in trls] == [1, 2, 3]
    for step, (a, b) in enumerate(zip(trls, mine), start=1):
        keys = [k for k in GRPO_METRICS if k in a or k in b]
        assert [k for k in keys if k in a] == [k for k in keys if k in b], step
        assert [b[k] for k in keys] == pytest.approx([a[k] for k in keys], abs=1e-4), (step, keys)
    if "clip_ratio/region_mean" in trls[1]:
        assert trls[1]["clip_ratio/region_mean"] > 0  # the second pass over a generation clips
    assert_same_weights(theirs, ours)


class NotTheOwnSampler(RolloutEngine):
    """An engine other than the own sampler (as vLLM is: no ``exact_logps``): the sampler correction applies to its
    rollouts. It samples nothing here (``generate`` is overridden); its weights need no loading."""

    def generate(self, prompt_ids, params, *, generator=None):
        raise AssertionError("FixedCompletions samples instead")

    def load_weights(self, model, version=None):
        pass


def sampling_logps_table(model, tokenizer) -> list[list[float]]:
    """Per FIXED completion, "the sampler's" log-probs: the initial model's (after the one prompt) plus a fixed
    perturbation of up to ±0.25 per token, as an engine with other numerics or slightly stale weights would report."""
    prompt = encode_prompt(tokenizer, "12+34=")
    g = torch.Generator().manual_seed(7)
    table = []
    with torch.no_grad():
        for completion in FIXED:
            ids = torch.tensor([prompt + completion])
            logps = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
            exact = logps.gather(1, torch.tensor(completion)[:, None])[:, 0]
            table.append((exact + (torch.rand(len(completion), generator=g) - 0.5) * 0.5).tolist())
    return table


@pytest.mark.parametrize("mode, clip_min, clip_max", [("sequence_mask", None, 1.3), ("token_truncate", 0.9, 1.1)])
def test_grpo_sampler_correction_matches_trl_with_vllm_logprobs(
    tmp_path, tokenizer, monkeypatch, mode, clip_min, clip_max
):
    """TRL runs its correction only under vLLM: its trainer is given a rollout_func that returns sampling log-probs,
    with ``use_vllm`` switched on after construction and a weight sync that does nothing; treadle's trainer gets the
    same log-probs from an engine that is not the own sampler. Every logged metric (TRL's ``sampling/*`` included)
    and the weights agree."""
    from types import SimpleNamespace

    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr("trl.trainer.grpo_trainer.shuffle_sequence_dict", lambda batch: batch)
    rows = Dataset.from_list([{"prompt": "12+34="}] * 8)
    toy.build_model("tiny", tokenizer=tokenizer).save_pretrained(tmp_path / "init")
    table = sampling_logps_table(AutoModelForCausalLM.from_pretrained(tmp_path / "init"), tokenizer)
    correction = dict(
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )
    kwargs = dict(
        COMMON,
        per_device_train_batch_size=GROUP,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        num_iterations=2,
        num_generations=GROUP,
        max_completion_length=MAX_COMPLETION,
        beta=0.1,
        epsilon=0.02,
        loss_type="dapo",
        scale_rewards="group",
        temperature=1.0,
        max_steps=3,
        **correction,
    )
    rollout = fixed_rollout(tokenizer)

    def with_logps(prompts, trainer):
        out = rollout(prompts, trainer)
        out["logprobs"] = [table[FIXED.index(c)] for c in out["completion_ids"]]
        return out

    theirs = trl.GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tmp_path / "init"),
        reward_funcs=fixed_reward,
        processing_class=tokenizer,
        train_dataset=rows,
        rollout_func=with_logps,
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), **TRL_ONLY, **kwargs),
    )
    theirs.use_vllm, theirs.vllm_generation = True, SimpleNamespace(sync_weights=lambda: None)
    theirs._last_loaded_step = -1  # set in its __init__ only under use_vllm
    theirs.train()

    class Ours(FixedToy):
        def build_engine(self):
            return NotTheOwnSampler()

        def generate(self, prompt_ids, *, num_generations, generator=None):
            start = self.handed_out
            out = super().generate(prompt_ids, num_generations=num_generations, generator=generator)
            logps = torch.zeros(out.completion_ids.shape)
            for row, completion in enumerate(cycled(FIXED, out.completion_ids.shape[0], start)):
                logps[row, : len(completion)] = torch.tensor(table[FIXED.index(completion)])
            out.sampling_logps = logps
            return out

    ours = Ours(
        AutoModelForCausalLM.from_pretrained(tmp_path / "init"),
        reward_funcs=fixed_reward,
        args=treadle.GRPOConfig(output_dir=str(tmp_path / "t"), max_prompt_length=None, **kwargs),
        train_dataset=rows,
        processing_class=tokenizer,
    )
    assert ours.corrects_sampling
    ours.train()
    mine, trls = train_logs(ours), train_logs(theirs)
    sampling = [f"sampling/sampling_logp_difference/{k}" for k in ("mean", "max")] + [
        f"sampling/importance_sampling_ratio/{k}" for k in ("min", "mean", "max")
    ]
    assert [h["step"] for h in mine] == [h["step"] for h in trls] == [1, 2, 3]
    assert all(k in trls[0] for k in sampling) and trls[0]["sampling/sampling_logp_difference/max"] > 0.1
    for step, (a, b) in enumerate(zip(trls, mine), start=1):
        keys = [k for k in GRPO_METRICS + sampling if k in a or k in b]
        assert [k for k in keys if k in a] == [k for k in keys if k in b], step
        assert [b[k] for k in keys] == pytest.approx([a[k] for k in keys], abs=1e-4), (step, keys)
    assert_same_weights(theirs, ours)
