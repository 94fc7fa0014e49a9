"""No trainer builds a ``[B, T, V]`` logits tensor (issue 56): one step of SFT, DPO, KTO, GRPO and distillation on a
tiny model with a large vocabulary, every tensor an aten op allocates recorded (a ``TorchDispatchMode``), and none
with the vocabulary as its last dimension may have more rows than one chunk of the LM head's logits or one position
per sequence of a forward (the fast path's ``logits_to_keep=1``, the sampler's decode step). The whole step is
watched: GRPO's and distillation's sampling, their reference / teacher forwards and the one-time checks included.

The detector is proven by the second test: the same steps with the chunking bypassed (the model's own logits, or one
chunk as large as the batch) must make it fire.

Sizes: every log-prob computation here covers more than ``SMALL_LOGITS`` logits (64 rows of a 65,536-token
vocabulary are 4M), as any real model's batch does; below that, treadle takes the few MB of logits in one piece
through plain autograd, by design (``logprobs.tokens._small_token_logps``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import treadle
from treadle.demos import toy
from treadle.logprobs import logsoftmax, prefix, tokens
from treadle.logprobs.tokens import SMALL_LOGITS

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 65_536  # large against everything else: hidden 64, 2 layers, rows of about 85 tokens
CHUNK = 8  # rows per chunk of the LM head's logits in these steps (logsoftmax.CHUNK_LOGITS set to CHUNK x VOCAB)
SEQUENCES = 8  # the most rows of one forward here (GRPO / distillation: 2 prompts x 4; DPO: 2 pairs; KTO 4 + 4 KL)
ALLOWED = max(CHUNK, SEQUENCES)  # a whole batch's logits: 96 rows (GRPO's 8 x 12 completion tokens) or more
TRAINERS = ("sft", "dpo", "kto", "grpo", "distillation")
ANSWER = "the ledger lists twelve barrels of salt and seven crates of tea"  # 64 characters: 64 toy tokens


class VocabTensors(TorchDispatchMode):
    """Records the shape of every tensor an aten op allocates whose last dimension is ``vocab`` (views and in-place
    results share an input's storage and are not allocations)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.shapes = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and t.numel():
                if t.untyped_storage().data_ptr() not in inputs:
                    self.shapes.append(tuple(t.shape))
        return out

    def widest(self) -> tuple[int, tuple]:
        """(rows, shape) of the allocation with the most vocabulary-wide rows; (0, ()) when there was none."""
        return max(((_rows(s), s) for s in self.shapes), default=(0, ()))


def _rows(shape: tuple) -> int:
    return int(torch.Size(shape).numel()) // shape[-1]


def rows(kind: str) -> list[dict]:
    prompts = [f"day {i}: what came in?" for i in range(4)]
    answer = [f" {ANSWER}{i}" for i in range(4)]
    if kind == "sft":
        return [{"prompt": p, "completion": a} for p, a in zip(prompts, answer)]
    if kind == "dpo":
        return [{"prompt": p, "chosen": a, "rejected": a.replace("salt", "sand")} for p, a in zip(prompts, answer)]
    if kind == "kto":
        return [{"prompt": p, "completion": a, "label": i % 2 == 0} for i, (p, a) in enumerate(zip(prompts, answer))]
    return [{"prompt": p} for p in prompts]


def model(seed: int = 0):
    return toy.build_model("tiny", tokenizer=toy.build_tokenizer(), vocab_size=VOCAB, seed=seed)


def one_step(kind: str, folder) -> treadle.Trainer:
    """The trainer of ``kind`` for one SGD step on a fresh ``model()`` (a reference or teacher where it has one)."""
    tok = toy.build_tokenizer()
    common = dict(output_dir=str(folder), max_steps=1, optim="sgd", learning_rate=1e-3, save_strategy="no", seed=0)
    common.update(report_to="none", disable_tqdm=True, logging_steps=1)
    if kind == "sft":
        args = treadle.SFTConfig(**common, per_device_train_batch_size=4)
        return treadle.SFTTrainer(model(), args, train_dataset=rows(kind), processing_class=tok)
    if kind == "dpo":
        args = treadle.DPOConfig(**common, per_device_train_batch_size=2)
        return treadle.DPOTrainer(model(), args=args, train_dataset=rows(kind), processing_class=tok)
    if kind == "kto":
        args = treadle.KTOConfig(**common, per_device_train_batch_size=4)
        return treadle.KTOTrainer(model(), args=args, train_dataset=rows(kind), processing_class=tok)
    online = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=12, temperature=1.0)
    if kind == "grpo":
        args = treadle.GRPOConfig(**common, **online, beta=0.04)  # a reference model's forward too
        return treadle.GRPOTrainer(model(), digit_reward, args=args, train_dataset=rows(kind), processing_class=tok)
    args = treadle.DistillationConfig(**common, **online)
    return treadle.DistillationTrainer(
        model(), model(seed=1), args=args, train_dataset=rows(kind), processing_class=tok
    )


