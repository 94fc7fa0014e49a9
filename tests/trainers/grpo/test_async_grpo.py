"""Asynchronous GRPO (``max_staleness``; trainers/onpolicy/producer.py, trainers/onpolicy/worker.py, docs/async.md):
the synchronous run unchanged, the schedule's staleness, reproducibility, exact resume after SIGKILL, a dead or hung
worker stopping the run in one line, SIGTERM, the importance-sampling correction's unbiasedness on a toy policy;
max_staleness's cap (no walk of the schedule scales with it), a LoRA policy sampled from its pushed adapters, a model
the process worker cannot load, and a thread worker's timeout ending the run cleanly and telling slow from hung
(docs/runs.md lists the trial cases)."""

import json
import os
import re
import signal
import subprocess
import sys
import threading

import _async_run as runner
import pytest
import torch
from _async_run import same, weights
from _factories import grpo_trainer
from peft import LoraConfig

from treadle.callbacks import TrainerCallback
from treadle.checkpoint import load_extra_state
from treadle.demos import toy
from treadle.engines.local import LocalEngine
from treadle.errors import Preempted, PreflightError, is_user_error
from treadle.generation.sampling import SamplingParams
from treadle.losses import GRPOObjective, grpo_loss, sampling_importance_ratio
from treadle.trainers.grpo.trainer import GRPOConfig
from treadle.trainers.onpolicy.producer import RolloutProducer, pushed_weights, worker_threads
from treadle.trainers.onpolicy.sampler import AsyncSampler, SyncSampler
from treadle.trainers.onpolicy.worker import RolloutWorkerError, check_picklable

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "..", "src")


def logged(trainer, name: str) -> list:
    return [h[name] for h in trainer.state.log_history if name in h]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    return weights(runner.run({"output_dir": str(tmp_path_factory.mktemp("sync") / "run")}))


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """max_staleness=1 with the default process worker, 5 steps, checkpoints every 2 (the resume reference)."""
    spec = {
        "output_dir": str(tmp_path_factory.mktemp("async") / "run"),
        "max_staleness": 1,
        "max_steps": 5,
        "save_strategy": "steps",
        "save_steps": 2,
    }
    trainer = runner.run(spec)
    return trainer, weights(trainer)


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"max_staleness": -1}, "max_staleness must be an integer >= 0"),
        ({"max_staleness": 1, "use_vllm": True}, "colocated vLLM engine cannot sample in the background"),
        ({"max_staleness": 1, "dynamic_sampling": True}, "cannot take dynamic_sampling"),
        ({"max_staleness": 1, "steps_per_generation": 2}, "one generation per optimizer step"),
        ({"max_staleness": 1, "async_worker": "fork"}, "async_worker='fork' is not supported"),
        ({"max_staleness": 1, "async_timeout": 0}, "async_timeout must be"),
    ],
)
def test_settings_async_grpo_does_not_take_are_refused_in_one_line(overrides, fragment):
    with pytest.raises(ValueError, match=fragment) as err:
        GRPOConfig(output_dir="unused", per_device_train_batch_size=4, num_generations=4, **overrides)
    assert "\n" not in str(err.value)


def test_thread_split():
    args = GRPOConfig(output_dir="unused", per_device_train_batch_size=4, num_generations=4, max_staleness=1)
    assert worker_threads(args.async_worker_threads, 2) == (1, 1)
    assert worker_threads(args.async_worker_threads, 1) == (1, 1)
    assert worker_threads(args.async_worker_threads, 16) == (8, 8)
    args.async_worker_threads = 3
    assert worker_threads(args.async_worker_threads, 16) == (3, 13)


# ------------------------------------------------------------------------------------------------ the schedule
def test_zero_staleness_is_the_synchronous_run_and_builds_no_worker(tmp_path):
    trainer = runner.build({"output_dir": str(tmp_path / "run"), "max_staleness": 0})
    assert type(trainer.engine) is LocalEngine and type(trainer.rollout_sampler) is SyncSampler  # today's run


