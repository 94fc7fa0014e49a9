"""treadle.losses against hand-computed numbers and plain-Python references."""

import dataclasses
import math
import statistics

import pytest
import torch

from treadle.losses import GRPOObjective, dpo_loss, group_advantages, grpo_loss, kl_k3, sft_loss


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def softplus(x):  # -log sigmoid(-x) = log(1 + e^x), written out so the test does not reuse torch's
    return math.log(1 + math.exp(x))


# ------------------------------------------------------------------------------------------------- DPO
# One pair used throughout: pc = -1, rc = -2  -> chosen log-ratio   pc - rc = 1
#                           pr = -3, rr = -2.5 -> rejected log-ratio pr - rr = -0.5
#                           h = 1 - (-0.5) = 1.5;  beta = 0.1 -> logits = 0.15
PAIR = dict(chosen_logps=t(-1.0), rejected_logps=t(-3.0), ref_chosen_logps=t(-2.0), ref_rejected_logps=t(-2.5))


def test_dpo_sigmoid_hand_value_and_rewards():
    losses, metrics = dpo_loss(**PAIR, beta=0.1)
    # -log sigmoid(0.15) = log(1 + e^-0.15) = log(1.860708) = 0.620957
    assert losses.item() == pytest.approx(softplus(-0.15), abs=1e-12)
    assert losses.item() == pytest.approx(0.620957, abs=1e-6)
    assert metrics["chosen_rewards"].item() == pytest.approx(0.1)  # 0.1 * 1
    assert metrics["rejected_rewards"].item() == pytest.approx(-0.05)  # 0.1 * -0.5
    assert metrics["logits"].item() == pytest.approx(0.15)


def test_dpo_beta_scales_the_whole_difference_not_only_chosen():
    # The classic bug: logits = beta * chosen_logratio - rejected_logratio = 0.1 * 1 + 0.5 = 0.6,
    # whose loss log(1 + e^-0.6) = 0.437488 differs from the right log(1 + e^-0.15) = 0.620957.
    losses, _ = dpo_loss(**PAIR, beta=0.1)
    buggy = softplus(-(0.1 * 1.0 - (-0.5)))
    assert buggy == pytest.approx(0.437488, abs=1e-6)
    assert abs(losses.item() - buggy) > 0.1
    assert losses.item() == pytest.approx(softplus(-0.1 * 1.5), abs=1e-12)


def test_dpo_sigmoid_gradient_wrt_chosen():
    # d/dpc [-log sigmoid(beta h)] = -beta * sigmoid(-beta h) = -0.1 / (1 + e^0.15) = -0.0462570
    chosen = t(-1.0).requires_grad_()
    losses, _ = dpo_loss(
        chosen, PAIR["rejected_logps"], PAIR["ref_chosen_logps"], PAIR["ref_rejected_logps"], beta=0.1
    )
    losses.sum().backward()
    assert chosen.grad.item() == pytest.approx(-0.1 / (1 + math.exp(0.15)), abs=1e-12)
    assert chosen.grad.item() == pytest.approx(-0.0462570, abs=1e-6)


def test_dpo_policy_equal_reference_gives_log2_and_zero_rewards():
    logps = torch.tensor([-3.0, -10.0, -0.5])
    rejected = torch.tensor([-4.0, -1.0, -7.0])
    losses, metrics = dpo_loss(logps, rejected, logps.clone(), rejected.clone(), beta=0.3)
    torch.testing.assert_close(losses, torch.full((3,), math.log(2)))
    assert torch.equal(metrics["chosen_rewards"], torch.zeros(3))
    assert torch.equal(metrics["rejected_rewards"], torch.zeros(3))


def test_dpo_conservative_label_smoothing():
    # eps = 0.1: 0.9 * log(1 + e^-0.15) + 0.1 * log(1 + e^0.15)
    #          = 0.9 * 0.620957 + 0.1 * 0.770957 = 0.558861 + 0.077096 = 0.635957
    losses, _ = dpo_loss(**PAIR, beta=0.1, label_smoothing=0.1)
    assert losses.item() == pytest.approx(0.9 * softplus(-0.15) + 0.1 * softplus(0.15), abs=1e-12)
    assert losses.item() == pytest.approx(0.635957, abs=1e-6)


