"""treadle.logprobs against the plain full log-softmax computation, values and gradients."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treadle.logprobs.tokens import chunked_token_logps, selective_log_softmax, token_logps

VOCAB = 61  # prime, so that no chunk size used below divides anything evenly by accident


def plain_logps(logits, index, temperature=1.0):
    """The reference: a full float32 (or float64) log-softmax, gathered."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def plain_entropy(logits, temperature=1.0):
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    return -(probs * probs.log()).sum(-1)


# ------------------------------------------------------------------------------ selective_log_softmax


def test_selective_log_softmax_hand_value():
    # logits (0, ln 3) -> softmax (1/4, 3/4): log p[1] = ln 0.75 = -0.287682, log p[0] = ln 0.25 = -1.386294
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    out = selective_log_softmax(logits, torch.tensor([1, 0]))
    assert out.tolist() == pytest.approx([math.log(0.75), math.log(0.25)], abs=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 100])
def test_selective_log_softmax_matches_plain_on_a_slice(chunk_size):
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 9, VOCAB, generator=g, dtype=torch.float64).requires_grad_()
    index = torch.randint(0, VOCAB, (3, 7), generator=g)
    index[1, 2] = -100
    logits = full[:, 1:-1]  # a non-contiguous view, as token_logps' fallback passes
    out = selective_log_softmax(logits, index, temperature=0.8, chunk_size=chunk_size)
    upstream = torch.arange(21.0, dtype=torch.float64).view(3, 7)
    (grad,) = torch.autograd.grad((out * upstream).sum(), full)

    valid = index != -100
    expected = plain_logps(logits, index.clamp(min=0), 0.8) * valid
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), full)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=0)
    assert out[1, 2].item() == 0.0
    assert torch.count_nonzero(grad[1, 3]) == 0  # row of the ignored target: no gradient


def test_selective_log_softmax_bf16_upcasts_per_chunk():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 5, VOCAB, generator=g) * 4).bfloat16().requires_grad_()
    index = torch.randint(0, VOCAB, (2, 5), generator=g)
    out = selective_log_softmax(logits, index, chunk_size=3)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, plain_logps(logits, index), atol=1e-5, rtol=0)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    reference = logits.detach().float().requires_grad_()
    plain_logps(reference, index).sum().backward()
    torch.testing.assert_close(logits.grad.float(), reference.grad, atol=1e-2, rtol=1e-2)


# -------------------------------------------------------------------------------- chunked_token_logps


def _head_problem(n=10, hidden_size=8, dtype=torch.float64, seed=2):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(VOCAB, hidden_size, generator=g, dtype=dtype).requires_grad_()
    bias = torch.randn(VOCAB, generator=g, dtype=dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    return hidden, weight, bias, labels


def test_chunked_token_logps_hand_value():
    # hidden e1, weight rows (1, 0) and (0, 0): logits (1, 0) -> log p[0] = 1 - ln(e + 1) = -0.313262
    out = chunked_token_logps(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.tensor([0]))
    assert out.item() == pytest.approx(1 - math.log(math.e + 1), abs=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 10, 64])