def test_the_worker_at_zero_staleness_trains_the_synchronous_weights_bit_for_bit(tmp_path, sync_run):
    """The worker machinery itself (a process, weights pushed through the queue, replies in order) with a schedule
    of staleness 0 and the correction off samples exactly what the live model samples."""
    trainer = runner.build({"output_dir": str(tmp_path / "run"), "vllm_importance_sampling_correction": False})
    trainer.rollout_sampler = trainer.build_rollout_sampler(trainer.engine, staleness=0)
    with runner.one_thread():
        trainer.train()
    assert logged(trainer, "async/staleness") == [0.0] * 4
    assert same(weights(trainer), sync_run)


@pytest.mark.parametrize("n", [1, 2])
def test_a_batch_is_never_older_than_max_staleness(tmp_path, n):
    """Generation g is sampled from the weights of generation max(g - N, 0): ages 0, 1, .., N, N, ..."""
    trainer = runner.run(
        {"output_dir": str(tmp_path / "run"), "max_staleness": n, "max_steps": 5, "async_worker": "thread"}
    )
    ages = logged(trainer, "async/staleness")
    assert ages == [float(min(g, n)) for g in range(5)]
    assert max(ages) <= n
    ratios = logged(trainer, "sampling/importance_sampling_ratio/mean")
    assert len(ratios) == 5 and ratios[0] == pytest.approx(1.0, abs=1e-4)  # generation 0 is on-policy
    assert any(abs(r - 1) > 1e-3 for r in ratios[1:])  # the stale batches are corrected


def test_same_seed_same_weights_whatever_the_worker(tmp_path, async_run):
    """Two runs with the same seed and N train the same weights, the process worker and the thread worker alike:
    the schedule, not the timing, decides which weights sample which batch."""
    _, reference = async_run
    spec = {"max_staleness": 1, "max_steps": 5, "save_strategy": "steps", "save_steps": 2}
    again = runner.run({"output_dir": str(tmp_path / "again"), **spec})
    threaded = runner.run({"output_dir": str(tmp_path / "thread"), "async_worker": "thread", **spec})
    assert same(weights(again), reference) and same(weights(threaded), reference)
    assert logged(again, "loss") == logged(async_run[0], "loss")


def test_async_weights_differ_from_the_synchronous_ones(async_run, tmp_path):
    sync5 = runner.run({"output_dir": str(tmp_path / "sync5"), "max_steps": 5})
    assert not same(async_run[1], weights(sync5))  # the staleness is real


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_identical(tmp_path, async_run):
    """SIGKILL at the end of step 3 (checkpoint-2 written, its pending batch of generation 2 in it); the resumed
    run in a new process trains the uninterrupted run's weights bit for bit."""
    out, final = tmp_path / "run", tmp_path / "final.pt"
    base = {"output_dir": str(out), "max_staleness": 1, "max_steps": 5, "save_strategy": "steps", "save_steps": 2}
    for extra, code in (({"kill_at": 3}, -signal.SIGKILL), ({"resume": True, "final": str(final)}, 0)):
        spec_path = tmp_path / "spec.json"
        spec_path.write_text(json.dumps({**base, **extra}))
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, "_async_run.py"), str(spec_path)],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert proc.returncode == code, proc.stderr[-2000:]
        if extra.get("kill_at"):
            saved = load_extra_state(str(out / "checkpoint-2"))["trainer"]["async"]
            assert saved["max_staleness"] == 1 and list(saved["ready"]) == ["2"]  # sampled from generation 1's weights
            assert saved["ready"]["2"]["version"] == 1
    assert same(torch.load(final), async_run[1])


# ------------------------------------------------------------------------------------------------ failures
class _AtStepEnd(TrainerCallback):
    def __init__(self, step, action):
        self.step, self.action, self.trainer = step, action, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.action(self.trainer)


def _train_with(tmp_path, step, action, **spec):
    callback = _AtStepEnd(step, action)
    trainer = runner.build({"output_dir": str(tmp_path / "run"), "max_staleness": 1, **spec}, [callback])
    callback.trainer = trainer
    with runner.one_thread():
        trainer.train()
    return trainer


