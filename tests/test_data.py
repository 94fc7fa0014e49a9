"""Samplers: deterministic, resumable, split across ranks; RepeatSampler for GRPO. The text rules every trainer
shares: chat detection, validation and rendering, prompt special tokens, eos, pad id, fast int tensors; and in a run,
prompts cut to max_prompt_length noted once, a tool-call turn the template cannot render and a tokenizer without a
chat template named before training."""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _factories import add, grpo_trainer, sft, sft_trainer

from treadle.data import RepeatSampler, SeededSampler, collator_for, require_columns
from treadle.demos import toy
from treadle.errors import UserError
from treadle.packing import long_tensor, right_padded
from treadle.rollouts.runner import RolloutRunner
from treadle.text import (
    encode_prompt,
    encode_prompts,
    is_conversation,
    pad_token_id,
    render_chat_prompt,
    split_chat_completion,
    with_eos,
)


def test_seeded_sampler_is_a_function_of_seed_and_epoch():
    a, b = SeededSampler(10, seed=1), SeededSampler(10, seed=1)
    assert list(a) == list(b) and sorted(a) == list(range(10))
    a.set_epoch(1)
    assert list(a) != list(b) and sorted(a) == list(range(10))


def test_seeded_sampler_skips_without_changing_the_order():
    s = SeededSampler(10, seed=1)
    s.set_epoch(2)
    full = list(s)
    s.start_epoch(2, skip=4)
    assert list(s) == full[4:] and len(s) == 6


def test_seeded_sampler_splits_across_ranks_and_pads():
    ranks = [SeededSampler(5, seed=0, shuffle=False, rank=r, world_size=2) for r in range(2)]
    assert [list(r) for r in ranks] == [[0, 2, 4], [1, 3, 0]]


def test_repeat_sampler_groups_and_repeats():
    s = RepeatSampler(4, mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=False)
    assert list(s) == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3] and len(s) == 16


