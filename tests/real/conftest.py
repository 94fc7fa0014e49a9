"""The real model's tier (``-m real``, ``make test-real``): SmolLM2-135M-Instruct (``treadle.demos.smollm2``), a BPE
tokenizer with a ChatML template that injects its own system prompt, eos = pad, grouped-query attention, tied
embeddings, a 49k vocabulary. Every test here is marked ``real`` and takes a few steps at most: a step of 1k tokens
costs seconds on 2 cores.

``smollm2`` loads the folder once per session and hands each test its own deep copy of the model (0.5 s) with the
one tokenizer; ``smollm2_folder`` is the folder for tests that load by name (the CLI, ``from_pretrained``)."""

import copy

import pytest

from treadle.demos import smollm2 as real


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/real/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.real)


@pytest.fixture(scope="session")
def smollm2_folder():
    return real.folder()


@pytest.fixture(scope="session")
def smollm2_pristine(smollm2_folder):
    from treadle.models import load_pretrained

    model, tokenizer = load_pretrained(smollm2_folder)
    model.eval()
    return model, tokenizer


@pytest.fixture
def smollm2(smollm2_pristine):
    """``(model, tokenizer)``: a fresh copy of the real model (in eval mode, as from_pretrained leaves it; a trainer
    puts it in train mode) and its tokenizer."""
    model, tokenizer = smollm2_pristine
    return copy.deepcopy(model), tokenizer