def test_chunked_token_logps_matches_plain_values_and_gradients(chunk_size):
    hidden, weight, bias, labels = _head_problem()
    labels[4] = -100
    weights_out = torch.linspace(-1, 2, 10, dtype=torch.float64)  # a non-uniform upstream gradient
    out, entropy = chunked_token_logps(
        hidden, weight, labels, bias=bias, temperature=1.3, chunk_size=chunk_size, return_entropy=True
    )
    grads = torch.autograd.grad((out * weights_out).sum(), (hidden, weight, bias))

    logits = F.linear(hidden, weight, bias)
    valid = labels != -100
    expected = plain_logps(logits, labels.clamp(min=0), 1.3) * valid
    expected_grads = torch.autograd.grad((expected * weights_out).sum(), (hidden, weight, bias))
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, plain_entropy(logits, 1.3), atol=1e-12, rtol=0)
    assert not entropy.requires_grad
    assert out[4].item() == 0.0
    assert torch.count_nonzero(grads[0][4]) == 0  # the -100 row gets no gradient


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_token_logps_kept_logits_give_the_recomputed_numbers(monkeypatch, with_entropy):
    """On CPU the backward pass takes the forward's logits when they fit in KEEP_LOGITS_BYTES, else recomputes
    them: the same product of the same chunk, so the same numbers bit for bit, in float32 as in float64."""
    from treadle.logprobs import logsoftmax

    for dtype in (torch.float32, torch.float64):
        hidden, weight, bias, labels = _head_problem(dtype=dtype)
        labels[4] = -100
        upstream = torch.linspace(-1, 2, 10, dtype=dtype)
        runs = []
        for budget in (1 << 30, 0):
            monkeypatch.setattr(logsoftmax, "KEEP_LOGITS_BYTES", budget)
            assert logsoftmax.keeps_logits(hidden, weight) == (budget > 0)
            out = chunked_token_logps(
                hidden, weight, labels, bias=bias, temperature=1.3, chunk_size=3, return_entropy=with_entropy
            )
            logps, entropy = out if with_entropy else (out, None)
            runs.append((logps, entropy, *torch.autograd.grad((logps * upstream).sum(), (hidden, weight, bias))))
        kept, recomputed = runs
        for got, want in zip(kept, recomputed):
            assert (got is None and want is None) or torch.equal(got, want)
    monkeypatch.setattr(logsoftmax, "KEEP_LOGITS_BYTES", 10 * VOCAB * 4)  # exactly 10 float32 rows
    rows = torch.zeros(11, 8)
    assert logsoftmax.keeps_logits(rows[:10], weight.float())
    assert not logsoftmax.keeps_logits(rows, weight.float())  # one row over
    assert not logsoftmax.keeps_logits(rows[:10].double(), weight)  # float64 logits: twice the bytes


def test_chunked_token_logps_only_requested_gradients():
    hidden, weight, _, labels = _head_problem()
    weight.requires_grad_(False)
    chunked_token_logps(hidden, weight, labels, chunk_size=4).sum().backward()
    expected = torch.autograd.grad(plain_logps(F.linear(hidden, weight), labels).sum(), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected)
    assert weight.grad is None


def test_chunked_token_logps_bf16_and_autocast():
    hidden, weight, _, labels = _head_problem(dtype=torch.float32)
    reference = plain_logps(F.linear(hidden.bfloat16(), weight.bfloat16()), labels)
    out = chunked_token_logps(hidden.bfloat16(), weight.bfloat16(), labels, chunk_size=3)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_token_logps(hidden, weight, labels, chunk_size=3)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
    out.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    assert torch.isfinite(weight.grad).all()


def test_chunked_token_logps_validation():
    hidden, weight, _, labels = _head_problem()
    with pytest.raises(ValueError, match="labels"):
        chunked_token_logps(hidden, weight, labels[:3])
    with pytest.raises(ValueError, match=r"\(V, H\)"):
        chunked_token_logps(hidden, weight.t(), labels)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logps(hidden, weight, labels, temperature=0.0)


# ------------------------------------------------------------------------------------- token_logps


def tiny_llama(tie=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config)


def batch(seed=3):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (3, 12), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0  # left padding
    attention_mask[2, 9:] = 0  # right padding
    return input_ids, attention_mask


def reference_logps(model, input_ids, attention_mask, temperature=1.0, start=0):
    logits = model(input_ids, attention_mask=attention_mask).logits[:, start:-1]
    logps = plain_logps(logits, input_ids[:, start + 1 :], temperature)
    return logps * attention_mask[:, start + 1 :], plain_entropy(logits, temperature)


