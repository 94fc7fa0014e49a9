"""The text rules every trainer shares: pure functions of a tokenizer and rows, one home each (trainers call
them, never restate them):

- a *conversation* is a list (or tuple) of message dicts with a ``"role"``; anything else is text;
- a conversation prompt is rendered by the chat template with the generation prompt; a completion is the text
  the whole chat adds after that prompt, which must be a prefix of it;
- a text prompt is encoded *with* the tokenizer's special tokens (e.g. a bos), a rendered conversation
  *without* them (the template wrote its own); completions never get them (they continue a prompt);
- ``with_eos`` appends eos unless the ids already end with it; ``eos_ids`` reads an eos id or ids as a tuple;
- padding uses an explicit override, else the tokenizer's pad, else its eos, else 0 (``pad_token_id``);
- chat messages need a chat template, and a template that fails on a row (a tool-call turn it cannot render) is
  one line naming the tokenizer or the row (``apply_chat_template``, ``ChatTemplateError``);
- prompts cut to ``max_prompt_length`` keep their end, with one note of what was cut (``cut_prompts``);
- token ids lie in the model's vocabulary (``token_id_problem``), and ``<unk>`` in tokenised rows is counted
  (``unknown_share``): a tokenizer without a token for a character writes it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from treadle.errors import UserError, shorten


def is_conversation(value) -> bool:
    """Whether ``value`` is chat messages: a list or tuple of dicts that each have a ``"role"`` (an empty list
    is an empty chat).

    >>> is_conversation([{"role": "user", "content": "1+1="}]), is_conversation("1+1=")
    (True, False)
    """
    return isinstance(value, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in value)


class ChatTemplateError(UserError, ValueError):
    """Chat messages the tokenizer cannot render: it has no chat template, or its template fails on a turn (a
    tool call given to a template without tool support): one line naming the tokenizer or the row, and the fix."""


RENDER_OPTIONS = ("add_generation_prompt", "continue_final_message", "tools", "documents", "chat_template")


def tokenizer_name(tokenizer) -> str:
    """The tokenizer's folder or Hub id (``name_or_path``), else its class name, for a message."""
    return repr(getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__)


def check_chat_template(tokenizer) -> None:
    """ChatTemplateError unless ``tokenizer`` has a chat template (rows of chat messages need one)."""
    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"the data holds chat messages but the tokenizer {tokenizer_name(tokenizer)} has no chat template; "
            f"set tokenizer.chat_template (or put a chat_template.jinja in the tokenizer's folder), or give the "
            f"rows as text"
        )


def apply_chat_template(tokenizer, chat, *, row: int | None = None, **options):
    """``tokenizer.apply_chat_template(chat, **options)``; ``chat`` is one conversation, or a batch of them whose
    first is dataset row ``row``. A missing template, or one that fails on a turn, is one ChatTemplateError line
    naming the tokenizer, the row (when known) and the turn, not a jinja traceback; so is a template that renders
    a tool-call turn without its call (one without tool support prints the turn's empty content)."""
    check_chat_template(tokenizer)
    text_options = {k: v for k, v in options.items() if k in RENDER_OPTIONS} | {"tokenize": False}
    conversations = [chat] if is_conversation(chat) else list(chat or [])
    where = ["" if row is None else f"row {row + i}: " for i in range(len(conversations))]
    try:
        out = tokenizer.apply_chat_template(chat, **options)
    except Exception as error:
        if not _raised_by_template(error):
            raise
        i, failure = first_failure(tokenizer, conversations, text_options) if len(conversations) > 1 else (0, error)
        raise ChatTemplateError(f"{where[i]}{cannot_render(tokenizer, conversations[i], failure or error)}") from None
    for i, conversation in enumerate(conversations):
        if any(isinstance(m, dict) and m.get("tool_calls") for m in conversation):
            dropped = dropped_call(conversation, tokenizer.apply_chat_template(conversation, **text_options))
            if dropped:
                raise ChatTemplateError(f"{where[i]}{dropped_message(tokenizer, *dropped)}")
    return out


def first_failure(tokenizer, conversations: list, text_options: dict) -> tuple[int, BaseException | None]:
    """The index of the first conversation of a batch that the template fails on, and its error."""
    for i, conversation in enumerate(conversations):
        try:
            tokenizer.apply_chat_template(conversation, **text_options)
        except Exception as error:
            return i, error
    return 0, None


def dropped_call(conversation, text: str) -> tuple[dict, str] | None:
    """``(turn, function name)`` of the first tool call whose function's name the rendered ``text`` lacks."""
    for message in conversation:
        for call in (message.get("tool_calls") or []) if isinstance(message, dict) else []:
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if name and str(name) not in text:
                return message, str(name)
    return None


def dropped_message(tokenizer, turn: dict, name: str) -> str:
    return (
        f"the chat template of {tokenizer_name(tokenizer)} renders the tool-call turn {shorten(repr(turn), 120)} "
        f"without its call to {name!r} (a template without tool support), so the model would learn an empty turn; "
        f"give the tokenizer a chat template that renders tool_calls (tokenizer.chat_template), or write the call "
        f"into the assistant's content as text"
    )


