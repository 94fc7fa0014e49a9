"""Preference rows as token ids: the tokenisation DPO and the reward model share (KTO splits its paired rows with
``split_implicit_prompt`` too).

``tokenize_row`` turns a row ``{prompt, chosen, rejected}`` (text or chat messages), ``{chosen, rejected}`` sharing a
prompt prefix (the implicit prompt), or one already holding the three ``ID_COLUMNS``, into ``{prompt_input_ids,
chosen_input_ids, rejected_input_ids}``: tokenised (text responses end with eos, chat ones as the template ends an
assistant turn), truncated (the prompt to ``max_prompt_length``, keeping ``truncation_mode``'s end, then the responses
to fit ``max_length``, keeping their start) and checked (an empty prompt or response, text mixed with chat, or a prompt
that leaves no room for a response is an error naming the row). These rules are DPO's departures 4-6 from TRL
(trainers/dpo.py).

Module-level functions, so that ``dataset_num_proc`` workers can pickle them.
"""

from __future__ import annotations

from treadle.text import encode_prompt_responses, is_conversation

ID_COLUMNS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")


def split_implicit_prompt(chosen, rejected):
    """``(prompt, chosen_rest, rejected_rest)``: the longest common prefix of two conversations (lists of
    messages, compared whole) or two strings (compared character by character), and what follows it.

    >>> split_implicit_prompt("Q: 2+2= 4", "Q: 2+2= 5")
    ('Q: 2+2= ', '4', '5')
    """
    n, limit = 0, min(len(chosen), len(rejected))
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    return chosen[:n], chosen[n:], rejected[n:]


def _tokenize_texts(tokenizer, prompt, chosen, rejected, index: int) -> tuple[list[int], list[int], list[int]]:
    """Token ids of a text or chat pair; text responses end with eos (trainers/dpo.py's docstring, 5)."""
    for name, response in (("chosen", chosen), ("rejected", rejected)):
        empty = (not response) or (is_conversation(response) and not any(m.get("content") for m in response))
        if empty:
            raise ValueError(
                f"row {index}: the {name} response is empty; every pair needs two non-empty "
                f"responses (drop or fix this row)"
            )
    chat = is_conversation(chosen)
    if chat != is_conversation(rejected) or chat != is_conversation(prompt):
        raise ValueError(
            f"row {index}: prompt, chosen and rejected must all be text or all be lists of chat "
            f"messages, got {type(prompt).__name__}, {type(chosen).__name__}, "
            f"{type(rejected).__name__}"
        )
    prompt_ids, (chosen_ids, rejected_ids) = encode_prompt_responses(tokenizer, prompt, (chosen, rejected))
    return prompt_ids, chosen_ids, rejected_ids


def _truncate(
    prompt: list[int],
    chosen: list[int],
    rejected: list[int],
    index: int,
    *,
    max_length,
    max_prompt_length,
    truncation_mode,
) -> tuple[list[int], list[int], list[int]]:
    if max_prompt_length is not None and len(prompt) > max_prompt_length:
        prompt = prompt[:max_prompt_length] if truncation_mode == "keep_start" else prompt[-max_prompt_length:]
    if max_length is not None:
        room = max_length - len(prompt)
        if room < 1:
            raise ValueError(
                f"row {index}: the prompt has {len(prompt)} tokens, which leaves no room for a "
                f"response within max_length={max_length}; raise max_length, or set "
                f"max_prompt_length below it so that long prompts are truncated"
            )
        chosen, rejected = chosen[:room], rejected[:room]
    return prompt, chosen, rejected


def tokenize_row(
    row: dict, index: int, *, tokenizer, max_length: int | None, max_prompt_length: int | None, truncation_mode: str
) -> dict[str, list[int]]:
    """One dataset row -> ``{prompt_input_ids, chosen_input_ids, rejected_input_ids}``, truncated.

    Rows that already hold the three id columns are only truncated and checked. Raises ValueError, naming
    the row, for an empty response, an empty prompt, or a prompt too long for ``max_length``.
    """
    if all(row.get(c) is not None for c in ID_COLUMNS):
        prompt, chosen, rejected = (list(row[c]) for c in ID_COLUMNS)
    else:
        if tokenizer is None:
            raise ValueError(
                "DPOTrainer needs a tokenizer (processing_class=...) to tokenise text or chat "
                "rows, or rows that already hold " + ", ".join(ID_COLUMNS)
            )
        prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
        if prompt is None:
            prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
        prompt, chosen, rejected = _tokenize_texts(tokenizer, prompt, chosen, rejected, index)
    if not prompt:
        raise ValueError(
            f"row {index}: the prompt has no tokens, so the first response token has nothing to "
            f"be predicted from; give a non-empty prompt (or a tokenizer that adds a bos token)"
        )
    for name, ids in (("chosen", chosen), ("rejected", rejected)):
        if not ids:
            raise ValueError(f"row {index}: the {name} response has no tokens; drop or fix this row")
    prompt, chosen, rejected = _truncate(
        prompt,
        chosen,
        rejected,
        index,
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        truncation_mode=truncation_mode,
    )
    return {"prompt_input_ids": prompt, "chosen_input_ids": chosen, "rejected_input_ids": rejected}


__all__ = ["tokenize_row", "split_implicit_prompt"]
