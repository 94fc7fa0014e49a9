"""Shared fixtures: tiny models and data built locally (no hub, no network)."""

import os
import sys
from pathlib import Path

import pytest
import torch

# a few tests import helpers from test modules in other folders (the golden GRPO run, the tool and the EOS-biased
# model of the rollout tests, the reward pairs): every test folder is importable by module name
sys.path += [str(folder) for folder in sorted(Path(__file__).parent.rglob("*")) if folder.is_dir()
             and not folder.name.startswith((".", "__"))]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_llama(seed: int = 0, vocab_size: int = 64, dropout: float = 0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=dropout, pad_token_id=0)
    return LlamaForCausalLM(config)


def lm_rows(n: int = 24, seed: int = 0, vocab_size: int = 64, min_len: int = 3, max_len: int = 12):
    """Variable-length causal-LM rows (input_ids, attention_mask, labels), some labels masked with -100."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(1, vocab_size, (length,), generator=g).tolist()
        prompt = int(torch.randint(0, length - 1, (1,), generator=g))
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": [-100] * prompt + ids[prompt:]})
    return rows


@pytest.fixture
def model():
    return tiny_llama()


@pytest.fixture
def rows():
    return lm_rows()


@pytest.fixture(scope="module")
def tok():
    """The toy character tokenizer (treadle.toy), built once per module."""
    from treadle.demos import toy

    return toy.build_tokenizer()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny models: their matrices gain nothing from a second thread, which on
    a loaded machine only adds synchronisation (seconds per step). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