def test_a_dead_worker_stops_the_run_in_one_line_with_its_exit_status(tmp_path):
    pids = []

    def kill(trainer):
        pids.append(trainer.rollout_sampler.producer.worker.handle.pid)
        os.kill(pids[0], signal.SIGKILL)

    with pytest.raises(RolloutWorkerError) as err:
        _train_with(tmp_path, 1, kill)
    message = str(err.value)
    assert is_user_error(err.value) and "\n" not in message
    assert f"(pid {pids[0]}) died with exit status {-signal.SIGKILL}" in message
    # generation 1's batch may have been sent whole before the kill (then it trains, and generation 2 is waited for)
    assert re.search(r"while the trainer waited for generation [12]'s batch", message)
    assert f"treadle rollout worker: pid {pids[0]}" in message  # its last output


def test_a_hung_worker_stops_the_run_at_the_timeout_naming_the_wait(tmp_path):
    pids = []

    def freeze(trainer):
        pids.append(trainer.rollout_sampler.producer.worker.handle.pid)
        os.kill(pids[0], signal.SIGSTOP)  # alive, never answering

    with pytest.raises(RolloutWorkerError) as err:
        _train_with(tmp_path, 1, freeze, async_timeout=2.0)
    message = str(err.value)
    assert "\n" not in message
    assert re.search(
        r"did not answer within async_timeout=2 s while the trainer waited for generation [12]'s batch", message
    )
    assert not os.path.exists(f"/proc/{pids[0]}") or "zombie" in open(f"/proc/{pids[0]}/status").read().lower()


@pytest.mark.slow
def test_sigterm_checkpoints_the_pending_batches_stops_the_worker_and_resumes_exactly(tmp_path, async_run):
    pids = []

    def term(trainer):
        pids.append(trainer.rollout_sampler.producer.worker.handle.pid)
        os.kill(os.getpid(), signal.SIGTERM)

    spec = {"max_steps": 5, "save_strategy": "steps", "save_steps": 2}
    with pytest.raises(Preempted) as stopped:
        _train_with(tmp_path, 3, term, **spec)
    step = stopped.value.step
    saved = load_extra_state(stopped.value.checkpoint)["trainer"]["async"]
    assert list(saved["ready"]) == [str(step)]  # the batch requested ahead is in the checkpoint
    assert not os.path.exists(f"/proc/{pids[0]}") or "zombie" in open(f"/proc/{pids[0]}/status").read().lower()
    resumed = runner.run({"output_dir": str(tmp_path / "run"), "max_staleness": 1, "resume": True, **spec})
    assert same(weights(resumed), async_run[1])