def digit_reward(completion_ids, **_):
    return [float(sum(ids) % 5) for ids in completion_ids]  # varies: the step has advantages to follow


def watched_step(kind: str, folder) -> VocabTensors:
    trainer = one_step(kind, folder)
    seen = VocabTensors(VOCAB)
    with seen:
        trainer.train()
    assert trainer.state.global_step == 1
    return seen


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of CHUNK rows at VOCAB, through the default every trainer takes (no trainer sets a chunk here)."""
    monkeypatch.setattr(logsoftmax, "CHUNK_LOGITS", CHUNK * VOCAB)
    assert CHUNK * VOCAB <= SMALL_LOGITS < 64 * VOCAB  # one chunk is small; a step's log-probs are not


@pytest.mark.parametrize("kind", TRAINERS)
def test_no_trainer_allocates_logits_for_more_than_a_chunk(kind, tmp_path, small_chunks):
    seen = watched_step(kind, tmp_path)
    rows_, shape = seen.widest()
    assert seen.shapes, "the step computed no logits at all: the detector watched nothing"
    assert rows_ <= ALLOWED, f"{kind} allocated a {shape} logits tensor ({rows_} rows > {ALLOWED})"
    assert (CHUNK, VOCAB) in seen.shapes, f"{kind} never ran a chunk of the hidden-state kernels: {set(seen.shapes)}"


@pytest.mark.parametrize("kind", TRAINERS)
@pytest.mark.parametrize("bypass", ["model's logits", "one chunk"])
def test_the_detector_fires_when_the_chunking_is_bypassed(kind, bypass, tmp_path, small_chunks, monkeypatch):
    """The same step with the model's own ``[B, T, V]`` logits (the fast path's switch off, as the benchmark's
    full-logits path does) or with a chunk as large as the whole batch: the detector must see it."""
    if bypass == "one chunk":
        monkeypatch.setattr(logsoftmax, "CHUNK_LOGITS", 1 << 40)
    else:
        for module in (tokens, prefix):  # no model fits the hidden-state seam: every forward returns its logits
            monkeypatch.setattr(module, "fast_path_head", lambda base: None)
    seen = watched_step(kind, tmp_path)
    rows_, shape = seen.widest()
    assert rows_ > ALLOWED, f"{kind} with {bypass}: the detector saw no logits wider than {shape}"


def test_the_default_chunk_shrinks_with_the_vocabulary():
    """At Gemma 3's 262,144 tokens the default chunk is 192 rows (192 MiB of float32 logits, SmolLM2's 1,024 rows'
    worth), not 1,024 (a 1 GiB block); up to SmolLM2's 49,152 it stays 1,024."""
    assert [logsoftmax.chunk_rows(v) for v in (103, 49_152, 65_536, 262_144)] == [1024, 1024, 768, 192]
    hidden, weight = torch.randn(200, 2), torch.randn(262_144, 2)
    seen = VocabTensors(262_144)
    with seen:
        logsoftmax.chunked_nll(hidden, weight, torch.randint(0, 262_144, (200,)))
    assert max(map(_rows, seen.shapes)) == 192
