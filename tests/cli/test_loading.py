"""What `treadle train` and `treadle merge` load, called directly (treadle.cli.loading): a reward file that is not a
Python file, and merge's refusals of an output folder that would overwrite the base model or the run, and of a folder
without an adapter. The commands end to end: tests/cli/test_cli.py; docs/runs.md lists the trial cases."""

import json

import pytest
from _factories import write


@pytest.mark.parametrize("spec", ["../../etc/passwd:fn", "../../rewards.txt:fn"])
def test_a_reward_file_that_is_not_python_is_one_line(tmp_path, spec):
    from treadle.cli.loading import load_reward_funcs

    write(tmp_path / "rewards.txt", "def fn(**kw): return []\n")
    (tmp_path / "a" / "b").mkdir(parents=True)
    write(tmp_path / "etc" / "passwd", "root:x:0:0")
    with pytest.raises(ValueError, match=r"is not a Python file; name a .py file and a function in it"):
        load_reward_funcs([spec], base_dir=tmp_path / "a" / "b")


def test_merge_into_the_base_models_folder_is_refused(tmp_path):
    pytest.importorskip("peft")
    from treadle.cli.loading import merge_adapter_folder

    base = write(tmp_path / "base" / "model.safetensors", "the base weights").parent
    run = tmp_path / "run"
    write(run / "adapter_config.json", json.dumps({"base_model_name_or_path": str(base)}))
    for out, needle in (
        (base, "is the model folder"),
        (base / "sub", "is inside the model folder"),
        (run, "is the run folder itself"),
    ):
        with pytest.raises(ValueError, match=f"--output-dir {out} {needle}"):
            merge_adapter_folder(str(run), str(out))
    assert (base / "model.safetensors").read_text() == "the base weights"


def test_merge_of_a_folder_without_an_adapter_says_what_merge_takes(tmp_path):
    pytest.importorskip("peft")
    from treadle.cli.loading import merge_adapter_folder

    with pytest.raises(
        ValueError, match="holds no adapter to merge; treadle merge takes the output_dir of a run trained with peft:"
    ):
        merge_adapter_folder(str(tmp_path))
