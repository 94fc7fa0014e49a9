"""Cases of the fourth hostile trial (issue 59), the run folder's side: run files that are not regular files (a FIFO
waits forever, a link to /dev/full reads endlessly), a line that never ends, output_dir in /proc or /sys or with a
name too long, a run.json cut mid-write, a demo's folder claimed before it writes, and `treadle merge`'s --output-
dir. docs/runs.md lists each case: "The fourth hostile trial"."""

import os
import threading
from types import SimpleNamespace

import pytest

from treadle import errors
from treadle.record import commands, runfiles, runs


def claim(output_dir, **kwargs):
    args = SimpleNamespace(output_dir=str(output_dir), overwrite_output_dir=False)
    return runs.claim_run_folder(args, resume=False, main_process=True, **kwargs)


def refused_without_blocking(call):
    """Run ``call`` in a daemon thread: a FIFO opened for reading would block it for ever (the hang of the trial);
    the refusal comes at once. The error it raised."""
    raised = []

    def target():
        try:
            call()
        except BaseException as error:  # noqa: BLE001 -- handed to the test
            raised.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(30)  # not a timing assertion: a hang is the failure, and the thread is a daemon
    assert not thread.is_alive(), "blocked on the run file"
    return raised[0] if raised else None


@pytest.mark.parametrize("name", ["metrics.jsonl", "completions.jsonl", "run.json", ".treadle.lock"])
def test_a_fifo_run_file_is_refused_in_one_line_not_opened(tmp_path, name):
    os.mkfifo(tmp_path / name)
    error = refused_without_blocking(lambda: claim(tmp_path).__enter__())
    assert isinstance(error, runs.RunFolderError), error
    assert f"{name} is a FIFO (named pipe), not a regular file" in str(error) and "\n" not in str(error)
    assert sorted(os.listdir(tmp_path)) == [name]  # nothing written


def test_a_metrics_file_linked_to_dev_full_is_refused(tmp_path):
    os.symlink("/dev/full", tmp_path / "metrics.jsonl")
    with pytest.raises(runs.RunFolderError, match=r"metrics.jsonl is a character device \(a link to /dev/full\)"):
        runs.check_run_folder(str(tmp_path), resume=True)
    # the readers refuse it too, rather than read one endless line
    for read in (runfiles.read_entries, lambda p: runfiles.read_new_entries(p, 0)):
        with pytest.raises(runfiles.RunFileError, match="not a regular file"):
            read(tmp_path / "metrics.jsonl")
    with pytest.raises(runfiles.RunFileError, match="not a regular file"):
        runfiles.append_entries(tmp_path / "metrics.jsonl", [{"step": 1}])


def test_a_line_longer_than_any_entry_is_refused_not_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(runfiles, "LINE_MOST", 100)
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n' + "x" * 500 + "\n")
    with pytest.raises(runfiles.RunFileError, match=r"metrics.jsonl:2: a line of over 100 characters"):
        runfiles.read_entries(path)
    path.write_text('{"step": 1}\n{"step": 2, "loss": 1.0}\n{"step": 3, "lo')  # the cut last line: still dropped
    assert [e["step"] for e in runfiles.read_entries(path)] == [1, 2]


@pytest.mark.parametrize("folder", ["/proc/treadle-run", "/sys/treadle-run", "/proc/self/treadle-run"])
def test_output_dir_in_proc_or_sys_is_one_line_not_a_traceback_from_the_lock(folder):
    with pytest.raises(runs.RunFolderError, match="the kernel's own file system"):
        claim(folder).__enter__()


def test_a_name_too_long_says_so_not_in_use_by_another_run(tmp_path):
    with pytest.raises(runs.RunFolderError, match="a name too long for its file system") as error:
        claim(tmp_path / ("r" * 300)).__enter__()
    assert "in use" not in str(error.value)
    assert os.listdir(tmp_path) == []


