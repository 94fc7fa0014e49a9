"""Shared-prefix forwards (``treadle.logprobs.prefix``, GRPO's ``shared_prefix``): each group's prompt run once, its
completions after it (through the KV cache, or packed under a 4D mask), give the same per-token log-probs and the same
gradient of every parameter as the unshared (padded and padding-free) forwards -- on the architecture matrix both
ways, for every GRPO loss type over an accumulation window, with LoRA -- take the cheaper way, and switch themselves
off where they cannot be exact or would not save work."""

from __future__ import annotations

import warnings

import pytest
import torch
from _factories import ARCHITECTURES, GOLDEN_GRPO, build_architecture, golden_grpo_run, grpo_trainer

from treadle import models
from treadle.demos import toy
from treadle.logprobs import prefix
from treadle.logprobs.prefix import (
    CachedPrefixBatch,
    cached_cost,
    estimated_cost,
    pack_shared_prefix,
    prompt_first_layout,
    shared_prefix_logps,
    shared_prefix_problem,
    takes_cache,
    token_ratio,
)
from treadle.logprobs.tokens import token_logps
from treadle.losses import DPO_LOSS_TYPES, GRPO_LOSS_TYPES
from treadle.packing import position_ids
from treadle.peft import reference_of

TOL = dict(rtol=1e-5, atol=1e-5)
pytestmark = pytest.mark.usefixtures("one_thread")


def grouped_batch(prompt_lengths, completion_lengths, seed=0, vocab=(8, 60)):
    """GRPO's layout, rows grouped: ``prompt_lengths[k]`` real tokens for group k (left-padded to the widest),
    ``completion_lengths[k]`` the lengths of its completions (right-padded). Returns ids, mask, P."""
    g = torch.Generator().manual_seed(seed)
    width_p = max(prompt_lengths)
    width_c = max(max(cs) for cs in completion_lengths)
    rows, masks = [], []
    for p, cs in zip(prompt_lengths, completion_lengths):
        prompt = torch.randint(*vocab, (p,), generator=g)
        for c in cs:
            row = torch.zeros(width_p + width_c, dtype=torch.long)
            row[width_p - p : width_p] = prompt
            row[width_p : width_p + c] = torch.randint(*vocab, (c,), generator=g)
            mask = torch.zeros_like(row)
            mask[width_p - p : width_p + c] = 1
            rows.append(row)
            masks.append(mask)
    return torch.stack(rows), torch.stack(masks), width_p


def padded_logps(model, ids, mask, width_p, **kwargs):
    return token_logps(model, ids, mask, start=width_p - 1, position_ids=position_ids(mask), **kwargs)


# ---- packing --------------------------------------------------------------------------------------------
def test_pack_by_hand():
    """Two groups (prompt [5, 6] with completions [7, 8] and [9]; prompt [4] with [3, 2]) and one completion-less row:
    each prompt once, positions restarting at the prompt's length, siblings invisible to each other."""
    ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0], [0, 0, 4, 3, 2], [0, 5, 6, 0, 0]])
    packed = pack_shared_prefix(ids, (ids > 0).long(), prompt_width=3)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 3, 2, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 0, 0]]
    assert packed.labels.tolist() == [7, 8, 9, 3, 2]
    # 7 from 6 (flat 1), 8 from 7 (2), 9 from 6 (1), 3 from 4 (5), 2 from 3 (6)
    assert packed.rows.tolist() == [1, 2, 1, 5, 6]
    allowed = packed.allowed[0, 0].long().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]
    tail = packed.allowed[1, 0].long()
    assert tail[3].tolist() == [0, 0, 0, 1, 0] and tail[4].tolist() == [0, 0, 0, 0, 1]  # unused tail: itself only
    assert packed.targets.long().tolist() == [[1, 1], [1, 0], [1, 1], [0, 0]]


def test_token_ratio_is_the_issue_formula():
    for p, c, g in [(256, 32, 8), (256, 128, 16), (64, 64, 8)]:
        assert token_ratio([p], [[c] * g]) == pytest.approx((p + g * c) / (g * (p + c)))


def test_layouts_that_are_not_grpo_s_are_refused():
    ids = torch.tensor([[5, 6, 7, 0, 8], [5, 6, 7, 9, 0]])
    hole = (ids > 0).long()  # row 0: a completion token after padding
    assert pack_shared_prefix(ids, hole, prompt_width=2) is None


def only_way(monkeypatch, way: str) -> None:
    """Make ``way`` ("cache" or "mask") the only one ``shared_prefix_logps`` may take."""
    if way == "mask":
        monkeypatch.setattr(prefix, "takes_cache", lambda model: False)
    else:
        monkeypatch.setattr(prefix, "pack_shared_prefix", lambda *args: None)