def test_repeat_sampler_same_prompts_on_every_rank():
    ranks = [
        list(RepeatSampler(6, mini_repeat_count=3, batch_size=2, shuffle=True, seed=5, rank=r, world_size=2))
        for r in range(2)
    ]
    merged = [ranks[r][i * 3 : (i + 1) * 3] for i in range(len(ranks[0]) // 3) for r in range(2)]
    flat = [x for chunk in merged for x in chunk]
    assert all(len(set(flat[i : i + 3])) == 1 for i in range(0, len(flat), 3))  # groups stay whole across ranks
    assert sorted(set(flat)) == list(range(6))


def test_repeat_sampler_rejects_uneven_splits():
    with pytest.raises(ValueError, match="cannot be split evenly over 4 ranks"):
        RepeatSampler(8, mini_repeat_count=3, batch_size=2, world_size=4)


def test_require_columns_names_what_is_missing():
    from datasets import Dataset

    with pytest.raises(ValueError, match=r"needs column\(s\) \['chosen'\] but the dataset has \['prompt'\]"):
        require_columns(Dataset.from_list([{"prompt": "x"}]), ["prompt", "chosen"], what="DPOTrainer")


# ---- text rules ---------------------------------------------------------------------------------------------
BOS, EOS, USER, ASSISTANT = 1, 2, 5, 6  # the toy tokenizer's ids
CHAT_PROMPT = [{"role": "user", "content": "1+2="}]
CHAT_ANSWER = [{"role": "assistant", "content": "3"}]


def ids_of(text):
    return [7 + toy.CHARACTERS.index(c) for c in text]


@pytest.fixture(scope="module")
def tokenizer():
    return toy.build_tokenizer()


@pytest.fixture(scope="module")
def bos_tokenizer():
    """The toy tokenizer, but adding a bos like Llama's: the special-tokens rule becomes visible."""
    from tokenizers.processors import TemplateProcessing

    tok = toy.build_tokenizer()
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return tok


def test_is_conversation_means_a_list_of_role_dicts():
    assert is_conversation(CHAT_PROMPT) and is_conversation(tuple(CHAT_PROMPT)) and is_conversation([])
    assert not is_conversation("1+2=")
    assert not is_conversation(["1+2="])
    assert not is_conversation([{"content": "no role"}])


def test_render_chat_prompt_ends_with_the_generation_prompt(tokenizer):
    assert render_chat_prompt(tokenizer, CHAT_PROMPT) == "<|user|>1+2=\n<|assistant|>"


def test_text_prompts_get_the_special_tokens_and_rendered_chats_do_not(bos_tokenizer):
    assert encode_prompt(bos_tokenizer, "12+3=") == [BOS] + ids_of("12+3=")
    # the template wrote its own special tokens (here none): no bos is added in front of them
    assert encode_prompt(bos_tokenizer, CHAT_PROMPT) == [USER] + ids_of("1+2=\n") + [ASSISTANT]
    assert encode_prompts(bos_tokenizer, ["7=", CHAT_PROMPT, "8="]) == [
        [BOS] + ids_of("7="),
        [USER] + ids_of("1+2=\n") + [ASSISTANT],
        [BOS] + ids_of("8="),
    ]
    assert encode_prompts(bos_tokenizer, []) == []


def test_encode_prompt_with_the_toy_tokenizer(tokenizer):
    assert encode_prompt(tokenizer, "12+3=") == ids_of("12+3=")  # no bos: the toy tokenizer adds none
    assert encode_prompt(tokenizer, CHAT_PROMPT) == [USER] + ids_of("1+2=\n") + [ASSISTANT]


def test_split_chat_completion_is_what_the_whole_chat_adds_after_the_prompt(tokenizer):
    prompt_text, completion_text = split_chat_completion(tokenizer, CHAT_PROMPT, CHAT_ANSWER)
    assert (prompt_text, completion_text) == ("<|user|>1+2=\n<|assistant|>", "3</s>")


def test_split_chat_completion_names_both_texts_when_the_prompt_is_not_a_prefix():
    tok = toy.build_tokenizer()
    # a template whose generation prompt ("<|assistant|>\n") differs from how it opens an assistant turn
    tok.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    )
    with pytest.raises(ValueError) as error:
        split_chat_completion(tok, CHAT_PROMPT, CHAT_ANSWER)
    message = str(error.value)
    assert "'<|user|>1+2=<|assistant|>\\n'" in message  # the rendered prompt
    assert "'<|user|>1+2=<|assistant|>3'" in message  # the whole chat
    assert "not a prefix" in message and "fix the template" in message


@pytest.mark.parametrize(
    "messages, needle",
    [
        (
            [{"role": "hacker", "content": "hi"}],
            "the train dataset, row 1: column 'messages', message 0 has role 'hacker', which no chat template renders",
        ),
        ([{"role": "user"}], "the train dataset, row 1: column 'messages', message 0 (user) has no 'content'"),
    ],
)
def test_chat_messages_of_an_unknown_role_or_without_content_name_the_row(tmp_path, messages, needle):
    from treadle.data import DatasetFileError

    ok = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    with pytest.raises(DatasetFileError) as error:
        sft(tmp_path, [{"messages": ok}, {"messages": messages}])
    assert needle in str(error.value) and len(str(error.value)) < 300


def test_with_eos_appends_once():
    assert with_eos([5, 6], EOS) == [5, 6, EOS]
    assert with_eos(with_eos([5, 6], EOS), EOS) == [5, 6, EOS]
    assert with_eos([], EOS) == [EOS]
    assert with_eos([5], None) == [5]


def test_pad_token_id_order_is_override_pad_eos_zero(capsys):
    both = SimpleNamespace(pad_token_id=3, eos_token_id=EOS)
    assert pad_token_id(both) == 3
    assert pad_token_id(both, override=9) == 9
    assert pad_token_id(both, override=0) == 0  # 0 is an id, not "unset"
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=EOS)) == EOS
    assert pad_token_id(None) == 0 and capsys.readouterr().err == ""
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0
    assert "no pad or eos token" in capsys.readouterr().err


def test_the_default_collator_pads_with_eos_when_there_is_no_pad():
    collate = collator_for(SimpleNamespace(pad_token_id=None, eos_token_id=EOS))
    assert collate([{"input_ids": [7, 8]}, {"input_ids": [9]}])["input_ids"].tolist() == [[7, 8], [9, EOS]]


