"""Shared fixtures: tiny models and data built locally (no hub, no network); what they build, and what scripts
import too, is in _factories.py."""

import os

import pytest
import torch

# before anything imports transformers and huggingface_hub, which read them once
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _factories import lm_rows, tiny_llama  # noqa: E402

from treadle.demos import toy  # noqa: E402


@pytest.fixture
def model():
    return tiny_llama()


@pytest.fixture
def rows():
    return lm_rows()


@pytest.fixture(scope="module")
def tok():
    """The toy character tokenizer (treadle.toy), built once per module."""
    return toy.build_tokenizer()


@pytest.fixture(scope="module")
def dataset():
    """The toy addition task's first 32 prompts (columns prompt, answer): the online-RL runs' dataset."""
    return toy.load_task("addition", kind="rl", n=32)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny models: their matrices gain nothing from a second thread, which on
    a loaded machine only adds synchronisation (seconds per step). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