def test_dpo_robust():
    # eps = 0.1: (0.9 * log(1 + e^-0.15) - 0.1 * log(1 + e^0.15)) / (1 - 0.2)
    #          = (0.558861 - 0.077096) / 0.8 = 0.481766 / 0.8 = 0.602207
    losses, _ = dpo_loss(**PAIR, beta=0.1, loss_type="robust", label_smoothing=0.1)
    assert losses.item() == pytest.approx((0.9 * softplus(-0.15) - 0.1 * softplus(0.15)) / 0.8, abs=1e-12)
    assert losses.item() == pytest.approx(0.602207, abs=1e-6)
    # with eps = 0 it is plain DPO
    plain, _ = dpo_loss(**PAIR, beta=0.1, loss_type="robust")
    assert plain.item() == pytest.approx(softplus(-0.15), abs=1e-12)


def test_dpo_hinge():
    # pair 1: relu(1 - 0.15) = 0.85
    # pair 2: pc - rc = 0, pr - rr = -20 -> h = 20, logits = 2 -> relu(1 - 2) = 0
    # pair 3: policy == reference -> logits 0 -> relu(1) = 1
    losses, _ = dpo_loss(
        t(-1.0, 0.0, -4.0), t(-3.0, -20.0, -5.0), t(-2.0, 0.0, -4.0), t(-2.5, 0.0, -5.0), beta=0.1, loss_type="hinge"
    )
    assert losses.tolist() == pytest.approx([0.85, 0.0, 1.0], abs=1e-12)


def test_dpo_ipo():
    # (h - 1 / (2 beta))^2 = (1.5 - 1 / 0.2)^2 = (1.5 - 5)^2 = 12.25
    losses, metrics = dpo_loss(**PAIR, beta=0.1, loss_type="ipo")
    assert losses.item() == pytest.approx(12.25, abs=1e-12)
    assert metrics["logits"].item() == pytest.approx(0.15)


def test_dpo_matches_plain_reference_on_random_pairs():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(8, generator=g, dtype=torch.float64) * 5 for _ in range(4))
    beta, eps = 0.25, 0.2
    losses, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="sigmoid", label_smoothing=eps)
    for i in range(8):
        z = beta * ((pc[i] - rc[i]) - (pr[i] - rr[i])).item()
        expected = (1 - eps) * softplus(-z) + eps * softplus(z)
        assert losses[i].item() == pytest.approx(expected, abs=1e-10)


def test_dpo_validation():
    with pytest.raises(ValueError, match="sigmoid, robust, hinge, ipo"):
        dpo_loss(**PAIR, loss_type="kto")
    with pytest.raises(ValueError, match="0.5"):
        dpo_loss(**PAIR, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(**PAIR, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(**PAIR, beta=0.0)
    with pytest.raises(ValueError, match="shapes must match"):
        dpo_loss(t(1.0, 2.0), t(1.0), t(1.0), t(1.0))


def test_sft_loss_is_per_token_nll():
    # -(-6) / 3 = 2; -(-3) / 2 = 1.5; an empty completion (sum 0, count 0) gives 0
    losses = sft_loss(torch.tensor([-6.0, -3.0, 0.0]), torch.tensor([3, 2, 0]))
    assert losses.tolist() == [2.0, 1.5, 0.0]


# ------------------------------------------------------------------------------------ group advantages
# rewards [1, 2, 3 | 4, 4, 4], G = 3
#   group 1: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1  -> advantages (-1, 0, 1) / (1 + eps)
#   group 2: mean 4, std 0                                    -> advantages 0
#   batch std: mean 3, squares 4 + 1 + 0 + 1 + 1 + 1 = 8, 8 / 5 = 1.6 -> sqrt(1.6) = 1.264911
REWARDS = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0, 4.0])


