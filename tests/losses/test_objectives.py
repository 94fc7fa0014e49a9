"""The objective table of issue 17 against TRL 1.16's own loss code, on the same fixed tensors.

TRL keeps its loss maths inside trainer methods (``GRPOTrainer._compute_loss``, ``DPOTrainer._compute_loss``,
``RewardTrainer.compute_loss``). These tests call those real methods on a stand-in ``self`` (a namespace with the
attributes the method reads, an identity accelerator) and a stand-in model whose forward returns the fixed
per-token log-probs, so TRL's formulas run unchanged on the inputs treadle's ``losses`` get. The advantage
estimators (RLOO, GDPO) live inside TRL's generation method, which cannot run without sampling: they are compared
with a plain-PyTorch re-derivation of TRL's code using TRL's own ``nanstd`` (see test_losses.py for hand values).
"""

import functools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from treadle.losses import (
    GRPOObjective,
    decoupled_advantages,
    dpo_loss,
    group_advantages,
    grpo_aggregation,
    grpo_loss,
    ld_token_weights,
)

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")


class IdentityAccelerator:
    """One process: gather, reduce and padding across processes are the identity."""

    device = torch.device("cpu")
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


# ------------------------------------------------------------------------------------------------ GRPO
B, T = 3, 5


def grpo_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    ref = logps + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    entropies = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    adv = torch.tensor([1.0, -0.7, -1.3], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    return logps, old, ref, entropies, adv, mask


def trl_grpo_loss(
    logps, old, ref, entropies, adv, mask, *, loss_type, beta, importance_sampling_ratio=None, **options
):
    """TRL 1.16's GRPOTrainer._compute_loss on fixed per-token log-probs (one process, no accumulation); with
    ``importance_sampling_ratio``, as TRL runs it under vLLM's importance-sampling correction."""
    cls = trl_grpo.GRPOTrainer
    args = SimpleNamespace(
        use_bias_correction_kl=options.get("use_bias_correction_kl", True),
        delta=options.get("delta"),
        sapo_temperature_pos=options.get("sapo_temperature_pos", 1.0),
        sapo_temperature_neg=options.get("sapo_temperature_neg", 1.05),
        steps_per_generation=1,
    )
    stub = SimpleNamespace(
        args=args,
        loss_type=loss_type,
        beta=beta,
        epsilon_low=options.get("epsilon_low", 0.2),
        epsilon_high=options.get("epsilon_high", 0.2),
        importance_sampling_level=options.get("importance_sampling_level", "token"),
        top_entropy_quantile=options.get("top_entropy_quantile", 1.0),
        off_policy_mask_threshold=options.get("off_policy_mask_threshold"),
        use_vllm=importance_sampling_ratio is not None,
        vllm_importance_sampling_correction=True,
        current_gradient_accumulation_steps=1,
        max_completion_length=T,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        model=SimpleNamespace(training=True),
        accelerator=IdentityAccelerator(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        get_off_policy_mask=cls.get_off_policy_mask,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None),
    )
    stub.get_high_entropy_mask = functools.partial(cls.get_high_entropy_mask, stub)
    inputs = {
        "prompt_ids": torch.ones(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    if importance_sampling_ratio is not None:
        inputs["importance_sampling_ratio"] = importance_sampling_ratio
    loss = cls._compute_loss(stub, None, inputs)
    return loss, {k: v[-1] for k, v in stub._metrics["train"].items()}


GRPO_CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo (clip-higher)": dict(loss_type="dapo", epsilon_high=0.28),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4),
    "gspo dapo": dict(loss_type="dapo", importance_sampling_level="sequence"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.1),
    "sapo": dict(loss_type="sapo"),
    "sapo sequence": dict(loss_type="sapo", importance_sampling_level="sequence", sapo_temperature_pos=0.8),
    "delta": dict(loss_type="dapo", delta=1.15),
    "top_entropy_quantile": dict(loss_type="dapo", top_entropy_quantile=0.3),
    "off_policy_mask": dict(loss_type="dapo", off_policy_mask_threshold=0.05),
    "plain kl": dict(loss_type="dapo", use_bias_correction_kl=False),
}


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_objectives_equal_trl(case, beta):
    options = dict(GRPO_CASES[case])
    loss_type = options.pop("loss_type")
    logps, old, ref, entropies, adv, mask = grpo_tensors()
    expected, trl_metrics = trl_grpo_loss(
        logps, old, ref, entropies, adv, mask, loss_type=loss_type, beta=beta, **options
    )
    objective = GRPOObjective(loss_type=loss_type, beta=beta, max_completion_length=T, **options)
    ours, metrics = grpo_loss(
        logps, adv, mask, objective, old_logps=old, ref_logps=ref if beta else None, entropies=entropies
    )
    # TRL builds SAPO's temperatures as float32 tensors: 1.05 becomes 1.0499999523, a 6e-8 difference
    assert ours.item() == pytest.approx(expected.item(), abs=1e-6 if loss_type == "sapo" else 1e-10)
    for name in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio"):
        assert (name in metrics) == (name in trl_metrics), name
        if name in metrics:
            assert metrics[name].item() == pytest.approx(trl_metrics[name], abs=1e-6), name  # TRL: float32


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
@pytest.mark.parametrize("case", ["grpo", "dapo (clip-higher)", "cispo", "sapo", "gspo dapo", "off_policy_mask"])
def test_the_sampler_correction_weighs_the_loss_as_trl(case, mode):
    from treadle.losses import sampling_importance_ratio

    options = dict(GRPO_CASES[case])
    loss_type = options.pop("loss_type")
    logps, old, ref, entropies, adv, mask = grpo_tensors(2)
    sampling = old + torch.randn(B, T, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.2
    ratio = sampling_importance_ratio(old, sampling, mask, mode=mode, clip_max=1.5)
    theirs = logps.clone().requires_grad_()
    expected, _ = trl_grpo_loss(
        theirs,
        old,
        ref,
        entropies,
        adv,
        mask,
        loss_type=loss_type,
        beta=0.04,
        importance_sampling_ratio=ratio,
        **options,
    )
    ours = logps.clone().requires_grad_()
    objective = GRPOObjective(loss_type=loss_type, beta=0.04, max_completion_length=T, **options)
    loss, _ = grpo_loss(
        ours, adv, mask, objective, old_logps=old, ref_logps=ref, entropies=entropies, importance_sampling_ratio=ratio
    )
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6 if loss_type == "sapo" else 1e-10)
    uncorrected, _ = grpo_loss(logps, adv, mask, objective, old_logps=old, ref_logps=ref, entropies=entropies)
    assert loss.item() != pytest.approx(uncorrected.item(), abs=1e-6)  # the ratio mattered
    expected.backward()
    loss.backward()
    torch.testing.assert_close(ours.grad * mask, theirs.grad * mask)


def test_grpo_gradients_equal_trl_for_every_loss_type():
    for loss_type in ("grpo", "dapo", "cispo", "sapo"):
        logps, old, ref, entropies, adv, mask = grpo_tensors(1)
        theirs = logps.clone().requires_grad_()
        trl_grpo_loss(theirs, old, ref, entropies, adv, mask, loss_type=loss_type, beta=0.04)[0].backward()
        ours = logps.clone().requires_grad_()
        grpo_loss(ours, adv, mask, GRPOObjective(loss_type=loss_type, beta=0.04), old_logps=old, ref_logps=ref)[
            0
        ].backward()
        torch.testing.assert_close(ours.grad * mask, theirs.grad * mask, msg=loss_type)
    assert grpo_aggregation("cispo") == "dapo" and grpo_aggregation("sapo") == "grpo"


def test_rloo_advantages_equal_trls_rloo_trainer_formula():
    """TRL's RLOOTrainer (normalize_advantages=False): baselines (group sum - r) / (G - 1); re-derived here."""
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5, 3.0, 3.0, 1.0, 0.0])
    grouped = rewards.view(-1, 4)
    trl_advantages = rewards - ((grouped.sum(1, keepdim=True) - grouped) / 3).view(-1)
    ours, _ = group_advantages(rewards, 4, scale_rewards="none", advantage_estimator="rloo")
    torch.testing.assert_close(ours, trl_advantages)


