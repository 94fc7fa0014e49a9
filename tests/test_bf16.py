"""bfloat16 weights (a model loaded with ``torch_dtype=torch.bfloat16``, as 7B models are on one GPU) train with
SFT, DPO and GRPO on CPU; the log-probs that reach the losses are float32, with bf16 weights and under
``bf16=True`` autocast alike; and the precision of each tensor is what docs/peft.md's table says."""

import pytest
import torch
from _factories import PAIRS, SFT_ROWS, dpo_trainer, grpo_trainer, length_reward, sft_trainer

from treadle.demos import toy
from treadle.trainers import dpo as dpo_module
from treadle.trainers.grpo import trainer as grpo_module

TOK = toy.build_tokenizer()
COMMON = dict(
    max_steps=2,
    per_device_train_batch_size=2,
    learning_rate=1e-2,
    disable_tqdm=True,
    save_strategy="no",
    logging_steps=1,
    report_to="none",
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16-model")
    toy.build_model("tiny", tokenizer=TOK).save_pretrained(str(folder))
    return folder


def load_bf16(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    return model


class Spy:
    """Wraps a loss function and records the dtypes of the tensors it is given."""

    def __init__(self, fn):
        self.fn, self.dtypes = fn, []

    def __call__(self, *args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        self.dtypes.append({t.dtype for t in tensors})
        return self.fn(*args, **kwargs)


def run(kind, model, tmp_path, monkeypatch, **overrides):
    """A trainer of ``kind`` on ``model`` (4 SFT rows, 2 pairs, GRPO: the 4 prompts) and a spy on its loss."""
    fields = {**COMMON, **overrides}
    spy = None
    if kind == "sft":
        trainer = sft_trainer(tmp_path / kind, TOK, SFT_ROWS, model, **fields)
    elif kind == "dpo":
        spy = Spy(dpo_module.dpo_loss)
        monkeypatch.setattr(dpo_module, "dpo_loss", spy)
        trainer = dpo_trainer(tmp_path / kind, TOK, PAIRS[:2], model, **fields)
    else:
        spy = Spy(grpo_module.grpo_loss)
        monkeypatch.setattr(grpo_module, "grpo_loss", spy)
        fields.update(per_device_train_batch_size=4, num_generations=4, max_completion_length=4, beta=0.1)
        trainer = grpo_trainer(
            tmp_path,
            TOK,
            [{"prompt": r["prompt"]} for r in SFT_ROWS],
            length_reward,
            model=model,
            output_dir=str(tmp_path / kind),
            **fields,
        )
    return trainer, spy


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_bf16_weights_train_and_the_losses_get_float32_log_probs(kind, tmp_path, monkeypatch, bf16_folder):
    model = load_bf16(bf16_folder)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer, spy = run(kind, model, tmp_path, monkeypatch)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(abs(x) < 1e3 for x in losses)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # weights stay bf16
    state = next(iter(trainer.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.bfloat16  # torch's AdamW keeps its moments in the weights' dtype
    if spy is not None:
        assert spy.dtypes and all(dtypes == {torch.float32} for dtypes in spy.dtypes), spy.dtypes


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_bf16_autocast_with_float32_weights_gives_float32_log_probs(kind, tmp_path, monkeypatch):
    model = toy.build_model("tiny", tokenizer=TOK)
    trainer, spy = run(kind, model, tmp_path, monkeypatch, bf16=True, max_steps=1)
    trainer.train()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert spy.dtypes and all(dtypes == {torch.float32} for dtypes in spy.dtypes), spy.dtypes


def test_precision_table(bf16_folder):
    """The rows of docs/peft.md's precision table, measured: one forward / backward of the toy model."""
    from treadle.logprobs.tokens import token_logps

    ids = torch.tensor([[1, 9, 10, 79, 11, 87, 12, 13]])
    seen = {}
    for name, model, autocast in [
        ("fp32+bf16", toy.build_model("tiny", tokenizer=TOK), True),
        ("bf16", load_bf16(bf16_folder), False),
    ]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids).logits
            logps = token_logps(model, ids).logps
        logps.sum().backward()
        weight = model.model.layers[0].mlp.up_proj.weight
        seen[name] = (weight.dtype, weight.grad.dtype, logits.dtype, logps.dtype)
    assert seen["fp32+bf16"] == (torch.float32, torch.float32, torch.bfloat16, torch.float32)
    assert seen["bf16"] == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)
