"""What the tests build their runs from, written once: tiny models, rows, reward functions, a tool, a file writer,
and one factory per trainer kind (SFT, DPO, reward, GRPO; the vision variants of DPO and GRPO; ``sft``: SFT at
treadle's own defaults, for the runs that are refused or stopped).

A plain module, not conftest.py: the scripts the tests start (_resume_worker.py, _dist_worker.py,
trainers/grpo/_async_run.py) and the vLLM tests, which run in another venv, import it too. tests/ is on sys.path in
every test (pytest puts the folder of the root conftest.py there) and in a script started from it.

A factory takes what the tests vary (where the run writes, the tokenizer or processor, the rows, the model or its
seed, the reward) and keyword overrides: the config's fields over the factory's defaults (the settings most of its
callers used before it existed; a caller that differs says so where it calls), and any other keyword of the trainer
(``eval_dataset``, ``callbacks``, ``peft_config``, ``ref_model``, ``compute_metrics``...) passed to it as it is.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from treadle.demos import toy, toy_vision as tv
from treadle.generation import GenerationOutput
from treadle.trainers.dpo import DPOConfig, DPOTrainer
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from treadle.trainers.reward import RewardConfig, RewardTrainer
from treadle.trainers.sft import SFTConfig, SFTTrainer


# ------------------------------------------------------------------------------------------------ tiny models
def tiny_llama_config(vocab_size: int, **fields) -> LlamaConfig:
    """The tests' tiny Llama shape: 2 layers of width 32, 4 heads over 2 KV heads, 64 positions."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **fields,
    )