def cannot_render(tokenizer, conversation, error: BaseException) -> str:
    """What the template failed on (a tool-call turn, else the chat) and the fix, for ChatTemplateError."""
    reason = " ".join(f"{type(error).__name__}: {error}".split())[:160]
    name = tokenizer_name(tokenizer)
    calls = [m for m in conversation if isinstance(m, dict) and m.get("tool_calls")] if conversation else []
    if calls:
        return (
            f"the chat template of {name} cannot render the tool-call turn {shorten(repr(calls[0]), 120)} "
            f"({reason}); give the tokenizer a chat template that renders tool_calls (tokenizer.chat_template), "
            f"or write the call into the assistant's content as text"
        )
    return (
        f"the chat template of {name} cannot render the chat {shorten(repr(list(conversation or [])), 120)} "
        f"({reason}); fix the row or the template (tokenizer.chat_template)"
    )


def _raised_by_template(error: BaseException) -> bool:
    """Whether ``error`` is the chat template's: a jinja error, or one raised in the template's own code (None +
    a string, ``raise_exception``), not one of treadle's or transformers' bugs."""
    import jinja2  # optional: transformers needs it for chat templates only, and a template just failed

    if isinstance(error, jinja2.TemplateError):
        return True
    frame = error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code.co_filename == "<template>":
            return True
        frame = frame.tb_next
    return False


def render_chat_prompt(tokenizer, messages) -> str:
    """The chat template's text for ``messages`` followed by the generation prompt (what the model answers)."""
    return apply_chat_template(tokenizer, list(messages), tokenize=False, add_generation_prompt=True)


def split_chat_completion(tokenizer, prompt, completion) -> tuple[str, str]:
    """``(prompt_text, completion_text)`` of a chat pair: the prompt rendered with the generation prompt, and
    the text that the whole chat (prompt messages then completion messages) adds after it.

    Raises ValueError when the rendered prompt is not a prefix of the whole chat, as the completion could
    then not be split off.
    """
    prompt_text = render_chat_prompt(tokenizer, prompt)
    full_text = apply_chat_template(tokenizer, list(prompt) + list(completion), tokenize=False)
    if not full_text.startswith(prompt_text):
        raise ValueError(
            f"the chat template renders the prompt with its generation prompt as {prompt_text!r}, "
            f"which is not a prefix of the whole conversation {full_text!r}, so the completion "
            f"cannot be split off; fix the template (the prompt with add_generation_prompt=True "
            f"must begin the whole chat) or give the rows as text"
        )
    return prompt_text, full_text[len(prompt_text) :]


def encode_prompt_responses(tokenizer, prompt, responses: Sequence) -> tuple[list[int], list[list[int]]]:
    """Token ids of a prompt and of responses to it, tokenised separately (the preference and reward-model rule):
    the prompt by ``encode_prompt``; a chat response (a list of messages, after chat-message prompts) as the
    template renders it after the prompt; a text response without special tokens, eos appended unless present."""
    chat = is_conversation(prompt)
    texts = [split_chat_completion(tokenizer, prompt, r)[1] if chat else r for r in responses]
    ids = encode_texts(tokenizer, texts, special_tokens=False)
    if not chat:  # a chat response ends the way the template ends an assistant turn
        ids = [with_eos(x, tokenizer.eos_token_id) for x in ids]
    return encode_prompt(tokenizer, prompt), ids


def encode_texts(tokenizer, texts: Sequence[str], *, special_tokens: bool) -> list[list[int]]:
    """Token ids of each text, with or without the tokenizer's special tokens, in one batched call."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=special_tokens)["input_ids"]]


def encode_prompts(tokenizer, prompts: Sequence) -> list[list[int]]:
    """Token ids of each prompt: text with the tokenizer's special tokens (e.g. a bos); a conversation rendered
    by ``render_chat_prompt`` and encoded without them, since the template wrote its own."""
    chat = [is_conversation(p) for p in prompts]
    texts = [render_chat_prompt(tokenizer, p) if c else p for p, c in zip(prompts, chat)]
    ids: list[list[int]] = [[] for _ in prompts]
    for is_chat in (False, True):  # one batched tokenizer call per kind
        where = [i for i, c in enumerate(chat) if c is is_chat]
        encoded = encode_texts(tokenizer, [texts[i] for i in where], special_tokens=not is_chat)
        for i, row in zip(where, encoded):
            ids[i] = row
    return ids


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids of one prompt (text or chat messages), as ``encode_prompts``."""
    return encode_prompts(tokenizer, [prompt])[0]


