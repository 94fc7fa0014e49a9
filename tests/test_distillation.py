"""Distillation divergences: hand-computed numbers, a plain-PyTorch reference, the chunked form's values and
gradients, and TRL's DistillationTrainer loss on fixed completions (its chunked divergence) for beta 0, 0.5, 1 and
a temperature != 1."""

import math

import pytest
import torch

from treadle.losses import chunked_generalized_jsd, generalized_jsd


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_hand_numbers():
    p_s, p_t = [0.5, 0.5], [0.9, 0.1]
    student, teacher = torch.tensor([[0.0, 0.0]]), torch.log(torch.tensor([[0.9, 0.1]]))
    assert generalized_jsd(student, teacher, beta=0.0).item() == pytest.approx(kl(p_t, p_s), abs=1e-6)
    assert generalized_jsd(student, teacher, beta=1.0).item() == pytest.approx(kl(p_s, p_t), abs=1e-6)
    m = [0.5 * a + 0.5 * b for a, b in zip(p_s, p_t)]
    assert generalized_jsd(student, teacher, beta=0.5).item() == pytest.approx(0.5 * kl(p_t, m) + 0.5 * kl(p_s, m),
                                                                              abs=1e-6)
    # temperature 2 halves the logits of both before the softmax
    hot = generalized_jsd(student, teacher, beta=1.0, temperature=2.0).item()
    assert hot == pytest.approx(generalized_jsd(student / 2, teacher / 2, beta=1.0).item(), abs=1e-7)


def plain_gjsd(s_logits, t_logits, beta, temperature):
    """Probabilities written out, no log-space tricks."""
    ps = torch.softmax(s_logits / temperature, -1)
    pt = torch.softmax(t_logits / temperature, -1)
    if beta == 0:
        return (pt * (pt.log() - ps.log())).sum(-1)
    if beta == 1:
        return (ps * (ps.log() - pt.log())).sum(-1)
    m = (1 - beta) * ps + beta * pt
    return beta * (pt * (pt.log() - m.log())).sum(-1) + (1 - beta) * (ps * (ps.log() - m.log())).sum(-1)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_matches_plain_reference_and_gradient(beta):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(5, 11, generator=g, dtype=torch.float64)
    ours, theirs = generalized_jsd(s, t, beta=beta, temperature=1.7), plain_gjsd(s, t, beta, 1.7)
    torch.testing.assert_close(ours, theirs)
    (a,) = torch.autograd.grad(ours.sum(), s)
    (b,) = torch.autograd.grad(theirs.sum(), s)
    torch.testing.assert_close(a, b)


def test_bad_options_and_shared_vocabulary():
    z = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(z, z, beta=1.5)
    with pytest.raises(ValueError, match="shared vocabulary"):
        generalized_jsd(z, torch.zeros(1, 4))


def heads(seed=0, n=13, hs=6, ht=9, v=17):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, hs, generator=g, requires_grad=True), torch.randn(v, hs, generator=g, requires_grad=True),
            torch.randn(n, ht, generator=g), torch.randn(v, ht, generator=g))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_equals_whole(beta):
    hs, ws, ht, wt = heads()
    whole = generalized_jsd(hs @ ws.T, ht @ wt.T, beta=beta, temperature=0.7)
    chunked = chunked_generalized_jsd(hs, ws, ht, wt, beta=beta, temperature=0.7, chunk_size=4)
    torch.testing.assert_close(chunked, whole)
    grads_whole = torch.autograd.grad(whole.sum(), (hs, ws))
    grads_chunked = torch.autograd.grad(chunked.sum(), (hs, ws))
    for a, b in zip(grads_chunked, grads_whole):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_loss_on_fixed_completions_matches_trl(beta):
    trl_distill = pytest.importorskip("trl.trainer.distillation_trainer")
    hs, ws, ht, wt = heads(seed=1)
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0])
    n_items = 17  # the window's completion tokens (more than this micro-batch's: accumulation)
    theirs, _, _ = trl_distill._chunked_divergence_loss(hs[None], ht[None], ws, wt, mask[None], beta,
                                                        num_items_in_batch=n_items, temperature=1.5)
    per_token = chunked_generalized_jsd(hs, ws, ht, wt, beta=beta, temperature=1.5)
    ours = (per_token * mask).sum() / n_items
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=1e-5, rtol=1e-5)
    grad_theirs = torch.autograd.grad(theirs, (hs, ws))
    grad_ours = torch.autograd.grad(ours, (hs, ws))
    for a, b in zip(grad_ours, grad_theirs):
        torch.testing.assert_close(a, b.to(a.dtype), atol=1e-5, rtol=1e-4)
