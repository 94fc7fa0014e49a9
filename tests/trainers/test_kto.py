"""KTO: the loss against hand-computed numbers and a plain-PyTorch reference, the collator's layout, dataset
preparation (unpairing, KL completions, labels as users write them), a tiny training run, the reference variants, and
parity with trl.KTOTrainer (eval loss and metrics for both loss types with unequal weights, one SGD step's weights)."""

import copy
import math
import warnings

import pytest
import torch

import treadle
from treadle.demos import toy
from treadle.losses import kto_kl, kto_loss
from treadle.trainers.kto import KTOCollator, rotate_completions, tokenize_row, unpair_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def sig(x):
    return 1 / (1 + math.exp(-x))


# ---- the loss ---------------------------------------------------------------------------------------------------
def test_kto_loss_hand_numbers():
    logps, ref = torch.tensor([-2.0, -5.0, -1.0]), torch.tensor([-3.0, -4.0, -1.0])  # log-ratios 1, -1, 0
    labels = torch.tensor([True, False, True])
    losses, rewards = kto_loss(logps, ref, labels, 0.5, beta=2.0, desirable_weight=1.5, undesirable_weight=0.5)
    expected = [1.5 * (1 - sig(2.0 * (1 - 0.5))), 0.5 * (1 - sig(2.0 * (0.5 + 1))), 1.5 * (1 - sig(2.0 * -0.5))]
    assert losses.tolist() == pytest.approx(expected, abs=1e-6)
    assert rewards.tolist() == pytest.approx([2.0, -2.0, 0.0])


def test_apo_zero_unpaired_hand_numbers_ignore_kl():
    logps, ref = torch.tensor([-2.0, -5.0]), torch.tensor([-3.0, -4.0])
    labels = torch.tensor([True, False])
    losses, _ = kto_loss(logps, ref, labels, 123.0, beta=0.5, loss_type="apo_zero_unpaired", undesirable_weight=2.0)
    assert losses.tolist() == pytest.approx([1 - sig(0.5), 2.0 * sig(-0.5)], abs=1e-6)


def plain_kto(logps, ref, labels, kl, beta, wd, wu):
    """The paper's Eq. 7 written out row by row in plain PyTorch."""
    out = []
    for p, r, y in zip(logps, ref, labels):
        u = p - r
        out.append(wd * (1 - torch.sigmoid(beta * (u - kl))) if y else wu * (1 - torch.sigmoid(beta * (kl - u))))
    return torch.stack(out)


def test_kto_loss_matches_plain_reference_and_gradient():
    g = torch.Generator().manual_seed(0)
    logps = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    ref, labels = torch.randn(7, generator=g, dtype=torch.float64), torch.rand(7, generator=g) > 0.4
    ours, _ = kto_loss(logps, ref, labels, 0.3, beta=0.7, desirable_weight=1.3, undesirable_weight=0.6)
    theirs = plain_kto(logps, ref, labels, 0.3, 0.7, 1.3, 0.6)
    torch.testing.assert_close(ours, theirs)
    (g1,) = torch.autograd.grad(ours.sum(), logps)
    (g2,) = torch.autograd.grad(theirs.sum(), logps)
    torch.testing.assert_close(g1, g2)


def test_kl_is_detached_mean():
    kl_logps = torch.tensor([-1.0, -2.0], requires_grad=True)
    kl = kto_kl(kl_logps, torch.tensor([-2.0, -2.5]))
    assert kl.item() == pytest.approx(0.75) and not kl.requires_grad


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(loss_type="dpo"), "not a KTO loss"),
        (dict(beta=0.0), "beta"),
        (dict(desirable_weight=0.0), "desirable_weight"),
    ],
)
def test_bad_options_are_refused(bad, match):
    kwargs = {**dict(beta=0.1, loss_type="kto", desirable_weight=1.0, undesirable_weight=1.0), **bad}
    z = torch.zeros(1)
    with pytest.raises(ValueError, match=match):
        kto_loss(z, z, torch.tensor([True]), 0.0, **kwargs)


