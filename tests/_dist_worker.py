"""Multi-process jobs for tests/test_distributed.py, run by torchrun on CPU (gloo)::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/_dist_worker.py SCENARIO OUT_DIR

Each scenario trains on every rank; rank 0 writes ``OUT_DIR/<scenario>.json`` (per-step losses and more)
and the final weights through ``save_model``. The builders below are shared with the test, which runs the
one-process reference in its own process with exactly the same model, data and arguments.

Scenarios: ``collectives`` (the helpers of treadle.distributed), ``trainer`` (DDP, then a resume from a
mid-run checkpoint), ``fsdp`` (the same under FSDP2), ``error`` (rank 1 raises), ``stuck`` (rank 1 raises but
stays alive), ``sft`` (``sft_compiled``: with ``torch_compile``), ``dpo``, ``grpo`` (and ``*_padded``: the same with
``padding_free=False``), ``grpo_groups``
(each rank samples whole groups of its own prompts through a rollout engine seeded by prompt, not by rank, so
that 1 process samples the same completions), ``distill`` (on-policy distillation through that engine).
SCENARIO may list several, comma-separated, run one after another in the same processes (one launch costs
seconds of imports). The same worker runs on two torchrun "nodes" (``--nnodes 2 --nproc-per-node 1``): it only
reads the rank and world size.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import sys
import time

import torch

from treadle.engines.base import RolloutEngine

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _factories as factories  # noqa: E402  (after the settings above; this script's folder, tests/, is on the path)

VOCAB = 64
PER_RANK_BATCH = 2  # b: micro-batch rows on each of the 2 ranks; the one-process reference uses 2b
ACCUM = 2
STEPS = 4


# ---------------------------------------------------------------------------------------------------------
# Builders shared with the test (same seeds on every rank and in the reference)
# ---------------------------------------------------------------------------------------------------------
def tiny_llama(seed: int = 0):
    """The tests' tiny Llama with tied embeddings (exercises the tied-weight paths of the FSDP2 export)."""
    return factories.tiny_llama(seed, VOCAB, tie_word_embeddings=True)


def lm_rows(n: int, seed: int) -> list[dict]:
    """Rows of 3..14 tokens whose first 0..len-2 labels are -100: the label-token count varies a lot between
    rows, so a per-rank mean instead of the all-rank token normalisation would give different numbers."""
    return factories.lm_rows(n, seed, VOCAB, max_len=14)


def trainer_args(output_dir: str, world_size: int, **overrides):
    from treadle import TrainingArguments

    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=PER_RANK_BATCH * 2 // world_size,
        per_device_eval_batch_size=3,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=3e-3,
        warmup_steps=1,
        max_grad_norm=0.5,
        logging_steps=1,
        save_steps=2,
        disable_tqdm=True,
        seed=0,
        weight_decay=0.1,
    )
    return TrainingArguments(**{**settings, **overrides})


def step_losses(log_history: list[dict]) -> list[float]:
    return [entry["loss"] for entry in log_history if "loss" in entry]


def run_trainer(output_dir: str, world_size: int, resume: str | None = None, **overrides):
    """Train the tiny Llama on 32 rows (4 optimizer steps of 8 rows), evaluate on 10 rows."""
    from treadle import Trainer

    trainer = Trainer(
        tiny_llama(),
        trainer_args(output_dir, world_size, **overrides),
        train_dataset=lm_rows(32, seed=1),
        eval_dataset=lm_rows(10, seed=2),
    )
    trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(output_dir, "final"))
    return trainer, {"losses": step_losses(trainer.state.log_history), "eval_loss": metrics["eval_loss"]}


# ---------------------------------------------------------------------------------------------------------
# Scenarios (run on every rank)
# ---------------------------------------------------------------------------------------------------------
def scenario_trainer(out: str, fsdp: str = "") -> dict:
    """Train 4 steps (checkpoints at 2 and 4), then a fresh Trainer resumes from checkpoint-2 in another
    output_dir and trains steps 3-4 again."""
    world = torch.distributed.get_world_size()
    full_dir, resumed_dir = os.path.join(out, "full"), os.path.join(out, "resumed")
    trainer, result = run_trainer(full_dir, world, fsdp=fsdp)
    _, resumed = run_trainer(resumed_dir, world, resume=os.path.join(full_dir, "checkpoint-2"), fsdp=fsdp)
    result["resumed_losses"] = resumed["losses"]
    result["wrapper"] = type(trainer.model_wrapped).__name__
    result["train_loss"] = trainer.state.total_loss_sum / trainer.state.total_loss_items
    return result


