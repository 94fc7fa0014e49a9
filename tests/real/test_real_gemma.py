"""What Gemma 3 270M makes real (``gemma3``: tests/real/conftest.py): its 512-token sliding window on 5 of every 6
layers, and a base model's rows.

- The own sampler equals ``generate`` greedily on prompts and completions that cross the window (a 600-token prompt,
  whose prefill is past it, beside a 490-token one whose completion crosses it), single-turn and multi-turn (where
  the kept cache cannot hold sliding layers, the engine says so and re-prefills each turn), and its sampled
  log-probs equal a plain forward's over each row alone.
- A chat row on its tokenizer, which has no chat template, is refused in one line naming the fix.

The window logic itself (padding-free and shared-prefix forwards included) is checked on a tiny Gemma 3 with an 8-token
window in tests/generation/test_sliding_window.py."""

import copy
import warnings

import pytest
import torch

from treadle.engines.local import LocalEngine
from treadle.errors import UserError
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import left_pad
from treadle.trainers.dpo import DPOConfig, DPOTrainer
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from treadle.trainers.sft import SFTConfig, SFTTrainer

WINDOW = 512
LOGP_ATOL = 2e-4  # as tests/real/test_real_model.py: a cached, left-padded batch against one plain forward
STORY = (
    "The harbour town kept a ledger of every ship that came in. On the first day the Mary arrived with 12 barrels "
    "of salt, on the second the Osprey with 7 crates of tea, and on the third the Heron with 30 sacks of grain. "
)


@pytest.fixture
def gemma3(gemma3_pristine):
    model, tokenizer = gemma3_pristine
    return copy.deepcopy(model), tokenizer


def long_prompt(tokenizer, length: int) -> list[int]:
    ids = tokenizer(STORY * (length // 40 + 2))["input_ids"][: length - 4]
    return ids + tokenizer(" The ledger says", add_special_tokens=False)["input_ids"][:4]


def test_the_model_slides_its_window(gemma3_pristine):
    model, tokenizer = gemma3_pristine
    assert model.config.sliding_window == WINDOW and model.config.layer_types.count("sliding_attention") == 15
    assert tokenizer.chat_template is None and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_greedy_decoding_across_the_window_is_generate_token_for_token(gemma3_pristine):
    model, tokenizer = gemma3_pristine
    prompts = [long_prompt(tokenizer, 600), long_prompt(tokenizer, 490)]
    pad, new = tokenizer.pad_token_id, 40
    params = SamplingParams(num_generations=1, max_new_tokens=new, eos_token_ids=(), pad_token_id=pad, do_sample=False)
    ours = LocalEngine(model, backend="fast").generate(prompts, params)
    ids, mask = left_pad(prompts, pad)
    with torch.no_grad():
        theirs = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new,
            pad_token_id=pad,
            eos_token_id=None,
        )[:, ids.shape[1] :]
    assert torch.equal(ours.completion_ids, theirs), (ours.completion_ids != theirs).nonzero()[:5]
    assert len(prompts[0]) > WINDOW and len(prompts[1]) < WINDOW < len(prompts[1]) + new


def test_sampled_log_probs_across_the_window_are_a_plain_forward(gemma3_pristine):
    model, tokenizer = gemma3_pristine
    prompts = [long_prompt(tokenizer, 500)]
    params = SamplingParams(
        num_generations=2, max_new_tokens=24, eos_token_ids=(), pad_token_id=tokenizer.pad_token_id
    )
    out = LocalEngine(model, backend="fast").generate(prompts, params, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for row in range(2):
            completion = out.completion_ids[row]
            sequence = torch.cat([torch.tensor(prompts[0]), completion])[None]
            hidden = model.model(input_ids=sequence).last_hidden_state[0, len(prompts[0]) - 1 : -1]  # (24, H)
            logps = model.lm_head(hidden).log_softmax(-1).gather(1, completion[:, None]).squeeze(1)
            torch.testing.assert_close(out.sampling_logps[row], logps, rtol=0, atol=LOGP_ATOL)
    assert len(prompts[0]) < WINDOW < len(prompts[0]) + 24


def test_multi_turn_across_the_window_says_it_re_prefills_and_is_generate_turn_by_turn(gemma3_pristine):
    model, tokenizer = gemma3_pristine
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    prompt = long_prompt(tokenizer, 500)
    fed = tokenizer(" Next, the Heron", add_special_tokens=False)["input_ids"]
    ends = (tokenizer.eos_token_id, *newline, *tokenizer(".", add_special_tokens=False)["input_ids"])
    params = SamplingParams(
        num_generations=1, max_new_tokens=48, eos_token_ids=ends, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    turns = []

    def respond(row, turn_ids):
        turns.append(turn_ids)
        return fed if len(turns) == 1 else None

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = LocalEngine(model, backend="auto").generate_turns([prompt], respond, params)
    assert any("re-prefills each turn" in str(w.message) for w in caught)
    transcript, expected = list(prompt), []
    for turn in range(2):
        with torch.no_grad():
            new = model.generate(
                input_ids=torch.tensor([transcript]),
                do_sample=False,
                max_new_tokens=48 - len(expected),
                eos_token_id=list(ends),
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(transcript) :].tolist()
        new = new[: next((i + 1 for i, t in enumerate(new) if t in ends), len(new))]
        expected, transcript = expected + new, transcript + new
        if turn == 0:
            assert new[-1] in ends and len(expected) + len(fed) < 48, new  # the set-up: a second turn follows
            expected, transcript = expected + fed, transcript + fed
    n = int(out.completion_mask[0].sum())
    assert out.completion_ids[0, :n].tolist() == expected, (tokenizer.decode(expected), turns)
    assert len(prompt) < WINDOW < len(prompt) + n


@pytest.mark.parametrize("trainer", ["sft", "dpo", "grpo"])
def test_chat_rows_on_a_tokenizer_without_a_template_are_one_line(tmp_path, gemma3, trainer):
    """A base model's rows are text; a chat row is refused before training, in one line naming the fix."""
    model, tokenizer = gemma3
    chat = [{"role": "user", "content": "What is 2+3?"}]
    answer = [{"role": "assistant", "content": "5."}]
    common = dict(output_dir=str(tmp_path), max_steps=1, report_to="none", disable_tqdm=True)
    with pytest.raises(UserError) as error:
        if trainer == "sft":
            SFTTrainer(
                model, SFTConfig(**common), train_dataset=[{"messages": chat + answer}], processing_class=tokenizer
            )
        elif trainer == "dpo":
            rows = [{"prompt": chat, "chosen": answer, "rejected": answer}]
            DPOTrainer(model, DPOConfig(**common), train_dataset=rows, processing_class=tokenizer)
        else:
            args = GRPOConfig(**common, per_device_train_batch_size=2, num_generations=2, max_completion_length=4)
            GRPOTrainer(
                model,
                reward_funcs=lambda completions, **_: [0.0] * len(completions),
                args=args,
                train_dataset=[{"prompt": chat}] * 2,
                processing_class=tokenizer,
            ).train()
    message = str(error.value)
    assert "\n" not in message and "has no chat template" in message and "give the rows as text" in message
