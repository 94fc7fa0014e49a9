"""Same rows, same numbers as TRL 1.16 on both real models (``real_model``: SmolLM2-135M-Instruct and Gemma 3 270M):
what tests/test_parity_trl.py checks on the toy model, where the toy cannot reach. SmolLM2: a BPE tokenizer, a ChatML
template that injects its own system prompt and ends a turn with ``<|im_end|>`` and a newline, eos = pad, 30 layers
of grouped-query attention, tied embeddings; its rows are chats. Gemma 3: a base model without a chat template, so
its rows are the same questions and answers as plain text (``Question: ...\nAnswer:`` and `` answer``), a tokenizer
that adds bos, pad apart from eos, sliding-window attention, a 262k vocabulary (the chunked losses).

Each test builds TRL's trainer and treadle's on copies of the same model, the same rows in the same order, the same
batch, seed, precision (float32) and optimizer, compares the token ids and loss masks both prepare, then the logs of
two steps: step 1 on the model as loaded, step 2 after one update. SGD, not AdamW: a real step's cost is the forward
and backward, which SGD adds little to, and its update is linear in the gradient, so rounding differences between
the libraries stay rounding differences (AdamW's first step is about lr x sign(g), which turns them into whole steps;
tests/test_parity_trl.py checks AdamW on toys).

Tolerance: ``rel=1e-4``, ``abs=1e-5`` near 0. Both run the same float32 maths along different paths (treadle packs
rows without padding and runs a shared prompt once, TRL pads; reductions run in other orders), so they agree to
rounding: measured, losses, gradient norms, summed log-probs and mean logits at most 2.3e-5 apart relative (a
summed log-prob of -10 to -30 to 1.4e-4). A mis-tokenised or mis-masked token moves a loss or a log-prob sum by far
more, and the token checks catch it before any step. DPO's and KTO's rewards are beta x log-ratios, differences of
two to four such sums: to ``abs=beta * 1e-3``.

SmolLM2's half takes about 2 minutes (measured twice: 119-122 s of tests, 134-144 s with the imports, on 2 cores
under a load of 2-3): six tests, two libraries, two steps each; Gemma's is in docs/models.md."""

import copy

import pytest
import torch
import trl  # the dev extras install TRL (pyproject.toml): a missing TRL is an error here, not a skip
from _factories import TRL_ONLY, FixedCompletions, in_order, length_reward, train_logs, trl_rollout
from datasets import Dataset
from transformers import AutoModelForSequenceClassification

import treadle

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # TRL's notes on the reference, padding-free, ...
]

REL, ABS = 1e-4, 1e-5
LOG_RATIO_ABS = 1e-3  # a log-ratio of summed log-probs: the difference of two to four sums, each to about 2e-4
BETA_REWARDS = {"rewards/chosen", "rewards/rejected", "rewards/margins"}  # beta x log-ratios (DPO, KTO)
STEPS = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=1,
    max_steps=2,
    optim="sgd",
    learning_rate=1e-2,  # a clipped step (gradient norms 7-25): DPO's step-2 log-ratios 0.1-0.3, GRPO's KL 0.2
    max_grad_norm=1.0,
    lr_scheduler_type="constant",
    warmup_steps=0,
    weight_decay=0.0,
    seed=0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    dataloader_pin_memory=False,
)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# short rows of different lengths: a batch pads, and the pad is eos (<|im_end|>), which a label must not lose
PROMPTS = [user("What is 2+3?"), user("Capital of France?"), user("Name a colour."), user("Say hi.")]
ANSWERS = [("2+3 is 5.", "It is 6."), ("Paris.", "Rome, I think."), ("Blue.", "Seven."), ("Hi there!", "No.")]
PAIRS = [{"prompt": [p], "chosen": [assistant(c)], "rejected": [assistant(r)]} for p, (c, r) in zip(PROMPTS, ANSWERS)]


def text(chat: list[dict], *, prompt: bool = False) -> str:
    """A chat's content as a base model's plain text: a question as ``Question: ...\nAnswer:``, an answer after a
    space."""
    content = chat[0]["content"]
    return f"Question: {content}\nAnswer:" if prompt else f" {content}"


def as_text(row: dict) -> dict:
    """A chat row with each field as plain text (the prompt, the completion / chosen / rejected); others kept."""
    return {k: text(v, prompt=k == "prompt") if isinstance(v, list) else v for k, v in row.items()}