def test_group_advantages_group_scaling():
    adv, metrics = group_advantages(REWARDS, 3, eps=1e-4)
    expected = [-1 / 1.0001, 0.0, 1 / 1.0001, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert metrics["reward"].item() == pytest.approx(3.0)  # 18 / 6
    assert metrics["reward_std"].item() == pytest.approx(0.5)  # (1 + 0) / 2
    assert metrics["frac_reward_zero_std"].item() == 0.5  # one group of two


def test_group_advantages_batch_and_none_scaling():
    adv, _ = group_advantages(REWARDS, 3, scale_rewards="batch", eps=1e-4)
    s = math.sqrt(1.6) + 1e-4
    assert adv.tolist() == pytest.approx([-1 / s, 0.0, 1 / s, 0.0, 0.0, 0.0], abs=1e-6)
    adv, _ = group_advantages(REWARDS, 3, scale_rewards="none")
    assert adv.tolist() == [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_group_advantages_match_plain_python():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(12, generator=g, dtype=torch.float64)
    adv, metrics = group_advantages(rewards, 4, eps=1e-4)
    values = rewards.tolist()
    stds = []
    for start in range(0, 12, 4):
        group = values[start : start + 4]
        mean, std = statistics.fmean(group), statistics.stdev(group)  # stdev: n - 1, like torch.std
        stds.append(std)
        for i, r in enumerate(group):
            assert adv[start + i].item() == pytest.approx((r - mean) / (std + 1e-4), abs=1e-10)
    assert metrics["reward_std"].item() == pytest.approx(statistics.fmean(stds), abs=1e-12)
    assert metrics["frac_reward_zero_std"].item() == 0.0


def test_group_advantages_zero_std_detects_equal_floats_that_do_not_average_exactly():
    adv, metrics = group_advantages(torch.full((3,), 0.1), 3)
    assert metrics["frac_reward_zero_std"].item() == 1.0
    assert adv.abs().max().item() < 1e-6


def test_group_advantages_validation():
    with pytest.raises(ValueError, match="not divisible by num_generations"):
        group_advantages(torch.zeros(7), 3)
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(torch.zeros(6), 3, scale_rewards="global")
    with pytest.raises(ValueError, match=">= 2"):
        group_advantages(torch.zeros(6), 1)


# --------------------------------------------------------------------------------------------- GRPO
# The 2 x 3 example: advantages A = (1, -2), mask [[1, 1, 0], [1, 1, 1]] (5 completion tokens).
A = torch.tensor([1.0, -2.0], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
LOGPS = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]], dtype=torch.float64)


@pytest.mark.parametrize(
    "loss_type, normalizer, expected",
    [
        # ratio 1, per-token loss -A: row 0 (-1, -1, pad), row 1 (2, 2, 2); masked sum -2 + 6 = 4
        ("grpo", None, 0.5),  # sequence means (-1, 2), sum 1, / B = 2
        ("grpo", 4, 0.25),  # 1 / 4
        ("bnpo", None, 0.8),  # 4 / 5 tokens
        ("bnpo", 100, 0.8),  # normalizer ignored
        ("dr_grpo", None, 0.5),  # 4 / (2 * max_completion_length 4)
        ("dapo", None, 0.8),  # 4 / 5 tokens
        ("dapo", 10, 0.4),  # 4 / 10
    ],
)
def test_grpo_loss_types_ratio_one(loss_type, normalizer, expected):
    objective = GRPOObjective(loss_type=loss_type, max_completion_length=4)
    loss, metrics = grpo_loss(LOGPS, A, MASK, objective, normalizer=normalizer)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["clip_ratio/region_mean"].item() == 0.0
    assert "kl" not in metrics


def _clipped_example():
    # ratios r = [[1.5, 0.5, pad], [1.5, 0.5, 1.1]], eps 0.2 -> clip range [0.8, 1.2]; A = (1, -2)
    ratios = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.1]], dtype=torch.float64)
    logps = LOGPS.clone().requires_grad_()
    old = LOGPS - torch.log(ratios)
    old[0, 2] = float("inf")  # padding may hold anything
    return logps, old