def scenario_fsdp(out: str) -> dict:
    return scenario_trainer(out, fsdp="full_shard")


class _FailingTrainerMixin:
    """Rank 1 raises in its forward of step 3 (global_step 2), after two good steps."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if torch.distributed.get_rank() == 1 and self.state.global_step == 2:
            raise RuntimeError("injected failure in compute_loss")
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _failing_trainer(out: str):
    from treadle import Trainer

    cls = type("FailingTrainer", (_FailingTrainerMixin, Trainer), {})
    return cls(tiny_llama(), trainer_args(out, 2, save_strategy="no"), train_dataset=lm_rows(32, seed=1))


def scenario_error(out: str) -> dict:
    _failing_trainer(out).train()
    return {}


def scenario_stuck(out: str) -> dict:
    """Rank 1 fails but its process stays alive (as if stuck in a hung data loader): rank 0, waiting in a
    collective, must give up after TREADLE_DDP_TIMEOUT seconds rather than wait forever."""
    try:
        _failing_trainer(out).train()
    except RuntimeError:
        if torch.distributed.get_rank() == 1:
            time.sleep(600)  # ended by torchrun once rank 0 has failed
            open(os.path.join(out, "stuck_rank_1_woke"), "w").close()  # the test asserts this never happens
        raise
    return {}


def scenario_sft(out: str, **overrides) -> dict:
    from treadle import SFTTrainer

    parts = sft_parts(out, torch.distributed.get_world_size())
    parts["args"] = dataclasses.replace(parts["args"], **overrides)
    trainer = SFTTrainer(**parts)
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    return {"losses": step_losses(trainer.state.log_history)}


def scenario_dpo(out: str, **overrides) -> dict:
    from treadle import DPOTrainer

    trainer = DPOTrainer(**dpo_parts(out, torch.distributed.get_world_size(), **overrides))
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    history = trainer.state.log_history
    return {
        "losses": step_losses(history),
        "margins": [entry["rewards/margins"] for entry in history if "rewards/margins" in entry],
        "num_tokens": [entry["num_tokens"] for entry in history if "num_tokens" in entry],
    }


def scenario_dpo_precomputed(out: str) -> dict:
    """DPO with reference log-probs computed before training (every rank over the whole dataset)."""
    return scenario_dpo(out, precompute_ref_log_probs=True)


def scenario_grpo(out: str, **overrides) -> dict:
    from treadle import GRPOTrainer, distributed as dist
    from treadle.text import encode_prompt

    parts = grpo_parts(out, torch.distributed.get_world_size(), **overrides)
    tokenizer, reward, sampled = parts["processing_class"], parts["reward_funcs"], []

    def digit_count_reward(prompts, completions, completion_ids, **columns):  # what this rank sampled
        eos = tokenizer.eos_token_id
        lengths, ended = [len(ids) for ids in completion_ids], [ids[-1] == eos for ids in completion_ids]
        prompt_tokens = sum(len(encode_prompt(tokenizer, p)) for p in prompts)
        sampled.append({"lengths": lengths, "ended": ended, "prompt_tokens": prompt_tokens})
        return reward(prompts, completions, completion_ids, **columns)

    trainer = GRPOTrainer(**{**parts, "reward_funcs": digit_count_reward})
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    history = trainer.state.log_history
    return {
        "losses": step_losses(history),
        "rewards": [e["reward"] for e in history if "reward" in e],
        "final_step": trainer.state.global_step,
        "wrapper": type(trainer.model_wrapped).__name__,
        "logs": [e for e in history if "loss" in e],
        "sampled": [list(ranks) for ranks in zip(*dist.gather_objects(sampled))],  # per generation: each rank's
    }


def scenario_dpo_padded(out: str) -> dict:
    """DPO with padded forwards: the padding-free default must give the same losses and weights."""
    return scenario_dpo(out, padding_free=False)


def scenario_grpo_padded(out: str) -> dict:
    """GRPO with padded forwards: the padding-free ones (``grpo_unshared``) must give the same losses and weights."""
    return scenario_grpo(out, padding_free=False, shared_prefix=False)


def scenario_grpo_unshared(out: str) -> dict:
    """GRPO padding-free without sharing prompts (the default shares each rank's group of 4 completions' prompt)."""
    return scenario_grpo(out, shared_prefix=False)


def scenario_grpo_sgd(out: str) -> dict:
    """GRPO with the default (shared-prefix) forwards and plain SGD: weights that follow the gradient linearly
    (AdamW's first steps divide a near-zero gradient by its own size, turning float32 noise into a visible step)."""
    return scenario_grpo(out, optim="sgd", learning_rate=0.1)


def scenario_grpo_padded_sgd(out: str) -> dict:
    """``grpo_sgd`` with padded, unshared forwards: the same losses and weights."""
    return scenario_grpo(out, optim="sgd", learning_rate=0.1, padding_free=False, shared_prefix=False)


def scenario_grpo_fsdp(out: str) -> dict:
    """GRPO with the policy sharded by FSDP2: generation must gather the shards on every rank alike."""
    return scenario_grpo(out, fsdp="full_shard")


# ---------------------------------------------------------------------------------------------------------
# SFT / DPO / GRPO parts (shared with the reference)
# ---------------------------------------------------------------------------------------------------------
def toy_model_and_tokenizer():
    from treadle.demos import toy

    return toy.build_model("tiny", seed=0), toy.build_tokenizer()


ADDITION = [
    (a, b)
    for a, b in [
        (1, 2),
        (12, 30),
        (7, 45),
        (99, 99),
        (3, 3),
        (50, 6),
        (18, 27),
        (64, 1),
        (9, 9),
        (10, 90),
        (2, 71),
        (40, 4),
        (5, 55),
        (81, 8),
        (33, 66),
        (0, 7),
    ]
]


def sft_parts(out: str, world_size: int) -> dict:
    from datasets import Dataset

    from treadle import SFTConfig

    model, tokenizer = toy_model_and_tokenizer()
    data = Dataset.from_list(
        [{"prompt": f"{a}+{b}=", "completion": str(a + b) * (1 + i % 3)} for i, (a, b) in enumerate(ADDITION)]
    )
    args = SFTConfig(
        output_dir=out,
        per_device_train_batch_size=4 // world_size,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return dict(model=model, args=args, train_dataset=data, processing_class=tokenizer)


def scenario_sft_compiled(out: str) -> dict:
    """SFT with ``torch_compile`` (aot_eager: the graph capture and autograd of inductor without its C++ build) under
    DDP: compiled blocks inside the DDP wrapper must train as the one-process eager run."""
    return scenario_sft(out, torch_compile=True, torch_compile_backend="aot_eager")


def dpo_parts(out: str, world_size: int, **overrides) -> dict:
    from datasets import Dataset

    from treadle import DPOConfig

    model, tokenizer = toy_model_and_tokenizer()
    data = Dataset.from_list(
        [
            {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1 + i) * 2}
            for i, (a, b) in enumerate(ADDITION)
        ]
    )
    args = DPOConfig(
        output_dir=out,
        per_device_train_batch_size=4 // world_size,
        gradient_accumulation_steps=2,
        max_steps=2,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        **overrides,
    )
    return dict(model=model, args=args, train_dataset=data, processing_class=tokenizer)


def grpo_parts(out: str, world_size: int, **overrides) -> dict:
    from datasets import Dataset

    from treadle import GRPOConfig

    model, tokenizer = toy_model_and_tokenizer()
    data = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ADDITION])
    # 8 completions of one prompt per generation, 4 on each rank: every group spans both ranks
    settings = dict(
        output_dir=out,
        per_device_train_batch_size=8 // world_size,
        num_generations=8,
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        log_completions=True,
    )
    args = GRPOConfig(**{**settings, **overrides})
    return dict(
        model=model, reward_funcs=digit_count_reward, args=args, train_dataset=data, processing_class=tokenizer
    )


