"""What the two real-engine modules (test_vllm.py in process, test_vllm_server.py over HTTP) check with: the
prompts, a plain-PyTorch log-prob reference and the completions' rows (the reward that moves the weights is
_factories.digit_sum_reward); and ``one_line``, a refusal's message checked to be one line and a UserError (there and
in test_vllm_client.py)."""

from __future__ import annotations

import torch

from treadle.demos import toy
from treadle.errors import UserError


def prompts(tok, n=4):
    return [tok(row["prompt"])["input_ids"] for row in toy.load_task("addition", kind="rl", n=n)]


def model_logps(model, prompt_ids, completion_ids):
    """Plain PyTorch: each completion token's log-prob under ``model`` (one unpadded forward per row)."""
    out = []
    with torch.no_grad():
        for p, c in zip(prompt_ids, completion_ids):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float()
            out.append(logits.log_softmax(-1).gather(1, torch.tensor(c)[:, None])[:, 0])
    return out


def rows_of(output):
    lengths = output.completion_mask.sum(1).tolist()
    return [ids[:n] for ids, n in zip(output.completion_ids.tolist(), lengths)]


def load_with_push_skipped(engine, model):
    """``engine.load_weights(model)`` with the engine's ``push`` replaced by a no-op: the planted "skip the sync"
    that the engine's weight-sync check must catch (``engine.sync_unchanged``)."""
    real_push, engine.push = engine.push, lambda weights: None
    try:
        engine.load_weights(model)
    finally:
        engine.push = real_push


def one_line(error) -> str:
    message = str(error)
    assert "\n" not in message and isinstance(error, UserError), message
    return message