# ---- data -------------------------------------------------------------------------------------------------------
def test_collator_layout_and_kl_rows():
    rows = [
        {
            "prompt_input_ids": [1, 2, 3],
            "completion_input_ids": [4, 5],
            "KL_completion_input_ids": [6],
            "label": True,
            "ref_logps": -1.0,
        },
        {
            "prompt_input_ids": [7, 8],
            "completion_input_ids": [9],
            "KL_completion_input_ids": [10, 11],
            "label": False,
            "ref_logps": -2.0,
        },
    ]
    batch = KTOCollator(pad_token_id=0)(rows)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 0, 0]]
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]]
    assert batch["KL_input_ids"].tolist() == [[1, 2, 3, 6], [7, 8, 10, 11]]
    assert batch["KL_attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert batch["label"].tolist() == [True, False] and batch["ref_logps"].tolist() == [-1.0, -2.0]
    assert "ref_KL_logps" not in batch


def test_unpair_and_rotate():
    out = unpair_rows({"prompt": ["a", "b"], "chosen": ["1", "2"], "rejected": ["x", "y"]})
    assert out == {
        "prompt": ["a", "b", "a", "b"],
        "completion": ["1", "2", "x", "y"],
        "label": [True, True, False, False],
    }
    assert unpair_rows({"chosen": ["Q: 4"], "rejected": ["Q: 5"]})["prompt"] == ["Q: ", "Q: "]
    assert rotate_completions({"completion_input_ids": [[1], [2], [3]]}) == {
        "KL_completion_input_ids": [[3], [1], [2]]
    }


def kto_rows(n=8):
    pairs = toy.load_task("addition", kind="preference", n=n)
    rows = []
    for i, r in enumerate(pairs):
        rows.append(
            {"prompt": r["prompt"], "completion": r["chosen"] if i % 3 else r["rejected"], "label": bool(i % 3)}
        )
    return rows


ARGS = dict(
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    max_steps=2,
    learning_rate=1e-2,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    max_length=64,
    seed=0,
)


def test_paired_dataset_is_split_and_kl_columns_added(tmp_path, tok):
    pairs = toy.load_task("addition", kind="preference", n=3)
    trainer = treadle.KTOTrainer(
        toy.build_model("tiny", tokenizer=tok),
        args=treadle.KTOConfig(output_dir=str(tmp_path), **ARGS),
        train_dataset=pairs,
        processing_class=tok,
    )
    data = trainer.train_dataset
    assert data["label"] == [True] * 3 + [False] * 3
    assert data["completion_input_ids"][0] == tok(pairs[0]["chosen"], add_special_tokens=False)["input_ids"] + [2]
    # the KL completions are the completions rotated by one within each run of per_device_train_batch_size rows
    completions = data["completion_input_ids"]
    assert data["KL_completion_input_ids"] == [completions[3], *completions[:3], completions[5], completions[4]]


def test_missing_columns_and_long_prompt_are_clear_errors(tmp_path, tok):
    model = toy.build_model("tiny", tokenizer=tok)
    with pytest.raises(ValueError, match="completion"):
        treadle.KTOTrainer(
            model,
            args=treadle.KTOConfig(output_dir=str(tmp_path), **ARGS),
            train_dataset=[{"prompt": "1+1=", "text": "2"}],
            processing_class=tok,
        )
    with pytest.raises(ValueError, match="leaves no room"):
        treadle.KTOTrainer(
            model,
            args=treadle.KTOConfig(output_dir=str(tmp_path), **{**ARGS, "max_length": 4}),
            train_dataset=[{"prompt": "12+34=", "completion": "46", "label": True}] * 2,
            processing_class=tok,
        )
    with pytest.raises(ValueError, match="per_device_train_batch_size must be >= 2"):
        treadle.KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=1)


@pytest.mark.parametrize(
    "label, expected",
    [
        (True, True),
        (False, False),
        (1, True),
        (0, False),
        (-1, False),
        (1.0, True),
        (0.0, False),
        ("True", True),
        ("False", False),
        (" false ", False),
        ("TRUE", True),
        ("1", True),
        ("0", False),
    ],
)
def test_kto_labels_as_users_write_them(tok, label, expected):
    row = tokenize_row({"prompt": "1+1=", "completion": "2", "label": label}, 0, tokenizer=tok, max_length=None)
    assert row["label"] is expected  # bool("False") and bool(-1) are True: the rejected answer pushed up


@pytest.mark.parametrize("label", [None, "yes", "-", 2, 0.5, float("nan"), [True]])
def test_kto_labels_that_are_not_labels_are_refused_naming_the_row(tok, label):
    with pytest.raises(ValueError, match=r"^row 3: label .* is neither desirable nor undesirable; give"):
        tokenize_row({"prompt": "1+1=", "completion": "2", "label": label}, 3, tokenizer=tok, max_length=None)


def kto(tmp_path, tok, labels):
    rows = [{"prompt": f"1+{i}=", "completion": str(i + 1), "label": label} for i, label in enumerate(labels)]
    args = treadle.KTOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to="none", disable_tqdm=True
    )
    model = toy.build_model("tiny", tokenizer=tok)
    return treadle.KTOTrainer(model, args=args, train_dataset=rows, processing_class=tok)


def test_kto_csv_labels_train_both_classes_and_one_class_is_warned(tmp_path, tok):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # two classes: no warning
        trainer = kto(tmp_path / "a", tok, ["True", "False", "true", "false"])
    assert [bool(x) for x in trainer.train_dataset["label"]] == [True, False, True, False]
    with pytest.warns(UserWarning, match="every one of the 4 KTO training rows is labelled desirable"):
        kto(tmp_path / "b", tok, [1, 1, 1, 1])
    with pytest.raises(ValueError, match="row 1: label None"):
        kto(tmp_path / "c", tok, [True, None, False, True])


