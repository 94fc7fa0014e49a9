"""A model named by a Hugging Face Hub id: read from the user's cache (HF_HOME) with HF_HUB_OFFLINE=1, no network.

A locally made tiny model is laid out as huggingface_hub lays out a download
(``hub/models--org--name/snapshots/<commit>/...`` plus ``refs/main``) in a temporary HF_HOME; a fresh Python
process (huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when imported) loads it by id through
``treadle.models.load_pretrained`` and the trainers' string ``model`` argument.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _factories import tiny_llama

from treadle import models
from treadle.demos import toy

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def hub_cache(home: Path, repo: str, commit: str, model, tokenizer, *, ref: str | None = "main") -> Path:
    """``model`` and ``tokenizer`` saved where huggingface_hub keeps ``repo`` at ``commit``; ``refs/<ref>`` names
    it."""
    root = home / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    if ref:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


def run_offline(home: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HOME": str(home),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(models.__file__).parents[1]), str(Path(__file__).parent)]),
    }
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_a_hub_id_loads_from_the_cache_offline_and_a_missing_one_is_one_line(tmp_path):
    home, tok = tmp_path / "hf", toy.build_tokenizer()
    main = tiny_llama(seed=0, vocab_size=len(tok))
    hub_cache(home, "org/tiny", COMMIT, main, tok)
    other = tiny_llama(seed=1, vocab_size=len(tok))  # an older commit, reached by revision only
    hub_cache(home, "org/tiny", OTHER, other, tok, ref=None)
    reference = {
        "main": main.model.embed_tokens.weight[5, :4].tolist(),
        "other": other.model.embed_tokens.weight[5, :4].tolist(),
    }
    (tmp_path / "work").mkdir()
    result = run_offline(
        home,
        f"""
        import json
        import torch
        from treadle.models import load_pretrained
        from treadle.trainers.sft import SFTConfig, SFTTrainer

        out = {{}}
        model, tok = load_pretrained("org/tiny")
        out["main"] = model.model.embed_tokens.weight[5, :4].tolist()
        out["vocab"] = len(tok)
        model, _ = load_pretrained("org/tiny", revision="{OTHER}")
        out["other"] = model.model.embed_tokens.weight[5, :4].tolist()
        args = SFTConfig(output_dir="run", max_steps=1, report_to="none", model_init_kwargs={{"revision": "{OTHER}"}})
        trainer = SFTTrainer("org/tiny", args=args, train_dataset=[{{"text": "1+2=3"}}])
        out["trainer"] = trainer.model.model.embed_tokens.weight[5, :4].tolist()
        for key, name, revision in (("absent", "org/absent", None), ("v9", "org/tiny", "v9")):
            try:
                load_pretrained(name, revision=revision)
            except ValueError as error:
                out[key] = str(error)
        print(json.dumps(out))
        """,
        cwd=tmp_path / "work",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["main"] == pytest.approx(reference["main"])  # refs/main's snapshot
    assert out["other"] == pytest.approx(reference["other"])  # revision= picks the other commit
    assert out["main"] != pytest.approx(out["other"])
    assert out["trainer"] == pytest.approx(reference["other"])  # SFTTrainer("org/tiny"): model_init_kwargs' revision
    assert out["vocab"] == len(tok)
    absent = out["absent"]
    assert "\n" not in absent
    assert "org/absent" in absent and str(home / "hub") in absent and "HF_HUB_OFFLINE" in absent
    assert "org/tiny at revision v9" in out["v9"] and "HF_HUB_OFFLINE" in out["v9"]


def test_an_existing_folder_wins_over_a_hub_id_of_the_same_name(tmp_path, monkeypatch, tok):
    folder = tmp_path / "org" / "tiny"
    model = tiny_llama(seed=3, vocab_size=len(tok))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    monkeypatch.chdir(tmp_path)
    loaded, _ = models.load_pretrained("org/tiny")  # relative: the folder, not the Hub
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_a_name_that_is_neither_a_folder_nor_an_id_is_one_line(tmp_path):
    with pytest.raises(
        ValueError, match=r"model folder \./nowhere/x not found, and it is not a Hugging Face model id"
    ):
        models.load_pretrained("./nowhere/x")


def test_trust_remote_code_is_passed_only_when_asked(monkeypatch, tmp_path, tok):
    import transformers

    seen = []

    def spy(cls):
        original = cls.from_pretrained.__func__

        def from_pretrained(klass, *args, **kwargs):
            seen.append((klass.__name__, kwargs.get("trust_remote_code"), kwargs.get("revision")))
            return original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(from_pretrained))

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        spy(cls)
    folder = tmp_path / "m"
    tiny_llama(vocab_size=len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    models.load_pretrained(str(folder))
    models.from_name(str(folder), None, type("Args", (), {"trust_remote_code": True, "model_init_kwargs": None})())
    assert [flag for _, flag, _ in seen] == [False, False, True, True]
