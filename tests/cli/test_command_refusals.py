"""Cases of the fourth hostile trial (issue 59), the commands' side: `treadle report` on a cut run.json, `treadle
merge` into another run or a file, `treadle demo` into a folder of the user's, a file, with --seed -1, or beside a
second demo. docs/runs.md lists each case: "The fourth hostile trial"."""

import os

from _runs import sft_events, write_run

from treadle.cli import command as cli
from treadle.record import commands, runs


def one_error_line(argv, capsys) -> str:
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("treadle: error: "), err
    return lines[0]


def test_report_says_a_cut_run_json_is_cut_not_absent(tmp_path, capsys):
    run = write_run(tmp_path / "run", sft_events())
    (run / "run.json").write_text('{\n  "model": {\n    "name": "toy:tiny",\n    "param')
    assert cli.main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert "run.json is cut" in err
    page = (run / "report.html").read_text()
    assert "run.json is cut" in page and "no run.json in the run folder" not in page


def test_merge_into_another_runs_model_is_refused_and_leaves_it(tmp_path, capsys):
    lora, other = tmp_path / "lora-run", tmp_path / "full-run"
    lora.mkdir()
    (lora / "adapter_config.json").write_text('{"base_model_name_or_path": "toy:tiny"}')
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"the other run's trained weights")
    line = one_error_line(["merge", lora, "--output-dir", other], capsys)
    assert "holds a run or a saved model (model.safetensors)" in line and "--overwrite-output-dir" in line
    assert (other / "model.safetensors").read_bytes() == b"the other run's trained weights"
    (tmp_path / "file").write_text("mine")
    line = one_error_line(["merge", lora, "--output-dir", tmp_path / "file"], capsys)
    assert "is a file, not a folder" in line and (tmp_path / "file").read_text() == "mine"


def test_demo_refuses_a_folder_of_the_users_own_results(tmp_path, capsys):
    (tmp_path / "results.json").write_text("my results")
    line = one_error_line(["demo", "--output-dir", tmp_path], capsys)
    assert "holds 1 entries (results.json)" in line and "choose a new --output-dir" in line
    assert os.listdir(tmp_path) == ["results.json"] and (tmp_path / "results.json").read_text() == "my results"
    (tmp_path / "file").write_text("x")
    assert "is a file, not a folder" in one_error_line(["demo", "--output-dir", tmp_path / "file"], capsys)


def test_demo_with_a_negative_seed_is_one_line_and_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "demo"
    assert "--seed -1 is out of range" in one_error_line(["demo", "--seed", "-1", "--output-dir", out], capsys)
    assert not out.exists()


def test_a_second_demo_is_refused_before_it_writes_anything(tmp_path, capsys):
    out = tmp_path / "demo"
    with commands.claim_demo_folder(str(out)):  # the first demo, running
        line = one_error_line(["demo", "--output-dir", out, "--sft-steps", "1", "--grpo-steps", "1"], capsys)
        assert "in use by another demo or run" in line
        assert os.listdir(out) == [runs.LOCK_FILE]  # no step 0 lines, no stage folders