def digit_count_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """Digits in the completion: an untrained model's samples differ in it, so groups have a spread."""
    return [float(sum(ch.isdigit() for ch in text)) for text in completions]


class PromptSeededEngine(RolloutEngine):
    """The own sampler behind the engine contract, each distinct prompt sampled alone from a generator seeded by
    (its token ids, this engine's call count): the completions of a prompt do not depend on which rank holds it
    or on which prompts share its batch, so 1 process and 2 sample the same. Records the prompts it sampled."""

    def __init__(self, model, backend: str, cut: bool = False):
        from treadle.engines import LocalEngine

        self.inner, self.calls, self.sampled, self.cut = LocalEngine(model, backend), 0, [], cut

    def generate(self, prompt_ids, params, *, generator=None):
        import zlib

        from treadle.generation.single import GenerationOutput, left_pad

        outs = []
        for prompt in prompt_ids:
            seed = zlib.crc32(str(prompt).encode()) + 100_003 * self.calls
            out = self.inner.generate([prompt], params, generator=torch.Generator().manual_seed(seed))
            outs.append(cut_completions(out, 1 + seed % params.max_new_tokens, params) if self.cut else out)
        self.sampled.append([[prompt, params.num_generations] for prompt in prompt_ids])
        self.calls += 1
        prompt_rows = [row[mask.bool()].tolist() for o in outs for row, mask in zip(o.prompt_ids, o.prompt_mask)]
        ids, mask = left_pad(prompt_rows, params.pad_token_id)
        width = max(o.completion_ids.shape[1] for o in outs)

        def right(name, value):
            return torch.cat(
                [
                    torch.nn.functional.pad(getattr(o, name), (0, width - getattr(o, name).shape[1]), value=value)
                    for o in outs
                ]
            )

        return GenerationOutput(
            prompt_ids=ids,
            prompt_mask=mask,
            completion_ids=right("completion_ids", params.pad_token_id),
            completion_mask=right("completion_mask", 0),
            is_truncated=torch.cat([o.is_truncated for o in outs]),
            sampling_logps=right("sampling_logps", 0.0),
        )

    def load_weights(self, model, version=None) -> None:
        self.inner.load_weights(model, version)

    def close(self) -> None:
        self.inner.close()


