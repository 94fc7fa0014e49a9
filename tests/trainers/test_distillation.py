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
    assert generalized_jsd(student, teacher, beta=0.5).item() == pytest.approx(
        0.5 * kl(p_t, m) + 0.5 * kl(p_s, m), abs=1e-6
    )
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
    return (
        torch.randn(n, hs, generator=g, requires_grad=True),
        torch.randn(v, hs, generator=g, requires_grad=True),
        torch.randn(n, ht, generator=g),
        torch.randn(v, ht, generator=g),
    )


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
    theirs, _, _ = trl_distill._chunked_divergence_loss(
        hs[None], ht[None], ws, wt, mask[None], beta, num_items_in_batch=n_items, temperature=1.5
    )
    per_token = chunked_generalized_jsd(hs, ws, ht, wt, beta=beta, temperature=1.5)
    ours = (per_token * mask).sum() / n_items
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=1e-5, rtol=1e-5)
    grad_theirs = torch.autograd.grad(theirs, (hs, ws))
    grad_ours = torch.autograd.grad(ours, (hs, ws))
    for a, b in zip(grad_ours, grad_theirs):
        torch.testing.assert_close(a, b.to(a.dtype), atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------ the trainer
import copy  # noqa: E402  (the trainer's tests below share the module with the loss tests above)

from _factories import add, chatty_model  # noqa: E402  (the tool and the EOS-biased toy model of GRPO's tests)
from datasets import Dataset  # noqa: E402

import treadle  # noqa: E402
from treadle.demos import toy  # noqa: E402
from treadle.errors import PreflightError  # noqa: E402
from treadle.generation import GenerationOutput, completion_masks, left_pad  # noqa: E402
from treadle.rollouts.tools import ToolEnvironment  # noqa: E402
from treadle.trainers import distillation as distillation_module  # noqa: E402
from treadle.trainers.distillation import DistillationConfig, DistillationTrainer  # noqa: E402
from treadle.trainers.grpo.config import GRPOConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
EOS = 2  # the toy tokenizer's eos id
FIXED = [[5, 6, EOS, 0], [7, 8, 9, 10], [EOS, 0, 0, 0], [11, EOS, 0, 0]]  # raw completions, cut after EOS


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        max_completion_length=4,
        max_steps=2,
        learning_rate=1e-3,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1000,
    )
    values.update(overrides)
    return DistillationConfig(**values)


def make_trainer(tmp_path, tok, dataset, student_seed=0, teacher_seed=1, **overrides):
    student = toy.build_model("tiny", tokenizer=tok, seed=student_seed)
    teacher = toy.build_model("tiny", tokenizer=tok, seed=teacher_seed)
    return DistillationTrainer(
        student, teacher, args=config(tmp_path, **overrides), train_dataset=dataset, processing_class=tok
    )


def fixed_generation(prompt_ids, *, num_generations, generator=None):
    """The engine's output for fixed completions (FIXED, cycled), so that both libraries train on the same."""
    rows = len(prompt_ids) * num_generations
    ids, mask = left_pad([p for p in prompt_ids for _ in range(num_generations)], 0)
    raw = torch.tensor([FIXED[i % len(FIXED)] for i in range(rows)])
    completion_ids, completion_mask, truncated = completion_masks(raw, (EOS,), 0)
    return GenerationOutput(ids, mask, completion_ids, completion_mask, truncated)


def trl_one_step(tmp_path, tok, student, teacher, prompt_ids, beta, temperature, lr):
    """One SGD step of trl.DistillationTrainer with its generation replaced by the FIXED completions."""
    trl = pytest.importorskip("trl")
    args = trl.DistillationConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(FIXED),
        max_steps=1,
        learning_rate=lr,
        optim="sgd",
        max_grad_norm=0.0,
        beta=beta,
        temperature=temperature,
        lr_scheduler_type="constant",
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_completion_length=4,
    )
    rows = Dataset.from_dict({"prompt": ["12+34="] * 8})
    trainer = trl.DistillationTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=rows, processing_class=tok
    )
    out = fixed_generation([prompt_ids] * len(FIXED), num_generations=1)

    def fixed(_inputs):
        return {
            "prompt_ids": out.prompt_ids,
            "prompt_mask": out.prompt_mask,
            "completion_ids": out.completion_ids,
            "completion_mask": out.completion_mask,
            "num_items_in_batch": out.completion_mask.sum(),
        }

    trainer._generate_and_score_completions = fixed
    trainer.train()
    return trainer.model