def ways_taken(monkeypatch) -> list[str]:
    """The way each shared forward from now on takes ("cache" or "mask"), as a list that fills."""
    taken, forward = [], prefix._shared_forward

    def spy(model, base, plan, options):
        taken.append("cache" if isinstance(plan, CachedPrefixBatch) else "mask")
        return forward(model, base, plan, options)

    monkeypatch.setattr(prefix, "_shared_forward", spy)
    return taken


def test_plan_for_the_cache_by_hand():
    """The same batch as test_pack_by_hand: each prompt once (left-padded as in the batch), each row's prompt, the
    completion tokens that predict a next one, the mask over prompt then those."""
    ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0], [0, 0, 4, 3, 2], [0, 5, 6, 0, 0]])
    plan = prefix.plan_cached_prefix(ids, (ids > 0).long(), prompt_width=3)
    assert plan.prompt_ids.tolist() == [[0, 5, 6], [0, 0, 4]] and plan.prompt_mask.tolist() == [[0, 1, 1], [0, 0, 1]]
    assert plan.group_of.tolist() == [0, 0, 1, 0]
    assert plan.completion_ids.tolist() == [[7], [9], [3], [0]]
    assert plan.attention_mask.tolist() == [[0, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 0]]
    assert plan.labels.tolist() == [7, 8, 9, 3, 2]
    assert plan.targets.long().tolist() == [[1, 1], [1, 0], [1, 1], [0, 0]]
    assert prefix.plan_cached_prefix(torch.tensor([[5, 6, 7, 0, 8]]), torch.tensor([[1, 1, 1, 0, 1]]), 2) is None


# ---- exactness: the architecture matrix -----------------------------------------------------------------------
@pytest.mark.parametrize("way", ["cache", "mask"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_log_probs_entropy_and_every_gradient_equal_the_padded_forward(arch, way, monkeypatch):
    """Two groups (prompts of 9 and 8 tokens, left-padded), completions of 0 to 7 tokens, one prompt alone:
    log-probs, entropies and every parameter's gradient equal the padded forward's (1e-5), through the KV cache and
    under the 4D mask. Gemma2 takes the full-logits path (its final softcap) and eager attention (the additive
    mask); the rest sdpa (the boolean one)."""
    only_way(monkeypatch, way)
    taken = ways_taken(monkeypatch)
    model = build_architecture(arch).train()
    ids, mask, width_p = grouped_batch([9, 8, 8], [[7, 2, 0, 5], [1, 6, 6], [3]])  # rows within Mistral's window
    weights = torch.rand(ids.shape[0], ids.shape[1] - width_p, generator=torch.Generator().manual_seed(1))
    results = []
    for shared in (False, True):
        out = (
            shared_prefix_logps(model, ids, mask, prompt_width=width_p, return_entropy=True)
            if shared
            else padded_logps(model, ids, mask, width_p, return_entropy=True)
        )
        assert out is not None
        model.zero_grad()
        (out.logps * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.logps, out.entropy * mask[:, width_p:], grads))
    (want, want_entropy, want_grads), (got, got_entropy, got_grads) = results
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_entropy, want_entropy, **TOL)
    assert got_grads.keys() == want_grads.keys() and len(want_grads) == len(list(model.parameters()))
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m, name=name: f"{arch} {name}: {m}")
    assert set(taken) == {way}


@pytest.mark.parametrize("way", ["cache", "mask"])
def test_hidden_state_and_full_logits_paths_agree(tok, monkeypatch, way):
    """The models-without-the-hidden-state-seam path (full logits, then selective_log_softmax) under sharing."""
    only_way(monkeypatch, way)
    model = toy.build_model("tiny", tokenizer=tok, seed=0)
    ids, mask, width_p = grouped_batch([5], [[4, 3, 6]])
    fast = shared_prefix_logps(model, ids, mask, prompt_width=width_p).logps
    monkeypatch.setattr("treadle.logprobs.tokens.fast_path_head", lambda base: None)
    slow = shared_prefix_logps(model, ids, mask, prompt_width=width_p).logps
    torch.testing.assert_close(slow, fast, **TOL)
    torch.testing.assert_close(fast, padded_logps(model, ids, mask, width_p).logps, **TOL)