# ---- training ---------------------------------------------------------------------------------------------------
def trained(tmp_path, tok, **overrides):
    model = toy.build_model("tiny", tokenizer=tok)
    before = copy.deepcopy(model.state_dict())
    trainer = treadle.KTOTrainer(
        model,
        args=treadle.KTOConfig(output_dir=str(tmp_path), **{**ARGS, **overrides}),
        train_dataset=kto_rows(),
        processing_class=tok,
    )
    trainer.train()
    return trainer, before


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_tiny_run_changes_every_weight_and_logs_trl_metrics(tmp_path, tok, loss_type):
    trainer, before = trained(tmp_path, tok, loss_type=loss_type)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    for key in (
        "kl",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
        "entropy",
    ):
        assert key in logs[-1], key
    after = trainer.model.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before), "every trainable weight moves"
    assert logs[1]["kl"] >= 0.0


def test_precomputed_reference_gives_the_same_run(tmp_path, tok):
    live, _ = trained(tmp_path / "live", tok)
    pre, _ = trained(tmp_path / "pre", tok, precompute_ref_log_probs=True)
    assert pre.ref_model is None and "ref_KL_logps" in pre.train_dataset.column_names
    a, b = live.model.state_dict(), pre.model.state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)


def test_peft_policy_is_its_own_reference(tmp_path, tok):
    peft = pytest.importorskip("peft")
    model = toy.build_model("tiny", tokenizer=tok)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = treadle.KTOTrainer(
        model,
        args=treadle.KTOConfig(output_dir=str(tmp_path), **ARGS),
        train_dataset=kto_rows(),
        processing_class=tok,
        peft_config=config,
    )
    assert trainer.ref_model is None
    trainer.train()
    # LoRA's B starts at zero: at the first step policy and reference agree, so KL and rewards start at exactly 0
    first = [h for h in trainer.state.log_history if "loss" in h][0]
    assert first["kl"] == 0.0 and first["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)


def test_gradient_accumulation_gives_the_big_batch_gradient(tmp_path, tok):
    # apo_zero_unpaired has no batch-dependent KL term, so 2 x 2 accumulated rows are exactly one batch of 4
    big, _ = trained(tmp_path / "big", tok, loss_type="apo_zero_unpaired", max_steps=1, optim="sgd")
    small, _ = trained(
        tmp_path / "small",
        tok,
        loss_type="apo_zero_unpaired",
        max_steps=1,
        optim="sgd",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    a, b = big.model.state_dict(), small.model.state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)


# ---- parity with TRL --------------------------------------------------------------------------------------------
PARITY = dict(
    per_device_train_batch_size=6,
    per_device_eval_batch_size=6,
    max_steps=1,
    learning_rate=0.5,
    optim="sgd",
    warmup_steps=0,
    weight_decay=0.0,
    max_grad_norm=1e9,
    seed=0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    dataloader_pin_memory=False,
    beta=0.3,
    desirable_weight=1.4,
    undesirable_weight=0.6,
    max_length=64,
)
METRICS = [
    "loss",
    "kl",
    "entropy",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
]


def perturbed(model, seed, scale):
    """A copy of ``model`` with noise added to every weight: a reference that differs from the policy."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return other


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_eval_metrics_and_one_sgd_step_match_trl(tmp_path, tok, loss_type):
    trl = pytest.importorskip("trl", minversion="1.16")
    from datasets import Dataset

    rows = Dataset.from_list(kto_rows(6))
    policy = toy.build_model("tiny", tokenizer=tok)
    # the reference far from the policy on its mismatched pairs makes z > 0 for one seed; check both branches below
    reference = perturbed(policy, 1, 0.05)
    kwargs = dict(PARITY, loss_type=loss_type)
    theirs = trl.KTOTrainer(
        model=copy.deepcopy(policy),
        ref_model=copy.deepcopy(reference),
        processing_class=tok,
        train_dataset=rows,
        eval_dataset=rows,
        args=trl.KTOConfig(
            output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, gradient_checkpointing=False, **kwargs
        ),
    )
    ours = treadle.KTOTrainer(
        copy.deepcopy(policy),
        ref_model=copy.deepcopy(reference),
        processing_class=tok,
        train_dataset=rows,
        eval_dataset=rows,
        args=treadle.KTOConfig(output_dir=str(tmp_path / "t"), **kwargs),
    )
    a, b = theirs.evaluate(), ours.evaluate()
    assert [b[f"eval_{k}"] for k in METRICS] == pytest.approx([a[f"eval_{k}"] for k in METRICS], abs=1e-4)
    assert a["eval_rewards/margins"] != 0.0
    if loss_type == "kto":
        assert a["eval_kl"] > 0.0, "the test must exercise an unclamped KL reference point"
    theirs.train()
    ours.train()
    pa, pb = theirs.model.state_dict(), ours.model.state_dict()
    moved = max((pa[k] - policy.state_dict()[k]).abs().max().item() for k in pa)
    assert moved > 1e-3, "the step moves the weights by more than the tolerance"
    for key in pa:
        torch.testing.assert_close(pb[key], pa[key], atol=1e-4, rtol=0, msg=key)