def cut_completions(out, length: int, params):
    """``out``'s completions ended by EOS at token ``length`` (1-based) when longer: an untrained toy model rarely
    samples EOS, and a test of token-count normalisation needs completions of different lengths."""
    ids, mask = out.completion_ids.clone(), out.completion_mask.clone()
    longer = mask.sum(dim=1) > length
    ids[longer, length - 1], ids[longer, length:], mask[longer, length:] = (
        params.eos_token_ids[0],
        params.pad_token_id,
        0,
    )
    logps = None if out.sampling_logps is None else out.sampling_logps * mask
    return dataclasses.replace(
        out, completion_ids=ids, completion_mask=mask, is_truncated=out.is_truncated & ~longer, sampling_logps=logps
    )


def grpo_groups_run(out: str, world_size: int):
    """GRPO with G=4, 2 prompts per generation (one per rank under 2 processes: groups whole on one rank),
    3 steps; returns (trainer, result)."""
    from treadle import GRPOTrainer

    class WholeGroupGRPO(GRPOTrainer):
        def build_engine(self):
            return PromptSeededEngine(self.model, self.args.generation_backend)

    trainer = WholeGroupGRPO(**grpo_parts(out, world_size, num_generations=4, max_steps=3))
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    history = trainer.state.log_history
    return trainer, {
        "losses": step_losses(history),
        "rewards": [e["reward"] for e in history if "reward" in e],
        "sampled": trainer.engine.sampled,
    }


def scenario_grpo_groups(out: str) -> dict:
    from treadle import distributed as dist

    trainer, result = grpo_groups_run(out, dist.get_world_size())
    result["sampled_by_rank"] = dist.gather_objects(result.pop("sampled"))
    return result


