"""treadle.streaming: streamed datasets in the Trainer, SFT (packed) and GRPO; ranks read disjoint rows; a resumed
streaming run equals the uninterrupted one bit for bit, by the source's state and by skipping; a stream is tied to
its data (resumed with a larger max_steps, refused on other rows), and a cut or null .jsonl line is named by its file
and line."""

from __future__ import annotations

import json
import os
import re

import _resume_worker as rw
import pytest
import torch
from _factories import sft_trainer, tiny_reward_model
from datasets import Dataset
from test_run_errors import ROWS, write_jsonl

from treadle import Trainer, streaming
from treadle.callbacks import TrainerCallback
from treadle.checkpoint import CheckpointError
from treadle.errors import PreflightError


def numbered(n: int = 20) -> Dataset:
    return Dataset.from_list([{"i": i} for i in range(n)])


class _Rows(torch.utils.data.IterableDataset):
    """A torch IterableDataset: no state_dict, so a resume skips."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def one_pass(loader) -> list[int]:
    return [row["i"] for batch in loader for row in batch]


# ---------------------------------------------------------------------------------------------------------
# Ranks: disjoint shards that cover the data
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: numbered().to_iterable_dataset(num_shards=4),  # whole shards per rank
        lambda: numbered().to_iterable_dataset(num_shards=3),  # every other row
        lambda: _Rows([{"i": i} for i in range(20)]),
    ],
    ids=["datasets-4-shards", "datasets-3-shards", "torch"],
)
def test_two_ranks_read_disjoint_rows_that_cover_the_stream(make):
    seen = [
        one_pass(streaming.StreamLoader(make(), batch_size=3, collate_fn=list, rank=r, world_size=2)) for r in (0, 1)
    ]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(20))
    assert abs(len(seen[0]) - len(seen[1])) <= 5  # a shard each (5 rows) at most apart


def test_resume_modes_say_which_sources_load_their_state():
    source = numbered().to_iterable_dataset(num_shards=2)
    assert streaming.resume_mode(source) == streaming.STATE
    assert streaming.resume_mode(source.shuffle(seed=0, buffer_size=4)) == streaming.SKIP  # buffer not in the state
    assert streaming.resume_mode(_Rows([])) == streaming.SKIP


def test_training_batches_cycle_and_continue_from_a_saved_position():
    def loader():
        return streaming.StreamLoader(numbered(7).to_iterable_dataset(num_shards=1), batch_size=3, collate_fn=list)

    first = loader()
    batches = first.training_batches()
    got = [[r["i"] for r in next(batches)] for _ in range(4)]
    assert got == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2]]  # the stream read again when it ran out (a short batch)
    state = first.state_dict()
    assert state["batches"] == 4 and state["epoch"] == 1 and state["mode"] == streaming.STATE
    want = [[r["i"] for r in next(batches)] for _ in range(4)]
    again = loader()
    again.load_state_dict(state)
    resumed = again.training_batches(4)
    assert [[r["i"] for r in next(resumed)] for _ in range(4)] == want
    # and without a saved position: counted out from the start, across the end of the first pass
    assert [r["i"] for r in next(loader().training_batches(4))] == want[0] == [3, 4, 5]


@pytest.mark.parametrize("shuffled", [False, True], ids=["state", "skip"])
def test_resuming_twice_inside_one_chunk_and_after_counting_out_continues_exactly(shuffled):
    """Chunks of 5 rows made into 2 rows each (a transform), batches of 3: a position saved inside a chunk, resumed,
    saved again inside the same chunk and resumed again; and a position counted out from the start (no saved
    one) and saved: every resumed loader gives the batches of the uninterrupted one."""

    def loader():
        source = numbered(23).to_iterable_dataset(num_shards=1)
        source = source.shuffle(seed=1, buffer_size=4) if shuffled else source
        stream = streaming.Stream(source, lambda rows: [{"i": r["i"]} for r in rows for _ in range(2)], chunk_size=5)
        return streaming.StreamLoader(stream, batch_size=3, collate_fn=lambda rows: [r["i"] for r in rows])

    def take(batches, n):
        return [next(batches) for _ in range(n)]

    want = take(loader().training_batches(), 30)  # 46 rows a pass: the 30 batches cross two passes' ends
    first = loader()
    got = take(first.training_batches(), 4)  # 12 rows: inside the 2nd chunk (rows 10-19)
    for stop in (5, 17, 22):  # 15 rows: still in the 2nd chunk; then beyond a pass's end
        again = loader()
        again.load_state_dict(first.state_dict())
        got += take(again.training_batches(len(got)), stop - len(got))
        first = again
    counted = loader()
    got += take(counted.training_batches(len(got)), 3)  # no saved position: counted out
    resumed = loader()
    resumed.load_state_dict(counted.state_dict())
    got += take(resumed.training_batches(len(got)), 30 - len(got))
    assert got == want


def test_a_stream_without_max_steps_is_refused_in_one_line(tmp_path):
    trainer = Trainer(
        rw.make_model(),
        rw.make_args(str(tmp_path), max_steps=-1, num_train_epochs=1),
        train_dataset=Dataset.from_list(rw.make_rows()).to_iterable_dataset(),
    )
    with pytest.raises(PreflightError, match="stream.*set max_steps") as info:
        trainer.train()
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------------------
# Resuming a streaming run: bit for bit
# ---------------------------------------------------------------------------------------------------------
class _StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = control.should_save = True


def _losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _assert_same_run(full, resumed) -> None:
    assert _losses(resumed) == _losses(full)
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def _interrupted_and_resumed(make_trainer, out, stop_at: int):
    make_trainer(os.path.join(out, "cut"), [_StopAt(stop_at)]).train()
    resumed = make_trainer(os.path.join(out, "cut"), [])
    resumed.train(resume_from_checkpoint=True)
    return resumed


READS = {"rows": 0}


def _counted(row):
    READS["rows"] += 1
    return row


@pytest.mark.slow
@pytest.mark.parametrize("shuffled", [False, True], ids=["state", "skip"])
def test_a_resumed_stream_run_equals_the_uninterrupted_one(tmp_path, shuffled):
    """22 rows, 4 a step: a pass ends mid-step 6; stopped at step 7 (in the 2nd pass), resumed to step 9."""

    def stream():
        source = Dataset.from_list(rw.make_rows()).to_iterable_dataset(num_shards=2).map(_counted)
        return source.shuffle(seed=3, buffer_size=5) if shuffled else source

    def make(out, callbacks):
        return Trainer(rw.make_model(), rw.make_args(out, max_steps=9), train_dataset=stream(), callbacks=callbacks)

    full = make(str(tmp_path / "full"), [])
    full.train()
    READS["rows"] = 0
    make(str(tmp_path / "cut"), [_StopAt(7)]).train()
    READS["rows"] = 0
    resumed = make(str(tmp_path / "cut"), [])
    resumed.train(resume_from_checkpoint=True)
    _assert_same_run(full, resumed)
    assert resumed.callback_handler.train_dataloader.mode == ("skip" if shuffled else "state")
    # steps 8-9 train on 8 rows. "state" reads from the chunk it stopped in (chunks of 1 row here: 1 row again);
    # "skip" reads the 2nd pass's first 6 rows again (and its shuffle buffer reads ahead). Both read the stream's
    # first rows for its fingerprint (streaming.head_fingerprint: at most HEAD_ROWS, here all 22)
    head = min(len(rw.make_rows()), streaming.HEAD_ROWS)
    if shuffled:
        assert READS["rows"] >= head + 6 + 8
    else:
        assert READS["rows"] == head + 1 + 8


# ---------------------------------------------------------------------------------------------------------
# SFT (packing over the stream) and GRPO (prompts from a stream)
# ---------------------------------------------------------------------------------------------------------
def _addition_rows(n: int = 24) -> list[dict]:
    return [{"prompt": f"{a}+{a + 3}=", "completion": str(2 * a + 3) * (1 + a % 3)} for a in range(n)]


def test_sft_packs_a_stream_as_it_packs_the_same_rows_in_memory(tmp_path):
    from treadle import SFTConfig, SFTTrainer
    from treadle.demos import toy

    args = SFTConfig(output_dir=str(tmp_path), packing=True, max_length=24, max_steps=1, disable_tqdm=True)
    tokenizer = toy.build_tokenizer()
    in_memory = SFTTrainer(
        toy.build_model("tiny", seed=0), args, train_dataset=_addition_rows(), processing_class=tokenizer
    )
    streamed = SFTTrainer(
        toy.build_model("tiny", seed=0),
        args,
        train_dataset=Dataset.from_list(_addition_rows()).to_iterable_dataset(),
        processing_class=tokenizer,
    )
    assert isinstance(streamed.train_dataset, streaming.Stream)
    # one chunk holds all 24 rows: the same best-fit packing as over the whole in-memory dataset
    assert list(streamed.train_dataset) == in_memory.train_dataset.to_list()


@pytest.mark.slow
def test_a_resumed_packed_sft_stream_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    from treadle import SFTConfig, SFTTrainer
    from treadle.demos import toy
    from treadle.trainers import sft

    monkeypatch.setattr(sft, "TOKENIZE_CHUNK", 10)  # several packing chunks; the stop lands inside one

    def make(out, callbacks):
        args = SFTConfig(
            output_dir=out,
            packing=True,
            max_length=24,
            max_steps=6,
            per_device_train_batch_size=2,
            learning_rate=1e-2,
            logging_steps=1,
            save_steps=1000,
            disable_tqdm=True,
            seed=0,
        )
        return SFTTrainer(
            toy.build_model("tiny", seed=0),
            args,
            processing_class=toy.build_tokenizer(),
            train_dataset=Dataset.from_list(_addition_rows()).to_iterable_dataset(num_shards=2),
            callbacks=callbacks,
        )

    full = make(str(tmp_path / "full"), [])
    full.train()
    resumed = _interrupted_and_resumed(make, str(tmp_path), stop_at=3)
    assert resumed.callback_handler.train_dataloader.mode == "state"
    _assert_same_run(full, resumed)


@pytest.mark.slow
def test_grpo_trains_on_prompts_from_a_stream_and_resumes_exactly(tmp_path):
    import _dist_worker as worker

    from treadle import GRPOTrainer

    def make(out, callbacks):
        parts = worker.grpo_parts(
            out, 1, num_generations=4, max_steps=4, save_steps=1000, per_device_train_batch_size=4
        )
        parts["train_dataset"] = parts["train_dataset"].to_iterable_dataset(num_shards=2)
        return GRPOTrainer(**parts, callbacks=callbacks)

    full = make(str(tmp_path / "full"), [])
    full.train()
    with open(tmp_path / "full" / "completions.jsonl") as f:
        prompts = [json.loads(line)["prompt"] for line in f]
    # each generation: one prompt of the stream (in order), its 4 completions
    assert prompts == [p for a, b in worker.ADDITION[:4] for p in [f"{a}+{b}="] * 4]
    resumed = _interrupted_and_resumed(make, str(tmp_path), stop_at=2)
    _assert_same_run(full, resumed)


def test_a_grpo_stream_needs_whole_groups_per_rank_and_no_dynamic_sampling():
    from types import SimpleNamespace

    from treadle.trainers.grpo.dynamic import check_stream
    from treadle.trainers.onpolicy.data import prompt_stream

    source = numbered(4).to_iterable_dataset()
    # 2 processes x 2 rows = 4 completions a generation: one group of 4 in all, but half a group on each rank
    with pytest.raises(PreflightError, match="generation_batch_size 2 .* multiple of num_generations 4"):
        prompt_stream(source, SimpleNamespace(generation_batch_size=2, num_generations=4))
    with pytest.raises(PreflightError, match="dynamic_sampling"):  # GRPO's get_train_dataloader checks it
        check_stream(source, SimpleNamespace(dynamic_sampling=True))
    check_stream(source, SimpleNamespace(dynamic_sampling=False))
    check_stream(numbered(4), SimpleNamespace(dynamic_sampling=True))  # a datasets.Dataset: extra draws are fine
    stream = prompt_stream(source, SimpleNamespace(generation_batch_size=4, num_generations=2))
    assert [row["i"] for row in stream] == [0, 0, 1, 1, 2, 2, 3, 3]


# ---------------------------------------------------------------------------------------------------------
# YAML: dataset: {path: ..., streaming: true}
# ---------------------------------------------------------------------------------------------------------
def test_a_config_streams_a_jsonl_file(tmp_path):
    from treadle.cli.loading import load_dataset

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _addition_rows(5)))
    data = load_dataset({"path": "train.jsonl", "streaming": True}, base_dir=tmp_path)
    assert streaming.is_stream(data) and list(data) == _addition_rows(5)
    assert streaming.resume_mode(data) == streaming.STATE
    toy = load_dataset({"path": "toy:addition:6", "streaming": True}, kind="sft")
    assert streaming.is_stream(toy) and len(list(toy)) == 6
    assert not streaming.is_stream(load_dataset({"path": "train.jsonl"}, base_dir=tmp_path))
    with pytest.raises(ValueError, match="takes path: .* and streaming: true/false"):
        load_dataset({"path": "train.jsonl", "stream": True}, base_dir=tmp_path)


# ---------------------------------------------------------------------------------------------------------
# DPO, KTO and the reward trainer: their tokenising maps run lazily over the stream
# ---------------------------------------------------------------------------------------------------------
def _preference_trainer(name: str, out: str, callbacks):
    import _dist_worker as worker

    import treadle
    from treadle.demos import toy

    pairs = Dataset.from_list(
        [
            {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1 + i) * 2}
            for i, (a, b) in enumerate(worker.ADDITION)
        ]
    ).to_iterable_dataset(num_shards=2)
    settings = dict(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=1000,
        disable_tqdm=True,
        seed=0,
    )
    tokenizer = toy.build_tokenizer()
    if name == "reward":
        model, config = tiny_reward_model(), treadle.RewardConfig(**settings)
    else:
        model = toy.build_model("tiny", seed=0)
        config = treadle.DPOConfig(**settings) if name == "dpo" else treadle.KTOConfig(**settings)
    trainer_class = {"dpo": treadle.DPOTrainer, "kto": treadle.KTOTrainer, "reward": treadle.RewardTrainer}[name]
    return trainer_class(model, args=config, train_dataset=pairs, processing_class=tokenizer, callbacks=callbacks)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpo", "kto", "reward"])
def test_preference_trainers_train_on_a_stream_and_resume_exactly(tmp_path, name):
    full = _preference_trainer(name, str(tmp_path / "full"), [])
    full.train()
    assert full.state.global_step == 3 and all(abs(x) < 1e3 for x in _losses(full))
    resumed = _interrupted_and_resumed(
        lambda out, callbacks: _preference_trainer(name, out, callbacks), str(tmp_path), stop_at=1
    )
    _assert_same_run(full, resumed)


def test_precomputed_reference_log_probs_refuse_a_stream_and_a_one_shot_iterator_is_named(tmp_path):
    import _dist_worker as worker

    from treadle import DPOTrainer

    parts = worker.dpo_parts(str(tmp_path), 1, precompute_ref_log_probs=True)
    parts["train_dataset"] = parts["train_dataset"].to_iterable_dataset()
    with pytest.raises(PreflightError, match="precompute_ref_log_probs needs a dataset with a length"):
        DPOTrainer(**parts).train()
    once = streaming.StreamLoader(iter([{"i": 0}, {"i": 1}]), batch_size=2, collate_fn=list)
    batches = once.training_batches()
    assert next(batches) == [{"i": 0}, {"i": 1}]
    with pytest.raises(PreflightError, match="can be read once only"):
        next(batches)


# ---------------------------------------------------------------------------------------------------------
# A stream tied to its data: resumed further or on other rows, a cut or null .jsonl line
# ---------------------------------------------------------------------------------------------------------
def streamed(rows=ROWS):
    from datasets import Dataset

    return Dataset.from_list(rows).to_iterable_dataset()


def test_a_streamed_run_resumes_with_a_larger_max_steps(tmp_path, tok, capsys):
    """A stream's one "epoch" is the run (max_steps): going further is not another batch size or process count."""
    folder = tmp_path / "run"
    sft_trainer(folder, tok, rows=streamed(), max_steps=2, save_strategy="steps", save_steps=1).train()
    resumed = sft_trainer(folder, tok, rows=streamed(), max_steps=4, save_strategy="steps", save_steps=1)
    assert resumed.train(resume_from_checkpoint=str(folder / "checkpoint-1")).global_step == 4
    assert f"treadle: resuming from {folder}/checkpoint-1 at step 1 of 4" in capsys.readouterr().err
    assert [h["step"] for h in resumed.state.log_history if "loss" in h] == [1, 2, 3, 4]


