"""The real model's tier (``-m real``, ``make test-real``): SmolLM2-135M-Instruct (``treadle.demos.smollm2``), a BPE
tokenizer with a ChatML template that injects its own system prompt, eos = pad, grouped-query attention, tied
embeddings, a 49k vocabulary. Every test here is marked ``real`` and takes a few steps at most: a step of 1k tokens
costs seconds on 2 cores.

``smollm2`` loads the folder once per session and hands each test its own deep copy of the model (0.5 s) with the
one tokenizer; ``smollm2_folder`` is the folder for tests that load by name (the CLI, ``from_pretrained``)."""

import copy

import pytest
import torch

from treadle.demos import smollm2 as real


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
