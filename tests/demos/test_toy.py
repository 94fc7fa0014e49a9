"""Tests for treadle.toy: the character tokenizer, the tiny Llama, the addition task and its verifiers."""

import re
import string

import pytest
import torch

from treadle.demos import toy

PUNCT = string.punctuation


def char_id(c):
    """Id of a character, worked out from the documented layout: 7 specials, digits, letters, punct."""
    for offset, alphabet in ((7, string.digits), (17, string.ascii_letters), (69, PUNCT), (101, " \n")):
        if c in alphabet:
            return offset + alphabet.index(c)
    raise KeyError(c)


@pytest.fixture(scope="module")
def tokenizer():
    return toy.build_tokenizer()


# ---------------------------------------------------------------------------------------------- tokenizer


def test_vocabulary_layout(tokenizer):
    assert len(tokenizer) == 7 + 10 + 52 + 32 + 2 == 103
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (
        0,
        1,
        2,
        3,
    )
    assert tokenizer.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"]) == [4, 5, 6]


def test_encoding_is_one_token_per_character_without_bos_or_eos(tokenizer):
    ids = tokenizer("12+3=", add_special_tokens=True)["input_ids"]
    assert ids == [8, 9, 79, 10, 87] == [char_id(c) for c in "12+3="]


def test_every_known_character_round_trips(tokenizer):
    text = toy.CHARACTERS + "  Hello,\n world! 99+1=100\n\n"
    ids = tokenizer(text)["input_ids"]
    assert ids == [char_id(c) for c in text]
    assert tokenizer.decode(ids) == text


def test_special_tokens_and_role_markers_are_atomic(tokenizer):
    ids = tokenizer("<|user|>1+1=<|assistant|>2</s><pad><s>")["input_ids"]
    assert ids == [5, 8, 79, 8, 87, 6, 9, 2, 0, 1]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "1+1=2"


def test_unknown_characters_become_unk(tokenizer):
    assert tokenizer("a\u00e9b")["input_ids"] == [char_id("a"), 3, char_id("b")]


def test_padding_side_is_settable():
    right = toy.build_tokenizer()(["1", "123"], padding=True)["input_ids"]
    left = toy.build_tokenizer(padding_side="left")(["1", "123"], padding=True)["input_ids"]
    assert right == [[8, 0, 0], [8, 9, 10]]
    assert left == [[0, 0, 8], [8, 9, 10]]


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|system|>Add.\n<|user|>1+2=\n<|assistant|>3</s>"
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|system|>Add.\n<|user|>1+2=\n<|assistant|>"
    encoded = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    assert encoded["input_ids"][-3:] == [6, char_id("3"), 2]  # the assistant turn ends with eos
    mask = encoded["assistant_masks"]
    assert mask == [0] * (len(mask) - 2) + [1, 1]  # the answer and its eos, not the role marker


def test_save_and_reload_round_trip(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path, padding_side="left")
    text = "<|user|>37+45=\n<|assistant|>82</s>"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.decode(reloaded(text)["input_ids"]) == text
    assert reloaded.chat_template == tokenizer.chat_template
    assert (reloaded.pad_token_id, reloaded.eos_token_id, len(reloaded)) == (0, 2, 103)
    assert reloaded.padding_side == "left"


# ---------------------------------------------------------------------------------------------- model


def llama_parameter_count(vocab, hidden, layers, intermediate):
    """Tied embedding + per layer (q, k, v, o; gate, up, down; two RMSNorms) + final norm."""
    return vocab * hidden + layers * (4 * hidden**2 + 3 * hidden * intermediate + 2 * hidden) + hidden


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_model_sizes(size, tokenizer):
    model = toy.build_model(size, tokenizer=tokenizer)
    shape = toy.MODEL_SIZES[size]
    expected = llama_parameter_count(103, shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"])
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.lm_head.weight is model.model.embed_tokens.weight
    config = model.config
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    assert config.max_position_embeddings == toy.MAX_POSITIONS


def test_model_is_deterministic_per_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    first = toy.build_model(seed=7)
    assert torch.equal(torch.rand(3), before)  # building consumed none of the caller's random numbers
    second = toy.build_model(seed=7)
    other = toy.build_model(seed=8)
    for (name, a), b in zip(first.named_parameters(), second.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_model_forward_and_vocab_override(tokenizer):
    model = toy.build_model(vocab_size=128, tokenizer=tokenizer)
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, 6, 128)
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="unknown model size"):
        toy.build_model("huge")