# ------------------------------------------------------------------------------------------------ the correction
def test_the_corrected_off_policy_gradient_is_the_on_policy_gradient_in_expectation():
    """A categorical policy pi = softmax(theta) over K actions, reward r(a). The on-policy policy gradient is exact:
    g = sum_a pi(a) r(a) grad log pi(a), with grad log pi(a) = onehot(a) - pi. A stale sampler mu = softmax(theta_old)
    draws M actions; grpo_loss with the sampler correction (token_truncate, clip far away) weighs each draw by
    pi(a)/mu(a). Its gradient is minus the mean of M i.i.d. terms w_i r_i (onehot(a_i) - pi), whose expectation
    under mu is g. So each component of the mean must lie within k standard errors (the terms' std / sqrt(M)) of g;
    k = 4.5 leaves a false alarm at about 7e-6 per component (normal tails; M = 40000 makes the mean normal), and
    the generator is seeded, so the test is deterministic. The uncorrected gradient (weights 1) estimates
    E_mu[...] instead, which is far from g in standard errors: the check has the power to fail."""
    K, M = 6, 40000
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(K, generator=g, dtype=torch.float64)
    theta_old = theta + 0.7 * torch.randn(K, generator=g, dtype=torch.float64)
    reward = torch.randn(K, generator=g, dtype=torch.float64)
    pi, mu = theta.softmax(0), theta_old.softmax(0)
    exact = ((pi * reward)[:, None] * (torch.eye(K, dtype=torch.float64) - pi)).sum(0)  # (K,)

    actions = torch.multinomial(mu, M, replacement=True, generator=g)
    mask = torch.ones(M, 1, dtype=torch.float64)
    sampling_logps = mu.log()[actions][:, None]

    def gradient(corrected: bool):
        param = theta.clone().requires_grad_(True)
        logps = param.log_softmax(0)[actions][:, None]  # (M, 1): one-token completions
        ratio = (
            sampling_importance_ratio(logps.detach(), sampling_logps, mask, mode="token_truncate", clip_max=1e9)
            if corrected
            else None
        )
        loss, _ = grpo_loss(
            logps,
            reward[actions],
            mask,
            GRPOObjective(loss_type="dapo"),
            normalizer=M,
            importance_sampling_ratio=ratio,
        )
        (grad,) = torch.autograd.grad(loss, param)
        return -grad  # the loss is minus the objective

    onehot = torch.nn.functional.one_hot(actions, K).double()
    terms = ((pi[actions] / mu[actions]) * reward[actions])[:, None] * (onehot - pi)  # (M, K)
    estimate, stderr = terms.mean(0), terms.std(0) / M**0.5
    corrected = gradient(True)
    torch.testing.assert_close(corrected, estimate, rtol=1e-9, atol=1e-12)  # the library's gradient is that mean
    assert ((corrected - exact).abs() <= 4.5 * stderr).all(), (corrected - exact) / stderr
    uncorrected = gradient(False)
    assert ((uncorrected - exact).abs() / stderr).max() > 20


# ------------------------------------------------------------------------------------------------ the demo flag
def test_the_demo_takes_max_staleness_and_other_tasks_refuse_it(monkeypatch, capsys, tmp_path):
    from treadle.cli import command as cli
    from treadle.demos import addition as demo, toy

    calls = []
    monkeypatch.setattr(demo, "run_demo", lambda settings, out: calls.append(settings) or 0)
    monkeypatch.chdir(tmp_path)  # the command claims the default folder (runs/demo-...) before the demo
    assert cli.main(["demo", "--max_staleness", "1"]) == 0 and cli.main(["demo"]) == 0
    assert [s.max_staleness for s in calls] == [1, 0]
    tok = toy.build_tokenizer()
    trainer = demo.heldout_trainer(toy.build_model("tiny", tokenizer=tok), tok, calls[0], tmp_path / "run")
    assert isinstance(trainer.rollout_sampler, AsyncSampler) and trainer.args.max_staleness == 1
    assert cli.main(["demo", "--task", "tools", "--max_staleness", "1"]) == 2
    assert "--max-staleness is for the addition demo's GRPO" in capsys.readouterr().err


# the cases below run in one torch thread each (conftest's one_thread), last in this module so that the runs
# above keep the thread count they were built with
# ------------------------------------------------------------------------ max_staleness's cap, the schedule's walk
@pytest.mark.usefixtures("one_thread")
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


@pytest.mark.usefixtures("one_thread")
def test_the_schedule_walks_the_rows_read_ahead_not_max_staleness(tok):
    """``due`` looked at every generation up to g + N (10^9 per generation under max_staleness=10^9, deaf to
    SIGTERM); it walks the rows read ahead."""
    params = SamplingParams(num_generations=2, max_new_tokens=2, eos_token_ids=(2,), pad_token_id=0)
    producer = RolloutProducer(toy.build_model("tiny", tokenizer=tok, seed=0), params, staleness=10**6, seed=0)
    producer.rows, producer.versions = CountingDict({0: ["a"], 1: ["b"], 2: ["c"]}), CountingDict()
    CountingDict.looked = 0
    assert [g for g, _ in producer.due(0, max_steps=2)] == [0, 1]
    assert CountingDict.looked <= 10