def distill_run(out: str, world_size: int):
    """On-policy distillation of the toy student towards another toy model (beta 0.5, temperature 1.3): a global
    batch of 8 prompts a step (4 a rank under 2 processes), in micro-batches of 4 // world_size rows and 2
    accumulation steps, 2 SGD steps; sampled through the prompt-seeded engine (completions cut to 1-6 tokens by
    prompt), so 1 process and 2 sample the same completions. Returns (trainer, result); the result lists each
    micro-batch's completion tokens."""
    from datasets import Dataset

    from treadle import DistillationConfig, DistillationTrainer
    from treadle.demos import toy

    class PromptSeededDistillation(DistillationTrainer):
        def build_engine(self):
            return PromptSeededEngine(self.model, self.args.generation_backend, cut=True)

        def count_items(self, inputs) -> int:
            items = super().count_items(inputs)
            self.micro_batch_tokens.append(items)
            return items

    model, tokenizer = toy_model_and_tokenizer()
    data = Dataset.from_list([{"prompt": f"{a}+{b}="} for a, b in ADDITION])
    args = DistillationConfig(
        output_dir=out,
        per_device_train_batch_size=4 // world_size,
        gradient_accumulation_steps=2,
        max_completion_length=6,
        max_steps=2,
        optim="sgd",
        learning_rate=0.5,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        beta=0.5,
        temperature=1.3,
    )
    trainer = PromptSeededDistillation(
        model, toy.build_model("tiny", seed=1), args=args, train_dataset=data, processing_class=tokenizer
    )
    trainer.micro_batch_tokens = []
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    return trainer, {
        "losses": step_losses(trainer.state.log_history),
        "tokens": trainer.micro_batch_tokens,
        "sampled": trainer.engine.sampled,
    }


def scenario_distill(out: str) -> dict:
    from treadle import distributed as dist

    _, result = distill_run(out, dist.get_world_size())
    result["tokens_by_rank"] = dist.gather_objects(result.pop("tokens"))
    result["sampled_by_rank"] = dist.gather_objects(result.pop("sampled"))
    return result


def scenario_collectives(out: str) -> dict:
    """Each rank records what the helpers return; rank r contributes a row of r + 1 values to gather_padded, and
    the two ranks record the same metrics in opposite orders."""
    from treadle import distributed as dist
    from treadle.metrics import MetricWindow

    rank = dist.get_rank()
    window = MetricWindow()
    if rank == 0:
        window.add_many({"a": (1.0, 1), "b": (10.0, 2)})
    else:
        window.add_many({"b": (20.0, 2), "a": (3.0, 1)})
    lonely = MetricWindow()  # rank 1 records nothing (as a rank with no evaluation batch)
    if rank == 0:
        lonely.add("only_rank_0", 6.0, 2)
    result = {
        "gather_padded": dist.gather_padded([torch.full((1, rank + 1), float(rank))]).tolist(),
        "metric_means": window.means(),
        "one_rank_recorded_nothing": lonely.means(),
        "all_reduce_sum": dist.all_reduce_sum(torch.tensor([rank + 1.0])).item(),
        "any_rank_one": dist.any_rank(rank == 1, torch.device("cpu")),
        "any_rank_none": dist.any_rank(False, torch.device("cpu")),
        "gather_objects": dist.gather_objects(f"r{rank}"),
    }
    with open(os.path.join(os.path.dirname(out), f"collectives_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    return result


SCENARIOS = {
    "collectives": scenario_collectives,
    "trainer": scenario_trainer,
    "fsdp": scenario_fsdp,
    "error": scenario_error,
    "stuck": scenario_stuck,
    "sft": scenario_sft,
    "sft_compiled": scenario_sft_compiled,
    "dpo": scenario_dpo,
    "dpo_precomputed": scenario_dpo_precomputed,
    "grpo": scenario_grpo,
    "grpo_fsdp": scenario_grpo_fsdp,
    "dpo_padded": scenario_dpo_padded,
    "grpo_padded": scenario_grpo_padded,
    "grpo_unshared": scenario_grpo_unshared,
    "grpo_sgd": scenario_grpo_sgd,
    "grpo_padded_sgd": scenario_grpo_padded_sgd,
    "grpo_groups": scenario_grpo_groups,
    "distill": scenario_distill,
}


def main(argv: list[str]) -> None:
    # An abort (SIGABRT) prints every thread's Python stack: a two-node launch in ~45 saw rank 0 write its last
    # result and then die with "terminate called without an active exception" (exit -6) on its way out
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    from treadle import distributed as dist

    dist.init_distributed(torch.device("cpu"))
    for scenario in argv[1].split(","):
        result = SCENARIOS[scenario](os.path.join(argv[2], scenario))
        result["world_size"] = dist.get_world_size()
        if dist.is_main_process():
            with open(os.path.join(argv[2], f"{scenario}.json"), "w") as f:
                json.dump(result, f)
    dist.finish()  # frees the trainers' reference cycles that hold the group first (pytorch/pytorch#190489)


if __name__ == "__main__":
    main(sys.argv)