def grads_of(model, loss):
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def lm_head_positions(model):
    """Record how many positions the LM head projects in each call."""
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out.shape[1]))
    return seen


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("temperature, start", [(1.0, 0), (0.7, 4)])
def test_token_logps_matches_full_log_softmax(tie, temperature, start):
    model = tiny_llama(tie)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    input_ids, attention_mask = batch()
    upstream = torch.rand(3, 11 - start, generator=torch.Generator().manual_seed(5))

    seen = lm_head_positions(model)
    logps, entropy = token_logps(
        model, input_ids, attention_mask, temperature=temperature, start=start, chunk_size=5, return_entropy=True
    )
    assert seen == [1]  # the fast path: the head projected one position only
    got = grads_of(model, (logps * upstream).sum())

    expected, expected_entropy = reference_logps(model, input_ids, attention_mask, temperature, start)
    want = grads_of(model, (expected * upstream).sum())
    assert logps.shape == (3, 11 - start)
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy.detach(), atol=1e-5, rtol=0)
    assert set(got) == set(want) and len(got) > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=name)


def test_token_logps_padding_targets_are_zero():
    model = tiny_llama()
    input_ids, attention_mask = batch()
    logps, entropy = token_logps(model, input_ids, attention_mask)
    assert entropy is None
    assert torch.equal(logps[0, :3], torch.zeros(3))  # targets 1..3 are left padding
    assert torch.equal(logps[2, 8:], torch.zeros(3))  # targets 9..11 are right padding
    assert (logps[1] < 0).all()


def test_token_logps_without_attention_mask_and_under_no_grad():
    model = tiny_llama()
    input_ids, _ = batch()
    with torch.no_grad():
        logps, _ = token_logps(model, input_ids)
        expected = plain_logps(model(input_ids).logits[:, :-1], input_ids[:, 1:])
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)


def test_token_logps_bf16_model_and_inference_mode():
    model = tiny_llama().to(torch.bfloat16)
    input_ids, attention_mask = batch()
    logps, _ = token_logps(model, input_ids, attention_mask, chunk_size=4)
    assert logps.dtype == torch.float32
    got = grads_of(model, logps.sum())
    expected, _ = reference_logps(model, input_ids, attention_mask)  # bf16 logits, float32 softmax
    want = grads_of(model, expected.sum())
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)
    for name in want:
        assert got[name].dtype == torch.bfloat16
        torch.testing.assert_close(got[name], want[name], atol=1e-2, rtol=1e-2, msg=name)
    with torch.inference_mode():
        again, entropy = token_logps(model, input_ids, attention_mask, return_entropy=True)
    torch.testing.assert_close(again, logps.detach())
    assert entropy.shape == logps.shape