def rows_for(tok, rows: list[dict]) -> list[dict]:
    """The rows as chats for a tokenizer with a chat template, else as plain text."""
    return rows if tok.chat_template else [as_text(r) for r in rows]


SFT_ROWS = {
    "prompt_completion": [{"prompt": r["prompt"], "completion": r["chosen"]} for r in PAIRS],
    # one chat with its own system prompt (the template then injects none) and two assistant turns
    "messages": [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                user("What is 2+3?"),
                assistant("5."),
                user("And 2+4?"),
                assistant("6."),
            ]
        }
    ]
    + [{"messages": r["prompt"] + r["chosen"]} for r in PAIRS[1:]],
    # a base model's language-modelling rows: the loss on every token
    "text": [{"text": text(r["prompt"], prompt=True) + text(r["chosen"])} for r in PAIRS],
}
SFT_FORMS = {"smollm2": ["prompt_completion", "messages"], "gemma3": ["prompt_completion", "text"]}


def assert_same_logs(theirs, ours, keys, *, beta=None):
    """Every step's ``keys`` (those the step logged: GRPO logs rewards only at a generation's first step) in ``ours``
    as in ``theirs``, to rel=REL, abs=ABS; with ``beta``, the rewards (rewards/chosen, /rejected, /margins) to
    abs=beta * LOG_RATIO_ABS."""
    a, b = train_logs(theirs), train_logs(ours)
    assert [h["step"] for h in a] == [h["step"] for h in b] == [1, 2]
    for step, (x, y) in enumerate(zip(a, b), start=1):
        logged = [k for k in keys if k in x]
        assert logged == [k for k in keys if k in y], step
        for key in logged:
            tolerance = beta * LOG_RATIO_ABS if beta is not None and key in BETA_REWARDS else ABS
            assert y[key] == pytest.approx(x[key], rel=REL, abs=tolerance), (step, key)


def assert_moved(trainer):
    """Step 2's loss differs from step 1's by far more than the tolerance. With the policy as its own reference,
    step 1's DPO and KTO losses are the same for any rows (log 2; the weighted mean of 1 - sigmoid(0)): step 2's
    differs only by the update, so this says that step 2 compared the updates."""
    first, second = train_logs(trainer)[:2]
    assert abs(second["loss"] - first["loss"]) > 1e-3, (first["loss"], second["loss"])


# ---- SFT --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", [0, 1], ids=["prompt_completion", "messages_or_text"])
def test_sft_tokens_masks_and_losses_match_trl(tmp_path, real_model, real_key, form):
    """TRL tokenises each chat row whole and takes the completion from where prompt and prompt + completion diverge;
    treadle renders the completion after the prompt (trainers/sft.py, departure 1): the same ids for ChatML. Before
    adf409a treadle appended a second <|im_end|> after the template's ``<|im_end|>\\n`` (step 1: 0.637, TRL 0.678)."""
    model, tok = real_model
    form = SFT_FORMS[real_key][form]
    rows = rows_for(tok, SFT_ROWS[form])
    args = dict(STEPS, max_length=128)
    theirs = trl.SFTTrainer(
        model=copy.deepcopy(model),
        processing_class=tok,
        train_dataset=Dataset.from_list(rows),
        args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), train_sampling_strategy="sequential", **TRL_ONLY, **args),
    )
    ours = in_order(treadle.SFTTrainer)(
        model, treadle.SFTConfig(output_dir=str(tmp_path / "t"), **args), train_dataset=rows, processing_class=tok
    )
    assert len(ours.train_dataset) == len(rows)
    for a, b in zip(theirs.train_dataset, ours.train_dataset, strict=True):
        assert b["input_ids"] == a["input_ids"], tok.decode(a["input_ids"])
        labels = [t if keep else -100 for t, keep in zip(b["input_ids"], b["completion_mask"])]
        assert labels == a["labels"], tok.decode(a["input_ids"])
        if tok.chat_template:
            assert tok.decode(b["input_ids"][-3:]) in (".<|im_end|>\n", "!<|im_end|>\n")  # the turn's end, no eos
        else:  # bos first, eos last, once each
            assert b["input_ids"][0] == tok.bos_token_id and b["input_ids"][-1] == tok.eos_token_id
            assert b["input_ids"].count(tok.eos_token_id) == b["input_ids"].count(tok.bos_token_id) == 1
        prompt_masked = form == "prompt_completion"  # messages and text rows: the loss on every token, as TRL
        assert (0 in b["completion_mask"]) is prompt_masked
    theirs.train()
    ours.train()
    assert_same_logs(theirs, ours, ["loss", "grad_norm"])