def tiny_llama(seed: int = 0, vocab_size: int = 64, dropout: float = 0.0, **fields) -> LlamaForCausalLM:
    """A tiny causal Llama seeded by ``torch.manual_seed(seed)`` (the global RNG stays where that leaves it);
    ``fields``: other LlamaConfig fields."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(vocab_size, attention_dropout=dropout, pad_token_id=0, **fields))


def tiny_reward_model(seed: int = 0) -> LlamaForSequenceClassification:
    """The tiny Llama shape over the toy vocabulary with a one-output classification head; pad_token_id finds each
    row's last token. The global RNG is left as it was."""
    tok = toy.build_tokenizer()
    config = tiny_llama_config(
        len(tok),
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForSequenceClassification(config)


def chatty_model(tok, seed=0, eos_bias=2.5):
    """The tiny toy model with a bias on the EOS logit, so that its random turns end after a few tokens. The bias
    lives in the LM head, where both sampling and treadle.logprobs read it."""
    model = toy.build_model("tiny", tokenizer=tok, seed=seed)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    head.weight = model.lm_head.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[tok.eos_token_id] = eos_bias
    model.lm_head = head
    return model


_SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
# the architecture matrix: name -> (transformers config class, its fields); every one a decoder-only causal LM of
# < 100k parameters over the toy vocabulary
ARCHITECTURES = {
    "llama": ("LlamaConfig", dict(**_SMALL, num_key_value_heads=2, max_position_embeddings=128)),
    "qwen2": ("Qwen2Config", dict(**_SMALL, num_key_value_heads=2, max_position_embeddings=128)),
    "qwen3": ("Qwen3Config", dict(**_SMALL, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)),
    "mistral": (
        "MistralConfig",
        dict(**_SMALL, num_key_value_heads=2, max_position_embeddings=128, sliding_window=16),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(**_SMALL, num_key_value_heads=2, head_dim=8, max_position_embeddings=128, sliding_window=16),
    ),
    "phi3": (
        "Phi3Config",
        dict(**_SMALL, num_key_value_heads=2, max_position_embeddings=128, original_max_position_embeddings=128),
    ),
    "gpt2": (
        "GPT2Config",
        dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
    "gpt_neox": ("GPTNeoXConfig", dict(**_SMALL, max_position_embeddings=128)),
}


def architecture_config(name: str):
    """The config of ``ARCHITECTURES[name]`` with the toy tokenizer's vocabulary and special tokens."""
    tok = toy.build_tokenizer()
    config_name, fields = ARCHITECTURES[name]
    return getattr(transformers, config_name)(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **fields,
    )


def build_architecture(name: str, seed: int = 0):
    """A random-weight model of ``ARCHITECTURES[name]`` in eval mode; the global RNG is left as it was."""
    config = architecture_config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config).eval()


# ------------------------------------------------------------------------------------------------ rows
def lm_rows(n: int = 24, seed: int = 0, vocab_size: int = 64, min_len: int = 3, max_len: int = 12) -> list[dict]:
    """Variable-length causal-LM rows (input_ids, attention_mask, labels) whose labels mask a prompt of random length
    with -100: the label-token count varies between rows (and so between windows)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(1, vocab_size, (length,), generator=g).tolist()
        prompt = int(torch.randint(0, length - 1, (1,), generator=g))
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": [-100] * prompt + ids[prompt:]})
    return rows


SFT_ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in [(1, 2), (12, 30), (7, 45), (99, 9)]]
PAIRS = [
    {"prompt": "12+34=", "chosen": "46", "rejected": "47"},
    {"prompt": "5+5=", "chosen": "10", "rejected": "100"},
    {"prompt": "99+1=", "chosen": "100", "rejected": "1"},
    {"prompt": "7+8=", "chosen": "15", "rejected": "51"},
]
REWARD_PAIRS = [PAIRS[0], {**PAIRS[1], "margin": 0.5}, *PAIRS[2:]]  # the reward model's: one pair with a margin


def vision_preference_rows(n: int = 4) -> list[dict]:
    """Counting-task rows as preference pairs: the right count chosen, another one rejected."""
    return [
        {
            "images": r["images"],
            "prompt": r["prompt"],
            "chosen": r["answer"],
            "rejected": str(int(r["answer"]) % 4 + 1),
        }
        for r in tv.count_task("train", n, kind="rl")
    ]


# ------------------------------------------------------------------------------------------------ rewards, tools
def digit_sum_reward(completion_ids, **kwargs):
    """A reward that varies between completions, so advantages are not all zero and a step moves the weights."""
    return [float(sum(ids) % 5) for ids in completion_ids]


def length_reward(completion_ids, **kwargs):
    return [float(len(ids) % 3) for ids in completion_ids]


def char_sum_reward(prompts, completions, **kwargs):
    """A reward that differs between a random VLM's chat completions (so that a step has an advantage to follow)."""
    return [float(sum(map(ord, c[0]["content"])) % 5) for c in completions]


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


# ------------------------------------------------------------------------------------------------ files
def write(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------ trainers
def _split(config_class, overrides: dict) -> tuple[dict, dict]:
    """``overrides`` as (the config's fields, the trainer's other keywords)."""
    fields = config_class.field_names()
    return (
        {k: v for k, v in overrides.items() if k in fields},
        {k: v for k, v in overrides.items() if k not in fields},
    )


SFT_ARGS = dict(
    max_steps=2,
    per_device_train_batch_size=2,
    learning_rate=1e-2,
    disable_tqdm=True,
    save_strategy="no",
    logging_steps=1,
    report_to="none",
)


def sft_trainer(output_dir, tok, rows=SFT_ROWS, model=None, **overrides) -> SFTTrainer:
    """SFT of ``model`` (default: the tiny toy model, seed 0) on ``rows``."""
    fields, kwargs = _split(SFTConfig, overrides)
    model = model if model is not None else toy.build_model("tiny", tokenizer=tok)
    return SFTTrainer(
        model,
        SFTConfig(**{"output_dir": str(output_dir), **SFT_ARGS, **fields}),
        train_dataset=rows,
        processing_class=tok,
        **kwargs,
    )


def sft(tmp_path, rows, **fields):
    """SFT of the tiny toy model on ``rows`` in ``tmp_path``/run at treadle's own learning rate, with its own
    toy tokenizer: the cases that a run refuses or stops (docs/runs.md, the second trial) build their run here."""
    fields = {"max_steps": 2, "per_device_train_batch_size": 2, "save_strategy": "no", **fields}
    args = SFTConfig(output_dir=str(tmp_path / "run"), report_to=[], disable_tqdm=True, logging_steps=1, **fields)
    tok = toy.build_tokenizer()
    return SFTTrainer(
        model=toy.build_model("tiny", tokenizer=tok), args=args, train_dataset=rows, processing_class=tok
    )


DPO_ARGS = dict(
    disable_tqdm=True,
    save_strategy="no",
    report_to="none",
    per_device_train_batch_size=2,
    per_device_eval_batch_size=2,
)


def dpo_args(output_dir, **overrides) -> DPOConfig:
    return DPOConfig(**{"output_dir": str(output_dir), **DPO_ARGS, **overrides})


def dpo_trainer(output_dir, tok, rows=PAIRS, model=None, **overrides) -> DPOTrainer:
    """DPO of ``model`` (default: ``tiny_llama(0)`` over the tokenizer's vocabulary) on ``rows``."""
    fields, kwargs = _split(DPOConfig, overrides)
    model = model if model is not None else tiny_llama(0, len(tok))
    return DPOTrainer(model, args=dpo_args(output_dir, **fields), train_dataset=rows, processing_class=tok, **kwargs)


REWARD_ARGS = dict(
    disable_tqdm=True,
    save_strategy="no",
    report_to="none",
    per_device_train_batch_size=2,
    per_device_eval_batch_size=4,
)


def reward_trainer(output_dir, tok, rows=REWARD_PAIRS, model=None, **overrides) -> RewardTrainer:
    """A reward model (default: ``tiny_reward_model()``) trained on ``rows``, a pair without a margin given 0."""
    fields, kwargs = _split(RewardConfig, overrides)
    model = model if model is not None else tiny_reward_model()
    return RewardTrainer(
        model,
        args=RewardConfig(**{"output_dir": str(output_dir), **REWARD_ARGS, **fields}),
        train_dataset=[{"margin": 0.0, **r} for r in rows],
        processing_class=tok,
        **kwargs,
    )


GRPO_ARGS = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=3,
    max_steps=2,
    learning_rate=1e-3,
    disable_tqdm=True,
    save_strategy="no",
    logging_steps=1000,
)


def grpo_args(folder, **overrides) -> GRPOConfig:
    """GRPO_ARGS and ``overrides``, writing to ``folder/run`` unless ``output_dir`` says otherwise."""
    return GRPOConfig(**{"output_dir": str(Path(folder) / "run"), **GRPO_ARGS, **overrides})


def grpo_trainer(
    folder, tok, dataset, reward=digit_sum_reward, model_seed=0, *, model=None, **overrides
) -> GRPOTrainer:
    """GRPO of ``model`` (default: the tiny toy model of seed ``model_seed``) on the prompts of ``dataset``,
    rewarded by ``reward`` (a function or a list of them), with ``grpo_args(folder, ...)``."""
    fields, kwargs = _split(GRPOConfig, overrides)
    model = model if model is not None else toy.build_model("tiny", tokenizer=tok, seed=model_seed)
    return GRPOTrainer(
        model, reward, args=grpo_args(folder, **fields), train_dataset=dataset, processing_class=tok, **kwargs
    )


GOLDEN_GRPO = [
    -0.019045989777221273,
    -0.01600946334656328,
    0.024846914639056195,
    0.0023342259228229523,
    0.046902469686756376,
]


def golden_grpo_run(output_dir, tok) -> GRPOTrainer:
    """The run of GOLDEN_GRPO, its first 5 logged losses: spg 4 over windows of 2 micro-steps (old log-probs), beta
    0.04 (a reference), so every part of the loss."""
    return grpo_trainer(
        output_dir,
        tok,
        toy.load_task("addition", kind="rl", n=64),
        output_dir=str(output_dir),
        max_steps=5,
        logging_steps=1,
        seed=0,
        per_device_train_batch_size=8,
        max_completion_length=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        beta=0.04,
        use_bias_correction_kl=False,
    )  # recorded with the plain k3 term (before issue 17)


# ------------------------------------------------------------------------------------------------ logs
WALL_CLOCK = ("step_time",)  # logged metrics that time the run: two runs of the same steps never log the same


def untimed(history: list[dict]) -> list[dict]:
    """``history`` (a ``log_history``) without its wall-clock metrics: what two runs of the same steps share."""
    return [{k: v for k, v in entry.items() if k not in WALL_CLOCK} for entry in history]


# ------------------------------------------------------------------------------------------------ vision
VISION_ARGS = dict(
    max_steps=1,
    per_device_train_batch_size=4,
    learning_rate=1e-2,
    report_to=[],
    disable_tqdm=True,
    logging_steps=1,
    save_strategy="no",
)


def vision_dpo_trainer(folder, kind, processor, model=None, **overrides) -> DPOTrainer:
    """DPO of a tiny VLM of ``kind`` (or ``model``) on ``vision_preference_rows()``, writing to ``folder/dpo``."""
    model = model if model is not None else tv.build_model(kind, processor)
    # per_device_eval_batch_size: the precomputed reference's batches, the config's default as these runs always had
    return dpo_trainer(
        Path(folder) / "dpo",
        processor,
        vision_preference_rows(),
        model,
        **{**VISION_ARGS, "per_device_eval_batch_size": 8, **overrides},
    )


def vision_grpo_trainer(folder, kind, processor, reward, **overrides) -> GRPOTrainer:
    """GRPO of a tiny VLM of ``kind`` on 16 counting-task prompts with their images, writing to ``folder/grpo``."""
    return grpo_trainer(
        folder,
        processor,
        tv.count_task("train", 16, kind="rl"),
        reward,
        model=tv.build_model(kind, processor),
        **{
            "output_dir": str(Path(folder) / "grpo"),
            **VISION_ARGS,
            "num_generations": 4,
            "max_completion_length": 4,
            **overrides,
        },
    )


# ------------------------------------------------------------------------------------------------ parity with TRL
TRL_ONLY = dict(use_cpu=True, bf16=False, gradient_checkpointing=False)  # TRL defaults both to True


def in_order(trainer_class):
    """``trainer_class`` reading its training rows in order (TRL: ``train_sampling_strategy="sequential"``)."""

    class InOrder(trainer_class):
        def build_sampler(self, dataset, *, shuffle):
            return super().build_sampler(dataset, shuffle=False)

    return InOrder


def train_logs(trainer) -> list[dict]:
    """The training steps' entries of ``trainer.state.log_history`` (either library's trainer)."""
    return [h for h in trainer.state.log_history if "loss" in h]


class FixedCompletions(GRPOTrainer):
    """treadle's GRPO trainer sampling nothing: ``generate`` hands out ``completions`` (token-id lists; one that does
    not end with the tokenizer's eos is a truncated one) in order, cycling, and records the prompts it was given in
    ``prompts_seen``. Subclasses set ``completions``; ``trl_rollout(completions, ...)`` hands TRL the same ones."""

    completions: list[list[int]] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handed_out, self.prompts_seen = 0, []

    def generate(self, prompt_ids, *, num_generations, generator=None, **kwargs):
        rows = [ids for ids in prompt_ids for _ in range(num_generations)]
        self.prompts_seen += rows
        completions = cycled(self.completions, len(rows), self.handed_out)
        self.handed_out += len(rows)
        width, pad, eos = max(map(len, completions)), self.pad_token_id, self.processing_class.eos_token_id
        prompts = torch.tensor(rows)  # the tests give one prompt for every row: no padding
        ids = torch.tensor([c + [pad] * (width - len(c)) for c in completions])
        mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
        truncated = torch.tensor([c[-1] != eos for c in completions])
        return GenerationOutput(prompts, torch.ones_like(prompts), ids, mask, truncated)


def cycled(items: list, count: int, start: int) -> list:
    """``count`` items of ``items`` from index ``start`` on, wrapping around."""
    return [items[(start + i) % len(items)] for i in range(count)]


def trl_rollout(completions: list[list[int]], encode_prompt):
    """TRL's ``rollout_func`` handing out ``completions`` in the order ``FixedCompletions`` does; ``encode_prompt``
    turns a dataset prompt into its token ids."""
    state = {"handed_out": 0}

    def rollout(prompts, trainer):
        handed = cycled(completions, len(prompts), state["handed_out"])
        state["handed_out"] += len(prompts)
        return {
            "prompt_ids": [encode_prompt(p) for p in prompts],
            "completion_ids": handed,
            "logprobs": [[0.0] * len(c) for c in handed],
        }

    return rollout