class PlainLM(nn.Module):
    """Not a transformers model: an embedding and a head, returning logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.embed(input_ids)))


def test_token_logps_falls_back_for_a_plain_module():
    model = PlainLM()
    input_ids, _ = batch()
    logps, entropy = token_logps(model, input_ids, start=2, return_entropy=True)
    got = grads_of(model, logps.sum())
    logits = model(input_ids)[:, 2:-1]
    expected = plain_logps(logits, input_ids[:, 3:])
    want = grads_of(model, expected.sum())
    torch.testing.assert_close(logps, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, plain_entropy(logits).detach(), atol=1e-5, rtol=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0)


def test_token_logps_detects_a_logit_transform_and_falls_back():
    from transformers import LlamaForCausalLM

    class ScaledLlama(LlamaForCausalLM):  # a head transform the config does not announce
        def forward(self, input_ids=None, attention_mask=None, logits_to_keep=0, **kwargs):
            out = super().forward(input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep, **kwargs)
            out.logits = out.logits * 3.0
            return out

    model = ScaledLlama(tiny_llama().config)
    input_ids, attention_mask = batch()
    with pytest.warns(UserWarning, match="full-logits path"):
        logps, _ = token_logps(model, input_ids, attention_mask)
    expected, _ = reference_logps(model, input_ids, attention_mask)
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)
    seen = lm_head_positions(model)
    token_logps(model, input_ids, attention_mask)  # remembered: no second check, straight to the fallback
    assert seen == [11 + 1]


def test_token_logps_config_softcap_takes_the_fallback():
    model = tiny_llama()
    model.config.final_logit_softcapping = 30.0  # Llama ignores it, but a Gemma-style model would not
    seen = lm_head_positions(model)
    token_logps(model, *batch())
    assert seen == [12]


def test_token_logps_forward_without_logits_to_keep_takes_the_fallback():
    from transformers import LlamaForCausalLM

    class WrappedLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return super().forward(input_ids, attention_mask=attention_mask, **kwargs)

    model = WrappedLlama(tiny_llama().config)
    input_ids, attention_mask = batch()
    seen = lm_head_positions(model)
    logps, _ = token_logps(model, input_ids, attention_mask)
    assert seen == [12]
    expected, _ = reference_logps(model, input_ids, attention_mask)
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fast", [True, False], ids=["fast path", "fallback"])
def test_mean_logits_come_from_the_same_forward_and_equal_the_full_logits_mean(fast):
    """DPO's logits/* metrics: the vocabulary mean of each position's logits, from the log-prob forward itself
    (h . mean(W) on the fast path, the logits' mean on the fallback) -- one forward, no second hook."""
    model = tiny_llama()
    if not fast:
        model.config.final_logit_softcapping = 30.0  # sends token_logps down the full-logits path
    input_ids, attention_mask = batch()
    seen = lm_head_positions(model)
    out = token_logps(model, input_ids, attention_mask, start=2, return_mean_logits=True)
    assert seen == ([1] if fast else [12])  # one forward either way
    logps, entropy = out  # unpacks as it always has
    assert entropy is None and out.logps is logps
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits[:, 2:-1].float().mean(dim=-1)
    torch.testing.assert_close(out.mean_logits, expected, atol=1e-5, rtol=0)
    assert token_logps(model, input_ids, attention_mask).mean_logits is None


def test_token_logps_through_a_ddp_wrapper(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = tiny_llama(tie=True)
        wrapped = DistributedDataParallel(model)
        input_ids, attention_mask = batch()
        seen = lm_head_positions(model)
        logps, _ = token_logps(wrapped, input_ids, attention_mask, chunk_size=4)
        assert seen == [1]
        got = grads_of(model, logps.sum())
        expected, _ = reference_logps(model, input_ids, attention_mask)
        want = grads_of(model, expected.sum())
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=0, msg=name)
    finally:
        if owns_group:
            dist.destroy_process_group()


def test_token_logps_validation():
    model = tiny_llama()
    input_ids, _ = batch()
    with pytest.raises(ValueError, match="start"):
        token_logps(model, input_ids, start=11)


def test_fallback_reads_logits_from_a_plain_dict_output():
    class DictLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(11, 8)
            self.head = torch.nn.Linear(8, 11)

        def forward(self, input_ids, attention_mask=None):
            return {"logits": self.head(self.emb(input_ids))}

    torch.manual_seed(0)
    model = DictLM()
    ids = torch.randint(0, 11, (2, 5))
    logps, _ = token_logps(model, ids)
    expected = torch.log_softmax(model(ids)["logits"][:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(logps, expected)


def test_small_problems_take_plain_autograd_and_agree_with_the_chunked_path(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    import treadle.logprobs.tokens as lp

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )
    ids = torch.randint(1, 50, (3, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0

    def run():
        model.zero_grad()
        logps, entropy = lp.token_logps(model, ids, mask, start=1, return_entropy=True)
        logps.sum().backward()
        return logps.detach(), entropy, [p.grad.clone() for p in model.parameters()]

    small = run()  # 3 x 6 rows x 50 logits: far below SMALL_LOGITS
    monkeypatch.setattr(lp, "SMALL_LOGITS", 0)  # force the chunked autograd Function
    chunked = run()
    torch.testing.assert_close(small[0], chunked[0])
    torch.testing.assert_close(small[1], chunked[1])
    for a, b in zip(small[2], chunked[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