# ---- exactness: GRPO, every loss type, an accumulation window, old and reference log-probs ----------------
def window_trainer(tmp_path, tok, **overrides):
    """The shared GRPO run (_factories.grpo_trainer) on 6 rows of one prompt, a zero reward, beta 0.04: its windows
    are built by hand below."""
    settings = dict(
        output_dir=str(tmp_path),
        beta=0.04,
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=12,
        report_to="none",
        temperature=0.8,
    )
    return grpo_trainer(
        tmp_path,
        tok,
        [{"prompt": "1+1="}] * 6,
        lambda completions, **kw: [0.0] * len(completions),
        **{**settings, **overrides},
    )


def grouped_micro_batches(trainer):
    """Two micro-batches of two groups of 3: old log-probs (padded forward, plus noise) and reference log-probs."""
    batches = []
    for seed, (prompts, completions) in enumerate(
        [([12, 9], [[12, 1, 3], [7, 0, 2]]), ([10, 14], [[5, 8, 2], [11, 1, 4]])]
    ):
        ids, mask, width_p = grouped_batch(prompts, completions, seed=seed)
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            "completion_mask": mask[:, width_p:].float(),
            "advantages": torch.tensor([1.0, -0.5, 0.3, -0.8, 0.6, -0.2]),
        }
        with torch.no_grad():
            noise = 0.05 * torch.randn(batch["completion_mask"].shape, generator=torch.Generator().manual_seed(seed))
        trainer.args.shared_prefix, trainer.args.padding_free = False, False
        batch["old_logps"] = trainer.frozen_logps(trainer.model, batch) + noise
        with reference_of(trainer.model, trainer.ref_model) as reference:  # LoRA: the policy, adapters off
            batch["ref_logps"] = trainer.frozen_logps(reference, batch)
            trainer.args.shared_prefix = True
            torch.testing.assert_close(trainer.frozen_logps(reference, batch), batch["ref_logps"], **TOL)
        batches.append(batch)
    return batches


def window_results(trainer, micro_batches, items, modes):
    """Per mode ``(shared_prefix, padding_free)``: the window's losses and the gradients it leaves."""
    results = []
    for shared, padding_free in modes:
        trainer.args.shared_prefix, trainer.args.padding_free = shared, padding_free
        trainer.model.zero_grad()
        losses = []
        for batch in micro_batches:
            loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=items)
            loss.backward()
            losses.append(loss.detach())
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        results.append((torch.stack(losses), grads))
    return results


def assert_same(results):
    (want_loss, want_grads), *others = results
    for loss, grads in others:
        torch.testing.assert_close(loss, want_loss, **TOL)
        assert grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
def test_grpo_losses_and_gradients_equal_the_unshared_paths(tmp_path, tok, loss_type, monkeypatch):
    trainer = window_trainer(tmp_path, tok, loss_type=loss_type)
    micro_batches = grouped_micro_batches(trainer)
    calls = []
    forward = prefix._shared_forward
    monkeypatch.setattr(prefix, "_shared_forward", lambda *a: calls.append(1) or forward(*a))
    tokens = int(sum(b["completion_mask"].sum() for b in micro_batches))
    items = 12 if loss_type == "grpo" else tokens
    # padded, padding-free, shared: one window of two micro-batches each
    assert_same(window_results(trainer, micro_batches, items, [(False, False), (False, True), (True, True)]))
    assert len(calls) >= 2  # the shared forward ran for both micro-batches (and the one-time check)


def test_lora_log_probs_gradients_and_the_adapters_off_reference(tmp_path, tok):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0)
    trainer = window_trainer(tmp_path, tok, peft_config=config)
    assert trainer.ref_model is None  # the reference is the policy with its adapters off
    with torch.no_grad():  # adapters that do something (B starts at 0)
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    micro_batches = grouped_micro_batches(trainer)  # checks the adapters-off reference shared == padded
    assert not torch.allclose(micro_batches[0]["old_logps"], micro_batches[0]["ref_logps"], atol=1e-3)
    results = window_results(trainer, micro_batches, 40, [(False, False), (True, True)])
    assert results[0][1] and all("lora_" in name for name in results[0][1])
    assert_same(results)


# ---- training: the same run, golden losses with the option off -------------------------------------------
def test_golden_losses_unchanged_with_the_option_off(tmp_path, tok):
    trainer = golden_grpo_run(tmp_path, tok)
    trainer.args.shared_prefix = False
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == pytest.approx(GOLDEN_GRPO, rel=1e-5, abs=1e-7)


