"""The second hostile trial (issue 33), in one process where the behaviour is not about the CLI process: what
overwrite_output_dir may delete, the lock race, checkpoint fingerprints, resuming a finished schedule, path
settings, config values at config time, merge into the base model's folder. docs/runs.md holds the table."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest


def write(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---- reward functions, tools and environments -------------------------------------------------------------------
def test_a_reward_function_that_edits_its_arguments_changes_nothing_for_the_next_or_the_record():
    from treadle.rewards import score_completions

    seen = {}

    def vandal(prompts, completions, completion_ids, answer, **kw):
        completions[0], prompts[0], answer[0] = "MUTATED", "MUTATED", "MUTATED"
        completion_ids[0].append(99)
        completions[1][0]["content"] = "MUTATED"
        return [0.0, 0.0]

    def judge(prompts, completions, completion_ids, answer, **kw):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer)
        return [1.0, 1.0]

    prompts, completions = ["p0", "p1"], ["c0", [{"role": "assistant", "content": "c1"}]]
    ids, columns = [[1, 2], [3]], {"answer": ["a0", "a1"]}
    original = json.dumps([prompts, completions, ids, columns])
    score_completions(
        [vandal, judge],
        [1.0, 1.0],
        prompts=prompts,
        completions=completions,
        completion_ids=ids,
        columns=columns,
        step=1,
    )
    assert json.dumps([prompts, completions, ids, columns]) == original  # what completions.jsonl logs
    assert (
        json.dumps([seen["prompts"], seen["completions"], seen["completion_ids"], {"answer": seen["answer"]}])
        == original
    )


def test_a_tool_calling_sys_exit_is_a_failed_call_not_the_end_of_training():
    from treadle.rollouts.tools import ToolEnvironment

    def quit_(x: int) -> int:
        """Exits."""
        raise SystemExit(3)

    env = ToolEnvironment([quit_], tool_timeout=None)
    try:
        assert env.step("<call>quit_(1)</call>")[0] == "<result>error: quit_ raised SystemExit: 3</result>"
        env.timeout = 5.0
        assert env.step("<call>quit_(1)</call>")[0] == "<result>error: quit_ raised SystemExit: 3</result>"
        assert env.failed_calls == 2
    finally:
        env.close()


def test_a_tool_without_a_deadline_that_runs_long_is_named_in_a_warning(monkeypatch):
    import threading

    from treadle.rollouts import calls as usercalls
    from treadle.rollouts.tools import ToolEnvironment

    released, seen = threading.Event(), []

    def slow(x: int) -> int:
        """Waits until the warning is out."""
        released.wait()
        return x

    def warn(message, category, stacklevel=1):
        seen.append((message, category))
        released.set()

    monkeypatch.setattr(usercalls, "SLOW_CALL_WARNING", 0.01)
    monkeypatch.setattr(usercalls, "warnings", SimpleNamespace(warn=warn))
    env = ToolEnvironment([slow], tool_timeout=None)
    try:
        assert env.step("<call>slow(7)</call>")[0] == "<result>7</result>"  # no limit: it waited, and said so
    finally:
        env.close()
    [(message, category)] = seen
    assert category is usercalls.SlowCallWarning
    assert "tool 'slow' has run for 0.01 s with tool_timeout=None (no limit)" in message


class Hangs:
    def __init__(self):
        self.release = __import__("threading").Event()

    def reset(self, row):
        return " go:"

    def step(self, text):
        self.release.wait()
        return "late", 1.0, False


def test_an_environment_that_never_answers_ends_its_rollout_at_env_timeout(recwarn):
    from treadle.demos import toy
    from treadle.rollouts.calls import GuardedEnvironment, SlowCallWarning
    from treadle.rollouts.runner import RolloutRunner, rollout_metrics

    with pytest.raises(ValueError, match="env_timeout must be > 0 seconds"):
        RolloutRunner(toy.build_tokenizer(), env_factory=Hangs, env_timeout=0)
    runner = RolloutRunner(toy.build_tokenizer(), env_factory=Hangs, env_timeout=0.05)
    try:
        env = runner.new_environment()
        assert isinstance(env, GuardedEnvironment) and env.timeout == 0.05
        assert env.reset({}) == " go:"
        assert env.step("7") == ("", None, True) and env.timed_out  # ended, unanswered
        assert env.step("8") == ("", None, True)  # never called again
        [warning] = [w for w in recwarn if w.category is SlowCallWarning]
        assert "environment Hangs.step ran past env_timeout=0.05 s: its rollout ends there" in str(warning.message)
        fine = GuardedEnvironment(Hangs(), 0.05, runner.tool_pool)
        metrics = rollout_metrics([[{"role": "assistant", "content": "x"}]] * 2, [False, False], [env, fine])
        assert metrics["rollouts/env_timeouts"] == (1, 2)
    finally:
        env.env.release.set()
        runner.close()


class Wrong:
    def __init__(self, first="", answer=("", None, False), error=None):
        self.first, self.answer, self.error = first, answer, error

    def reset(self, row):
        return self.first

    def step(self, text):
        if self.error:
            raise self.error
        return self.answer


@pytest.mark.parametrize(
    "env, method, needle",
    [
        (
            Wrong(first=5),
            "reset",
            "environment Wrong.reset returned the first observation 5 (int); its contract is reset",
        ),
        (Wrong(answer=(5, None, False)), "step", "environment Wrong.step returned observation 5 (int)"),
        (Wrong(answer=("ok", "1.0", False)), "step", "environment Wrong.step returned reward '1.0' (str)"),
        (Wrong(answer=("ok", None, "False")), "step", "environment Wrong.step returned done 'False' (str)"),
        (Wrong(answer="ok"), "step", "environment Wrong.step returned 'ok' (str); its contract is step(text) -> ("),
        (Wrong(error=SystemExit(1)), "step", "environment Wrong.step raised SystemExit: 1 on 'turn'"),
    ],
)
def test_an_environment_breaking_its_contract_is_one_line_naming_it(env, method, needle):
    from treadle.errors import is_user_error, one_line
    from treadle.rollouts.calls import EnvironmentContractError, GuardedEnvironment, ToolPool

    pool = ToolPool()
    try:
        guarded = GuardedEnvironment(env, 5.0, pool)
        with pytest.raises(EnvironmentContractError) as error:
            guarded.reset({}) if method == "reset" else guarded.step("turn")
        assert GuardedEnvironment(Wrong(answer=("ok", 1, 1)), 5.0, pool).step("t") == ("ok", 1, True)
    finally:
        pool.close()
    assert is_user_error(error.value) and needle in one_line(error.value)


# ---- data that would train on something the user did not mean ---------------------------------------------------
def sft(tmp_path, rows, **fields):
    from treadle.demos import toy
    from treadle.trainers.sft import SFTConfig, SFTTrainer

    fields = {"max_steps": 2, "per_device_train_batch_size": 2, "save_strategy": "no", **fields}
    args = SFTConfig(output_dir=str(tmp_path / "run"), report_to=[], disable_tqdm=True, logging_steps=1, **fields)
    tok = toy.build_tokenizer()
    return SFTTrainer(
        model=toy.build_model("tiny", tokenizer=tok), args=args, train_dataset=rows, processing_class=tok
    )


@pytest.mark.parametrize(
    "messages, needle",
    [
        (
            [{"role": "hacker", "content": "hi"}],
            "the train dataset, row 1: column 'messages', message 0 has role 'hacker', which no chat template renders",
        ),
        ([{"role": "user"}], "the train dataset, row 1: column 'messages', message 0 (user) has no 'content'"),
    ],
)
def test_chat_messages_of_an_unknown_role_or_without_content_name_the_row(tmp_path, messages, needle):
    from treadle.data import DatasetFileError

    ok = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    with pytest.raises(DatasetFileError) as error:
        sft(tmp_path, [{"messages": ok}, {"messages": messages}])
    assert needle in str(error.value) and len(str(error.value)) < 300


@pytest.mark.parametrize(
    "rows, needle",
    [
        (
            [{"prompt": "1+1=", "completion": ""}] * 4,
            r"4 of 4 train rows have an empty 'completion' \(rows 0, 1, 2, 3\)",
        ),
        (
            [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": " "}],
            r"1 of 2 train rows have an empty 'completion' \(rows 1\): SFT would train them on the end-of-text token",
        ),
        ([{"text": "1+1=2"}, {"text": ""}], r"1 of 2 train rows have an empty 'text'"),
    ],
)
def test_sft_refuses_empty_completions_as_dpo_does(tmp_path, rows, needle):
    with pytest.raises(ValueError, match=needle):
        sft(tmp_path, rows)


def test_a_run_that_trained_on_nothing_never_ends_as_if_it_had(tmp_path):
    from treadle.errors import NothingTrainedError, is_user_error

    rows = [{"input_ids": [1, 5, 6, 2], "completion_mask": [0, 0, 0, 0]}] * 4  # not one token with loss
    trainer = sft(tmp_path, rows)
    with pytest.raises(
        NothingTrainedError, match="the run took 2 steps but not one of its batches held a token with loss"
    ) as error:
        trainer.train()
    assert is_user_error(error.value)


def dpo(tmp_path, rows):
    from treadle.demos import toy
    from treadle.trainers.dpo import DPOConfig, DPOTrainer

    tok = toy.build_tokenizer()
    args = DPOConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
    )
    return DPOTrainer(toy.build_model("tiny", tokenizer=tok), args=args, train_dataset=rows, processing_class=tok)


def test_dpo_refuses_pairs_that_are_all_identical_and_notes_some(tmp_path, capsys):
    same = [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 1)} for a in range(4)]
    with pytest.raises(
        ValueError,
        match=r"every one of the 4 train pairs has chosen identical to rejected .*loss "
        r"log 2, gradient 0",
    ):
        dpo(tmp_path, same)
    mixed = same[:1] + [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(3)]
    dpo(tmp_path, mixed)
    assert "treadle: 1 of 4 train pairs have chosen identical to rejected (rows 0)" in capsys.readouterr().err


def test_a_batch_larger_than_the_dataset_is_capped_and_the_header_says_so(tmp_path, capsys):
    rows = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(6)]
    trainer = sft(tmp_path, rows, per_device_train_batch_size=10**7, max_steps=1)
    out = trainer.train()
    header = capsys.readouterr().out
    assert (
        "6 rows; 6 rows per step (6 per device x 1 accumulated x 1 processes, per_device_train_batch_size="
        "10000000 capped at the rows there are)" in header
    )
    assert trainer.get_train_dataloader().batch_size == 6
    samples_per_step = out.metrics["train_samples_per_second"] / out.metrics["train_steps_per_second"]
    assert samples_per_step == pytest.approx(6, rel=1e-2)  # was 10**7 "samples" a step


def test_merge_adapters_without_adapters_and_a_classifier_task_type_on_a_causal_lm_are_refused(tmp_path):
    pytest.importorskip("peft")
    from treadle.peft import lora_config

    rows = [{"prompt": "1+1=", "completion": "2"}] * 2
    with pytest.raises(ValueError, match="merge_adapters=True but the model has no adapters to merge"):
        sft(tmp_path, rows, merge_adapters=True)
    with pytest.raises(ValueError, match="peft task_type 'SEQ_CLS' does not fit LlamaForCausalLM, a causal LM"):
        from treadle.demos import toy
        from treadle.trainers.sft import SFTConfig, SFTTrainer

        tok = toy.build_tokenizer()
        SFTTrainer(
            toy.build_model("tiny", tokenizer=tok),
            args=SFTConfig(output_dir=str(tmp_path / "r"), report_to=[]),
            train_dataset=rows,
            processing_class=tok,
            peft_config=lora_config({"r": 2, "target_modules": "all-linear", "task_type": "SEQ_CLS"}),
        )


def test_python_api_refuses_a_model_vocabulary_smaller_than_the_tokenizer_as_the_cli_does(tmp_path):
    from treadle.demos import toy
    from treadle.errors import PreflightError
    from treadle.trainers.sft import SFTConfig, SFTTrainer

    tok = toy.build_tokenizer()
    with pytest.raises(
        PreflightError,
        match=rf"the tokenizer of LlamaForCausalLM has {len(tok)} tokens but the model's "
        r"embedding has 16 rows; .*resize_token_embeddings",
    ):
        SFTTrainer(
            toy.build_model("tiny", vocab_size=16),
            args=SFTConfig(output_dir=str(tmp_path), report_to=[]),
            train_dataset=[{"prompt": "1+1=", "completion": "2"}],
            processing_class=tok,
        )
