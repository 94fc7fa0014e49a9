"""The architecture matrix: tiny random-weight models of the common decoder families, built in code from their
transformers configs (nothing downloaded; each a few hundred thousand parameters at most), each run through
what treadle does to a model -- one SFT, DPO and GRPO step, greedy fast generation against ``model.generate``,
the chunked log-probs against the full log-softmax, and save -> reload -> the same logits."""

import functools

import pytest
import torch
from _factories import (
    ARCHITECTURES,
    PAIRS,
    SFT_ROWS,
    architecture_config,
    build_architecture,
    dpo_trainer,
    grpo_trainer,
    length_reward,
    sft_trainer,
)

from treadle import checkpoint as ckpt
from treadle.demos import toy
from treadle.generation import fast_path_problem, generate_completions
from treadle.logprobs.tokens import fast_path_head, fast_path_verified, token_logps

transformers = pytest.importorskip("transformers")

TOK = toy.build_tokenizer()
PROMPTS = [
    [TOK.bos_token_id] + TOK.encode("12+34=", add_special_tokens=False),
    TOK.encode("7+8=", add_special_tokens=False),
]


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def param_count(name: str) -> int:
    return sum(p.numel() for p in build_architecture(name).parameters())


@pytest.fixture(params=list(ARCHITECTURES))
def arch(request):
    return request.param


def test_models_are_tiny(arch):
    assert param_count(arch) < 100_000


def test_greedy_fast_generation_equals_generate(arch):
    model = build_architecture(arch)
    backend = "hf" if fast_path_problem(model) else "fast"
    out = generate_completions(
        model,
        PROMPTS,
        num_generations=2,
        max_new_tokens=8,
        eos_token_id=None,
        pad_token_id=TOK.pad_token_id,
        do_sample=False,
        backend="auto",
    )
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS):
            want = model.generate(
                input_ids=torch.tensor([prompt]),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=TOK.pad_token_id,
            )[0, len(prompt) :]
            for g in range(2):
                assert out.completion_ids[2 * row + g].tolist() == want.tolist(), (arch, backend)


def test_chunked_log_probs_equal_the_full_log_softmax(arch):
    """``token_logps`` (hidden-state fast path where the head allows it, chunked: 3 rows a chunk) against
    ``log_softmax(model(ids).logits)`` in plain PyTorch, values and gradients."""
    model = build_architecture(arch).train()
    ids = torch.tensor([PROMPTS[0] + [9, 10, 11], [TOK.pad_token_id] * 4 + PROMPTS[1] + [12, 13]])  # (2, 10)
    mask = (torch.arange(ids.shape[1]) >= torch.tensor([[0], [4]])).long()  # the second row left-padded
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    got = token_logps(model, ids, mask, chunk_size=3, position_ids=positions).logps
    assert got.dtype == torch.float32
    (grad_got,) = torch.autograd.grad((got * mask[:, 1:]).sum(), model.get_input_embeddings().weight)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits.float()
    want = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2) * mask[:, 1:]
    (grad_want,) = torch.autograd.grad(want.sum(), model.get_input_embeddings().weight)
    torch.testing.assert_close(got * mask[:, 1:], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-4, atol=1e-5)
    softcapped = getattr(model.config, "final_logit_softcapping", None) is not None
    assert (fast_path_head(model) is None) == softcapped  # Gemma's softcap: the exact full-logits path
    if not softcapped:  # the fast path was taken, and its one-time check against the model's logits passed
        assert fast_path_verified(model) is True


def test_save_reload_gives_the_same_logits(arch, tmp_path):
    model = build_architecture(arch)
    ckpt.export_model(model, str(tmp_path), TOK)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


COMMON = dict(
    max_steps=1,
    per_device_train_batch_size=2,
    learning_rate=1e-2,
    disable_tqdm=True,
    save_strategy="no",
    logging_steps=1,
    report_to="none",
)


def one_step(kind: str, model, output_dir: str, **overrides):
    """One optimizer step of ``kind`` on ``model`` (two rows; GRPO: their prompts); returns the trainer."""
    fields = {**COMMON, **overrides}
    if kind == "sft":
        trainer = sft_trainer(output_dir, TOK, SFT_ROWS[:2], model, **fields)
    elif kind == "dpo":
        trainer = dpo_trainer(output_dir, TOK, PAIRS[:2], model, **fields)
    else:
        fields.update(per_device_train_batch_size=4, num_generations=4, max_completion_length=4)
        trainer = grpo_trainer(
            output_dir,
            TOK,
            [{"prompt": r["prompt"]} for r in SFT_ROWS[:2]],
            length_reward,
            model=model,
            **{"beta": 0.1, "output_dir": output_dir, **fields},
        )
    trainer.train()
    return trainer


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_one_step_of_each_trainer(arch, kind, tmp_path):
    model = build_architecture(arch).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = one_step(kind, model, str(tmp_path))
    loss = trainer.state.log_history[0]["loss"]
    assert loss == loss and abs(loss) < 1e3  # finite
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert changed, f"{arch} {kind}: no parameter changed"
    if kind == "dpo":
        assert loss == pytest.approx(0.6931472, abs=1e-5)  # policy == its frozen copy at step 0


class _NoCacheLlama(transformers.LlamaForCausalLM):
    """A causal LM whose forward names no KV cache nor position ids: the fast path cannot drive it."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def test_auto_falls_back_to_hf_with_one_line_saying_why():
    config = architecture_config("llama")
    model = _NoCacheLlama(config).eval()
    fallback = "generation_backend='auto' uses 'hf' for _NoCacheLlama: its forward"
    with pytest.warns(UserWarning, match=fallback) as record:
        out = generate_completions(
            model,
            PROMPTS,
            num_generations=1,
            max_new_tokens=4,
            eos_token_id=None,
            pad_token_id=TOK.pad_token_id,
            do_sample=False,
        )
    assert len(record) == 1 and "\n" not in str(record[0].message)
    with torch.no_grad():
        want = model.generate(
            input_ids=torch.tensor([PROMPTS[0]]),
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=TOK.pad_token_id,
        )[0, len(PROMPTS[0]) :]
    assert out.completion_ids[0].tolist() == want.tolist()


def test_lora_dpo_step_with_the_adapters_off_reference(arch, tmp_path):
    """LoRA on every linear layer of each family: one DPO step, the reference being the policy with its
    adapters disabled (no copy), log 2 at step 0, only adapter weights changed."""
    peft = pytest.importorskip("peft")
    model = build_architecture(arch).train()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = dpo_trainer(
        tmp_path, TOK, PAIRS[:2], model, peft_config=peft.LoraConfig(r=2, target_modules="all-linear"), **COMMON
    )
    trainer.train()
    assert trainer.ref_model is None
    assert trainer.state.log_history[0]["loss"] == pytest.approx(0.6931472, abs=1e-5)
    after = trainer.model.get_base_model().state_dict()
    lora = [k for k in after if "lora_B" in k]
    assert lora and all(after[k].abs().sum() > 0 for k in lora)  # B starts at 0: each one trained
    frozen = {k.replace(".base_layer", ""): v for k, v in after.items() if "lora_" not in k}
    assert frozen.keys() == base.keys() and all(torch.equal(frozen[k], v) for k, v in base.items())
