"""The run folder's record files: one policy for a broken line (treadle.record.runfiles)."""

import json

import pytest

from treadle.record import runfiles


def lines(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_a_last_line_cut_by_a_crash_is_dropped_and_a_corrupt_one_is_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(lines({"step": 1}, {"step": 2}) + '{"step": 3, "lo')
    assert [r["step"] for r in runfiles.read_entries(path)] == [1, 2]
    path.write_text(lines({"step": 1}) + '{"step": 2, "lo\n' + lines({"step": 3}))
    with pytest.raises(runfiles.RunFileError, match=r"metrics\.jsonl:2: corrupt line"):
        runfiles.read_entries(path)
    assert runfiles.read_entries(tmp_path / "absent.jsonl") == []


def test_cut_back_keeps_the_accepted_lines_as_written(tmp_path):
    path = tmp_path / "completions.jsonl"
    path.write_text('{"step": 1, "x": 1.50}\n' + lines({"step": 2}, {"step": 3}) + '{"step": 4')
    runfiles.cut_back(path, lambda r: r["step"] < 3)
    assert path.read_text() == '{"step": 1, "x": 1.50}\n' + lines({"step": 2})


def test_new_records_wait_for_a_line_being_written(tmp_path):
    path = tmp_path / "completions.jsonl"
    path.write_text(lines({"step": 1}) + '{"step": 2')
    records, offset = runfiles.read_new_entries(path, 0)
    assert [r["step"] for r in records] == [1] and offset == len(lines({"step": 1}))
    with path.open("a") as f:
        f.write(', "x": 0}\n' + "[1]\n")
    bad_line_at = offset + len('{"step": 2, "x": 0}\n')
    with pytest.raises(runfiles.RunFileError, match=rf"completions\.jsonl:byte {bad_line_at}: expected a JSON object"):
        runfiles.read_new_entries(path, offset)
    path.write_text(lines({"step": 1}) + lines({"step": 2, "x": 0}))
    records, end = runfiles.read_new_entries(path, offset)
    assert [r["step"] for r in records] == [2] and end == path.stat().st_size