def test_a_streamed_run_resumed_on_another_dataset_is_refused_as_a_map_style_one_is(tmp_path, tok):
    folder = tmp_path / "run"
    sft_trainer(folder, tok, rows=streamed(), max_steps=2, save_strategy="steps", save_steps=1).train()
    other = [{"prompt": row["prompt"], "completion": row["completion"] + "0"} for row in ROWS]
    for rows in (streamed(other), other):  # streamed or not, other rows
        with pytest.raises(CheckpointError) as refused:
            sft_trainer(folder, tok, rows=rows).train(resume_from_checkpoint=str(folder / "checkpoint-1"))
        assert "checkpoint-1 is not what was saved: the training dataset differs from the one it trained on" in str(
            refused.value
        )
    assert "ignore_checkpoint_fingerprints: true" in str(refused.value)
    resumed = sft_trainer(folder, tok, rows=streamed(other), ignore_checkpoint_fingerprints=True)
    assert resumed.train(resume_from_checkpoint=str(folder / "checkpoint-1")).global_step == 2  # the override works


def test_a_stream_read_once_is_not_read_for_its_fingerprint():
    from treadle import streaming

    rows = iter(ROWS)
    assert streaming.head_fingerprint(rows) is None and next(rows) == ROWS[0]
    assert streaming.head_fingerprint(streamed()).startswith("stream:16:")
    assert streaming.head_fingerprint(ROWS) is None  # not a stream: the sampled fingerprint's