@pytest.mark.parametrize("beta,temperature", [(0.0, 1.5), (0.5, 1.5), (1.0, 1.0)])
def test_one_sgd_step_equals_trl(tmp_path, tok, beta, temperature):
    """The same student, teacher and fixed completions (prompts of one length: TRL's forward counts positions
    from the left padding, treadle's from the first prompt token): one SGD step gives TRL's weights."""
    student = toy.build_model("tiny", tokenizer=tok, seed=0)
    teacher = toy.build_model("tiny", tokenizer=tok, seed=1)
    lr = 0.5
    prompt = tok("12+34=", add_special_tokens=True)["input_ids"]
    theirs = trl_one_step(tmp_path, tok, copy.deepcopy(student), copy.deepcopy(teacher), prompt, beta, temperature, lr)
    rows = Dataset.from_dict({"prompt": ["12+34="] * 8})
    ours = DistillationTrainer(
        copy.deepcopy(student),
        teacher,
        train_dataset=rows,
        processing_class=tok,
        args=config(
            tmp_path,
            max_steps=1,
            optim="sgd",
            learning_rate=lr,
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
            beta=beta,
            temperature=temperature,
        ),
    )
    ours.generate = fixed_generation
    ours.train()
    moved = 0.0
    for (name, p), q, before in zip(ours.model.named_parameters(), theirs.parameters(), student.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)
        moved += float((p.detach() - before.detach()).abs().sum())
    assert moved > 1e-2


def test_accumulation_two_by_two_equals_one_by_four(tmp_path, tok, dataset):
    """One generation of 4 completions in one micro-batch, or in 2 micro-batches of 2: the same SGD step."""
    common = dict(max_steps=1, optim="sgd", learning_rate=0.5, max_grad_norm=0.0, temperature=1.3, beta=0.5)
    big = make_trainer(tmp_path / "big", tok, dataset, per_device_train_batch_size=4, **common)
    small = make_trainer(
        tmp_path / "small", tok, dataset, per_device_train_batch_size=2, gradient_accumulation_steps=2, **common
    )
    before = {n: p.detach().clone() for n, p in big.model.named_parameters()}
    big.train()
    small.train()
    moved = 0.0
    for (name, p), q in zip(big.model.named_parameters(), small.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
        moved += float((p.detach() - before[name]).abs().sum())
    assert moved > 1e-3


def test_training_is_finite_and_moves_every_parameter(tmp_path, tok, dataset):
    trainer = make_trainer(tmp_path, tok, dataset, max_steps=3, learning_rate=1e-2, logging_steps=1)
    teacher_before = {n: p.detach().clone() for n, p in trainer.teacher_model.named_parameters()}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(v) and v > 0 for v in losses)
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged
    assert all(torch.equal(p, teacher_before[n]) for n, p in trainer.teacher_model.named_parameters())
    assert "completions/mean_length" in trainer.state.log_history[0]


