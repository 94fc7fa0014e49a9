"""A config file's YAML (treadle.cli.configfile) as `treadle train` reads it: a key written twice and an alias bomb are
refused by name before anything expands, and a 100,000-character path in a config is named short; each one line
(exit 2, never a traceback). The other config errors: tests/cli/test_cli.py; docs/runs.md lists the trial cases."""

from _factories import write


def cli_error(argv, capsys) -> str:
    """The one line ``treadle`` prints for a user error (exit 2)."""
    from treadle.cli import command as cli

    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("treadle: error: "), err
    return err[0]


def test_a_key_written_twice_in_the_yaml_is_refused_by_name(tmp_path, capsys):
    config = write(
        tmp_path / "c.yaml",
        "trainer: sft\nmodel: toy:tiny\ndataset: toy:addition\nlearning_rate: 1e-3\n"
        "max_steps: 2\nlearning_rate: 1e3\n",
    )
    line = cli_error(["train", config], capsys)
    assert "at line 6: duplicate key 'learning_rate' (also at line 4)" in line


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path, capsys):
    levels = ["a: &a [" + ",".join(["lol"] * 9) + "]"]
    levels += [f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(6)]
    config = write(
        tmp_path / "c.yaml", "trainer: sft\nmodel: toy:tiny\n" + "\n".join(levels) + "\ndataset: [*g, *g]\n"
    )
    assert config.stat().st_size < 1024  # 1 KB that expands to 9**8 values
    line = cli_error(["train", config], capsys)
    assert "expand to more than 100,000 values (an alias bomb?)" in line and len(line) < 300


def test_a_huge_path_is_named_short_and_never_a_traceback(tmp_path, capsys):
    line = cli_error(
        ["train", write(tmp_path / "c.yaml", f"trainer: sft\nmodel: toy:tiny\ndataset: {'d' * 100_000}\n")], capsys
    )
    assert "dataset ddd" in line and "(100,000 characters) not found" in line and len(line) < 500