def test_a_training_run_shares_and_logs_the_unshared_run_s_losses(tmp_path, tok, monkeypatch):
    """``golden_grpo_run`` (old and reference log-probs, accumulation) with sharing on: the golden losses, and the
    shared forward did the work (policy, old and reference passes)."""
    calls = []
    forward = prefix._shared_forward
    monkeypatch.setattr(prefix, "_shared_forward", lambda *a: calls.append(1) or forward(*a))
    trainer = golden_grpo_run(tmp_path, tok)
    assert trainer.args.shared_prefix  # the default
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == pytest.approx(GOLDEN_GRPO, rel=1e-5, abs=1e-7)
    assert len(calls) >= 5 * 2 * 3  # 5 steps x 2 micro-steps x (policy, old, reference)


# ---- switching itself off -------------------------------------------------------------------------------
def test_off_where_nothing_is_shared_or_too_little_is_saved(tok, monkeypatch):
    model = toy.build_model("tiny", tokenizer=tok, seed=0)
    ids, mask, width_p = grouped_batch([5, 4, 6], [[3], [2], [7]])  # no two rows share a prompt
    assert shared_prefix_logps(model, ids, mask, prompt_width=width_p) is None
    ids, mask, width_p = grouped_batch([2], [[30, 30]])  # 62 of 64 tokens: the dense mask's attention costs more
    assert shared_prefix_logps(model, ids, mask, prompt_width=width_p) is None
    ids, mask, width_p = grouped_batch([64], [[64] * 16])  # (64, 64), G 16: 0.53 of the tokens
    assert token_ratio([64], [[64] * 16]) < 0.55
    got = shared_prefix_logps(model, ids, mask, prompt_width=width_p)  # through the cache: the padded attention
    torch.testing.assert_close(got.logps, padded_logps(model, ids, mask, width_p).logps, **TOL)
    monkeypatch.setattr(prefix, "takes_cache", lambda model: False)  # the 4D mask: 4.5x the attention
    assert shared_prefix_logps(model, ids, mask, prompt_width=width_p) is None  # tiny: hidden 64, attention-bound


def test_the_cheaper_way_is_taken(tok, monkeypatch):
    """Completions of one length: the cache's way (no masked pairs); ragged ones: the 4D mask (no padding). A model
    under gradient checkpointing (which drops a cache) or with compiled blocks takes the mask."""
    model = toy.build_model("tiny", tokenizer=tok, seed=0)
    taken = ways_taken(monkeypatch)
    for completions in ([[16] * 4] * 2, [[16, 2, 3, 1]] * 2):
        ids, mask, width_p = grouped_batch([8, 8], completions)
        got = shared_prefix_logps(model, ids, mask, prompt_width=width_p)
        torch.testing.assert_close(got.logps, padded_logps(model, ids, mask, width_p).logps, **TOL)
    assert taken == ["cache", "cache", "mask"]  # the first: the one-time check's, then the batch's
    assert cached_cost(2, 8, 8, 16, 64) < estimated_cost(2, 8 + 4 * 16, 64)
    assert cached_cost(2, 8, 8, 16, 64) > estimated_cost(2, 8 + 22, 64)
    assert takes_cache(model)
    models.enable_gradient_checkpointing(model)
    assert not takes_cache(model)
    compiled = toy.build_model("tiny", tokenizer=tok, seed=0)
    compiled.model.layers[0].compile()  # as torch_compile does (treadle.compilation): nothing runs, nothing compiles
    assert not takes_cache(compiled)


def test_the_cost_estimate_by_hand():
    """tokens + pairs / (6 h): (256, 32), G 8 at h = 64 (toy tiny) shares, (256, 128), G 16 does not; at h = 512
    (toy base) it does."""
    unshared = estimated_cost([288] * 8, None, 64)
    assert unshared == 8 * 288 + 8 * 288**2 / 2 / 384
    assert estimated_cost(1, 512, 64) == 512 + 512**2 / 384 and estimated_cost(1, 512, 64) < 0.4 * unshared
    assert estimated_cost(1, 2304, 64) > estimated_cost([384] * 16, None, 64)
    assert estimated_cost(1, 2304, 512) < prefix.MIN_SAVING * estimated_cost([384] * 16, None, 512)
    assert estimated_cost([3], None, None) == 3 and estimated_cost(2, 4, None) == 8


