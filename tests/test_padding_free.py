"""Padding-free forwards (``token_logps(padding_free=True)``, GRPO's and DPO's ``padding_free``): the rows of a
padded batch packed side by side give the same log-probs, losses and gradients as the padded forward, and as
each row run alone; models where packing would not be exact fall back to the padded forward."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from treadle.demos import toy
from treadle.logprobs.tokens import token_logps
from treadle.losses import DPO_LOSS_TYPES, GRPO_LOSS_TYPES
from treadle.packing import best_fit_bins, pack_padded_batch

TOL = dict(rtol=1e-5, atol=1e-5)


def tiny(tok, attn: str = "sdpa", seed: int = 0):
    model = toy.build_model("tiny", tokenizer=tok, seed=seed)
    model.config._attn_implementation = attn
    return model


def ragged_batch(prompt_lengths, completion_lengths, seed=0):
    """GRPO's layout: prompts left-padded to one width, completions right-padded to another; ids, mask, P."""
    g = torch.Generator().manual_seed(seed)
    width_p, width_c = max(prompt_lengths), max(completion_lengths)
    ids = torch.randint(8, 100, (len(prompt_lengths), width_p + width_c), generator=g)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        mask[i, width_p - p : width_p + c] = 1
    return ids.masked_fill(mask == 0, 0), mask, width_p


# ---- packing --------------------------------------------------------------------------------------------
def test_best_fit_bins_by_hand():
    assert best_fit_bins([5, 3, 4, 2, 8, 1], 8) == [[4], [0, 1], [2, 3, 5]]
    with pytest.raises(ValueError, match="more than max_length=4"):
        best_fit_bins([5], 4)


def test_pack_padded_batch_keeps_every_real_token_once_with_positions_restarting_per_row():
    ids, mask, _ = ragged_batch([5, 1, 3, 2], [2, 6, 1, 1])
    packed = pack_padded_batch(ids, mask)
    real = mask.bool()
    assert packed.input_ids.shape == (3, 7)  # rows of 7, 7, 4 and 3 tokens: [7], [7], [4 + 3]
    flat_ids, flat_pos = packed.input_ids.view(-1), packed.position_ids.view(-1)
    assert torch.equal(flat_ids[packed.index[real]], ids[real])
    assert torch.equal(flat_pos[packed.index[real]], (mask.cumsum(1) - 1)[real])
    assert len(set(packed.index[real].tolist())) == int(real.sum())  # no two tokens share a slot