def test_loss_is_the_divergence_of_the_full_logits(tmp_path, tok, dataset, monkeypatch):
    """The chunked path (hidden states, only completion positions projected) against both models' full logits
    through losses.generalized_jsd, summed over the completion tokens and divided by their count."""
    trainer = make_trainer(tmp_path, tok, dataset, beta=0.5, temperature=0.7)
    trainer.generate = fixed_generation
    (sample,) = trainer.generate_and_score(list(dataset.select(range(4))), 0)
    loss = trainer.compute_loss(trainer.model, sample)
    ids, mask = sample.input_ids, sample.attention_mask
    start = ids.shape[1] - sample.completion_mask.shape[1] - 1
    keep = sample.completion_mask.bool()
    positions = torch.cumsum(mask, 1) - 1
    student = trainer.model(ids, attention_mask=mask, position_ids=positions).logits[:, start:-1][keep]
    teacher = trainer.teacher_model(ids, attention_mask=mask, position_ids=positions).logits[:, start:-1][keep]
    expected = plain_gjsd(student.double(), teacher.double(), 0.5, 0.7).sum() / keep.sum()
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)
    # a model outside the fast path (full logits) gives the same loss
    monkeypatch.setattr(
        distillation_module,
        "hidden_states_and_head",
        lambda model, ids, mask, **kw: (model(ids, attention_mask=mask, **kw).logits, None),
    )
    torch.testing.assert_close(trainer.compute_loss(trainer.model, sample), loss, atol=1e-6, rtol=1e-5)


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path, tok, dataset):
    student = toy.build_model("tiny", tokenizer=tok, seed=0)
    teacher = toy.build_model("tiny", tokenizer=tok, seed=1, vocab_size=len(tok) + 8)
    with pytest.raises(PreflightError, match="share one tokenizer"):
        DistillationTrainer(student, teacher, args=config(tmp_path), train_dataset=dataset, processing_class=tok)


def test_a_teacher_folder_with_another_tokenizer_is_refused(tmp_path, tok, dataset):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(str(save_toy(tmp_path / "base", tok)))
    other.add_tokens(["<extra>"])  # one token more: another vocabulary
    folder = tmp_path / "teacher"
    toy.build_model("tiny", tokenizer=tok, seed=1, vocab_size=len(other)).save_pretrained(folder)
    other.save_pretrained(folder)
    with pytest.raises(PreflightError, match="teacher's tokenizer"):
        DistillationTrainer(
            toy.build_model("tiny", tokenizer=tok),
            str(folder),
            args=config(tmp_path),
            train_dataset=dataset,
            processing_class=tok,
        )


@pytest.mark.parametrize(
    "teacher, needle", [("same", "is the student model itself"), ("copy", "has the student.s very weights")]
)
def test_a_teacher_that_is_the_student_is_refused(tmp_path, tok, teacher, needle):
    student = toy.build_model("tiny", tokenizer=tok)
    args = treadle.DistillationConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1)
    with pytest.raises(PreflightError, match=f"teacher_model {needle}.*would train on nothing"):
        treadle.DistillationTrainer(
            student,
            student if teacher == "same" else copy.deepcopy(student),
            args=args,
            train_dataset=[{"prompt": "1+1="}] * 4,
            processing_class=tok,
        )
    assert all(p.requires_grad for p in student.parameters())  # the "frozen teacher" did not freeze the student


def save_toy(folder, tok):
    toy.build_model("tiny", tokenizer=tok, seed=1).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("steps_per_generation", 2, "samples once per optimizer step"),
        ("beta", 1.5, "beta must be in"),
        ("num_generations", 0, "num_generations must be"),
    ],
)
def test_config_refusals(field, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        DistillationConfig(output_dir="unused", **{field: value})


@pytest.mark.parametrize(
    "field",
    [
        "loss_type",
        "epsilon",
        "scale_rewards",
        "dynamic_sampling",
        "health_checks",
        "vllm_importance_sampling_mode",
        "padding_free",
        "log_completions",
    ],
)
def test_a_grpo_field_is_not_a_distillation_field(field):
    """GRPO's and distillation's configs are siblings: a GRPO setting on a DistillationConfig is an unknown
    argument, named in one line."""
    assert field in GRPOConfig.field_names() and field not in DistillationConfig.field_names()
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{field}'") as err:
        DistillationConfig(output_dir="unused", **{field: GRPOConfig.__dataclass_fields__[field].default})
    assert "\n" not in str(err.value)


def test_eval_loss_without_reward_functions(tmp_path, tok, dataset):
    trainer = make_trainer(tmp_path, tok, dataset)
    metrics = trainer.evaluate(dataset.select(range(6)))
    assert set(metrics) == {"eval_loss", "eval_completions/mean_length"}
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] > 0
    # the student as its own teacher (refused for training: test_a_teacher_that_is_the_student_is_refused above):
    # the divergence is 0
    same_teacher = make_trainer(tmp_path, tok, dataset)
    same_teacher.teacher_model = copy.deepcopy(same_teacher.model).eval()
    assert same_teacher.evaluate(dataset.select(range(6)))["eval_loss"] == pytest.approx(0.0, abs=1e-6)


