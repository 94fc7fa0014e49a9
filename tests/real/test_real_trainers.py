"""Every trainer a step or two on the real SmolLM2-135M-Instruct (``smollm2``, tests/real/conftest.py), for what the
toy models hide: a BPE tokenizer that could merge tokens across the prompt / completion boundary, a ChatML template
that injects its own system prompt and ends a turn with ``<|im_end|>`` and a newline, eos = pad, grouped-query
attention (9 / 3 heads) and tied embeddings.

Each run checks that its losses are finite, that what it trains moved (every parameter; with LoRA the adapters and
nothing else), that no exact fast path (padding-free, shared-prefix, the hidden-state head) fell back on this model,
and the metric names it logs against TRL 1.16's for the same trainer. ``TRL_NAMES`` is read from TRL's source
(``self._metrics[mode][...]`` in trl/trainer/{dpo,kto,reward,grpo,distillation}_trainer.py, under the conditions these
runs meet) plus transformers' own ``loss``, ``grad_norm``, ``learning_rate`` and ``epoch``; ``DOCUMENTED`` and
``UNDOCUMENTED`` are what treadle leaves out of them, pinned so that a change either way shows.
"""

import copy
import math

import pytest
import torch
from _factories import dpo_trainer, grpo_trainer, sft_trainer

from treadle.logprobs import prefix
from treadle.trainers.distillation import DistillationConfig, DistillationTrainer
from treadle.trainers.kto import KTOConfig, KTOTrainer
from treadle.trainers.reward import RewardConfig, RewardTrainer

peft = pytest.importorskip("peft")
QA = [
    ("What is 2+2?", "2+2 is 4.", "2+2 is 5."),
    ("Name a primary colour.", "Red.", "Green, of course."),
    ("Say hello in French.", "Bonjour!", "Hola!"),
    ("What is the capital of Italy?", "Rome.", "Milan."),
]
SYSTEM = "You are a helpful AI assistant named SmolLM"  # what the template injects when a chat has no system turn
TURN_END = "<|im_end|>\n"  # how the template ends every turn


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


PROMPT_COMPLETION = [{"prompt": user(q), "completion": assistant(a)} for q, a, _ in QA]
MESSAGES = [{"messages": user(q) + assistant(a)} for q, a, _ in QA]
PAIRS = [{"prompt": user(q), "chosen": assistant(a), "rejected": assistant(b)} for q, a, b in QA]

