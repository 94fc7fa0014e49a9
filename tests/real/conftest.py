"""The real models' tier (``-m real``, ``make test-real``), on the two real families of ``treadle.demos.real_models``:

- SmolLM2-135M-Instruct: a BPE tokenizer with a ChatML template that injects its own system prompt, eos = pad,
  grouped-query attention, tied embeddings, a 49k vocabulary, full attention;
- Gemma 3 270M: a base model (no chat template: its rows are plain text), bos added by the tokenizer, pad apart from
  eos, sliding-window attention (512 tokens) on 5 of every 6 layers, tied embeddings scaled by sqrt(hidden), a
  262,144-token vocabulary.

Every test here is marked ``real`` and takes a few steps at most, on short rows: a step of 1k tokens costs seconds.

``real_model`` (parametrized over ``REAL_MODELS``) runs a test on both families: it loads each folder once per
session and hands each test its own deep copy of the model (0.5-1 s) with the one tokenizer; ``real_pristine`` is the
loaded one (never train it), ``real_folder`` the folder for tests that load by name, ``real_key`` the model's key. The
``smollm2`` fixtures are the same for the tests about SmolLM2 alone (its ChatML template)."""

import copy

import pytest
import torch

from treadle.demos import real_models

REAL_MODELS = tuple(real_models.MODELS)  # ("smollm2", "gemma3")


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/real/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.real)


@pytest.fixture(scope="session", autouse=True)
def real_model_threads():
    """One torch thread for the whole tier: on a shared 2-core machine a second thread waits on the other jobs (a
    step of this model took 4-8x longer with two threads than with one at a load of 3-8; docs/models.md), and one
    thread gives the same rounding on every machine; on a quiet machine two would save at most half."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_LOADED: dict[str, tuple] = {}  # one pristine copy of each model per session, whichever fixture asks first


def _load(key: str):
    from treadle.models import load_pretrained

    if key not in _LOADED:
        model, tokenizer = load_pretrained(real_models.folder(key))
        _LOADED[key] = model.eval(), tokenizer
    return _LOADED[key]


@pytest.fixture(scope="session", params=REAL_MODELS)
def real_key(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def real_folder(real_key) -> str:
    return real_models.folder(real_key)


@pytest.fixture(scope="session")
def real_pristine(real_key):
    return _load(real_key)


@pytest.fixture
def real_model(real_pristine):
    """``(model, tokenizer)``: a fresh copy of the real model (in eval mode, as from_pretrained leaves it; a trainer
    puts it in train mode) and its tokenizer."""
    model, tokenizer = real_pristine
    return copy.deepcopy(model), tokenizer


@pytest.fixture(scope="session")
def smollm2_folder():
    return real_models.folder("smollm2")


@pytest.fixture(scope="session")
def smollm2_pristine():
    return _load("smollm2")


@pytest.fixture
def smollm2(smollm2_pristine):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct, a fresh copy as ``real_model`` gives."""
    model, tokenizer = smollm2_pristine
    return copy.deepcopy(model), tokenizer


@pytest.fixture(scope="session")
def gemma3_pristine():
    return _load("gemma3")