def test_gdpo_advantages_equal_trls_normalize_then_sum():
    """TRL's ``normalize_then_sum`` branch, re-derived with TRL's own nanstd, NaN (no opinion) included."""
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    g = torch.Generator().manual_seed(5)
    rewards = torch.randint(0, 3, (8, 3), generator=g).float()
    rewards[1, 2] = float("nan")
    weights = torch.tensor([1.0, 0.5, 2.0])
    grouped = rewards.view(-1, 4, 3)
    reward_k = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    summed = (reward_k.view(-1, 3) * weights).nansum(dim=1)
    expected = (summed - torch.nanmean(summed)) / (nanstd(summed) + 1e-4)
    torch.testing.assert_close(decoupled_advantages(rewards, weights.tolist(), 4), expected)


# ------------------------------------------------------------------------------------------------- DPO
P, L = 4, 6  # pairs, sequence length


def dpo_tensors(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.zeros(2 * P, L, dtype=torch.long)
    for row, (start, end) in enumerate([(2, 6), (1, 4), (3, 5), (2, 3), (2, 4), (1, 6), (3, 6), (2, 6)]):
        completion_mask[row, start:end] = 1
    token_logps = -torch.rand(2 * P, L - 1, generator=g, dtype=dtype) * 2  # predictions of tokens 1..L-1
    ref_token_logps = token_logps + torch.randn(2 * P, L - 1, generator=g, dtype=dtype) * 0.5
    log_sum_sq = -torch.rand(2 * P, L - 1, generator=g, dtype=dtype)
    return completion_mask, token_logps, ref_token_logps, log_sum_sq


def trl_dpo_loss(
    loss_type,
    *,
    beta=0.1,
    ld_alpha=None,
    use_weighting=False,
    label_smoothing=0.0,
    loss_weights=None,
    f_divergence_type="reverse_kl",
    f_alpha_divergence_coef=0.5,
    seed=0,
    dtype=torch.float64,
):
    """TRL 1.16's DPOTrainer._compute_loss with a stand-in model returning fixed per-token log-probs; the reference
    log-probs are 'precomputed' (given as columns), with ld_alpha's shared/tail split applied as TRL does."""
    completion_mask, token_logps, ref_token_logps, log_sum_sq = dpo_tensors(seed, dtype)
    shift = completion_mask[:, 1:]
    token_logps = token_logps * shift  # TRL's fused head returns 0 where the label is -100 (not a completion token)
    if ld_alpha is None:
        ref = (ref_token_logps * shift).sum(1)
    else:
        chosen_w, rejected_w = ld_token_weights(*shift.double().chunk(2), ld_alpha)
        ref = (ref_token_logps * torch.cat([chosen_w, rejected_w])).sum(1)

    def model(**kwargs):
        zeros = torch.zeros_like(token_logps)
        return SimpleNamespace(
            log_probs=token_logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(), log_sum_sq_probs=log_sum_sq
        )

    stub = SimpleNamespace(
        beta=beta,
        loss_types=loss_type if isinstance(loss_type, list) else [loss_type],
        loss_weights=loss_weights or [1.0] * (len(loss_type) if isinstance(loss_type, list) else 1),
        ld_alpha=ld_alpha,
        f_divergence_type=f_divergence_type,
        f_alpha_divergence_coef=f_alpha_divergence_coef,
        label_smoothing=label_smoothing,
        use_weighting=use_weighting,
        precompute_ref_logps=True,
        aux_loss_enabled=False,
        accelerator=IdentityAccelerator(),
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(discopop_tau=0.05),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.ones(2 * P, L, dtype=torch.long),
        "attention_mask": torch.ones(2 * P, L),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref[:P],
        "ref_rejected_logps": ref[P:],
    }
    loss = trl_dpo.DPOTrainer._compute_loss(stub, model, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in stub._metrics["train"].items()}


def treadle_dpo_loss(
    loss_type, *, beta=0.1, ld_alpha=None, use_weighting=False, seed=0, dtype=torch.float64, **options
):
    """treadle's path: summed (LD-weighted) completion log-probs -> losses.dpo_loss, WPO weights, mean over pairs."""
    from treadle.losses import wpo_weights

    completion_mask, token_logps, ref_token_logps, log_sum_sq = dpo_tensors(seed, dtype)
    shift = completion_mask[:, 1:].to(token_logps.dtype)
    weights = shift if ld_alpha is None else torch.cat(ld_token_weights(*shift.chunk(2), ld_alpha))
    logps, ref, counts = (token_logps * weights).sum(1), (ref_token_logps * weights).sum(1), shift.sum(1)
    losses, metrics = dpo_loss(
        logps[:P],
        logps[P:],
        ref[:P],
        ref[P:],
        beta=beta,
        loss_type=loss_type,
        chosen_counts=counts[:P],
        rejected_counts=counts[P:],
        **options,
    )
    if use_weighting:
        means = ((token_logps - log_sum_sq) * shift).sum(1) / counts
        losses = losses * wpo_weights(means[:P], means[P:])
    return losses.mean(), metrics


DPO_CASES = {
    "sigmoid": dict(loss_type="sigmoid"),
    "hinge": dict(loss_type="hinge"),
    "ipo": dict(loss_type="ipo"),
    "robust": dict(loss_type="robust", label_smoothing=0.1),
    "sigmoid_norm": dict(loss_type="sigmoid_norm"),
    "apo_zero": dict(loss_type="apo_zero"),
    "apo_down": dict(loss_type="apo_down"),
    "bco_pair": dict(loss_type="bco_pair"),
    "sppo_hard": dict(loss_type="sppo_hard"),
    "nca_pair": dict(loss_type="nca_pair"),
    "exo_pair": dict(loss_type="exo_pair", label_smoothing=1e-3),
    "discopop": dict(loss_type="discopop"),
    "aot": dict(loss_type="aot"),
    "aot_unpaired": dict(loss_type="aot_unpaired"),
    "mpo list": dict(loss_type=["sigmoid", "bco_pair", "sigmoid_norm"], loss_weights=[0.8, 0.2, 1.0]),
    "ld_alpha": dict(loss_type="sigmoid", ld_alpha=0.3),
    "use_weighting (WPO)": dict(loss_type="sigmoid", use_weighting=True),
    "f-DPO js": dict(loss_type="sigmoid", f_divergence_type="js_divergence"),
    # TRL's alpha divergence knows only float16/bfloat16/float32 (its clamp table): compared in float32
    "f-DPO alpha": dict(
        loss_type="hinge", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3, dtype=torch.float32
    ),
    "f-DPO forward_kl": dict(loss_type="ipo", f_divergence_type="forward_kl"),
}


@pytest.mark.parametrize("case", list(DPO_CASES))
def test_dpo_objectives_equal_trl(case):
    options = dict(DPO_CASES[case])
    loss_type = options.pop("loss_type")
    expected, trl_metrics = trl_dpo_loss(loss_type, **options)
    ours, metrics = treadle_dpo_loss(loss_type, **options)
    # float32 in TRL: EXO's ε is a float32 tensor there; the alpha-divergence case runs in float32
    tolerance = 1e-6 if case in ("exo_pair", "f-DPO alpha") else 1e-10
    assert ours.item() == pytest.approx(expected.item(), abs=tolerance)
    assert metrics["chosen_rewards"].mean().item() == pytest.approx(trl_metrics["rewards/chosen"], abs=tolerance)
    accuracy = (metrics["chosen_rewards"] > metrics["rejected_rewards"]).double().mean().item()
    assert accuracy == pytest.approx(trl_metrics["rewards/accuracies"])


def test_sigmoid_label_smoothing_departs_from_trl_on_purpose():
    """TRL 1.16's sigmoid ignores label_smoothing; treadle's applies cDPO (docs/dpo.md). With ε = 0 they agree."""
    expected, _ = trl_dpo_loss("sigmoid", label_smoothing=0.2)
    ours, _ = treadle_dpo_loss("sigmoid", label_smoothing=0.2)
    plain, _ = treadle_dpo_loss("sigmoid")
    assert plain.item() == pytest.approx(expected.item(), abs=1e-10)
    assert ours.item() != pytest.approx(expected.item(), abs=1e-6)


def test_sft_entry_is_a_per_pair_token_mean_where_trl_takes_a_batch_token_mean():
    """Equal only when every chosen response has the same length (documented departure)."""
    completion_mask, token_logps, _, _ = dpo_tensors()
    shift = completion_mask[:, 1:].double()
    batch_mean = -(token_logps[:P] * shift[:P]).sum() / shift[:P].sum()
    ours, _ = treadle_dpo_loss("sft")
    per_pair = (-(token_logps[:P] * shift[:P]).sum(1) / shift[:P].sum(1)).mean()
    assert ours.item() == pytest.approx(per_pair.item(), abs=1e-12)
    assert ours.item() != pytest.approx(batch_mean.item(), abs=1e-6)
    expected, _ = trl_dpo_loss("sft")
    assert expected.item() == pytest.approx(batch_mean.item(), abs=1e-12)


def test_ld_token_weights_equal_trls_shared_and_tail_split():
    completion_mask, token_logps, _, _ = dpo_tensors(3)
    shift = completion_mask[:, 1:]
    token_logps = token_logps * shift  # as TRL's fused head gives them: 0 off the completion
    comp_pos = shift.cumsum(1)
    lengths = shift.sum(1)
    shared = torch.minimum(*lengths.chunk(2)).repeat(2).unsqueeze(1)
    trl_sums = (token_logps * ((comp_pos > 0) & (comp_pos <= shared))).sum(1) + 0.6 * (
        token_logps * (comp_pos > shared)
    ).sum(1)
    ours = (token_logps * torch.cat(ld_token_weights(*shift.chunk(2), 0.6))).sum(1)
    torch.testing.assert_close(ours, trl_sums)
    assert math.isfinite(float(ours.sum()))