# SmolLM2's own template with {% generation %} around what the assistant says (its content and the turn's end): the
# same text, and the markers transformers' return_assistant_tokens_mask needs (the shipped template has none)
GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# transformers.Trainer's own training log; each TRL trainer adds its names (read from its source, see the docstring)
BASE_NAMES = {"loss", "grad_norm", "learning_rate", "epoch"}
COMPLETION_NAMES = {
    "num_tokens",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
}
TRL_NAMES = {
    "dpo": BASE_NAMES
    | {"entropy", "num_tokens", "logits/chosen", "logits/rejected", "mean_token_accuracy"}
    | {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"}
    | {"logps/chosen", "logps/rejected"},
    "kto": BASE_NAMES
    | {"kl", "entropy", "num_tokens", "logits/chosen", "logits/rejected", "rewards/margins"}
    | {"rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected"},
    "reward": BASE_NAMES | {"num_tokens", "min_reward", "mean_reward", "max_reward", "accuracy", "margin"},
    # loss_type dapo, no entropy bonus (no policy_loss / entropy_coef); kl only with beta != 0
    "grpo": BASE_NAMES
    | COMPLETION_NAMES
    | {"rewards/digit_sum_reward/mean", "rewards/digit_sum_reward/std", "reward", "reward_std"}
    | {"frac_reward_zero_std", "entropy", "step_time"}
    | {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min"}
    | {"clip_ratio/high_max"},
    "distillation": BASE_NAMES | COMPLETION_NAMES | {"entropy", "step_time"},
}
# TRL's names that treadle does not log, pinned so that a change either way shows. DOCUMENTED: the trainer's module
# docstring or docs/coming-from-transformers-and-trl.md says so; UNDOCUMENTED: nothing says so.
DOCUMENTED = {
    "dpo": {"epoch", "entropy", "mean_token_accuracy"},  # epoch: in metrics.jsonl, not log_history
    "kto": {"epoch"},
    "reward": {"epoch", "min_reward", "max_reward"},
    "grpo": {"epoch", "clip_ratio/low_min", "clip_ratio/high_max"},
    "distillation": {"epoch", "entropy"},
}
UNDOCUMENTED = {"dpo": set(), "kto": set(), "reward": set(), "grpo": set(), "distillation": set()}
FALLBACK_WARNINGS = ("does not reproduce", "does not match", "runs its forwards unshared")


# ---- helpers ----------------------------------------------------------------------------------------------------
def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def moved(model, before: dict[str, torch.Tensor]) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


def trainable(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def lora() -> "peft.LoraConfig":
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def train_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_trains(trainer, before: dict[str, torch.Tensor], *, adapters: bool, steps: int) -> list[dict]:
    """Run ``trainer``: ``steps`` finite losses; what moved is every trainable parameter (``adapters``: LoRA's and
    nothing else). Returns the training logs."""
    names = trainable(trainer.model)
    if adapters:
        assert names and all("lora_" in n for n in names), sorted(names)[:5]
    else:
        assert names == set(before)  # full fine-tuning: everything trains
    trainer.train()
    logs = train_logs(trainer)
    assert len(logs) == steps and all(math.isfinite(h["loss"]) for h in logs), logs
    assert moved(trainer.model, before) == names
    return logs


def assert_trl_names(kind: str, logs: list[dict], also: frozenset = frozenset()) -> None:
    """Of TRL's names for ``kind`` (and ``also``, the ones this run's settings add), the run logged all but the
    pinned DOCUMENTED and UNDOCUMENTED ones."""
    logged = set().union(*logs)
    assert (TRL_NAMES[kind] | also) - logged == DOCUMENTED[kind] | UNDOCUMENTED[kind], sorted(logged)


def assert_no_fallback(recwarn) -> None:
    fallbacks = [str(w.message) for w in recwarn if any(s in str(w.message) for s in FALLBACK_WARNINGS)]
    assert not fallbacks


def chat_turns(tok, prompt: list[dict], completion: list[dict]) -> tuple[list[int], list[int]]:
    """The template's prompt with its generation prompt, and the whole chat, as ids (the template writes the
    special tokens itself)."""
    prompt_text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full_text = tok.apply_chat_template(prompt + completion, tokenize=False)
    assert prompt_text.startswith(f"<|im_start|>system\n{SYSTEM}") and prompt_text.endswith("<|im_start|>assistant\n")
    assert full_text == prompt_text + completion[0]["content"] + TURN_END
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(prompt_text), encode(full_text)


def assert_chat_response(tok, prompt_ids: list[int], response_ids: list[int]) -> None:
    """A preference row's prompt is the rendered chat up to the generation prompt (the injected system prompt
    first) and its response ends the turn as the template does, with no eos of its own after it."""
    prompt = tok.decode(prompt_ids)
    assert prompt.startswith(f"<|im_start|>system\n{SYSTEM}") and prompt.endswith("<|im_start|>assistant\n")
    assert tok.decode(response_ids).endswith(TURN_END) and response_ids.count(tok.eos_token_id) == 1


def assert_loss_on_the_answer(tok, ids_and_masks) -> None:
    """Token by token: the loss is on the tokens after the generation prompt (the answer, ``<|im_end|>``, ``\\n``)
    and nowhere else -- not the injected system prompt, not the user's turn."""
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    for (q, a, _), (ids, mask) in zip(QA, ids_and_masks, strict=True):
        prompt_ids, full_ids = chat_turns(tok, user(q), assistant(a))
        assert ids == full_ids  # the prompt and the completion tokenised apart = the whole chat tokenised
        assert mask == [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
        trained = [t for t, m in zip(ids, mask) if m]
        assert tok.decode(trained) == a + TURN_END
        assert trained[-2:] == [tok.eos_token_id, *newline] and trained.count(tok.eos_token_id) == 1
        assert q not in tok.decode(trained) and "SmolLM" not in tok.decode(trained)


# ---- SFT --------------------------------------------------------------------------------------------------------
def with_generation_template(tok):
    chatml = copy.copy(tok)
    chatml.chat_template = GENERATION_TEMPLATE
    return chatml


@pytest.mark.parametrize("tuning", ["full", "lora"])
@pytest.mark.parametrize("form", ["prompt_completion", "messages"])
def test_sft_trains_exactly_the_assistant_turn(tmp_path, smollm2, recwarn, form, tuning):
    """Conversational prompt/completion rows, and messages rows with ``assistant_only_loss`` (through SmolLM2's
    template with ``{% generation %}`` markers): the loss mask token by token against the rendered chat; two steps
    train every parameter (full) or the adapters alone (LoRA), the tied head staying tied."""
    model, tok = smollm2
    rows, extra = PROMPT_COMPLETION, {}
    if form == "messages":
        rows, tok, extra = MESSAGES, with_generation_template(tok), {"assistant_only_loss": True}
    if tuning == "lora":
        extra["peft_config"] = lora()
    trainer = sft_trainer(tmp_path, tok, rows, model, learning_rate=1e-4, **extra)
    dataset = trainer.train_dataset
    assert_loss_on_the_answer(tok, list(zip(dataset["input_ids"], dataset["completion_mask"])))
    batch = trainer.data_collator([dataset[i] for i in range(2)])
    for labels, ids, mask in zip(batch["labels"].tolist(), dataset["input_ids"], dataset["completion_mask"]):
        assert labels[: len(ids)] == [t if m else -100 for t, m in zip(ids, mask)]  # the collator keeps the mask
    logs = assert_trains(trainer, snapshot(trainer.model), adapters=tuning == "lora", steps=2)
    assert all("mean_token_accuracy" in h for h in logs)
    base = trainer.model.get_base_model() if tuning == "lora" else trainer.model
    assert base.lm_head.weight is base.model.embed_tokens.weight  # tied embeddings stay one tensor
    assert_no_fallback(recwarn)


def test_sft_chunked_and_compiled_is_the_full_logits_eager_run(tmp_path, smollm2, monkeypatch, capsys):
    """On a 49k vocabulary SFT takes the chunked hidden-state loss (no [B, T, V] logits); with ``torch_compile``
    (inductor, the CPU default) the blocks run compiled. Two steps of each against the eager full-logits run: the same
    losses and token accuracies within float tolerance, the same first gradient norm (the second differs by 1e-3:
    the first update's rounding, grown)."""
    from treadle.trainers import sft

    model, tok = smollm2
    calls = []
    real_nll = sft.chunked_nll
    monkeypatch.setattr(sft, "chunked_nll", lambda *a, **k: calls.append(1) or real_nll(*a, **k))
    compiled = sft_trainer(tmp_path / "c", tok, PROMPT_COMPLETION, copy.deepcopy(model), torch_compile=True)
    compiled.train()
    assert calls and "torch_compile compiled 30 blocks with inductor" in capsys.readouterr().out
    monkeypatch.setattr(sft.SFTTrainer, "_chunked_loss", lambda *a: None)  # the model's own loss, full logits
    eager = sft_trainer(tmp_path / "e", tok, PROMPT_COMPLETION, model)
    eager.train()
    for name in ("loss", "mean_token_accuracy", "grad_norm"):
        ours = [h[name] for h in compiled.state.log_history if "loss" in h]
        theirs = [h[name] for h in eager.state.log_history if "loss" in h]
        assert len(ours) == 2 and ours[0] == pytest.approx(theirs[0], rel=1e-4), name  # the same first step
        if name != "grad_norm":  # after one update at learning rate 1e-2 the rounding has grown to 1e-3 there
            assert ours[1] == pytest.approx(theirs[1], rel=2e-4), name


def test_sft_messages_without_generation_markers(tmp_path, smollm2):
    """SmolLM2's shipped template has no ``{% generation %}``: ``assistant_only_loss`` is refused in one line that
    says so, as TRL 1.16 refuses it (it has no training template to swap in for this one); without it a messages row
    trains on every token, the injected system prompt included (as TRL)."""
    model, tok = smollm2
    with pytest.raises(ValueError, match="generation"):
        sft_trainer(tmp_path, tok, MESSAGES, model, assistant_only_loss=True)
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    with pytest.raises(ValueError, match="not training-compatible"):
        trl.SFTTrainer(
            model=model,
            args=trl.SFTConfig(
                output_dir=str(tmp_path / "trl"), report_to="none", bf16=False, assistant_only_loss=True
            ),
            train_dataset=Dataset.from_list(MESSAGES),
            processing_class=tok,
        )
    trainer = sft_trainer(tmp_path, tok, MESSAGES, model)
    for (q, a, _), ids, mask in zip(QA, trainer.train_dataset["input_ids"], trainer.train_dataset["completion_mask"]):
        assert ids == chat_turns(tok, user(q), assistant(a))[1] and mask == [1] * len(ids)


@pytest.mark.parametrize("form", ["prompt_completion", "messages"])
def test_sft_rows_are_trl_s(tmp_path, smollm2, form):
    """TRL 1.16's SFTTrainer tokenises the same rows into the same ids and the same loss tokens (its labels), on the
    real tokenizer and template: conversational prompt/completion rows, and messages rows with
    ``assistant_only_loss`` through the template with ``{% generation %}``."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    model, tok = smollm2
    rows, extra = PROMPT_COMPLETION, {}
    if form == "messages":
        rows, tok, extra = MESSAGES, with_generation_template(tok), {"assistant_only_loss": True}
    theirs = trl.SFTTrainer(
        model=model,
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), report_to="none", bf16=False, **extra),
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
    ).train_dataset
    ours = sft_trainer(tmp_path / "ours", tok, rows, model, **extra).train_dataset
    assert theirs["input_ids"] == ours["input_ids"]
    assert [[int(label != -100) for label in r] for r in theirs["labels"]] == ours["completion_mask"]


# ---- packing ----------------------------------------------------------------------------------------------------
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "Paris is the capital of France.",
    "A prime number has exactly two divisors.",
    "The Moon orbits the Earth about once a month, and its phases follow.",
    "Bees make honey.",
]


def per_token_losses(model, input_ids, labels, **kwargs) -> torch.Tensor:
    """``(B, T-1)`` cross-entropies of each next token (0 where the label is -100); use_cache=False as the
    Trainer's loss: transformers reads packed rows from position_ids only without a cache and an attention mask."""
    logits = model(input_ids=input_ids, use_cache=False, **kwargs).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], reduction="none")


def test_packed_rows_lose_what_they_lose_alone(tmp_path, smollm2):
    """Packing real text (eos = pad closes each row, GQA, sdpa): each packed row's per-token losses are those of the
    row run alone, and the trainer's loss of the packed batch is that of the unpacked rows."""
    model, tok = smollm2
    model.eval()
    rows = [{"text": t} for t in TEXTS]
    packed = sft_trainer(tmp_path, tok, rows, model, packing=True, max_length=40)
    alone = sft_trainer(tmp_path, tok, rows, model)
    assert len(packed.train_dataset) < len(alone.train_dataset)
    batch = packed.data_collator(list(packed.train_dataset))
    unpacked = alone.data_collator(list(alone.train_dataset))
    with torch.no_grad():
        together = per_token_losses(model, batch["input_ids"], batch["labels"], position_ids=batch["position_ids"])
        leaky = per_token_losses(model, batch["input_ids"], batch["labels"])  # no position ids: rows attend across
        by_row = {}
        for ids in alone.train_dataset["input_ids"]:
            assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1
            by_row[tuple(ids)] = per_token_losses(model, torch.tensor([ids]), torch.tensor([ids]))[0]
        loss_packed = packed.compute_loss(model, batch)
        loss_alone = alone.compute_loss(model, unpacked)
    found = 0
    for r, positions in enumerate(batch["position_ids"].tolist()):
        starts = [t for t, p in enumerate(positions) if p == 0] + [len(positions)]
        for start, end in zip(starts, starts[1:]):
            ids = tuple(batch["input_ids"][r, start:end].tolist())
            if ids not in by_row:
                continue  # padding
            found += 1
            torch.testing.assert_close(together[r, start : end - 1], by_row[ids], rtol=1e-4, atol=1e-4)
            if start > 0:
                assert together[r, start - 1].item() == 0.0  # no label across the boundary
                assert not torch.allclose(leaky[r, start : end - 1], by_row[ids], atol=1e-2)  # the test can fail
    assert found == len(TEXTS)
    assert loss_packed.item() == pytest.approx(loss_alone.item(), rel=1e-5)


# ---- preference trainers ----------------------------------------------------------------------------------------
def test_dpo(tmp_path, smollm2, recwarn):
    model, tok = smollm2
    trainer = dpo_trainer(tmp_path, tok, PAIRS, model, max_steps=2, learning_rate=1e-5, logging_steps=1)
    for row in trainer.train_dataset:
        assert_chat_response(tok, row["prompt_input_ids"], row["chosen_input_ids"])
        assert_chat_response(tok, row["prompt_input_ids"], row["rejected_input_ids"])
    logs = assert_trains(trainer, snapshot(trainer.model), adapters=False, steps=2)
    assert logs[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-4)  # the policy starts as its reference
    assert_trl_names("dpo", logs)
    assert_no_fallback(recwarn)


def test_kto(tmp_path, smollm2, recwarn):
    model, tok = smollm2
    rows = [{"prompt": user(q), "completion": assistant(a), "label": True} for q, a, _ in QA[:2]]
    rows += [{"prompt": user(q), "completion": assistant(b), "label": False} for q, _, b in QA[2:]]
    args = KTOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = KTOTrainer(model, args=args, train_dataset=rows, processing_class=tok)
    for row in trainer.train_dataset:
        assert_chat_response(tok, row["prompt_input_ids"], row["completion_input_ids"])
    logs = assert_trains(trainer, snapshot(trainer.model), adapters=False, steps=1)
    assert logs[0]["kl"] == 0.0  # the policy starts as its reference (the estimate is clamped at 0)
    assert_trl_names("kto", logs)
    assert_no_fallback(recwarn)


def test_reward_model(tmp_path, smollm2_folder, smollm2):
    """A one-score head on SmolLM2 loaded by name (as TRL's RewardTrainer loads it); pad = eos, so the head reads
    each row's last token that is not ``<|im_end|>``: the newline that ends the assistant's turn."""
    _, tok = smollm2
    torch.manual_seed(0)  # the fresh score head
    args = RewardConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = RewardTrainer(smollm2_folder, args=args, train_dataset=PAIRS, processing_class=tok)
    assert trainer.model.config.pad_token_id == tok.eos_token_id
    row = trainer.train_dataset[0]
    assert tok.decode(row["chosen_input_ids"][-1:]) == "\n"
    logs = assert_trains(trainer, snapshot(trainer.model), adapters=False, steps=2)
    assert_trl_names("reward", logs)


# ---- on-policy trainers -----------------------------------------------------------------------------------------
# chat prompts of unequal lengths (left padding with pad = eos) that a short answer ends
GRPO_PROMPTS = [
    {"prompt": user(q)}
    for q in ("Say hi.", "Answer yes or no: is ice cold?", "Reply with one word: the colour of grass?", "Say 7.")
]


def count_shared_forwards(monkeypatch) -> list[int]:
    calls: list[int] = []
    forward = prefix._shared_forward
    monkeypatch.setattr(prefix, "_shared_forward", lambda *a: calls.append(1) or forward(*a))
    return calls


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_grpo_with_the_own_sampler_and_shared_prefixes(tmp_path, smollm2, recwarn, monkeypatch, tuning):
    """Two chat prompts a step (the injected system prompt makes them ~40 tokens, left-padded with pad = eos), 2
    completions of up to 8 tokens each from treadle's own sampler; the training forwards share each group's prompt.
    The reward functions see completions cut at their eos, decoded without special tokens. LoRA runs with beta > 0:
    its reference is the policy with the adapters off, and ``kl`` is logged (as TRL's, only when beta != 0)."""
    model, tok = smollm2
    seen, seen_prompts = [], []

    def digit_sum_reward(prompts, completions, completion_ids, **kwargs):  # rewards/digit_sum_reward/* in the logs
        seen.extend(zip(completions, completion_ids))
        seen_prompts.extend(prompts)
        return [float(sum(ids) % 5) for ids in completion_ids]

    shared = count_shared_forwards(monkeypatch)
    extra = {"peft_config": lora(), "beta": 0.04} if tuning == "lora" else {}
    trainer = grpo_trainer(
        tmp_path,
        tok,
        GRPO_PROMPTS,
        digit_sum_reward,
        model=model,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-5,
        logging_steps=1,
        report_to="none",
        seed=0,
        **extra,
    )
    assert trainer.args.shared_prefix
    logs = assert_trains(trainer, snapshot(trainer.model), adapters=tuning == "lora", steps=2)
    assert len(shared) >= (4 if tuning == "lora" else 2)  # the policy's forwards (and the reference's) ran shared
    if tuning == "lora":
        assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA's B starts at 0: the policy is its reference
    assert len(seen) == 8
    for completion, ids in seen:
        assert [m["role"] for m in completion] == ["assistant"] and "<|im_end|>" not in completion[0]["content"]
        assert 0 < len(ids) <= 8 and tok.eos_token_id not in ids[:-1]  # nothing after an eos, no pad (= eos) run
    ended = [ids for _, ids in seen if ids[-1] == tok.eos_token_id]
    assert ended  # some answers end within 8 tokens: the eos is theirs, not padding
    clipped = sum(h["completions/clipped_ratio"] for h in logs) / len(logs)
    assert clipped == pytest.approx(1 - len(ended) / len(seen))
    for log, generation in zip(logs, (seen[:4], seen[4:])):  # one generation of 4 completions a step
        lengths = [len(ids) for _, ids in generation if ids[-1] == tok.eos_token_id] or [0]  # none ended: 0 (TRL)
        assert log["completions/mean_terminated_length"] == pytest.approx(sum(lengths) / len(lengths))
        assert log["completions/max_terminated_length"] == max(lengths)
    prompt_tokens = sum(len(chat_turns(tok, p, assistant(""))[0]) for p in seen_prompts)  # the rendered chat prompt's
    assert logs[-1]["num_tokens"] == prompt_tokens + sum(len(ids) for _, ids in seen)
    assert_trl_names("grpo", logs, also=frozenset({"kl"}) if tuning == "lora" else frozenset())
    if tuning == "full":
        assert "kl" not in set().union(*logs)  # beta 0: no reference, no kl (as TRL)
    assert_no_fallback(recwarn)


def test_the_own_sampler_s_log_probs_are_the_trained_ones(tmp_path, smollm2):
    """The own sampler reports exact log-probs (``exact_logps``: no sampler correction applies). On the real model
    (GQA's KV cache, prompts left-padded with pad = eos, completions cut at eos) its log-probs of what it sampled are
    those of the training forward, shared-prefix and padding-free alike, to float32 rounding."""
    model, tok = smollm2
    trainer = grpo_trainer(
        tmp_path, tok, GRPO_PROMPTS, model=model, num_generations=2, max_completion_length=8, seed=0, report_to="none"
    )
    assert trainer.engine.exact_logps and not trainer.corrects_sampling
    rows = [GRPO_PROMPTS[0]] * 2 + [GRPO_PROMPTS[1]] * 2  # prompts of unequal length
    [sample] = trainer.generate_and_score(rows, 0)
    assert not sample.attention_mask[:, 0].all()  # one prompt is left-padded
    mask = sample.completion_mask.bool()
    for shared in (True, False):
        trainer.args.shared_prefix = shared
        trained = trainer.frozen_logps(trainer.model, sample)
        torch.testing.assert_close(trained[mask], sample.sampling_logps[mask], rtol=0, atol=1e-4)


def distillation_args(tmp_path, **overrides) -> DistillationConfig:
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    return DistillationConfig(**{**values, **overrides})


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_on_policy_distillation(tmp_path, smollm2, recwarn, tuning):
    """The real model teaches a copy of itself whose final norm is scaled by 0.7 (flatter next-token distributions:
    an exact copy would have nothing to learn); the student moves (LoRA: its adapters alone), the teacher does not."""
    teacher, tok = smollm2
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        student.model.norm.weight.mul_(0.7)
    trainer = DistillationTrainer(
        student,
        teacher,
        args=distillation_args(tmp_path),
        train_dataset=GRPO_PROMPTS,
        processing_class=tok,
        peft_config=lora() if tuning == "lora" else None,
    )
    teacher_before = snapshot(trainer.teacher_model)
    logs = assert_trains(trainer, snapshot(trainer.model), adapters=tuning == "lora", steps=2)
    assert all(h["loss"] > 0 for h in logs)
    assert not moved(trainer.teacher_model, teacher_before)
    assert_trl_names("distillation", logs)
    assert_no_fallback(recwarn)