# ------------------------------------------------------------------------------------ tools
def test_with_tools_the_teacher_scores_only_the_students_own_tokens(tmp_path, tok, dataset, monkeypatch):
    """Multi-turn rollouts through ``tools=``: every rollout's first turn is read as the call ``add(2, 3)``, so
    its tool result (``<result>5</result>``) sits in the completion between sampled turns. The loss is the
    divergence over the sampled tokens only (both models' full logits, plain PyTorch), not over the result's."""
    real_step = ToolEnvironment.step
    monkeypatch.setattr(
        ToolEnvironment,
        "step",
        lambda env, text: real_step(env, "<call>add(2, 3)</call>" if env.iterations == 0 else text),
    )
    trainer = DistillationTrainer(
        chatty_model(tok, eos_bias=4.0),
        toy.build_model("tiny", tokenizer=tok, seed=1),
        args=config(tmp_path, max_completion_length=40, beta=0.5, temperature=0.7, max_steps=1, logging_steps=1),
        train_dataset=dataset,
        processing_class=tok,
        tools=[add],
    )
    (sample,) = trainer.generate_and_score(list(dataset.select(range(4))), 0)
    loss_mask, width = sample.completion_mask.bool(), sample.completion_mask.shape[1]
    in_completion = sample.attention_mask[:, -width:].bool()
    tool_tokens = in_completion & ~loss_mask
    assert tool_tokens.any() and loss_mask.any()
    result_ids = tok("<result>5</result>", add_special_tokens=False)["input_ids"]
    for row in range(4):  # each row's masked-out tokens are exactly the tool's answer
        assert sample.input_ids[row, -width:][tool_tokens[row]].tolist() == result_ids
    loss = trainer.compute_loss(trainer.model, sample, num_items_in_batch=int(loss_mask.sum()))
    ids, mask = sample.input_ids, sample.attention_mask
    start, positions = ids.shape[1] - width - 1, torch.cumsum(mask, 1) - 1
    with torch.no_grad():
        student = trainer.model(ids, attention_mask=mask, position_ids=positions).logits[:, start:-1].double()
        teacher = trainer.teacher_model(ids, attention_mask=mask, position_ids=positions).logits[:, start:-1].double()
    per_token = plain_gjsd(student, teacher, 0.5, 0.7)  # (B, C)
    torch.testing.assert_close(loss.double(), per_token[loss_mask].sum() / loss_mask.sum(), atol=1e-6, rtol=1e-5)
    # a mask that let the tool's tokens in would give another loss
    assert abs(per_token[in_completion].sum() / in_completion.sum() - loss.double()) > 1e-4
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["tools/call_frequency"] > 0 and "tools/add/calls" in logged


def test_min_p_and_generation_kwargs_reach_the_students_sampler(tmp_path, tok, dataset):
    """GRPO's sampling fields: one step samples through min_p and top-k with suppressed tokens (every digit but 1,
    which the untrained student samples otherwise) and logs a finite divergence."""
    digits = [tok.convert_tokens_to_ids(d) for d in "023456789"]
    trainer = make_trainer(
        tmp_path,
        tok,
        dataset,
        max_steps=1,
        logging_steps=1,
        min_p=0.05,
        generation_kwargs={"suppress_tokens": digits, "top_k": 40},
    )
    params = trainer.sampling_params()
    assert (params.min_p, params.top_k, params.suppress_token_ids) == (0.05, 40, tuple(digits))
    rollout = trainer.sample_rows(list(dataset.select(range(8))), torch.Generator().manual_seed(0))
    sampled = rollout.generation.completion_ids[rollout.generation.completion_mask.bool()]
    assert sampled.numel() > 8 and not set(sampled.tolist()) & set(digits)
    plain = (
        make_trainer(tmp_path, tok, dataset)
        .sample_rows(list(dataset.select(range(8))), torch.Generator().manual_seed(0))
        .generation
    )
    assert set(plain.completion_ids[plain.completion_mask.bool()].tolist()) & set(digits)  # it would sample them
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])