# --------------------------------------------------------------------------------------------------- a LoRA policy
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
    lagged.rollout_sampler = lagged.build_rollout_sampler(lagged.engine, staleness=0)
    producer, pushed = lagged.rollout_sampler.producer, []
    push = producer.push_weights
    producer.push_weights = lambda model, version: pushed.append(sorted(pushed_weights(model))) or push(model, version)
    lagged.train()  # 2a6f17d: RolloutWorkerError, the worker raised loading the push (Missing key(s) ...)
    assert len(pushed) == 3 and all(names and all("lora_" in n for n in names) for names in pushed)  # adapters
    reference, trained = weights(sync), weights(lagged)
    assert reference.keys() == trained.keys()
    assert all(torch.equal(reference[k], trained[k]) for k in reference)
    assert any(not torch.equal(reference[k], start[k]) for k in reference if "lora_B" in k)  # it trained


@pytest.mark.usefixtures("one_thread")
def test_async_with_a_lora_policy_samples_from_the_pushed_adapters(tmp_path, tok, dataset):
    lora_async_trains_the_synchronous_weights(tmp_path, tok, dataset, "thread")


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_async_with_a_lora_policy_in_a_worker_process(tmp_path, tok, dataset):
    lora_async_trains_the_synchronous_weights(tmp_path, tok, dataset, "process")


# -------------------------------------------------------------- a worker that cannot start, answers late, or hangs
@pytest.mark.usefixtures("one_thread")
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


def run_slow_worker(folder, hogs: int) -> subprocess.CompletedProcess:
    """`treadle train` with a thread worker that samples 200 tokens x 128 completions (seconds) and 50 ms to do it
    in, beside ``hogs`` CPU hogs. (32 x 64 tokens was not slow enough: in the full suite the worker once finished
    before the trainer first waited, and the run ended with exit 0.)"""
    (folder / "c.yaml").write_text(SLOW_WORKER.format(out=folder / "run"))
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC)}  # torch's own threads: the abort needs them
    running = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        return subprocess.run(
            [sys.executable, "-m", "treadle", "train", str(folder / "c.yaml")],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    finally:
        for hog in running:
            hog.kill()
            hog.wait()


@pytest.fixture(scope="module")
def slow_thread_worker(tmp_path_factory):
    """The slow worker's run on its own: its model has run by the time the trainer gives up on it."""
    return run_slow_worker(tmp_path_factory.mktemp("slow"), hogs=0)


@pytest.fixture(scope="module")
def slow_thread_worker_under_load(tmp_path_factory):
    """The same under load, as in the full suite where it aborted (issue 59): a CPU hog per core beside the run, so
    that the worker's forward pass outlasts close()'s wait and the thread is still inside torch when the run ends.
    (Whether its model ran by then depends on the load, so only the ending is asserted on this run.)"""
    return run_slow_worker(tmp_path_factory.mktemp("loaded"), hogs=os.cpu_count() or 1)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_thread_worker_timeout_ends_the_run_with_exit_2_not_an_abort(slow_thread_worker_under_load):
    done = slow_thread_worker_under_load
    assert done.returncode == 2, done.stderr[-2000:]  # 2a6f17d: 134, "terminate called without an active exception"
    assert "terminate called" not in done.stderr and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("treadle: error:")]
    assert len(errors) == 1 and errors[0] == done.stderr.strip().splitlines()[-1]
    assert "the rollout worker (thread) did not answer within async_timeout=0.05 s" in errors[0]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_slow_worker_is_called_slow_and_told_to_raise_async_timeout(slow_thread_worker):
    error = slow_thread_worker.stderr.strip().splitlines()[-1]
    # 2a6f17d: "... (a hung worker) ...: resume with resume_from_checkpoint=True (--resume auto)": it times out again
    assert "it is slow, not hung (its model ran" in error and "(a hung worker" not in error
    assert "raise async_timeout above 0.05 s" in error
    assert error.endswith("once async_timeout is raised (resumed as it is, it times out again)")


@pytest.mark.usefixtures("one_thread")
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