def cut_prompts(tokenizer, prompt_ids: Sequence[list[int]], max_prompt_length: int | None):
    """``(ids, note)``: each prompt's last ``max_prompt_length`` tokens (the start is cut, as TRL's GRPO cuts on the
    left: the end, which the completion continues, stays) and, when any prompt was cut, a one-line note counting
    them (each distinct prompt once: a group repeats its prompt) and showing what the first one lost (a chat
    template's header and system prompt come first); else None.

    >>> from types import SimpleNamespace
    >>> tok = SimpleNamespace(decode=lambda ids, **kw: "".join(chr(96 + i) for i in ids))
    >>> ids, note = cut_prompts(tok, [[1, 2, 3, 4], [1, 2, 3, 4], [5]], 2)
    >>> ids
    [[3, 4], [3, 4], [5]]
    >>> print(note)  # doctest: +NORMALIZE_WHITESPACE
    treadle: 1 of 2 prompts is longer than max_prompt_length=2 tokens and lost its start (the first lost 'ab'; a
    chat template's header and system prompt come first): raise max_prompt_length to 4 or more (None keeps whole
    prompts)
    """
    if not max_prompt_length:
        return [list(ids) for ids in prompt_ids], None
    out = [list(ids[-max_prompt_length:]) for ids in prompt_ids]
    distinct = list(dict.fromkeys(tuple(ids) for ids in prompt_ids))
    cut = [ids for ids in distinct if len(ids) > max_prompt_length]
    if not cut:
        return out, None
    lost = tokenizer.decode(list(cut[0][: len(cut[0]) - max_prompt_length]), skip_special_tokens=False)
    lost = repr(lost if len(lost) <= 60 else lost[:60] + "...")
    longest = max(len(ids) for ids in cut)
    verb = "is" if len(cut) == 1 else "are"
    return out, (
        f"treadle: {len(cut)} of {len(distinct)} prompts {verb} longer than max_prompt_length={max_prompt_length} "
        f"tokens and lost {'its' if len(cut) == 1 else 'their'} start (the first lost {lost}; a chat template's "
        f"header and system prompt come first): raise max_prompt_length to {longest} or more (None keeps whole "
        f"prompts)"
    )


def with_eos(ids: list[int], eos_token_id: int | None) -> list[int]:
    """``ids`` ending with ``eos_token_id`` (appended unless already last; unchanged when it is None).

    >>> with_eos([5, 6], 2), with_eos([5, 2], 2), with_eos([5], None)
    ([5, 6, 2], [5, 2], [5])
    """
    if eos_token_id is None or (ids and ids[-1] == eos_token_id):
        return ids
    return ids + [eos_token_id]


def pad_token_id(tokenizer, override: int | None = None) -> int:
    """The id to pad ``input_ids`` with: ``override``, else the tokenizer's pad token, else its eos, else 0.

    Any valid id would do: padded positions are masked from attention and carry no loss. The pad token comes
    first because it is what the tokenizer itself pads with; eos next because tokenizers without a pad (GPT-2,
    Llama) conventionally pad with it; 0 last, with a note on stderr when a tokenizer has neither.
    """
    if override is not None:
        return override
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if candidate is not None:
            return candidate
    if tokenizer is not None:
        print(
            "treadle: the tokenizer has no pad or eos token; padding with id 0 (padded positions carry no "
            "loss and are masked from attention)",
            file=sys.stderr,
        )
    return 0


def eos_ids(eos_token_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """An eos id, a list of them or None (as ``generation_config.eos_token_id`` holds it), as a tuple.

    >>> eos_ids(2), eos_ids([2, 7]), eos_ids(None)
    ((2,), (2, 7), ())
    """
    if eos_token_id is None:
        return ()
    return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(int(t) for t in eos_token_id)


def token_id_problem(rows: Sequence[Sequence[int]], vocab_size: int, first_row: int | None = 0) -> str | None:
    """What is wrong with the first row of token ids holding an id outside ``[0, vocab_size)`` (a tokenizer of another
    model, or -100, which marks ignored labels, never inputs), naming the row (``first_row``: the index of ``rows[0]``;
    None: a streamed chunk's, not known); None when every id is one.

    >>> token_id_problem([[1, 2], [3, 9]], 5)
    'row 1 holds the id 9 at position 1'
    >>> token_id_problem([[1, -100]], 5, first_row=None) is None, token_id_problem([[4]], 5)
    (False, None)
    """
    for i, ids in enumerate(rows):
        for j, token in enumerate(ids):
            if not 0 <= token < vocab_size:
                row = f"row {first_row + i}" if first_row is not None else "a streamed row"
                return f"{row} holds the id {token} at position {j}"
    return None


def unknown_share(tokenizer, rows: Sequence[tuple[list[int], list[int]]]) -> tuple[int, int, int] | None:
    """``(unknown tokens, of them in the loss, tokens)`` of tokenised rows ``(ids, loss mask)``: the tokenizer's
    ``<unk>`` stands where it has no token for a character (an emoji, an accent, CJK); None when it has no unknown
    token or the rows hold none."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return None
    unknown = in_loss = total = 0
    for ids, mask in rows:
        total += len(ids)
        for token, loss in zip(ids, mask):
            if token == unk:
                unknown += 1
                in_loss += bool(loss)
    return (unknown, in_loss, total) if unknown else None