def test_a_run_json_cut_mid_write_is_said_to_be_cut(tmp_path):
    (tmp_path / "run.json").write_text('{"model": {"name": "toy:tiny", "para')
    assert runfiles.read_run_info(tmp_path) is None
    assert "run.json is cut" in runfiles.unreadable_note(tmp_path / "run.json")
    (tmp_path / "run.json").write_text('{"model": 1}\n')
    assert runfiles.unreadable_note(tmp_path / "run.json") is None
    assert runfiles.unreadable_note(tmp_path / "absent.json") is None


# ---- treadle merge --output-dir, treadle demo's folder --------------------------------------------------------------
def test_merge_refuses_a_folder_holding_another_runs_model_or_a_file(tmp_path):
    other = tmp_path / "other-run"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"trained weights")
    (other / "config.json").write_text("{}")
    with pytest.raises(runs.RunFolderError, match="pass --overwrite-output-dir to replace them"):
        commands.check_merge_output(str(other), overwrite=False)
    commands.check_merge_output(str(other), overwrite=True)
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(runs.RunFolderError, match="is a file, not a folder"):
        commands.check_merge_output(str(tmp_path / "a-file"), overwrite=True)
    commands.check_merge_output(str(tmp_path / "new"), overwrite=False)  # a new folder: fine


def test_a_demo_folder_holding_the_users_results_is_refused(tmp_path):
    (tmp_path / "results.json").write_text('{"mine": true}')
    with (
        pytest.raises(runs.RunFolderError, match=r"holds 1 entries \(results.json\)"),
        commands.claim_demo_folder(str(tmp_path)),
    ):
        pass
    assert (tmp_path / "results.json").read_text() == '{"mine": true}' and os.listdir(tmp_path) == ["results.json"]
    (tmp_path / "file").write_text("x")
    with (
        pytest.raises(runs.RunFolderError, match="is a file, not a folder"),
        commands.claim_demo_folder(str(tmp_path / "file")),
    ):
        pass


def test_a_second_demo_into_a_held_folder_is_refused_before_it_writes(tmp_path):
    out = tmp_path / "demo"
    with commands.claim_demo_folder(str(out)):
        assert errors.resume_hint() == commands.DEMO_RESUME_HINT  # the demo's lines name what a demo has
        with (
            pytest.raises(runs.RunFolderError, match="is in use by another demo or run"),
            commands.claim_demo_folder(str(out)),
        ):
            pass
        assert os.listdir(out) == [runs.LOCK_FILE]  # the second wrote nothing
    assert errors.resume_hint() == errors.RESUME_HINT and not out.exists()  # made by the claim, left empty: removed


def test_a_demos_sigterm_line_names_what_a_demo_has_not_resume_from_checkpoint(tmp_path, capsys):
    import signal

    from treadle.callbacks import PreemptionCallback

    stopped = PreemptionCallback()
    stopped.signal, stopped.stopped = signal.SIGTERM, True
    args, state = SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=3, is_world_process_zero=True)
    with commands.claim_demo_folder(str(tmp_path / "demo")):
        stopped.on_train_end(args, state, None)
    line = capsys.readouterr().err.strip()
    assert "stopped by SIGTERM after step 3" in line and "run `treadle demo` again, with a new --output-dir" in line
    assert "resume_from_checkpoint" not in line and "--resume" not in line
    stopped.on_train_end(args, state, None)  # outside a demo: the Trainer's way, as before
    assert "trainer.train(resume_from_checkpoint=True)" in capsys.readouterr().err


def test_merge_into_a_folder_whose_metrics_is_a_fifo_does_not_open_it(tmp_path):
    os.mkfifo(tmp_path / "metrics.jsonl")
    error = refused_without_blocking(lambda: commands.check_merge_output(str(tmp_path), overwrite=False))
    assert isinstance(error, runs.RunFolderError) and "holds a run or a saved model (metrics.jsonl)" in str(error)