def test_grpo_clipped_ratio_with_old_logps():
    logps, old = _clipped_example()
    # row 0, A = 1:  r 1.5: -min(1.5, 1.2) = -1.2 (clipped high)   r 0.5: -min(0.5, 0.8) = -0.5
    # row 1, A = -2: r 1.5: -min(-3, -2.4) = 3    r 0.5: -min(-1, -1.6) = 1.6 (clipped low)
    #                r 1.1: -min(-2.2, -2.2) = 2.2
    # sum = -1.2 - 0.5 + 3 + 1.6 + 2.2 = 5.1
    loss, metrics = grpo_loss(logps, A, MASK, GRPOObjective(loss_type="dapo"), old_logps=old)
    assert loss.item() == pytest.approx(5.1 / 5, abs=1e-12)
    assert metrics["clip_ratio/low_mean"].item() == pytest.approx(1 / 5)
    assert metrics["clip_ratio/high_mean"].item() == pytest.approx(1 / 5)
    assert metrics["clip_ratio/region_mean"].item() == pytest.approx(2 / 5)
    # grpo: row means -1.7 / 2 = -0.85 and 6.8 / 3 = 2.266667; (-0.85 + 2.266667) / 2 = 0.708333
    loss, _ = grpo_loss(logps, A, MASK, GRPOObjective(loss_type="grpo"), old_logps=old)
    assert loss.item() == pytest.approx((-0.85 + 6.8 / 3) / 2, abs=1e-12)
    # gradient: clipped tokens get none; elsewhere d(-r A)/dlogp = -r A / 5
    loss, _ = grpo_loss(logps, A, MASK, GRPOObjective(loss_type="dapo"), old_logps=old)
    loss.backward()
    expected = torch.tensor([[0.0, -0.5 / 5, 0.0], [3.0 / 5, 0.0, 2.2 / 5]], dtype=torch.float64)
    torch.testing.assert_close(logps.grad, expected)


def test_grpo_asymmetric_clip_higher():
    logps, old = _clipped_example()
    # epsilon_high 0.6: r = 1.5 with A = 1 is no longer clipped: -1.5 instead of -1.2 -> sum 4.8
    loss, metrics = grpo_loss(logps, A, MASK, GRPOObjective(epsilon_high=0.6), old_logps=old)
    assert loss.item() == pytest.approx(4.8 / 5, abs=1e-12)
    assert metrics["clip_ratio/high_mean"].item() == 0.0


def test_kl_k3_hand_values():
    # delta = ref - logp; k3 = e^delta - delta - 1
    # delta = -1: e^-1 = 0.367879;  delta = 0.5: e^0.5 - 1.5 = 0.148721;  delta = 0: 0
    kl = kl_k3(t(-1.0, -2.0, -3.0), t(-2.0, -1.5, -3.0))
    assert kl.tolist() == pytest.approx([math.exp(-1), math.exp(0.5) - 1.5, 0.0], abs=1e-12)
    assert kl.tolist() == pytest.approx([0.367879, 0.148721, 0.0], abs=1e-6)