@pytest.mark.parametrize(
    "last_line, needle",
    [
        ('{"prompt": "1+2=", "compl', "data.jsonl:17: not valid JSON (Unterminated string"),
        ("null", "data.jsonl:17: a JSON lines dataset holds one object per line, got NoneType"),
        ('{"prompt": null, "completion": "3"}', "data.jsonl, line 17: column 'prompt' holds nothing (null / empty)"),
    ],
    ids=["cut-last-line", "null-line", "null-prompt"],
)
def test_a_streamed_jsonl_row_that_is_cut_or_null_names_the_file_and_line(tmp_path, tok, last_line, needle):
    from treadle.cli.loading import load_dataset
    from treadle.data import DatasetFileError

    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    path.write_text(path.read_text() + last_line)  # the last line as a crash leaves it: no newline
    stream = load_dataset({"path": str(path), "streaming": True}, kind="sft")
    with pytest.raises(DatasetFileError, match=re.escape(f"{tmp_path}/{needle}")):
        list(stream)
    trainer = sft_trainer(tmp_path / "run", tok, rows=load_dataset({"path": str(path), "streaming": True}))
    with pytest.raises(DatasetFileError, match=re.escape(needle)):  # in a run: the same one line
        trainer.train()


def test_a_streamed_jsonl_file_still_resumes_from_its_state(tmp_path, tok):
    from treadle.cli.loading import load_dataset

    spec = {"path": str(write_jsonl(tmp_path / "data.jsonl", ROWS)), "streaming": True}
    folder = tmp_path / "run"
    sft_trainer(folder, tok, rows=load_dataset(spec), max_steps=4, save_strategy="steps", save_steps=2).train()
    resumed = sft_trainer(folder, tok, rows=load_dataset(spec), max_steps=4)
    assert resumed.train(resume_from_checkpoint=str(folder / "checkpoint-2")).global_step == 4
    assert resumed.callback_handler.train_dataloader.mode == "state"
