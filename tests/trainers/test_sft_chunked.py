"""SFT's chunked loss (logprobs.chunked_nll through SFTTrainer.compute_loss): where the logits are large it gives
the full-logits loss, gradients and token accuracy without building them; small logits keep the model's own
loss; a whole run trains the same either way."""

import copy

import pytest
import torch
from _factories import tiny_llama

from treadle import SFTConfig, SFTTrainer
from treadle.logprobs.logsoftmax import chunked_nll
from treadle.logprobs.tokens import SMALL_LOGITS
from treadle.trainers import sft
from treadle.trainers.sft import token_accuracy_counts

VOCAB = 8192  # 4 rows x 48 tokens x 8192 = 1.6M logits > SMALL_LOGITS: the chunked path


def rows(n=8, seed=0, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 30 + 2 * i
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        mask = [0] * 10 + [1] * (length - 10)  # the first 10 tokens are the prompt: no loss there
        out.append({"input_ids": ids, "completion_mask": mask})
    return out


def trainer(tmp_path, model=None, **kw):
    args = dict(
        output_dir=str(tmp_path),
        disable_tqdm=True,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_length=48,
    )
    model = model if model is not None else tiny_llama(vocab_size=VOCAB)
    return SFTTrainer(model, SFTConfig(**{**args, **kw}), train_dataset=rows(vocab=model.config.vocab_size))


def batch_of(t: SFTTrainer) -> dict:
    return next(iter(t.get_train_dataloader()))


def test_chunked_nll_matches_cross_entropy_and_argmax():
    torch.manual_seed(0)
    hidden, weight = torch.randn(50, 16, dtype=torch.float64), torch.randn(300, 16, dtype=torch.float64)
    labels = torch.randint(0, 300, (50,))
    labels[::7] = -100
    nll, correct = chunked_nll(hidden, weight, labels, chunk_size=8)
    logits = hidden @ weight.T
    expected = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    assert torch.allclose(nll, expected, rtol=1e-12)
    valid = labels != -100
    assert int(correct) == int((logits.argmax(-1).eq(labels) & valid).sum())


@pytest.mark.parametrize("frozen_head", [False, True])
def test_chunked_nll_gradients_are_cross_entropys_scaled_by_the_upstream_gradient(frozen_head):
    """The kernel computes its gradients in the forward pass: they must equal autograd's through the full logits,
    for any upstream scale, with a bias, across chunks, with ignored rows, and none for a frozen head."""
    torch.manual_seed(1)
    hidden = torch.randn(37, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.float64, requires_grad=not frozen_head)
    bias = torch.randn(50, dtype=torch.float64, requires_grad=not frozen_head)
    labels = torch.randint(0, 50, (37,))
    labels[3::5] = -100
    nll, _ = chunked_nll(hidden, weight, labels, bias=bias, chunk_size=6)
    (nll * 3.5).backward()
    ours = [t.grad.clone() if t.grad is not None else None for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    expected = torch.nn.functional.cross_entropy(hidden @ weight.T + bias, labels, reduction="sum")
    (expected * 3.5).backward()
    assert torch.allclose(nll, expected, rtol=1e-12)
    for mine, theirs in zip(ours, (hidden.grad, weight.grad, bias.grad), strict=True):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert torch.allclose(mine, theirs, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # evaluation: no gradient work (no mm into a gradient), the same numbers
        with torch.profiler.profile() as prof:
            again = chunked_nll(hidden, weight, labels, bias=bias, chunk_size=6)[0]
    assert torch.equal(again, nll.detach())
    assert not any(e.name in ("aten::mm", "aten::addmm_") for e in prof.events())  # F.linear is aten::addmm


@pytest.mark.parametrize("num_items", [None, 97])
@pytest.mark.parametrize("packing", [False, True])
def test_the_chunked_loss_equals_the_full_logits_loss(tmp_path, num_items, packing):
    t = trainer(tmp_path, packing=packing)
    batch = batch_of(t)
    assert batch["labels"].numel() * VOCAB > SMALL_LOGITS
    assert ("position_ids" in batch) == packing
    model = t.model
    chunked = t.compute_loss(model, batch, num_items_in_batch=num_items)
    chunked.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    accuracy = t.metrics.reduce("train")["mean_token_accuracy"]  # reduce empties the window
    model.zero_grad(set_to_none=True)
    full, outputs = t.compute_loss(model, batch, return_outputs=True, num_items_in_batch=num_items)
    full.backward()
    assert torch.allclose(chunked, full, rtol=1e-5, atol=0), (chunked.item(), full.item())
    for g, p in zip(grads, model.parameters(), strict=True):
        assert torch.allclose(g, p.grad, rtol=1e-4, atol=1e-7)
    correct, total = token_accuracy_counts(outputs.logits, batch["labels"])
    assert accuracy[1] == total.item() and accuracy[0] == correct.item()


def test_the_chunked_path_builds_no_full_logits(tmp_path, monkeypatch):
    """The model runs with logits_to_keep=1 (one position's logits) and chunked_nll gets the label rows only."""
    t = trainer(tmp_path)
    batch = batch_of(t)
    seen = {}
    real = sft.chunked_nll

    def spy(hidden, weight, labels, **kw):
        seen["rows"] = hidden.shape[0]
        return real(hidden, weight, labels, **kw)

    monkeypatch.setattr(sft, "chunked_nll", spy)
    shapes = []
    handle = t.model.register_forward_hook(lambda _m, _a, out: shapes.append(tuple(out.logits.shape)))
    t.compute_loss(t.model, batch)
    handle.remove()
    assert shapes == [(batch["input_ids"].shape[0], 1, VOCAB)]
    assert seen["rows"] == int((batch["labels"][:, 1:] != -100).sum())


def test_small_logits_keep_the_models_own_loss(tmp_path, monkeypatch):
    t = trainer(tmp_path, model=tiny_llama(vocab_size=64))
    monkeypatch.setattr(sft, "chunked_nll", lambda *a, **k: pytest.fail("chunked on a few KB of logits"))
    t.compute_loss(t.model, batch_of(t))


def test_a_run_trains_the_same_with_and_without_the_chunked_loss(tmp_path, monkeypatch):
    model = tiny_llama(vocab_size=VOCAB)
    chunked = trainer(tmp_path / "a", model=copy.deepcopy(model))
    chunked.train()
    monkeypatch.setattr(SFTTrainer, "_chunked_loss", lambda *a: None)
    full = trainer(tmp_path / "b", model=model)
    full.train()
    for name in ("loss", "mean_token_accuracy", "grad_norm"):
        a = [h[name] for h in chunked.state.log_history if "loss" in h]
        b = [h[name] for h in full.state.log_history if "loss" in h]
        assert len(a) == 3 and a == pytest.approx(b, rel=1e-4), name
    losses = [h["loss"] for h in chunked.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]  # the model learned: the comparison is over steps that moved