def test_long_tensor_and_right_padded_rows():
    got = long_tensor([1, 2, 3, 4, 5, 6], (2, 3))
    assert got.dtype == torch.int64 and got.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert long_tensor(list(np.arange(4)), (2, 2)).tolist() == [[0, 1], [2, 3]]  # datasets may hand numpy ints
    assert long_tensor([], (0, 3)).shape == (0, 3)  # torch.frombuffer refuses an empty buffer
    padded = right_padded([[1, 2, 3], [4]], 4, 0)
    assert padded.dtype == torch.int64 and padded.tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    assert right_padded([np.array([1, 2]), [3]], 2, 9).tolist() == [[1, 2], [3, 9]]


# ---- chat rows and prompts in a run -------------------------------------------------------------------------
CHAT = [{"role": "system", "content": "You add."}, {"role": "user", "content": "12+34="}]


@pytest.mark.usefixtures("one_thread")
def test_cut_prompts_are_noted_once_with_what_was_lost(tmp_path, tok, capsys):
    rows = [{"prompt": CHAT}] * 4 + [{"prompt": "1+1="}] * 4
    trainer = grpo_trainer(tmp_path, tok, rows, max_prompt_length=8)
    prompts = trainer.encode_prompts(rows)
    assert tok.decode(prompts.ids[0]) == "12+34=\n<|assistant|>"  # the last 8 tokens: the end is kept, as TRL
    trainer.encode_prompts(rows)
    err = capsys.readouterr().err
    assert err.count("treadle: 1 of 2 prompts is longer than max_prompt_length=8 tokens") == 1
    assert "the first lost '<|system|>You add." in err and "raise max_prompt_length to " in err


@pytest.mark.usefixtures("one_thread")
def test_the_tool_runners_cut_prompts_are_noted_too(tok, capsys):
    runner = RolloutRunner(tok, tools=[add])
    assert runner.encode_prompts([CHAT, "1+1="], 5)[1] == tok("1+1=")["input_ids"]
    assert "1 of 2 prompts is longer than max_prompt_length=5" in capsys.readouterr().err
    runner.close()


@pytest.mark.usefixtures("one_thread")
def test_a_tool_call_turn_the_template_cannot_render_names_the_row(tmp_path, tok):
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{}"}}]}
    good = [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"}]
    rows = [{"messages": good}, {"messages": good}, {"messages": [good[0], call, good[1]]}]
    with pytest.raises(UserError, match=r"^row 2: the chat template of .* cannot render the tool-call turn .*'add'"):
        sft_trainer(tmp_path, tok, rows=rows)
    rows[2]["messages"][1] = {**call, "content": ""}  # rendered as an empty turn: the call silently dropped
    with pytest.raises(UserError, match=r"^row 2: .* renders the tool-call turn .* without its call to 'add'"):
        sft_trainer(tmp_path, tok, rows=rows)
    adding = copy.copy(tok)
    adding.chat_template = "{% for m in messages %}{{ m['role'] + 1 }}{% endfor %}"  # a TypeError of the template's
    with pytest.raises(UserError, match=r"cannot render the chat \[\{'role': 'user'.*\(TypeError: .*\); fix the row"):
        render_chat_prompt(adding, good[:1])


@pytest.mark.usefixtures("one_thread")
def test_a_tokenizer_without_a_chat_template_is_named_before_training(tmp_path, dataset):
    from transformers import AutoTokenizer

    plain = toy.build_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "tokenizer")
    plain = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in dataset["prompt"][:8]]
    needle = rf"tokenizer '{tmp_path / 'tokenizer'}' has no chat template; set tokenizer.chat_template"
    with pytest.raises(UserError, match=needle):
        grpo_trainer(tmp_path, plain, rows, model=toy.build_model("tiny", tokenizer=plain))
    with pytest.raises(UserError, match=needle):  # SFT's chat rows too
        sft_trainer(tmp_path, plain, rows=[{"messages": rows[0]["prompt"] + [{"role": "assistant", "content": "2"}]}])