def test_grpo_kl_term_and_metric():
    # ref - logps: row 0 (-1, 0.5, pad), row 1 (0, 0, 0) -> k3 (0.367879, 0.148721, -, 0, 0, 0)
    ref = LOGPS + torch.tensor([[-1.0, 0.5, 99.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    kl_sum = math.exp(-1) + math.exp(0.5) - 1.5
    loss, metrics = grpo_loss(LOGPS, A, MASK, GRPOObjective(beta=0.1, loss_type="dapo"), ref_logps=ref)
    assert metrics["kl"].item() == pytest.approx(kl_sum / 5, abs=1e-12)
    assert loss.item() == pytest.approx((4 + 0.1 * kl_sum) / 5, abs=1e-12)


def test_grpo_ratio_one_gradient_is_reinforce():
    g = torch.Generator().manual_seed(2)
    logps = (-torch.rand(4, 6, generator=g, dtype=torch.float64) * 3).requires_grad_()
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=g) > 0.3).long()
    loss, _ = grpo_loss(logps, adv, mask, GRPOObjective(loss_type="dapo"), normalizer=30)
    loss.backward()
    torch.testing.assert_close(logps.grad, -adv[:, None] * mask / 30)


def _reference_grpo(
    logps, old, ref, adv, mask, beta, eps_low, eps_high, loss_type, normalizer, length, bias_correction=True
):
    """Token-by-token plain-Python version of the documented formula (the k3 term times r when bias-corrected)."""
    B, T = len(logps), len(logps[0])
    per_seq, total, count = [], 0.0, 0
    for b in range(B):
        seq = 0.0
        n = sum(mask[b][j] for j in range(T))
        for j in range(T):
            if not mask[b][j]:
                continue
            r = math.exp(logps[b][j] - old[b][j])
            a = adv[b]
            value = -min(r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a)
            d = ref[b][j] - logps[b][j]
            value += beta * (math.exp(d) - d - 1) * (r if bias_correction else 1.0)
            seq += value
        per_seq.append(seq / max(n, 1))
        total += seq
        count += n
    if loss_type == "grpo":
        return sum(per_seq) / (normalizer or B)
    if loss_type == "bnpo":
        return total / count
    if loss_type == "dr_grpo":
        return total / (B * length)
    return total / (normalizer or count)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_matches_plain_reference(loss_type, bias_correction):
    g = torch.Generator().manual_seed(3)
    logps = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    old = logps + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.3
    ref = logps + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    objective = GRPOObjective(
        loss_type=loss_type,
        beta=0.05,
        epsilon_low=0.1,
        epsilon_high=0.25,
        use_bias_correction_kl=bias_correction,
        max_completion_length=7,
    )
    loss, _ = grpo_loss(logps, adv, mask, objective, old_logps=old, ref_logps=ref)
    expected = _reference_grpo(
        logps.tolist(),
        old.tolist(),
        ref.tolist(),
        adv.tolist(),
        mask.tolist(),
        0.05,
        0.1,
        0.25,
        loss_type,
        None,
        7,
        bias_correction,
    )
    assert loss.item() == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_grpo_gradient_accumulation_matches_big_batch(loss_type):
    # The documented normalizers make two micro-batches of 2 give the gradient of one batch of 4.
    g = torch.Generator().manual_seed(4)
    logps = (-torch.rand(4, 5, generator=g, dtype=torch.float64)).requires_grad_()
    old = logps.detach() + torch.randn(4, 5, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    objective = GRPOObjective(loss_type=loss_type, max_completion_length=5)
    full, _ = grpo_loss(logps, adv, mask, objective, old_logps=old)
    (full_grad,) = torch.autograd.grad(full, logps)
    normalizer = {"grpo": 4, "dapo": int(mask.sum()), "dr_grpo": None}[loss_type]
    accumulated = torch.zeros_like(logps)
    for rows in (slice(0, 2), slice(2, 4)):
        part, _ = grpo_loss(logps[rows], adv[rows], mask[rows], objective, old_logps=old[rows], normalizer=normalizer)
        if loss_type == "dr_grpo":
            part = part / 2  # the caller divides by the number of micro-steps
        accumulated += torch.autograd.grad(part, logps)[0]
    torch.testing.assert_close(accumulated, full_grad)


def test_grpo_empty_mask_gives_zero_not_nan():
    loss, metrics = grpo_loss(LOGPS, A, torch.zeros(2, 3), GRPOObjective(loss_type="dapo"))
    assert loss.item() == 0.0
    assert metrics["clip_ratio/region_mean"].item() == 0.0


def test_grpo_objective_is_checked_once_when_built():
    with pytest.raises(ValueError, match="grpo, bnpo, dr_grpo, dapo"):
        GRPOObjective(loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        GRPOObjective(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="epsilon"):
        GRPOObjective(epsilon_low=1.0)
    objective = GRPOObjective(loss_type="sapo")
    assert objective.aggregation == "grpo" and GRPOObjective().loss_type == "dapo"
    with pytest.raises(dataclasses.FrozenInstanceError):
        objective.beta = 0.1  # a setting changes by building another objective, which checks it again
    with pytest.raises(TypeError, match="GRPOObjective"):
        grpo_loss(LOGPS, A, MASK, {"loss_type": "dapo"})


def test_grpo_validation():
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(LOGPS, A, MASK, GRPOObjective(beta=0.1))
    with pytest.raises(ValueError, match="shorter"):
        grpo_loss(LOGPS, A, MASK, GRPOObjective(loss_type="dr_grpo", max_completion_length=2))
    with pytest.raises(ValueError, match="shapes must match"):
        grpo_loss(LOGPS, A, MASK[:, :2], GRPOObjective())
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(LOGPS, A[:1], MASK, GRPOObjective())
    with pytest.raises(ValueError, match="normalizer"):
        grpo_loss(LOGPS, A, MASK, GRPOObjective(), normalizer=0)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        grpo_loss(LOGPS[0], A, MASK[0], GRPOObjective())


# ------------------------------------------------------------------ the objective table (issue 17), by hand
def sigmoid(x):
    return 1 / (1 + math.exp(-x))


# PAIR with 2 chosen and 4 rejected tokens: chosen log-ratio 1, rejected -0.5, beta 0.1.
COUNTS = dict(chosen_counts=t(2.0), rejected_counts=t(4.0))
DPO_HAND = {
    # per-token means: 1/2 - (-0.5/4) = 0.625 -> -log sigmoid(0.0625)
    "sigmoid_norm": softplus(-0.0625),
    "apo_zero": 1 - sigmoid(0.1) + sigmoid(-0.05),  # 0.462537...
    "apo_down": sigmoid(0.1) + 1 - sigmoid(0.15),
    "bco_pair": softplus(-0.1) + softplus(-0.05),  # -log s(b*1) - log s(-b*(-0.5))
    "sppo_hard": (1 - 5) ** 2 + (-0.5 + 5) ** 2,  # 36.25
    "nca_pair": softplus(-0.1) + 0.5 * softplus(0.1) + 0.5 * softplus(-0.05),
    "discopop": softplus(-0.15) * (1 - sigmoid(3)) + math.exp(-0.15) * sigmoid(3),  # tau 0.05: z / tau = 3
    "aot": softplus(-0.15),  # one pair: sorting changes nothing, (pc - pr) - (rc - rr) = 1.5
    "sft": 0.5,  # -pc / 2 chosen tokens
}


@pytest.mark.parametrize("loss_type", list(DPO_HAND))
def test_dpo_table_hand_values(loss_type):
    losses, metrics = dpo_loss(**PAIR, **COUNTS, beta=0.1, loss_type=loss_type)
    assert losses.item() == pytest.approx(DPO_HAND[loss_type], abs=1e-12)
    assert metrics["chosen_rewards"].item() == pytest.approx(0.1)  # always beta * summed log-ratio


def test_dpo_exo_pair_hand_value():
    eps, z = 1e-3, 0.15
    expected = sigmoid(z) * (-softplus(-z) - math.log(1 - eps)) + sigmoid(-z) * (-softplus(z) - math.log(eps))
    losses, _ = dpo_loss(**PAIR, beta=0.1, loss_type="exo_pair", label_smoothing=eps)
    assert losses.item() == pytest.approx(expected, abs=1e-12)


def test_dpo_loss_list_with_weights_is_the_weighted_sum():  # MPO
    losses, _ = dpo_loss(**PAIR, **COUNTS, beta=0.1, loss_type=["sigmoid", "sft"], loss_weights=[0.8, 0.2])
    assert losses.item() == pytest.approx(0.8 * softplus(-0.15) + 0.2 * 0.5, abs=1e-12)
    unweighted, _ = dpo_loss(**PAIR, **COUNTS, beta=0.1, loss_type=["sigmoid", "sppo_hard"])
    assert unweighted.item() == pytest.approx(softplus(-0.15) + 36.25, abs=1e-12)


def test_dpo_f_divergence_forward_kl():
    # f'(t) = 1 - 1/t: chosen 1 - e^-1 = 0.632121, rejected 1 - e^0.5 = -0.648721 -> z = 0.1 * 1.280842
    losses, metrics = dpo_loss(**PAIR, beta=0.1, f_divergence_type="forward_kl")
    z = 0.1 * ((1 - math.exp(-1)) - (1 - math.exp(0.5)))
    assert losses.item() == pytest.approx(softplus(-z), abs=1e-12)
    assert metrics["logits"].item() == pytest.approx(z, abs=1e-12)


def test_ld_token_weights_and_wpo_weights_by_hand():
    from treadle.losses import ld_token_weights, wpo_weights

    chosen = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])  # 3 and 2 tokens (prompt/padding 0)
    rejected = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])  # 2 and 4 tokens
    c, r = ld_token_weights(chosen, rejected, 0.25)
    assert c.tolist() == [[0, 1, 1, 0.25, 0], [1, 1, 0, 0, 0]]
    assert r.tolist() == [[1, 1, 0, 0, 0], [1, 1, 0.25, 0.25, 0]]
    assert wpo_weights(t(-0.5), t(-1.0)).item() == pytest.approx(math.exp(-1.5))