# ---------------------------------------------------------------------------------------------- tasks


def pairs_of(dataset):
    return [tuple(map(int, re.fullmatch(r"(\d+)\+(\d+)=", p).groups())) for p in dataset["prompt"]]


def test_addition_splits_are_disjoint_and_cover_every_pair():
    train = pairs_of(toy.load_task("addition", "train"))
    test = pairs_of(toy.load_task("addition", "test"))
    assert (len(train), len(test)) == (9000, 1000)
    assert len(set(train)) == 9000 and len(set(test)) == 1000
    assert set(train) | set(test) == {(a, b) for a in range(100) for b in range(100)}
    # a problem and its commuted twin are in the same split
    assert {(b, a) for a, b in test} == set(test)
    assert not {(min(p), max(p)) for p in train} & {(min(p), max(p)) for p in test}


def test_seed_changes_order_not_membership():
    test0 = pairs_of(toy.load_task("addition", "test", seed=0))
    test1 = pairs_of(toy.load_task("addition", "test", seed=1))
    assert test0 != test1 and set(test0) == set(test1)
    assert pairs_of(toy.load_task("addition", "test", seed=0)) == test0
    assert pairs_of(toy.load_task("toy:addition", "test", n=10, seed=0)) == test0[:10]
    # every kind lists the same problems in the same order, so an SFT run and a DPO/GRPO run agree
    for kind in ("preference", "rl"):
        assert pairs_of(toy.load_task("addition", "test", kind=kind, seed=1)) == test1


def test_sft_rows():
    ds = toy.load_task("addition", "train", kind="sft", n=300)
    assert ds.column_names == ["prompt", "completion"]
    for (a, b), completion in zip(pairs_of(ds), ds["completion"]):
        assert completion == str(a + b)  # no eos, no padding, no leading zeros


def test_rl_and_chat_rows():
    rl = toy.load_task("addition", "test", kind="rl", n=50, seed=3)
    assert rl.column_names == ["prompt", "answer"]
    assert all(ans == str(a + b) for (a, b), ans in zip(pairs_of(rl), rl["answer"]))
    chat = toy.load_task("addition", "test", kind="chat", n=50, seed=3)
    assert chat.column_names == ["messages"]
    assert chat[0]["messages"] == [
        {"role": "user", "content": rl[0]["prompt"]},
        {"role": "assistant", "content": rl[0]["answer"]},
    ]


def test_preference_rows_are_plausible_and_wrong():
    ds = toy.load_task("addition", "train", kind="preference")
    assert ds.column_names == ["prompt", "chosen", "rejected"]
    kinds = set()
    for (a, b), chosen, rejected in zip(pairs_of(ds), ds["chosen"], ds["rejected"]):
        total = a + b
        assert chosen == str(total) and rejected != chosen
        wrong = int(rejected)
        if abs(wrong - total) == 1:
            kinds.add("off by one")
        elif abs(wrong - total) == 10:
            kinds.add("off by ten")
        else:
            digits = str(total)
            assert rejected == digits[:-2] + digits[-1] + digits[-2], (a, b, rejected)
            assert not rejected.startswith("0")
            kinds.add("swapped digits")
    assert kinds == {"off by one", "off by ten", "swapped digits"}


def test_load_task_errors():
    with pytest.raises(ValueError, match="unknown toy task"):
        toy.load_task("multiplication")
    with pytest.raises(ValueError, match="split"):
        toy.load_task("addition", "validation")
    with pytest.raises(ValueError, match="kind"):
        toy.load_task("addition", kind="dpo")
    with pytest.raises(ValueError, match="1..1000"):
        toy.load_task("addition", "test", n=1001)


