"""Issue 44, the third hostile trial, on asynchronous GRPO and the health checks: an absurd ``max_staleness`` refused
in one line (no loop of the schedule scales with it), a learning run whose every completion is truncated warned and
not stopped, async with a LoRA policy, a worker that cannot be pickled, a thread worker's timeout ending cleanly
(exit 2, no abort), and a slow worker's message naming the setting to raise."""

import functools
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from _factories import grpo_trainer
from peft import LoraConfig

from treadle.demos import toy
from treadle.errors import PreflightError, is_user_error
from treadle.generation.sampling import SamplingParams
from treadle.trainers.grpo.config import HEALTH_CHECKS
from treadle.trainers.grpo.health import HealthWarning, TrainingStalled, reward_rose
from treadle.trainers.grpo.trainer import GRPOConfig
from treadle.trainers.onpolicy.producer import RolloutProducer, pushed_weights
from treadle.trainers.onpolicy.worker import RolloutWorkerError, check_picklable

pytestmark = pytest.mark.usefixtures("one_thread")

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "src")


def logged(tmp_path):
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------------------------------ 1: max_staleness
def test_an_absurd_max_staleness_is_refused_in_one_line_naming_the_cap():
    with pytest.raises(ValueError, match=r"max_staleness=1000000000 is above the cap of 64 optimizer steps") as err:
        GRPOConfig(output_dir="unused", per_device_train_batch_size=4, num_generations=4, max_staleness=10**9)
    assert "\n" not in str(err.value) and "use 1-4" in str(err.value)
    GRPOConfig(output_dir="unused", per_device_train_batch_size=4, num_generations=4, max_staleness=64)


class CountingDict(dict):
    """A dict that counts membership tests: how many generations a schedule's walk looked at."""

    looked = 0

    def __contains__(self, key):
        CountingDict.looked += 1
        return super().__contains__(key)


def test_the_schedule_walks_the_rows_read_ahead_not_max_staleness(tok):
    """``due`` looked at every generation up to g + N (10^9 per generation under max_staleness=10^9, deaf to
    SIGTERM); it walks the rows read ahead."""
    params = SamplingParams(num_generations=2, max_new_tokens=2, eos_token_ids=(2,), pad_token_id=0)
    producer = RolloutProducer(toy.build_model("tiny", tokenizer=tok, seed=0), params, staleness=10**6, seed=0)
    producer.rows, producer.versions = CountingDict({0: ["a"], 1: ["b"], 2: ["c"]}), CountingDict()
    CountingDict.looked = 0
    assert [g for g, _ in producer.due(0, max_steps=2)] == [0, 1]
    assert CountingDict.looked <= 10