# ---- token_logps ----------------------------------------------------------------------------------------
def rows_alone(model, ids, mask, start):
    """The independent reference: each row's real tokens run alone (no padding at all), plain log-softmax."""
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1 - start)
    for i in range(ids.shape[0]):
        cols = mask[i].nonzero().squeeze(1)
        logits = model(ids[i, cols][None], use_cache=False).logits[0, :-1]
        logps = torch.log_softmax(logits, -1).gather(1, ids[i, cols][1:, None]).squeeze(1)
        for k, col in enumerate(cols[1:].tolist()):
            if col > start:
                out[i, col - 1 - start] = logps[k]
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("fast", [True, False])
def test_log_probs_entropy_and_gradients_equal_the_padded_forward(tok, attn, fast, monkeypatch):
    if not fast:  # the models-without-the-hidden-state-seam path: full logits, then selective_log_softmax
        monkeypatch.setattr("treadle.logprobs.tokens.fast_path_head", lambda base: None)
    model = tiny(tok, attn)
    ids, mask, width_p = ragged_batch([9, 1, 4, 12, 2, 6], [30, 1, 3, 2, 17, 8])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    start = width_p - 1
    weights = torch.rand(ids.shape[0], ids.shape[1] - 1 - start, generator=torch.Generator().manual_seed(1))
    results = []
    for padding_free in (False, True):
        model.zero_grad()
        out = token_logps(
            model,
            ids,
            mask,
            start=start,
            return_entropy=True,
            return_mean_logits=True,
            position_ids=positions,
            padding_free=padding_free,
        )
        (out.logps * weights).sum().backward()
        target = mask[:, start + 1 :].bool()
        results.append(
            (
                out.logps[target],
                out.entropy[target],
                out.mean_logits[target],
                [p.grad.clone() for p in model.parameters()],
                out.logps.detach(),
            )
        )
    (lp, ent, ml, grads, full), (lp2, ent2, ml2, grads2, full2) = results
    torch.testing.assert_close(lp2, lp, **TOL)
    torch.testing.assert_close(ent2, ent, **TOL)
    torch.testing.assert_close(ml2, ml, **TOL)
    for g, g2 in zip(grads, grads2):
        torch.testing.assert_close(g2, g, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(full2, rows_alone(model, ids, mask, start), **TOL)
    assert torch.equal(full2[~mask[:, start + 1 :].bool()], torch.zeros(int((mask[:, start + 1 :] == 0).sum())))


def test_right_padded_rows_without_position_ids_as_dpo_passes_them(tok):
    model = tiny(tok)
    ids, mask, _ = ragged_batch([1] * 4, [20, 3, 11, 1])  # one prompt token, then rows of 21, 4, 12, 2
    with torch.no_grad():
        padded = token_logps(model, ids, mask).logps
        packed = token_logps(model, ids, mask, padding_free=True).logps
        torch.testing.assert_close(packed, padded, **TOL)
        torch.testing.assert_close(packed, rows_alone(model, ids, mask, 0), **TOL)


class MixesRows(nn.Module):
    """Takes position_ids but ignores them: each position sees the mean of everything before it, padding or
    not, so packing rows together changes its outputs. Padding-free must notice and fall back."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(100, 8), nn.Linear(8, 100)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = self.embed(input_ids)
        return self.head(h.cumsum(dim=1) / torch.arange(1, h.shape[1] + 1)[:, None])


def test_a_model_that_leaks_across_packed_rows_falls_back_to_padded_with_a_warning():
    torch.manual_seed(0)
    model = MixesRows()
    ids, mask, width_p = ragged_batch([1, 1, 1], [4, 7, 2])  # right-padded: no position_ids needed
    with torch.no_grad():
        padded = token_logps(model, ids, mask, start=width_p - 1).logps
        with pytest.warns(UserWarning, match="padding-free forward .* does not reproduce"):
            first = token_logps(model, ids, mask, start=width_p - 1, padding_free=True).logps
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # decided once per model: no second warning
            again = token_logps(model, ids, mask, start=width_p - 1, padding_free=True).logps
    assert torch.equal(first, padded) and torch.equal(again, padded)


# ---- GRPO: every loss type, accumulation, old and reference log-probs -------------------------------------
@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_grpo_losses_and_gradients_equal_the_padded_path(tmp_path, tok, loss_type):
    from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path),
        loss_type=loss_type,
        beta=0.04,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=30,
        disable_tqdm=True,
        report_to="none",
        temperature=0.8,
    )
    trainer = GRPOTrainer(
        tiny(tok),
        lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=[{"prompt": "1+1="}] * 8,
        processing_class=tok,
    )
    micro_batches = []
    for seed, (prompts, completions) in enumerate([([9, 1, 4, 12], [30, 1, 3, 17]), ([2, 6, 2, 5], [8, 2, 25, 1])]):
        ids, mask, width_p = ragged_batch(prompts, completions, seed=seed)
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            "completion_mask": mask[:, width_p:].float(),
            "advantages": torch.tensor([1.0, -0.5, 0.3, -0.8]),
        }
        with torch.no_grad():  # a policy other than the current one: the old log-probs differ
            noise = 0.05 * torch.randn(batch["completion_mask"].shape, generator=torch.Generator().manual_seed(seed))
        args.padding_free = False
        batch["old_logps"] = trainer.frozen_logps(trainer.model, batch) + noise
        batch["ref_logps"] = trainer.frozen_logps(trainer.ref_model, batch)
        args.padding_free = True
        assert torch.allclose(trainer.frozen_logps(trainer.ref_model, batch), batch["ref_logps"], **TOL)
        micro_batches.append(batch)
    tokens = int(sum(b["completion_mask"].sum() for b in micro_batches))
    items = 8 if loss_type == "grpo" else tokens
    assert_window_equal_both_ways(trainer, micro_batches, items)  # one window of two micro-batches


def assert_window_equal_both_ways(trainer, micro_batches: list, items: int) -> None:
    """The losses of an accumulation window's micro-batches and the gradients they leave are the same with
    ``padding_free`` off and on (to TOL)."""
    results = []
    for padding_free in (False, True):
        trainer.args.padding_free = padding_free
        trainer.model.zero_grad()
        losses = []
        for batch in micro_batches:
            loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=items)
            loss.backward()
            losses.append(loss.detach())
        results.append((torch.stack(losses), [p.grad.clone() for p in trainer.model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0], **TOL)
    for g, g2 in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(g2, g, **TOL)


# ---- DPO: every loss type, chosen and rejected of different lengths --------------------------------------
@pytest.mark.parametrize("loss_type, rpo_alpha", [(t, 0.0) for t in DPO_LOSS_TYPES] + [("sigmoid", 1.0)])
def test_dpo_losses_and_gradients_equal_the_padded_path(tmp_path, tok, loss_type, rpo_alpha):
    from treadle.trainers.dpo import DPOConfig, DPOTrainer

    rows = [
        {"prompt": "12+34=", "chosen": "46", "rejected": "47 is what it is, surely, isn't it"},
        {"prompt": "5+5=", "chosen": "ten, as everyone knows by now", "rejected": "1"},
        {"prompt": "99+1+1000=", "chosen": "1100", "rejected": "11"},
    ]
    args = DPOConfig(
        output_dir=str(tmp_path),
        loss_type=loss_type,
        rpo_alpha=rpo_alpha,
        label_smoothing={"robust": 0.1, "exo_pair": 1e-3}.get(loss_type, 0.0),
        per_device_train_batch_size=3,
        disable_tqdm=True,
        report_to="none",
    )
    trainer = DPOTrainer(tiny(tok), args=args, train_dataset=rows, processing_class=tok)
    with torch.no_grad():  # a reference that differs from the policy
        for p in trainer.ref_model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    batches = [
        trainer.prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in part]))
        for part in ([0, 1], [2])
    ]
    assert_window_equal_both_ways(trainer, batches, 3)