def test_dpo_table_validation():
    with pytest.raises(ValueError, match="loss_weights has 1 entries for 2"):
        dpo_loss(**PAIR, loss_type=["sigmoid", "ipo"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="exo_pair.*1e-3"):
        dpo_loss(**PAIR, loss_type="exo_pair")
    with pytest.raises(ValueError, match="f_divergence_type='js_divergence' works only"):
        dpo_loss(**PAIR, loss_type="bco_pair", f_divergence_type="js_divergence")
    with pytest.raises(ValueError, match="both chosen_counts and rejected_counts"):
        dpo_loss(**PAIR, loss_type="ipo", chosen_counts=t(1.0))
    # a list where one loss uses label_smoothing accepts it; hinge alone refuses it
    dpo_loss(**PAIR, loss_type=["robust", "hinge"], label_smoothing=0.1)


def test_bradley_terry_loss_by_hand():
    from treadle.losses import bradley_terry_loss

    losses = bradley_terry_loss(t(1.0, 0.5), t(0.0, 1.5), margin=t(0.5, 0.0), center_rewards_coefficient=0.01)
    # pair 0: -log s(1 - 0 - 0.5) + 0.01 * 1^2; pair 1: -log s(-1) + 0.01 * 2^2
    assert losses.tolist() == pytest.approx([softplus(-0.5) + 0.01, softplus(1.0) + 0.04], abs=1e-12)


def test_rloo_leave_one_out_advantages():
    adv, _ = group_advantages(t(1.0, 0.0, 2.0), 3, scale_rewards="none", advantage_estimator="rloo")
    # baselines (0 + 2)/2 = 1, (1 + 2)/2 = 1.5, (1 + 0)/2 = 0.5
    assert adv.tolist() == pytest.approx([0.0, -1.5, 1.5])
    grpo, _ = group_advantages(t(1.0, 0.0, 2.0), 3, scale_rewards="none")
    torch.testing.assert_close(adv, grpo * 3 / 2)  # G/(G-1) times the group-mean advantage
    with pytest.raises(ValueError, match="advantage_estimator"):
        group_advantages(t(1.0, 0.0), 2, advantage_estimator="ppo")


def test_decoupled_advantages_gdpo_by_hand():
    from treadle.losses import decoupled_advantages

    rewards = t(1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0).view(4, 2)  # (N=4, F=2), G = 2: f0 1,0,1,1; f1 0,1,0,0
    # group 0: f0 (1, 0) -> +-0.5/(s + eps), f1 (0, 1) -> -+0.5/(s + eps) with s = sqrt(0.5); weights (1, 2)
    # group 1: constant -> 0. Sums: -u, u, 0, 0 with u = 0.5/(s + eps); then (x - 0)/(std + eps)
    u = 0.5 / (math.sqrt(0.5) + 1e-4)
    sums = [-u, u, 0.0, 0.0]
    std = statistics.stdev(sums)
    adv = decoupled_advantages(rewards, [1.0, 2.0], 2)
    assert adv.tolist() == pytest.approx([x / (std + 1e-4) for x in sums], abs=1e-12)


def test_gspo_sequence_level_ratio():
    logps, old = _clipped_example()
    r0, r1 = math.sqrt(0.75), 0.825 ** (1 / 3)  # exp of the mean log-ratio of each row; both inside [0.8, 1.2]
    loss, metrics = grpo_loss(logps, A, MASK, GRPOObjective(importance_sampling_level="sequence"), old_logps=old)
    assert loss.item() == pytest.approx((2 * -r0 + 3 * 2 * r1) / 5, abs=1e-12)
    loss, _ = grpo_loss(
        logps, A, MASK, GRPOObjective(importance_sampling_level="sequence", loss_type="grpo"), old_logps=old
    )
    assert loss.item() == pytest.approx((-r0 + 2 * r1) / 2, abs=1e-12)
    assert metrics["clip_ratio/region_mean"].item() == 0.0


def test_two_sided_clip_delta():
    logps, old = _clipped_example()
    # delta 1.4 caps r = 1.5 of the A = -2 row: -min(-2.8, -2.4) = 2.8 instead of 3 -> sum 5.1 - 0.2
    loss, _ = grpo_loss(logps, A, MASK, GRPOObjective(delta=1.4), old_logps=old)
    assert loss.item() == pytest.approx(4.9 / 5, abs=1e-12)


def test_cispo_by_hand():
    logps, old = _clipped_example()
    # w = min(r, 1.2), no gradient: row 0 (1.2, 0.5), row 1 (1.2, 0.5, 1.1); per token -w A logp:
    # 1.2, 1.0 | -1.2, -1.5, -5.5 -> sum -6.0 over 5 tokens
    loss, metrics = grpo_loss(logps, A, MASK, GRPOObjective(loss_type="cispo", epsilon_high=1.2), old_logps=old)
    assert loss.item() == pytest.approx(-6.0 / 5, abs=1e-12)
    assert metrics["cispo_clip_ratio"].item() == pytest.approx(1 / 5)  # r 1.5 > 1.2 with A > 0
    loss.backward()
    expected = torch.tensor([[-1.2, -0.5, 0.0], [2.4, 1.0, 2.2]], dtype=torch.float64) / 5  # -w A / 5
    torch.testing.assert_close(logps.grad, expected)


def test_sapo_by_hand():
    logps, old = _clipped_example()
    row0 = [-sigmoid(r - 1) * 4 for r in (1.5, 0.5)]  # tau_pos 1, A = 1
    row1 = [2 * sigmoid(1.05 * (r - 1)) * 4 / 1.05 for r in (1.5, 0.5, 1.1)]  # tau_neg 1.05, A = -2
    loss, _ = grpo_loss(logps, A, MASK, GRPOObjective(loss_type="sapo"), old_logps=old)
    assert loss.item() == pytest.approx((sum(row0) / 2 + sum(row1) / 3) / 2, abs=1e-12)  # grpo aggregation


def test_top_entropy_quantile_keeps_the_high_entropy_tokens():
    entropies = t(0.1, 0.9, 9.0, 0.5, 0.3, 0.7).view(2, 3)  # 9.0 is padding
    # completion-token entropies (0.1, 0.9, 0.5, 0.3, 0.7): the 0.6 quantile is 0.58 -> keep 0.9 and 0.7
    loss, _ = grpo_loss(LOGPS, A, MASK, GRPOObjective(top_entropy_quantile=0.4), entropies=entropies)
    assert loss.item() == pytest.approx((-1 + 2) / 5, abs=1e-12)  # ratio 1: per-token -A; still / 5 tokens
    with pytest.raises(ValueError, match="needs entropies"):
        grpo_loss(LOGPS, A, MASK, GRPOObjective(top_entropy_quantile=0.4))


def test_off_policy_mask_drops_drifted_negative_sequences():
    logps, old = _clipped_example()
    # mean(old - logp): row 0 -ln(0.75)/2 = 0.144 (A > 0: kept), row 1 -ln(0.825)/3 = 0.064 (A < 0)
    kept, _ = grpo_loss(logps, A, MASK, GRPOObjective(off_policy_mask_threshold=0.1), old_logps=old)
    assert kept.item() == pytest.approx(5.1 / 5, abs=1e-12)
    dropped, _ = grpo_loss(logps, A, MASK, GRPOObjective(off_policy_mask_threshold=0.05), old_logps=old)
    assert dropped.item() == pytest.approx(-1.7 / 5, abs=1e-12)  # row 1 gone, normaliser unchanged


@pytest.mark.parametrize("bias_correction", [True, False])
def test_bias_corrected_kl_gradient(bias_correction):
    # A = 0, on-policy: only the KL term. d = ref - logp. Corrected: d(r k3)/dlogp = k3 + 1 - e^d = -d;
    # plain: 1 - e^d. Both times beta / 5 tokens. The value is the same (r = 1).
    logps = LOGPS.clone().requires_grad_()
    ref = LOGPS + t(-1.0, 0.5, 0.0, 0.0, 0.3, -0.2).view(2, 3)
    loss, metrics = grpo_loss(
        logps,
        torch.zeros(2, dtype=torch.float64),
        MASK,
        GRPOObjective(beta=0.1, use_bias_correction_kl=bias_correction),
        ref_logps=ref,
    )
    d = (ref - LOGPS) * MASK
    assert loss.item() == pytest.approx(0.1 * float(((torch.exp(d) - d - 1) * MASK).sum()) / 5, abs=1e-12)
    loss.backward()
    expected = (-d if bias_correction else 1 - torch.exp(d)) * MASK * 0.1 / 5
    torch.testing.assert_close(logps.grad, expected)


def test_grpo_table_validation():
    with pytest.raises(ValueError, match="importance_sampling_level"):
        GRPOObjective(importance_sampling_level="batch")
    with pytest.raises(ValueError, match="delta"):
        GRPOObjective(delta=0.9)
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        GRPOObjective(top_entropy_quantile=1.5)
    with pytest.raises(ValueError, match="sapo_temperature"):
        GRPOObjective(loss_type="sapo", sapo_temperature_neg=0.0)
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        GRPOObjective(off_policy_mask_threshold=-1.0)