# ------------------------------------------------------------------------------------------------ 2: health
def digit_share(completions, **kwargs):
    """The share of digits in each answer: a random policy learns it within a few dozen steps."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def noise(completions, **kwargs):
    """A reward nothing can learn: seeded noise that ignores the completion (the groups differ)."""
    draw = torch.Generator().manual_seed(len(completions) + sum(map(len, completions)))
    return torch.rand(len(completions), generator=draw).tolist()


# issue 44's run, shrunk: answers of exactly 4 tokens (EOS never sampled, every completion truncated), async N=1
FIXED_LENGTH = dict(
    per_device_train_batch_size=8,
    max_completion_length=4,
    learning_rate=1e-2,
    max_staleness=1,
    async_worker="thread",
    logging_steps=1,
    seed=0,
)
fixed_length_run = functools.partial(grpo_trainer, **FIXED_LENGTH)


def test_reward_rose_by_hand():
    assert reward_rose([0.1, 0.2], [0.3, 0.4]) and not reward_rose([0.3, 0.2], [0.25, 0.25])
    assert not reward_rose([0.5], [0.5])  # equal: not moving


def test_a_learning_run_whose_every_completion_is_truncated_is_warned_not_stopped(tmp_path, tok, dataset):
    trainer = fixed_length_run(
        tmp_path,
        tok,
        dataset,
        reward=digit_share,
        max_steps=8,
        generation_kwargs={"suppress_tokens": [tok.eos_token_id]},
        health_checks={"patience": 3},
    )
    with pytest.warns(
        HealthWarning,
        match=r"step 3: every completion hit max_completion_length=4 .* fine for "
        r"answers of a fixed length while the reward rises",
    ) as caught:
        trainer.train()  # 2a6f17d: TrainingStalled, 'all_truncated' stopped the run at step 3
    assert trainer.state.global_step == 8
    assert len([w for w in caught if "max_completion_length" in str(w.message)]) == 1  # once
    records = [r for r in logged(tmp_path) if "loss" in r]
    assert all(r["completions/clipped_ratio"] == 1.0 for r in records)
    assert records[-1]["reward"] > records[0]["reward"]  # it learns
    assert not any(k.startswith("health/stop/") for r in records for k in r)
    assert [r["step"] for r in records if "health/warning/all_truncated" in r] == [3]


def test_a_truncated_run_whose_reward_does_not_rise_still_stops(tmp_path, tok, dataset):
    trainer = fixed_length_run(
        tmp_path,
        tok,
        dataset,
        reward=noise,
        max_steps=12,
        generation_kwargs={"suppress_tokens": [tok.eos_token_id]},
        health_checks={"patience": 2, "constant_reward": False},
    )
    with pytest.warns(HealthWarning), pytest.raises(TrainingStalled) as stop:
        trainer.train()
    message = str(stop.value)
    assert "\n" not in message and "'all_truncated' stopped the run at step" in message
    assert "and the mean reward did not rise" in message and "since step 1" in message
    assert trainer.state.global_step >= 4  # 2 x patience steps at least
    assert HEALTH_CHECKS["patience"] == 10  # the default the false-alarm benchmark measured


# ------------------------------------------------------------------------------------------------ 3: async + LoRA
def weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


LORA_RUN = dict(max_steps=3, learning_rate=1e-2, seed=3, logging_steps=1)


def lora_async_trains_the_synchronous_weights(tmp_path, tok, dataset, kind: str) -> None:
    """The worker with a schedule of staleness 0 (the correction off) samples what the live LoRA policy samples,
    so the run trains the synchronous run's weights bit for bit: its rollouts come from the adapters pushed at
    each step (the LoRA B matrices start at 0: rollouts from unpushed adapters would differ from step 2 on)."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    sync = grpo_trainer(tmp_path / "sync", tok, dataset, peft_config=lora, **LORA_RUN)
    start = weights(sync)
    sync.train()
    lagged = grpo_trainer(
        tmp_path / "async",
        tok,
        dataset,
        peft_config=lora,
        async_worker=kind,
        vllm_importance_sampling_correction=False,
        **LORA_RUN,
    )
    lagged.producer = lagged.build_producer(staleness=0)
    pushed = []
    push = lagged.producer.push_weights
    lagged.producer.push_weights = lambda model, version: (
        pushed.append(sorted(pushed_weights(model))) or push(model, version)
    )
    lagged.train()  # 2a6f17d: RolloutWorkerError, the worker raised loading the push (Missing key(s) ...)
    assert len(pushed) == 3 and all(names and all("lora_" in n for n in names) for names in pushed)  # adapters
    reference, trained = weights(sync), weights(lagged)
    assert reference.keys() == trained.keys()
    assert all(torch.equal(reference[k], trained[k]) for k in reference)
    assert any(not torch.equal(reference[k], start[k]) for k in reference if "lora_B" in k)  # it trained


def test_async_with_a_lora_policy_samples_from_the_pushed_adapters(tmp_path, tok, dataset):
    lora_async_trains_the_synchronous_weights(tmp_path, tok, dataset, "thread")


@pytest.mark.slow
def test_async_with_a_lora_policy_in_a_worker_process(tmp_path, tok, dataset):
    lora_async_trains_the_synchronous_weights(tmp_path, tok, dataset, "process")