# ---- DPO --------------------------------------------------------------------------------------------------------
DPO_METRICS = [
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
]


def test_dpo_tokens_loss_and_logps_match_trl(tmp_path, real_model):
    """Step 1 (policy = reference): the log-probs of chosen and rejected; step 2: the loss and the log-probs after one
    update. max_prompt_length=None: treadle's own prompt cap, which TRL 1.16 has not (dpo.py, departure 4)."""
    model, tok = real_model
    pairs = rows_for(tok, PAIRS)
    args = dict(STEPS, beta=0.1, max_length=128)
    theirs = trl.DPOTrainer(
        model=copy.deepcopy(model),
        ref_model=copy.deepcopy(model),
        processing_class=tok,
        train_dataset=Dataset.from_list(pairs),
        args=trl.DPOConfig(
            output_dir=str(tmp_path / "trl"),
            train_sampling_strategy="sequential",
            loss_type=["sigmoid"],
            **TRL_ONLY,
            **args,
        ),
    )
    ours = in_order(treadle.DPOTrainer)(
        model,
        args=treadle.DPOConfig(output_dir=str(tmp_path / "t"), max_prompt_length=None, **args),
        train_dataset=pairs,
        processing_class=tok,
    )
    for a, b in zip(theirs.train_dataset, ours.train_dataset, strict=True):
        assert b["prompt_input_ids"] == a["prompt_ids"], tok.decode(a["prompt_ids"])
        assert b["chosen_input_ids"] == a["chosen_ids"], tok.decode(a["chosen_ids"])
        assert b["rejected_input_ids"] == a["rejected_ids"], tok.decode(a["rejected_ids"])
    theirs.train()
    ours.train()
    assert_same_logs(theirs, ours, DPO_METRICS, beta=args["beta"])
    assert_moved(theirs)


# ---- KTO --------------------------------------------------------------------------------------------------------
# unpaired rows, a desirable and an undesirable one in every batch of 2
KTO_ROWS = [
    {"prompt": [p], "completion": [assistant(answers[i % 2])], "label": i % 2 == 0}
    for i, (p, answers) in enumerate(zip(PROMPTS, ANSWERS))
]
KTO_METRICS = [
    "loss",
    "grad_norm",
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
]


def test_kto_tokens_and_loss_match_trl(tmp_path, real_model):
    """TRL 1.16 has KTOTrainer at the top level (trl.KTOTrainer). Both trainers read the rows in order, so each batch's
    KL completions are its own completions rotated by one (kto.py, departure 3)."""
    model, tok = real_model
    kto_rows = rows_for(tok, KTO_ROWS)
    args = dict(STEPS, beta=0.5, max_length=128, desirable_weight=1.4, undesirable_weight=0.6)
    theirs = trl.KTOTrainer(
        model=copy.deepcopy(model),
        ref_model=copy.deepcopy(model),
        processing_class=tok,
        train_dataset=Dataset.from_list(kto_rows),
        args=trl.KTOConfig(output_dir=str(tmp_path / "trl"), train_sampling_strategy="sequential", **TRL_ONLY, **args),
    )
    ours = in_order(treadle.KTOTrainer)(
        model,
        args=treadle.KTOConfig(output_dir=str(tmp_path / "t"), **args),
        train_dataset=kto_rows,
        processing_class=tok,
    )
    for a, b in zip(theirs.train_dataset, ours.train_dataset, strict=True):
        assert b["prompt_input_ids"] == a["prompt_ids"], tok.decode(a["prompt_ids"])
        assert b["completion_input_ids"] == a["completion_ids"], tok.decode(a["completion_ids"])
        assert b["KL_completion_input_ids"] == a["KL_completion_ids"]
        assert b["label"] == a["label"]
    theirs.train()
    ours.train()
    assert_same_logs(theirs, ours, KTO_METRICS, beta=args["beta"])
    assert_moved(theirs)


