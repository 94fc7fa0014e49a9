"""The embedded default: a tiny model, a character tokenizer and synthetic tasks, all built in code.

Nothing here touches the network: the tokenizer is assembled with the ``tokenizers`` library, the model
from a ``LlamaConfig`` with random weights, and the data from Python's ``random`` with fixed seeds. This
is what ``treadle demo`` and the test suite train, so it must learn something real on a laptop CPU in
minutes.

Task ``addition`` (``toy:addition`` in a config): two numbers 0..99, prompt ``"12+34="``, answer ``"46"``.
The 10,000 ordered pairs are split once, by the fixed ``SPLIT_SEED``, into 9,000 train and 1,000 test
pairs. A pair and its commuted twin (``12+34`` and ``34+12``) always land in the same split, so the test
accuracy measures arithmetic rather than recall of the swapped problem.

Task ``tools``: 3-digit addition (``"123+456="`` -> ``"579"``; 20,000 train and 1,000 test problems, split the same
way), which the tiny model cannot learn in minutes but can solve by calling the ``calc`` tool
(``treadle demo --task tools``; ``tool_transcripts`` are its SFT rows).

Heavy libraries (transformers, datasets, tokenizers) are imported inside the functions that use them so
that ``import treadle`` stays cheap.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from treadle.models import eval_mode
from treadle.text import is_conversation, render_chat_prompt

if TYPE_CHECKING:  # pragma: no cover - for type checkers only
    from datasets import Dataset
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

# ----------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"
MAX_POSITIONS = 256  # longest sequence the toy model sees; toy prompts + answers are < 30 tokens

# A user or system turn ends with a newline, an assistant turn with eos: the model learns to stop there.
# The {% generation %} markers let `apply_chat_template(..., return_assistant_tokens_mask=True)` find the
# assistant tokens (answer and eos) for an assistant-only loss.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '</s>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer(*, padding_side: str = "right") -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per digit, ASCII letter, punctuation mark, space, newline.

    Ids: 0 ``<pad>``, 1 ``<s>``, 2 ``</s>``, 3 ``<unk>``, 4-6 the role markers ``<|system|>``,
    ``<|user|>``, ``<|assistant|>``, then the characters of ``CHARACTERS`` in order (103 tokens in all).
    Special tokens and role markers are matched whole; any other character becomes ``<unk>``.
    Encoding adds no bos/eos (decode(encode(s)) == s for every string made of known characters); the
    trainers append eos where a sequence should end. Saves and reloads with save_pretrained /
    AutoTokenizer.from_pretrained like any transformers tokenizer.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS.values()]
    vocab = {token: i for i, token in enumerate(specials + list(CHARACTERS))}
    # BPE without merges splits every word into single characters; no pre-tokenizer, so spaces and
    # newlines are ordinary tokens and survive the round trip.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.decoder = decoders.Fuse()  # join tokens with nothing in between
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=list(ROLE_TOKENS.values()),
        chat_template=CHAT_TEMPLATE,
        padding_side=padding_side,
        model_max_length=MAX_POSITIONS,
    )


# ----------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------

# Llama shapes by name. Parameter counts are for the 103-token toy vocabulary (embeddings tied).
MODEL_SIZES: dict[str, dict[str, int]] = {
    # 138k params: tests and `treadle demo`; trains in seconds to minutes on one CPU core.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256),
    # tiny with 2 heads of 32: vLLM's CPU attention has no kernel for tiny's head size 16 (`treadle demo --use-vllm`)
    "tiny32": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
    # 4.2M params: a stronger CPU baseline; minutes per thousand steps on a laptop.
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, intermediate_size=1024),
    # 33.6M params: benchmarks and GPU smoke runs; slow on CPU.
    "base": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=2048),
}


def build_model(
    size: str = "tiny",
    *,
    vocab_size: int | None = None,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerFast | None = None,
    reward_head: bool = False,
) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` of one of ``MODEL_SIZES``, identical for equal seeds
    (``reward_head=True``: a ``LlamaForSequenceClassification`` with one label, for ``trainer: reward``).

    Special-token ids and the vocabulary size come from ``tokenizer`` (the toy tokenizer when None);
    ``vocab_size`` overrides the size. The global torch RNG is left untouched.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(MODEL_SIZES)}")
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab_size if vocab_size is not None else len(tokenizer),
        num_key_value_heads=MODEL_SIZES[size]["num_attention_heads"],
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,  # one vocab x hidden matrix instead of two, as in small LMs
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **MODEL_SIZES[size],
    )
    if reward_head:
        config.num_labels = 1
    with torch.random.fork_rng(devices=[]):  # weights depend on `seed` only, not on the caller's RNG
        torch.manual_seed(seed)
        model = (LlamaForSequenceClassification if reward_head else LlamaForCausalLM)(config)
    if reward_head:
        return model
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def init_dtype(spec: str, model_init_kwargs: dict | None) -> torch.dtype:
    """The dtype a toy model ``spec`` (``toy:tiny``) is built in: ``model_init_kwargs``' ``dtype`` (or ``torch_dtype``;
    checked by ``TrainingArguments``; ``auto``: the toy's own float32). A toy is built in code, not read from files, so
    any other ``from_pretrained`` keyword (``gguf_file``, ``revision`` ...) means nothing for it: refused (ValueError,
    one line)."""
    kwargs = dict(model_init_kwargs or {})
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
    if kwargs:
        raise ValueError(
            f"model_init_kwargs {sorted(kwargs)} mean nothing for {spec}, which treadle builds in code (no files to "
            f"read): only dtype applies to it; drop them, or name a model folder or .gguf file as model:"
        )
    if dtype is None or dtype == "auto":
        return torch.float32
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))


# ----------------------------------------------------------------------------------------------------
# Tasks
# ----------------------------------------------------------------------------------------------------

SPLIT_SEED = 20240601  # fixes which problems are held out; never changes, so splits stay disjoint
ADDITION_TEST_PAIRS = 500  # unordered pairs {a, b}, a != b, held out -> 1,000 ordered test problems

Problem = dict[str, str]  # {"prompt": ..., "answer": ..., "rejected": ...}


def _addition_pairs(split: str) -> list[tuple[int, int]]:
    """The ordered (a, b) pairs of one split, sorted. Train: 9,000 pairs; test: 1,000 pairs."""
    unordered = [(a, b) for a in range(100) for b in range(a + 1, 100)]
    held_out = set(random.Random(SPLIT_SEED).sample(unordered, ADDITION_TEST_PAIRS))
    pairs = [(a, b) for a in range(100) for b in range(100)]
    return [(a, b) for a, b in pairs if ((min(a, b), max(a, b)) in held_out) == (split == "test")]


def addition_wrong_answer(a: int, b: int, rng: random.Random) -> str:
    """A plausible wrong sum, drawn uniformly from those that differ from ``a + b``: off by one, off by
    ten (a dropped or spurious carry), or its last two digits swapped (46 -> 64, 136 -> 163)."""
    total = str(a + b)
    candidates = {str(a + b + delta) for delta in (-10, -1, 1, 10) if a + b + delta >= 0}
    swapped = total[:-2] + total[-1] + total[-2] if len(total) >= 2 else total
    if not swapped.startswith("0"):  # "03" is no answer a person or a model would write for 30
        candidates.add(swapped)
    candidates.discard(total)
    return rng.choice(sorted(candidates))


def _addition(split: str, rng: random.Random) -> list[Problem]:
    problems = []
    for a, b in _addition_pairs(split):
        problems.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "rejected": addition_wrong_answer(a, b, rng)})
    return problems


TOOLS_TRAIN_PAIRS, TOOLS_TEST_PAIRS = 20000, 1000  # of the 810,000 ordered 3-digit pairs


def _tools_pairs(split: str) -> list[tuple[int, int]]:
    """Ordered 3-digit pairs (a, b) of one split of task ``tools``: 20,000 train, 1,000 test, disjoint (a pair
    and its commuted twin always land in the same split), fixed by ``SPLIT_SEED``."""
    rng = random.Random(f"tools/{SPLIT_SEED}")
    chosen: dict[tuple[int, int], None] = {}
    while len(chosen) < (TOOLS_TRAIN_PAIRS + TOOLS_TEST_PAIRS) // 2:
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        if a != b:
            chosen.setdefault((min(a, b), max(a, b)), None)
    unordered = list(chosen)
    part = unordered[: TOOLS_TEST_PAIRS // 2] if split == "test" else unordered[TOOLS_TEST_PAIRS // 2 :]
    return sorted([(a, b) for a, b in part] + [(b, a) for a, b in part])


def _tools(split: str, rng: random.Random) -> list[Problem]:
    return [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), "rejected": addition_wrong_answer(a, b, rng)}
        for a, b in _tools_pairs(split)
    ]


def calc(expression: str) -> int:
    """The calculator of task ``tools``: the value of an integer expression with + - * and parentheses, e.g.
    calc("123+456") returns 579."""
    import ast
    import operator

    operators = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in operators:
            return operators[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"calc takes integers with + - * and parentheses, got {expression!r}")

    try:
        return value(ast.parse(expression, mode="eval").body)
    except SyntaxError:
        raise ValueError(f"calc cannot parse {expression!r}") from None


def tool_transcripts(dataset: Dataset) -> Dataset:
    """SFT rows (prompt, completion) that show task ``tools`` solved with the ``calc`` tool, in the tagged call
    format of ``treadle.rollouts``: two rows per problem, one per model turn, so that only the model's turns
    are trained on (the tool's result is in the second row's prompt)::

        "123+456="                                                  -> '<call>calc("123+456")</call>'
        '123+456=<call>calc("123+456")</call></s><result>579</result>' -> "579"
    """
    from datasets import Dataset

    rows = []
    for prompt, answer in zip(dataset["prompt"], dataset["answer"]):
        call = f'<call>calc("{prompt.rstrip("=")}")</call>'
        rows.append({"prompt": prompt, "completion": call})
        rows.append({"prompt": f"{prompt}{call}{EOS_TOKEN}<result>{answer}</result>", "completion": answer})
    return Dataset.from_list(rows)


# name -> builder(split, rng) -> problems in a fixed order; load_task shuffles and formats them.
# "tools": 3-digit addition, which the tiny model cannot learn in minutes but can solve with the `calc` tool.
TASKS: dict[str, Callable[[str, random.Random], list[Problem]]] = {"addition": _addition, "tools": _tools}
KINDS = ("sft", "preference", "rl", "chat")


def load_task(name: str, split: str = "train", *, kind: str = "sft", n: int | None = None, seed: int = 0) -> Dataset:
    """One split of a toy task as a ``datasets.Dataset``, shuffled by ``seed``, first ``n`` rows.

    ``name`` is a key of ``TASKS``, optionally prefixed ``toy:``. Columns by ``kind``:
      sft:        prompt, completion   (no eos: the trainer appends it)
      preference: prompt, chosen, rejected   (rejected is a plausible wrong answer, never == chosen)
      rl:         prompt, answer
      chat:       messages = [{"role": "user", ...}, {"role": "assistant", ...}]
    Train and test are disjoint whatever ``seed`` is; ``seed`` changes only the order, the subset
    taken by ``n`` and the choice of rejected answers.
    """
    from datasets import Dataset

    name = name.removeprefix("toy:")
    if name not in TASKS:
        raise ValueError(f"unknown toy task {name!r}; choose one of {sorted(TASKS)}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    # Separate streams, so that how many draws a builder makes never changes the order of the rows.
    problems = TASKS[name](split, random.Random(f"{name}/{seed}"))
    random.Random(f"order/{seed}").shuffle(problems)
    if n is not None:
        if not 0 < n <= len(problems):
            raise ValueError(f"n must be in 1..{len(problems)} for {name}/{split}, got {n}")
        problems = problems[:n]
    return Dataset.from_list([_format(p, kind) for p in problems])


def _format(problem: Problem, kind: str) -> dict[str, Any]:
    prompt, answer = problem["prompt"], problem["answer"]
    if kind == "sft":
        return {"prompt": prompt, "completion": answer}
    if kind == "preference":
        return {"prompt": prompt, "chosen": answer, "rejected": problem["rejected"]}
    if kind == "rl":
        return {"prompt": prompt, "answer": answer}
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


# ----------------------------------------------------------------------------------------------------
# Verifiers
# ----------------------------------------------------------------------------------------------------


def extract_answer(completion: str | list[dict[str, str]]) -> str:
    """The answer a completion gives: its text up to the first newline or eos, stripped.

    A chat completion (a list of messages) counts by the content of its last message.
    """
    if isinstance(completion, list):
        completion = completion[-1]["content"] if completion else ""
    return completion.split(EOS_TOKEN, 1)[0].split("\n", 1)[0].strip()


def addition_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float]:
    """1.0 where the completion's answer equals ``answer`` exactly, else 0.0 (a GRPO reward function).

    Extra dataset columns and ``completion_ids`` arrive in ``kwargs`` and are ignored.
    """
    return [float(extract_answer(c) == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


REWARDS: dict[str, Callable[..., list[float]]] = {"addition": addition_reward, "tools": addition_reward}


# ----------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------


def _prompts_and_answers(dataset: Dataset, tokenizer) -> tuple[list[str], list[str]]:
    if "messages" in dataset.column_names:  # chat form: the last message is the reference answer
        conversations = dataset["messages"]
        prompts = [render_chat_prompt(tokenizer, m[:-1]) for m in conversations]
        return prompts, [m[-1]["content"] for m in conversations]
    column = "answer" if "answer" in dataset.column_names else "completion"
    if column not in dataset.column_names:
        raise ValueError(f"dataset needs an 'answer' or 'completion' column, has {dataset.column_names}")
    prompts = [render_chat_prompt(tokenizer, p) if is_conversation(p) else p for p in dataset["prompt"]]
    return prompts, [str(a) for a in dataset[column]]


@torch.no_grad()
def greedy_completions(
    model, tokenizer, prompts: list[str], *, batch_size: int = 64, max_new_tokens: int = 4
) -> list[str]:
    """Greedy continuations of ``prompts`` (special tokens dropped), decoded in left-padded batches."""
    completions = []
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(
            prompts[start : start + batch_size],
            padding=True,
            padding_side="left",
            return_tensors="pt",
            add_special_tokens=False,
        ).to(model.device)
        output = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        new_tokens = output[:, batch["input_ids"].shape[1] :]
        completions += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    return completions


def exact_match_accuracy(
    model, tokenizer, dataset: Dataset, *, batch_size: int = 64, max_new_tokens: int = 4
) -> float:
    """Fraction of rows whose greedy completion of ``prompt`` equals ``answer`` (or ``completion``).

    Rows in chat form (a ``messages`` column) are prompted with all but the last message. The answer
    is read as in ``addition_reward``. The model's train/eval mode is restored afterwards.
    """
    prompts, answers = _prompts_and_answers(dataset, tokenizer)
    if not prompts:
        raise ValueError("exact_match_accuracy needs a non-empty dataset")
    with eval_mode(model):
        completions = greedy_completions(
            model, tokenizer, prompts, batch_size=batch_size, max_new_tokens=max_new_tokens
        )
    correct = sum(extract_answer(c) == a.strip() for c, a in zip(completions, answers))
    return correct / len(answers)