# ------------------------------------------------------------------------------------------------ 4: pickling
def test_a_model_class_or_hook_the_process_worker_cannot_load_is_refused_in_one_line(tmp_path, tok, dataset):
    model = toy.build_model("tiny", tokenizer=tok, seed=0)
    script_class = type("ScriptModel", (type(model),), {"__module__": "__main__"})  # as if defined in the script
    model.__class__ = script_class
    trainer = grpo_trainer(tmp_path, tok, dataset, model=model, max_staleness=1, max_steps=2)
    with pytest.raises(PreflightError) as err:
        trainer.train()  # 2a6f17d: "the rollout worker (pid ...) died with exit status 1 ...; its last output: (none)"
    message = str(err.value)
    assert is_user_error(err.value) and "\n" not in message
    assert "class 'ScriptModel' is defined in the training script (__main__)" in message
    assert "set async_worker: thread" in message and "define the class or hook at module level" in message

    hooked = toy.build_model("tiny", tokenizer=tok, seed=0)
    hooked.model.layers[0].register_forward_hook(lambda module, args, out: None)
    with pytest.raises(PreflightError, match=r"cannot be pickled \(.*lambda.*\): set async_worker: thread"):
        check_picklable(hooked)  # 2a6f17d: _pickle.PicklingError: Can't pickle <function <lambda> ...> (a traceback)
    check_picklable(toy.build_model("tiny", tokenizer=tok, seed=0))  # a plain model passes


# ------------------------------------------------------------------------------------------------ 5, 6: timeouts
SLOW_WORKER = """\
trainer: grpo
model: toy:tiny
dataset: toy:addition:64
reward_funcs:
  - treadle.toy.addition_reward
output_dir: {out}
max_steps: 4
per_device_train_batch_size: 128
num_generations: 8
max_completion_length: 200
max_staleness: 1
async_worker: thread
async_timeout: 0.05
save_strategy: "no"
"""


@pytest.fixture(scope="module")
def slow_thread_worker(tmp_path_factory):
    """`treadle train` with a thread worker that samples 200 tokens x 128 completions (seconds) and 50 ms to do it
    in. (32 x 64 tokens was not slow enough: in the full suite the worker once finished before the trainer first
    waited, and the run ended with exit 0.)"""
    folder = tmp_path_factory.mktemp("slow")
    (folder / "c.yaml").write_text(SLOW_WORKER.format(out=folder / "run"))
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC)}  # torch's own threads: the abort needs them
    return subprocess.run(
        [sys.executable, "-m", "treadle", "train", str(folder / "c.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.slow
def test_a_thread_worker_timeout_ends_the_run_with_exit_2_not_an_abort(slow_thread_worker):
    done = slow_thread_worker
    assert done.returncode == 2, done.stderr[-2000:]  # 2a6f17d: 134, "terminate called without an active exception"
    assert "terminate called" not in done.stderr and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("treadle: error:")]
    assert len(errors) == 1 and errors[0] == done.stderr.strip().splitlines()[-1]
    assert "the rollout worker (thread) did not answer within async_timeout=0.05 s" in errors[0]


@pytest.mark.slow
def test_a_slow_worker_is_called_slow_and_told_to_raise_async_timeout(slow_thread_worker):
    error = slow_thread_worker.stderr.strip().splitlines()[-1]
    # 2a6f17d: "... (a hung worker) ...: resume with resume_from_checkpoint=True (--resume auto)": it times out again
    assert "it is slow, not hung (its model ran" in error and "(a hung worker" not in error
    assert "raise async_timeout above 0.05 s" in error
    assert error.endswith("once async_timeout is raised (resumed as it is, it times out again)")


def test_a_hung_thread_worker_is_called_hung(tmp_path, tok, dataset):
    release = threading.Event()

    def stuck_in_the_worker(module, args):  # the trainer's own forwards (main thread) pass
        if threading.current_thread() is not threading.main_thread():
            release.wait(60)

    model = toy.build_model("tiny", tokenizer=tok, seed=0)
    model.register_forward_pre_hook(stuck_in_the_worker)
    trainer = grpo_trainer(
        tmp_path, tok, dataset, model=model, max_staleness=1, async_worker="thread", async_timeout=0.5, max_steps=2
    )
    try:
        with pytest.raises(RolloutWorkerError) as err:
            trainer.train()
    finally:
        release.set()  # the thread's next forward pass meets the stop flag and ends
    message = str(err.value)
    assert "\n" not in message
    assert (
        "did not answer within async_timeout=0.5 s while the trainer waited for generation 0's batch, and its "
        "model ran no forward pass in that time (a hung worker" in message
    )