# ---------------------------------------------------------------------------------------------- rewards


def test_addition_reward():
    completions = [
        "46",
        " 46 ",
        "46\n12",
        "46</s><pad>",
        "4",
        "046",
        "",
        "47",
        [{"role": "assistant", "content": "46"}],
        [{"role": "assistant", "content": "64"}],
    ]
    rewards = toy.addition_reward(
        ["12+34="] * 10, completions, ["46"] * 10, completion_ids=[[0]] * 10, other_column=[1] * 10
    )
    assert rewards == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert toy.addition_reward(["1+1="], ["2"], [2]) == [1.0]  # a numeric answer column works too
    with pytest.raises(ValueError):
        toy.addition_reward(["1+1="], ["2", "3"], ["2"])


# ---------------------------------------------------------------------------------------------- evaluation


def reference_greedy(model, tokenizer, prompt, max_new_tokens):
    """Independent greedy decode: one unpadded prompt at a time, argmax of the full forward pass."""
    ids = tokenizer(prompt)["input_ids"]
    new = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            next_id = model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax().item()
        if next_id == tokenizer.eos_token_id:
            break
        new.append(next_id)
    return tokenizer.decode(new, skip_special_tokens=True)


@pytest.fixture(scope="module")
def half_trained(tokenizer):
    """A tiny model fitted for a second on 32 problems: it gets about half of them right."""
    data = toy.load_task("addition", "train", kind="sft", n=32, seed=5)
    prompts = [tokenizer(p)["input_ids"] for p in data["prompt"]]
    rows = [p + tokenizer(c)["input_ids"] + [2] for p, c in zip(prompts, data["completion"])]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    labels = ids.masked_fill(ids == 0, -100)
    for i, prompt in enumerate(prompts):
        labels[i, : len(prompt)] = -100
    model = toy.build_model(seed=1, tokenizer=tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for _ in range(50):
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, toy.load_task("addition", "train", kind="rl", n=32, seed=5)


def test_greedy_completions_match_unpadded_reference(half_trained, tokenizer):
    model, data = half_trained
    prompts = data["prompt"][:12] + ["1+2=", "99+99="]  # mixed lengths: left padding must not matter
    got = toy.greedy_completions(model, tokenizer, prompts, batch_size=5, max_new_tokens=4)
    assert got == [reference_greedy(model, tokenizer, p, 4) for p in prompts]


def test_exact_match_accuracy_matches_reference(half_trained, tokenizer):
    model, data = half_trained
    model.train()
    accuracy = toy.exact_match_accuracy(model, tokenizer, data, batch_size=16)
    assert model.training  # mode restored
    model.eval()
    expected = sum(
        reference_greedy(model, tokenizer, p, 4).strip() == a for p, a in zip(data["prompt"], data["answer"])
    ) / len(data)
    assert 0.0 < expected < 1.0  # the check is informative only if some, not all, are right
    assert accuracy == pytest.approx(expected)
    sft = toy.load_task("addition", "train", kind="sft", n=32, seed=5)
    assert toy.exact_match_accuracy(model, tokenizer, sft) == pytest.approx(expected)
    assert not model.training  # eval mode restored too


def test_exact_match_accuracy_on_chat_rows(tokenizer):
    model = toy.build_model(seed=2, tokenizer=tokenizer)
    chat = toy.load_task("addition", "test", kind="chat", n=8)
    prompt = tokenizer.apply_chat_template(chat[0]["messages"][:1], add_generation_prompt=True, tokenize=False)
    assert prompt == f"<|user|>{chat[0]['messages'][0]['content']}\n<|assistant|>"
    expected = (
        sum(
            reference_greedy(
                model, tokenizer, tokenizer.apply_chat_template(m[:1], add_generation_prompt=True, tokenize=False), 4
            ).strip()
            == m[1]["content"]
            for m in chat["messages"]
        )
        / 8
    )
    assert toy.exact_match_accuracy(model, tokenizer, chat) == pytest.approx(expected)
