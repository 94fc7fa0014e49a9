"""Asynchronous GRPO through an engine that samples in another process (``RolloutEngine.samples_elsewhere``: the
vLLM server; docs/async.md), without vLLM: a stand-in engine that holds its own copy of the policy, as the server
does, and samples it with the own sampler. The producer's worker is then a thread that drives the engine (pushing its
copy's weights), the trainer's evaluation takes turns on it (``engines.base.take_turns``), and the schedule is the
own worker's: the same weights bit for bit, evaluation or not, resumed or not. The real server's run is in
tests/engines/test_vllm_server.py (``make test-vllm``)."""

import copy

import _async_run as runner
import pytest
import torch
from _async_run import same, weights

from treadle.demos import toy
from treadle.engines.base import EngineSide, RolloutEngine, take_turns
from treadle.engines.local import LocalEngine
from treadle.errors import is_user_error
from treadle.generation.sampling import SamplingParams
from treadle.models import base_model
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from treadle.trainers.onpolicy.worker import RolloutWorkerError

SPEC = {"max_staleness": 1, "max_steps": 5, "save_strategy": "steps", "save_steps": 2}


class Elsewhere(RolloutEngine):
    """A server's stand-in: its own copy of the policy, refreshed by ``load_weights``, sampled by the own sampler;
    ``pushes`` lists the version of each push, ``fail_at`` makes that generate call (1-based) raise."""

    samples_elsewhere = True

    def __init__(self, model, fail_at: int | None = None):
        self.copy = copy.deepcopy(base_model(model)).eval()
        self.local = LocalEngine(self.copy, backend="fast")
        self.pushes, self.calls, self.fail_at, self.closed = [], 0, fail_at, False

    def load_weights(self, model, version=None):
        self.copy.load_state_dict(base_model(model).state_dict())
        self.pushes.append(version)
        self.policy_version = version

    def generate(self, prompt_ids, params, *, generator=None, prompt_inputs=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("the stand-in server stopped answering (call 3)")
        with torch.no_grad():
            return self.local.generate(prompt_ids, params, generator=generator)

    def close(self):
        self.closed = True


class ServedGRPO(GRPOTrainer):
    fail_at = None

    def build_engine(self):
        return Elsewhere(self.model, self.fail_at)


def build(spec: dict, fail_at=None) -> ServedGRPO:
    trainer_class = type("Failing", (ServedGRPO,), {"fail_at": fail_at}) if fail_at else ServedGRPO
    evaluated = toy.load_task("addition", kind="rl", n=8) if spec.get("eval_strategy") else None
    return runner.build(spec, trainer_class=trainer_class, eval_dataset=evaluated)


def train(spec: dict, resume=None, fail_at=None) -> ServedGRPO:
    with runner.one_thread():
        trainer = build(spec, fail_at)
        trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.fixture(scope="module")
def thread_run(tmp_path_factory):
    """The own sampler's thread worker, N = 1, 5 steps: what the engine sampling elsewhere must train."""
    trainer = runner.run({"output_dir": str(tmp_path_factory.mktemp("own") / "run"), "async_worker": "thread", **SPEC})
    return weights(trainer)


@pytest.fixture(scope="module")
def served_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("served") / "run"
    return out, train({"output_dir": str(out), **SPEC})


def test_the_engine_that_samples_elsewhere_trains_the_own_workers_weights_bit_for_bit(served_run, thread_run):
    _, trainer = served_run
    assert same(weights(trainer), thread_run)
    assert [h["async/staleness"] for h in trainer.state.log_history if "async/staleness" in h] == [0, 1, 1, 1, 1]
    assert isinstance(trainer.engine, EngineSide) and trainer.engine.owner  # the trainer's side owns the engine
    engine = trainer.engine.turns.engine
    # generations 0 and 1 from weights 0, then g + 1 from weights g: a push a version (none for the last step's,
    # which samples nothing), a call a generation
    assert engine.pushes == [0, 1, 2, 3] and engine.calls == 5
    # the run ended: its worker stopped, the engine not
    assert trainer.rollout_sampler.producer.worker is None and not engine.closed


def test_evaluation_takes_its_turn_and_leaves_the_schedule_alone(tmp_path, thread_run):
    """Evaluating every step pushes the trainer's current weights to the engine; the worker pushes its copy's
    again before its next batch, so the run trains the same weights as without evaluation."""
    trainer = train(
        {"output_dir": str(tmp_path / "run"), "eval_strategy": "steps", "eval_steps": 1, "num_generations_eval": 4}
        | SPEC
    )
    assert same(weights(trainer), thread_run)
    engine = trainer.engine.turns.engine
    assert len([h for h in trainer.state.log_history if "eval_reward" in h]) == 5
    assert engine.pushes[:2] == [0, 1] and len(engine.pushes) > 5  # evaluation's pushes came between the worker's


def test_a_resumed_run_continues_exactly(served_run, thread_run):
    out, _ = served_run
    resumed = train({"output_dir": str(out), **SPEC}, resume=str(out / "checkpoint-2"))
    assert same(weights(resumed), thread_run)


def test_an_engine_failing_in_the_worker_stops_the_run_in_one_line_naming_it(tmp_path):
    with pytest.raises(RolloutWorkerError) as err:
        train({"output_dir": str(tmp_path / "run"), **SPEC}, fail_at=3)
    message = str(err.value)
    assert is_user_error(err.value) and "\n" not in message
    assert "(thread) raised while sampling generation 2's batch" in message
    assert message.count("the stand-in server stopped answering (call 3)") == 1  # the worker's own error, once


def test_server_mode_takes_max_staleness_and_colocate_refuses_it():
    GRPOConfig(
        output_dir="unused",
        per_device_train_batch_size=4,
        num_generations=4,
        max_staleness=1,
        use_vllm=True,
        vllm_mode="server",
    )
    with pytest.raises(ValueError, match="set vllm_mode: server"):
        GRPOConfig(
            output_dir="unused", per_device_train_batch_size=4, num_generations=4, max_staleness=1, use_vllm=True
        )


def test_two_sides_take_turns_with_their_own_weights():
    tok = toy.build_tokenizer()
    a, b = (toy.build_model("tiny", tokenizer=tok, seed=s) for s in (0, 1))
    engine = Elsewhere(a)
    mine, other = take_turns(engine)
    assert take_turns(mine)[0] is mine and take_turns(mine)[1].turns is mine.turns  # shared again, not wrapped
    mine.load_weights(a, version=7)
    other.load_weights(b, version=3)
    assert engine.pushes == [7, 3] and mine.policy_version == 7 and other.policy_version == 3
    prompts = [tok("1+2=")["input_ids"]]
    params = SamplingParams(num_generations=2, max_new_tokens=3, eos_token_ids=(2,), pad_token_id=tok.pad_token_id)
    mine.generate(prompts, params, generator=torch.Generator().manual_seed(0))
    assert engine.pushes == [7, 3, 7]  # b's weights were in the engine: a's pushed again first
    mine.generate(prompts, params, generator=torch.Generator().manual_seed(0))
    assert engine.pushes == [7, 3, 7]  # still a's: nothing pushed
    other.close()
    assert not engine.closed
    mine.close()
    assert engine.closed