# ---- GRPO -------------------------------------------------------------------------------------------------------
def grpo_completions(tok) -> list[list[int]]:
    """One group of four completions: three turns that end with eos (<|im_end|>, also the pad), one cut at
    max_completion_length (10 tokens, no eos)."""
    ended = [tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for text in ("5.", "2+3 is 5.")]
    ended.append(tok("Five.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    cut = tok("Let me think step by step about two plus three", add_special_tokens=False)["input_ids"][:10]
    assert len(cut) == 10 and all(len(c) < 10 for c in ended), [len(c) for c in ended]
    return [ended[0], cut, ended[1], ended[2]]


GRPO_METRICS = [
    "loss",
    "grad_norm",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "rewards/length_reward/mean",
    "rewards/length_reward/std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
]


def test_grpo_loss_matches_trl_on_fixed_completions(tmp_path, real_model, monkeypatch):
    """Neither trainer samples: both train on the same four completions of one chat prompt (treadle: a ``generate``
    override; TRL: a ``rollout_func`` that renders the prompt with the chat template). One generation, used twice
    (num_iterations=2): step 1 on-policy, step 2 with the importance ratio and the KL to the reference after a step.
    Step 1's dapo loss is -sum(A_i L_i) / sum(L_i) (ratio 1, KL 0): it holds the completion masks and the rewards;
    entropy holds the logits."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tok = real_model
    fixed = grpo_completions(tok)
    prompt = [user("What is 2+3?")] if tok.chat_template else text([user("What is 2+3?")], prompt=True)
    rows = Dataset.from_list([{"prompt": prompt}] * 4)  # one prompt: the order of the rows cannot matter

    def render(prompt):
        if isinstance(prompt, str):  # plain text: the tokenizer's own special tokens (Gemma's bos)
            return tok(prompt)["input_ids"]
        text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    args = dict(
        STEPS,
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=1,
        num_iterations=2,
        max_completion_length=10,
        beta=0.1,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        temperature=1.0,
        use_bias_correction_kl=True,
    )
    theirs = trl.GRPOTrainer(
        model=copy.deepcopy(model),  # its reference: loaded again from the folder (config._name_or_path)
        reward_funcs=length_reward,
        processing_class=tok,
        train_dataset=rows,
        rollout_func=trl_rollout(fixed, render),
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), **TRL_ONLY, **args),
    )

    class Ours(FixedCompletions):
        completions = fixed

    ours = Ours(
        model,
        reward_funcs=length_reward,
        args=treadle.GRPOConfig(output_dir=str(tmp_path / "t"), max_prompt_length=None, **args),
        train_dataset=rows,
        processing_class=tok,
    )
    theirs.train()
    ours.train()
    assert ours.prompts_seen == [render(prompt)] * 4  # treadle renders the chat prompt as TRL's rollout does
    a = train_logs(theirs)
    assert all(k in a[0] for k in GRPO_METRICS)  # every metric of the list is compared at least at step 1
    assert_same_logs(theirs, ours, GRPO_METRICS)
    assert a[0]["reward_std"] > 0 and a[0]["completions/clipped_ratio"] == 0.25
    assert a[1]["kl"] > 0 and a[1]["loss"] != a[0]["loss"]


# ---- reward model -----------------------------------------------------------------------------------------------
def test_reward_model_tokens_and_loss_match_trl(tmp_path, real_folder, real_pristine):
    """A one-label sequence classifier on the real model (a fresh score head, seeded), read at each row's last token
    that is not the pad: the newline after the final <|im_end|> in both libraries' chat rows, eos in text rows."""
    _, tok = real_pristine
    pairs = rows_for(tok, PAIRS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(real_folder, num_labels=1)
    assert model.config.pad_token_id == tok.pad_token_id
    args = dict(STEPS, max_length=128)
    theirs = trl.RewardTrainer(
        model=copy.deepcopy(model),
        processing_class=tok,
        train_dataset=Dataset.from_list(pairs),
        args=trl.RewardConfig(
            output_dir=str(tmp_path / "trl"), train_sampling_strategy="sequential", **TRL_ONLY, **args
        ),
    )
    ours = in_order(treadle.RewardTrainer)(
        model,
        args=treadle.RewardConfig(output_dir=str(tmp_path / "t"), **args),
        train_dataset=pairs,
        processing_class=tok,
    )
    # TRL tokenises prompt + response as one chat, treadle the response after the prompt (reward.py, departure 2)
    for a, b in zip(theirs.train_dataset, ours.train_dataset, strict=True):
        assert b["prompt_input_ids"] + b["chosen_input_ids"] == a["chosen_ids"], tok.decode(a["chosen_ids"])
        assert b["prompt_input_ids"] + b["rejected_input_ids"] == a["rejected_ids"], tok.decode(a["rejected_ids"])
    theirs.train()
    ours.train()
    assert_same_logs(theirs, ours, ["loss", "grad_norm", "accuracy", "margin", "mean_reward"])
    assert train_logs(theirs)[0]["margin"] != 0