def test_off_for_attention_that_takes_no_4d_mask_and_for_short_sliding_windows(tok, monkeypatch):
    model = toy.build_model("tiny", tokenizer=tok, seed=0)
    model.config._attn_implementation = "flash_attention_2"
    assert "takes no custom 4D mask" in shared_prefix_problem(model)
    ids, mask, width_p = grouped_batch([6], [[7, 2, 5]])
    with pytest.warns(UserWarning, match="LlamaForCausalLM runs its forwards unshared: its attention") as record:
        assert shared_prefix_logps(model, ids, mask, prompt_width=width_p) is None
    assert len(record) == 1 and "\n" not in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one note per model
        assert shared_prefix_logps(model, ids, mask, prompt_width=width_p) is None
    # sliding_window=16: a row of 6 + 12 tokens would need the window the 4D mask replaces; the cache's way keeps
    # the model's own mask, window included
    mistral = build_architecture("mistral")
    ids, mask, width_p = grouped_batch([6], [[14, 13, 12, 14]])
    got = shared_prefix_logps(mistral, ids, mask, prompt_width=width_p)
    torch.testing.assert_close(got.logps, padded_logps(mistral, ids, mask, width_p).logps, **TOL)
    monkeypatch.setattr(prefix, "takes_cache", lambda model: False)
    ids, mask, width_p = grouped_batch([6], [[12, 2, 5]])
    assert shared_prefix_logps(mistral, ids, mask, prompt_width=width_p) is None
    ids, mask, width_p = grouped_batch([6], [[10, 2, 5]])  # 16 tokens: within the window, shared and exact
    got = shared_prefix_logps(mistral, ids, mask, prompt_width=width_p)
    torch.testing.assert_close(got.logps, padded_logps(mistral, ids, mask, width_p).logps, **TOL)


def test_an_inexact_model_warns_once_and_runs_unshared(tok, monkeypatch):
    """A model whose attention let siblings see each other (the mask ignored): the one-time check finds it, one
    warning, then None (the caller's forward) without checking again."""
    model = toy.build_model("tiny", tokenizer=tok, seed=0)
    monkeypatch.setattr(prefix, "_mask", lambda allowed, base: torch.ones_like(allowed).tril())
    ids, mask, width_p = grouped_batch([6], [[7, 2, 5]])
    with pytest.warns(UserWarning, match="shared-prefix forward does not reproduce the padded one") as record:
        assert shared_prefix_logps(model, ids, mask, prompt_width=width_p) is None
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shared_prefix_logps(model, ids, mask, prompt_width=width_p) is None
    assert "inexact" in shared_prefix_problem(model)


# ---- DPO: chosen and rejected after their prompt once -----------------------------------------------------
def test_prompt_first_layout_refuses_what_is_not_prompt_then_response():
    ids = torch.tensor([[5, 6, 7, 8]])
    assert prompt_first_layout(ids, torch.ones_like(ids), torch.tensor([[0, 1, 0, 1]])) is None  # two runs


@pytest.mark.parametrize(
    "loss_type, rpo_alpha, ld_alpha",
    [(t, 0.0, None) for t in DPO_LOSS_TYPES] + [("sigmoid", 1.0, None), ("sigmoid", 0.0, 0.5)],
)
def test_dpo_losses_and_gradients_equal_the_unshared_paths(tmp_path, tok, loss_type, rpo_alpha, ld_alpha, monkeypatch):
    """Each pair's prompt once (long prompts, short responses of different lengths: the rule shares), every DPO
    loss type, RPO's NLL term, LD-DPO's weights: the window's losses and gradients equal padded and padding-free."""
    from treadle.trainers.dpo import DPOConfig, DPOTrainer

    rows = [
        {"prompt": "Add the two numbers, then say only the sum: 12+34=", "chosen": "46", "rejected": "47 or so"},
        {"prompt": "Add the two numbers, then say only the sum: 5+5=", "chosen": "ten, surely", "rejected": "1"},
        {"prompt": "Add the numbers and say the sum, nothing else: 99+1+1000=", "chosen": "1100", "rejected": "11"},
    ]
    args = DPOConfig(
        output_dir=str(tmp_path),
        loss_type=loss_type,
        rpo_alpha=rpo_alpha,
        ld_alpha=ld_alpha,
        label_smoothing={"robust": 0.1, "exo_pair": 1e-3}.get(loss_type, 0.0),
        per_device_train_batch_size=3,
        disable_tqdm=True,
        report_to="none",
    )
    trainer = DPOTrainer(
        toy.build_model("tiny", tokenizer=tok, seed=0), args=args, train_dataset=rows, processing_class=tok
    )
    with torch.no_grad():  # a reference that differs from the policy
        for p in trainer.ref_model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    batches = [
        trainer.prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in part]))
        for part in ([0, 1], [2])
    ]
    calls = []
    forward = prefix._shared_forward
    monkeypatch.setattr(prefix, "_shared_forward", lambda *a: calls.append(1) or forward(*a))
    assert_same(window_results(trainer, batches, 3, [(False, False), (False, True), (True, True)]))
    assert len(calls) >= 4  # policy and reference, both micro-batches
