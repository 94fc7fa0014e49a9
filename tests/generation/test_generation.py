"""Tests for treadle.generation: processors by hand, greedy tokens against transformers, sampled token
frequencies against exact probabilities, fallbacks, argument checks and model-state hygiene."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
from torch import nn

from treadle.generation import (
    GenerationOutput,
    SamplingParams,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    completion_masks,
    generate_completions,
    left_pad,
    process_logits,
    token_presence,
)

transformers = pytest.importorskip("transformers")

VOCAB, PAD = 64, 0
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23, 24]]  # different lengths: left padding


def tiny_llama(seed: int = 0, attention: str = "sdpa") -> nn.Module:
    """2-layer Llama with grouped-query attention; initializer_range=0.3 makes next-token distributions peaked
    (entropy ~3 nats of 4.16), so that greedy has no near-ties and the sampling tests have real shape."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=PAD,
        attn_implementation=attention,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


# ---------------------------------------------------------------------------------------------------------
# Processors against hand-computed numbers.
# ---------------------------------------------------------------------------------------------------------


def test_token_presence_ignores_padding():
    ids = torch.tensor([[0, 3, 3], [2, 1, 5]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    seen = token_presence(ids, mask, vocab_size=6)
    assert seen.tolist() == [[False, False, False, True, False, False], [False, True, True, False, False, True]]


def test_repetition_penalty_divides_positive_multiplies_negative():
    scores = torch.tensor([[2.0, -1.0, 0.5, -3.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert apply_repetition_penalty(scores, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, -3.0]]


def test_temperature_divides():
    assert apply_temperature(torch.tensor([[1.0, -2.0]]), 0.5).tolist() == [[2.0, -4.0]]


def test_top_k_keeps_k_best_and_ties():
    inf = float("-inf")
    assert apply_top_k(torch.tensor([[1.0, 3.0, 2.0, 3.0]]), 2).tolist() == [[inf, 3.0, inf, 3.0]]
    # ties with the k-th score survive, as in transformers' TopKLogitsWarper
    assert apply_top_k(torch.tensor([[1.0, 3.0, 2.0, 2.0]]), 2).tolist() == [[inf, 3.0, 2.0, 2.0]]
    assert apply_top_k(torch.tensor([[1.0, 2.0]]), 5).tolist() == [[1.0, 2.0]]


@pytest.mark.parametrize("top_p, kept", [(0.9, [0, 1, 2]), (0.75, [0, 1]), (0.4, [0]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_smallest_set_reaching_mass(top_p, kept):
    # probabilities 0.5, 0.3, 0.15, 0.05: cumulative mass from the top is 0.5, 0.8, 0.95, 1.0
    scores = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = apply_top_p(scores, top_p)
    assert torch.isfinite(out[0]).nonzero().squeeze(1).tolist() == kept
    assert torch.equal(out[0, kept], scores[0, kept])


def test_processing_order_is_penalty_temperature_top_k_top_p():
    base = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    inf = float("-inf")
    # temperature 0.5 squares the probabilities: 0.533, 0.3, 0.133, 0.033. top-p 0.8 then keeps 2 tokens;
    # applied before the temperature it would keep 3 (0.4 + 0.3 < 0.8).
    params = SamplingParams(1, 1, (), PAD, temperature=0.5, top_p=0.8)
    assert torch.allclose(
        process_logits(base, params), torch.tensor([[2 * math.log(0.4), 2 * math.log(0.3), inf, inf]])
    )
    # top-k 2 renormalises to 0.571, 0.429, then top-p 0.5 keeps only the first; top-p first would keep two.
    params = SamplingParams(1, 1, (), PAD, top_k=2, top_p=0.5)
    assert torch.isfinite(process_logits(base, params)).tolist() == [[True, False, False, False]]
    # the penalty acts on raw logits: log 0.4 < 0, so it is multiplied by 2 before the temperature divides it
    params = SamplingParams(1, 1, (), PAD, temperature=0.5, repetition_penalty=2.0)
    seen = torch.tensor([[True, False, False, False]])
    assert process_logits(base, params, seen)[0, 0].item() == pytest.approx(4 * math.log(0.4))
    # greedy: only the penalty applies (generate skips the warpers when do_sample=False)
    params = SamplingParams(1, 1, (), PAD, temperature=0.5, top_k=1, do_sample=False)
    assert torch.equal(process_logits(base, params), base)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_equals_transformers_warper(min_p):
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(6, VOCAB, generator=g) * 3
    scores[0, :20] = float("-inf")  # rows already cut by top-k / top-p
    want = transformers.MinPLogitsWarper(min_p=min_p)(torch.zeros(6, 1, dtype=torch.long), scores.clone())
    assert torch.equal(apply_min_p(scores, min_p), want)


def test_min_p_comes_after_temperature_by_hand():
    base = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # temperature 0.5: 0.533, 0.3, 0.133, 0.033; min_p 0.2 drops below 0.107, i.e. the last token only. Before the
    # temperature it would drop nothing (0.1 >= 0.2 x 0.4).
    params = SamplingParams(1, 1, (), PAD, temperature=0.5, min_p=0.2)
    assert torch.isfinite(process_logits(base, params)).tolist() == [[True, True, True, False]]
    # after top-k 2 (0.571, 0.429), min_p 0.8 keeps the first only
    params = SamplingParams(1, 1, (), PAD, top_k=2, min_p=0.8)
    assert torch.isfinite(process_logits(base, params)).tolist() == [[True, False, False, False]]


def test_completion_masks_cut_after_first_eos():
    raw = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 2, 1, 1]])
    ids, mask, truncated = completion_masks(raw, (2,), pad_token_id=0)
    assert ids.tolist() == [[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]
    # trailing columns that are padding in every row are dropped; several EOS ids
    ids, mask, truncated = completion_masks(torch.tensor([[2, 5, 5], [3, 9, 9]]), (2, 3), pad_token_id=0)
    assert ids.tolist() == [[2], [3]] and mask.tolist() == [[1], [1]] and truncated.tolist() == [False, False]


def test_left_pad():
    ids, mask = left_pad([[4, 5, 6], [7]], pad_token_id=9)
    assert ids.tolist() == [[4, 5, 6], [9, 9, 7]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


# ---------------------------------------------------------------------------------------------------------
# Greedy: identical tokens to transformers generate.
# ---------------------------------------------------------------------------------------------------------


def hf_greedy_reference(model, prompts, group, max_new_tokens, eos, penalty=1.0):
    """transformers generate on the prompts repeated G times (it refuses num_return_sequences > 1 when greedy),
    then the completion mask computed token by token in plain Python."""
    rows = [p for p in prompts for _ in range(group)]
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=PAD, repetition_penalty=penalty
    )
    with torch.no_grad():
        completions = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]
    out_ids, out_mask, truncated = [], [], []
    for row in completions.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t == eos), None)
        keep = cut if cut is not None else len(row)
        out_ids.append(row[:keep] + [PAD] * (len(row) - keep))
        out_mask.append([1] * keep + [0] * (len(row) - keep))
        truncated.append(cut is None)
    longest = max(sum(m) for m in out_mask)
    return [r[:longest] for r in out_ids], [m[:longest] for m in out_mask], truncated


@pytest.fixture(scope="module")
def early_eos(model):
    """An EOS id that ends the greedy completion of the first prompt at its 2nd token but never ends the others."""
    out = generate_completions(
        model, PROMPTS, num_generations=1, max_new_tokens=12, eos_token_id=None, pad_token_id=PAD, do_sample=False
    )
    eos = out.completion_ids[0, 1].item()
    assert eos != out.completion_ids[0, 0].item()
    assert eos not in out.completion_ids[1:].tolist(), "test set-up: pick another prompt set or seed"
    return eos


@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_greedy_matches_transformers(model, early_eos, backend, penalty):
    group, max_new = 3, 12
    expected_ids, expected_mask, expected_truncated = hf_greedy_reference(
        model, PROMPTS, group, max_new, early_eos, penalty
    )
    out = generate_completions(
        model,
        PROMPTS,
        num_generations=group,
        max_new_tokens=max_new,
        eos_token_id=early_eos,
        pad_token_id=PAD,
        do_sample=False,
        repetition_penalty=penalty,
        backend=backend,
    )
    assert isinstance(out, GenerationOutput)
    assert out.completion_ids.tolist() == expected_ids
    assert out.completion_mask.tolist() == expected_mask
    assert out.is_truncated.tolist() == expected_truncated
    if penalty == 1.0:  # the set-up promised an early stop on the first prompt only
        assert out.is_truncated.tolist() == [False] * group + [True] * (len(PROMPTS) - 1) * group
        assert out.completion_mask[0].sum().item() == 2
    prompt_ids, prompt_mask = left_pad(PROMPTS, PAD)
    assert torch.equal(out.prompt_ids, prompt_ids.repeat_interleave(group, 0))
    assert torch.equal(out.prompt_mask, prompt_mask.repeat_interleave(group, 0))


def test_greedy_matches_transformers_with_eager_attention(early_eos):
    # eager attention takes the 2-D mask path (the 4-D padding-mask shortcut is SDPA-only)
    model = tiny_llama(attention="eager")
    assert model.config._attn_implementation == "eager"
    expected_ids, expected_mask, _ = hf_greedy_reference(model, PROMPTS, 2, 10, early_eos)
    out = generate_completions(
        model,
        PROMPTS,
        num_generations=2,
        max_new_tokens=10,
        eos_token_id=early_eos,
        pad_token_id=PAD,
        do_sample=False,
        backend="fast",
    )
    assert out.completion_ids.tolist() == expected_ids and out.completion_mask.tolist() == expected_mask


def test_fast_prefills_distinct_prompts_once_and_stops_when_all_finished(model, early_eos):
    batch_sizes = []
    # the backbone: the prefill reaches it through the model's forward, a decode step calls it with the sliced head
    hook = model.model.register_forward_pre_hook(
        lambda m, a, kw: batch_sizes.append(kw["input_ids"].shape), with_kwargs=True
    )
    try:
        # every token is an EOS, so every row finishes with its first token: the prefill is the only forward
        out = generate_completions(
            model,
            PROMPTS,
            num_generations=4,
            max_new_tokens=10,
            eos_token_id=list(range(VOCAB)),
            pad_token_id=PAD,
            backend="fast",
        )
        assert batch_sizes == [(len(PROMPTS), 7)]
        assert out.completion_ids.shape == (4 * len(PROMPTS), 1) and not out.is_truncated.any()
        batch_sizes.clear()
        generate_completions(
            model, PROMPTS, num_generations=4, max_new_tokens=5, eos_token_id=None, pad_token_id=PAD, backend="fast"
        )
        assert batch_sizes == [(len(PROMPTS), 7)] + [(4 * len(PROMPTS), 1)] * 4
        batch_sizes.clear()
        # the first prompt's 4 rows end with their 2nd token (1/3 of the batch): they leave the batch
        generate_completions(
            model,
            PROMPTS,
            num_generations=4,
            max_new_tokens=5,
            eos_token_id=early_eos,
            pad_token_id=PAD,
            do_sample=False,
            backend="fast",
        )
        assert batch_sizes == [(len(PROMPTS), 7), (12, 1)] + [(8, 1)] * 3
    finally:
        hook.remove()


# ---------------------------------------------------------------------------------------------------------
# Sampling: token frequencies against exact probabilities.
# ---------------------------------------------------------------------------------------------------------

SAMPLING = dict(temperature=0.7, top_k=6, top_p=0.9, repetition_penalty=1.5)


def reference_probs(logits: torch.Tensor, history: list[int]) -> torch.Tensor:
    """Plain, loop-based re-statement of the processors for one row of logits (V,), in generate's order."""
    scores = logits.double().clone()
    for token in set(history):
        penalty = SAMPLING["repetition_penalty"]
        scores[token] = scores[token] * penalty if scores[token] < 0 else scores[token] / penalty
    scores = scores / SAMPLING["temperature"]
    order = sorted(range(len(scores)), key=lambda t: -scores[t].item())[: SAMPLING["top_k"]]
    probs = torch.softmax(scores[order], dim=0)
    kept, mass = [], 0.0
    for token, p in zip(order, probs.tolist()):  # most likely first, until the mass reaches top_p
        kept.append(token)
        mass += p
        if mass >= SAMPLING["top_p"]:
            break
    out = torch.zeros(len(scores), dtype=torch.float64)
    out[kept] = torch.softmax(scores[kept], dim=0)
    return out


ENDED = VOCAB  # extra bin: the completion ended (EOS) before this position


def exact_marginals(model, prompt: list[int], eos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact distributions (V+1,) of the 1st and 3rd generated token, the last bin meaning "ended earlier",
    enumerating every 2-token prefix in the support (plain forwards on unpadded sequences, no KV cache)."""
    with torch.no_grad():
        first = torch.zeros(VOCAB + 1, dtype=torch.float64)
        first[:VOCAB] = reference_probs(model(torch.tensor([prompt])).logits[0, -1], prompt)
        third = torch.zeros(VOCAB + 1, dtype=torch.float64)
        for t1 in first.nonzero().squeeze(1).tolist():
            if t1 == eos:
                third[ENDED] += first[t1]
                continue
            second = reference_probs(model(torch.tensor([prompt + [t1]])).logits[0, -1], prompt + [t1])
            t2s = second.nonzero().squeeze(1).tolist()
            logits = model(torch.tensor([prompt + [t1, t2] for t2 in t2s])).logits[:, -1]
            for t2, row in zip(t2s, logits):
                if t2 == eos:
                    third[ENDED] += first[t1] * second[t2]
                else:
                    third[:VOCAB] += first[t1] * second[t2] * reference_probs(row, prompt + [t1, t2])
    return first, third


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic over bins with expected count >= 5 (the rest pooled) and its critical value at
    significance 1e-4 (Wilson-Hilferty approximation of the chi-square quantile, z = 3.719). With a fixed
    seed the test is deterministic; 1e-4 leaves a true implementation essentially no chance of failing
    while a wrong processor (see the power check below) overshoots the bound many times over."""
    n = counts.sum().item()
    expected = probs * n
    big = expected >= 5
    observed = torch.cat([counts[big].double(), counts[~big].sum().double().view(1)])
    expected = torch.cat([expected[big], expected[~big].sum().view(1)])
    if expected[-1] < 5:  # pool too small to be its own bin: fold it into the smallest big bin
        observed, expected = observed[:-1], expected[:-1]
        observed[expected.argmin()] += counts[~big].sum()
        expected[expected.argmin()] += probs[~big].sum() * n
    assert (observed[expected == 0] == 0).all(), "sampled a token of probability zero"
    keep = expected > 0
    stat = (((observed - expected) ** 2)[keep] / expected[keep]).sum().item()
    df = int(keep.sum()) - 1
    z = 3.719
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


@pytest.mark.parametrize("with_eos", [False, True])
def test_sampled_frequencies_match_exact_probabilities(model, with_eos):
    group = 2000
    prompts = [PROMPTS[0], PROMPTS[1]]  # the second is left-padded by 5
    eos = None
    if with_eos:  # the 2nd most likely first token: many rows stop at once, so finished rows get dropped
        eos = exact_marginals(model, prompts[0])[0].argsort(descending=True)[1].item()
    out = generate_completions(
        model,
        prompts,
        num_generations=group,
        max_new_tokens=3,
        eos_token_id=eos,
        pad_token_id=PAD,
        generator=torch.Generator().manual_seed(1234),
        **SAMPLING,
    )
    assert out.completion_ids.shape == (2 * group, 3)
    for b, prompt in enumerate(prompts):
        first, third = exact_marginals(model, prompt, eos)
        rows = slice(b * group, (b + 1) * group)
        tokens = out.completion_ids[rows].masked_fill(out.completion_mask[rows] == 0, ENDED)
        for position, probs in ((0, first), (2, third)):
            counts = torch.bincount(tokens[:, position], minlength=VOCAB + 1)
            stat, critical = chi_square(counts, probs)
            assert stat < critical, (b, position, stat, critical)
        # power check: the same counts reject the distribution without temperature, top-k and top-p
        with torch.no_grad():
            plain = model(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
        counts = torch.bincount(tokens[:, 0], minlength=VOCAB + 1)[:VOCAB]
        stat, critical = chi_square(counts, plain)
        assert stat > critical
    if with_eos:
        assert out.is_truncated.float().mean() < 0.9  # the EOS really cut rows short


def test_hf_backend_samples_the_same_distribution(model):
    # transformers' own processors against the same exact reference: validates reference_probs itself
    group = 2000
    out = generate_completions(
        model,
        [PROMPTS[1]],
        num_generations=group,
        max_new_tokens=1,
        eos_token_id=None,
        pad_token_id=PAD,
        generator=torch.Generator().manual_seed(7),
        backend="hf",
        **SAMPLING,
    )
    first, _ = exact_marginals(model, PROMPTS[1])
    stat, critical = chi_square(torch.bincount(out.completion_ids[:, 0], minlength=VOCAB + 1), first)
    assert stat < critical


def test_generator_makes_sampling_reproducible(model):
    def run(seed, backend):
        return generate_completions(
            model,
            PROMPTS,
            num_generations=4,
            max_new_tokens=6,
            eos_token_id=2,
            pad_token_id=PAD,
            generator=torch.Generator().manual_seed(seed),
            backend=backend,
        ).completion_ids

    for backend in ("fast", "hf"):
        global_state = torch.get_rng_state()
        assert torch.equal(run(3, backend), run(3, backend))
        assert not torch.equal(run(3, backend), run(4, backend))
        assert torch.equal(torch.get_rng_state(), global_state)  # the global RNG is left alone


# ---------------------------------------------------------------------------------------------------------
# Backends, fallbacks, arguments, model state.
# ---------------------------------------------------------------------------------------------------------


class NoPositionsLlama(transformers.LlamaForCausalLM):
    """A causal LM whose forward hides position_ids and the cache: the fast path must refuse it."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def test_auto_falls_back_to_hf_for_models_the_fast_path_refuses(model):
    other = NoPositionsLlama(model.config).eval()
    other.load_state_dict(model.state_dict())
    kwargs = dict(num_generations=2, max_new_tokens=5, eos_token_id=None, pad_token_id=PAD, do_sample=False)
    with pytest.raises(ValueError, match="backend='fast' cannot run.*position_ids"):
        generate_completions(other, PROMPTS, backend="fast", **kwargs)
    fallback = generate_completions(other, PROMPTS, backend="auto", **kwargs)
    assert torch.equal(fallback.completion_ids, generate_completions(model, PROMPTS, **kwargs).completion_ids)


def test_plain_module_raises_clear_error():
    with pytest.raises(ValueError, match="cannot generate.*no `generate` method"):
        generate_completions(
            nn.Linear(4, 4), PROMPTS, num_generations=2, max_new_tokens=3, eos_token_id=2, pad_token_id=PAD
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_generations=0), "num_generations must be >= 1.*e.g. 8"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\].*1.0 to disable"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be >= 0"),
        (dict(temperature=0.0), "temperature must be > 0.*do_sample=False"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(backend="vllm"), "backend must be one of"),
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompts=[]), "non-empty list"),
    ],
)
def test_bad_arguments_raise_with_a_fix(model, kwargs, message):
    args = dict(prompts=PROMPTS, num_generations=2, max_new_tokens=3, eos_token_id=2, pad_token_id=PAD)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        generate_completions(model, args.pop("prompts"), **args)


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_restores_train_mode_of_every_submodule(backend):
    model = tiny_llama()
    model.train()
    model.model.layers[1].eval()  # e.g. a frozen block kept in eval mode
    modes = {name: m.training for name, m in model.named_modules()}
    seen_training = []
    hook = model.register_forward_pre_hook(lambda m, args: seen_training.append(m.training))
    generate_completions(
        model, PROMPTS, num_generations=2, max_new_tokens=3, eos_token_id=None, pad_token_id=PAD, backend=backend
    )
    hook.remove()
    assert seen_training and not any(seen_training)  # generated in eval mode (dropout off)
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert model.generation_config.eos_token_id == 2  # the hf backend set the model's config aside, then back


def test_peft_style_wrapper_is_unwrapped(model):
    class Wrapper(nn.Module):  # duck-types PeftModel.get_base_model()
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_base_model(self):
            return self.inner

    kwargs = dict(num_generations=2, max_new_tokens=4, eos_token_id=None, pad_token_id=PAD, do_sample=False)
    assert torch.equal(
        generate_completions(Wrapper(model), PROMPTS, backend="fast", **kwargs).completion_ids,
        generate_completions(model, PROMPTS, **kwargs).completion_ids,
    )


def test_ddp_and_fsdp2_models_generate_like_the_plain_model(model):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    kwargs = dict(num_generations=2, max_new_tokens=6, eos_token_id=None, pad_token_id=PAD, do_sample=False)
    expected = generate_completions(model, PROMPTS, **kwargs).completion_ids
    owns_group = not dist.is_initialized()
    if owns_group:
        store = dist.FileStore(tempfile.mktemp(prefix="treadle-gen-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(tiny_llama())
        assert torch.equal(generate_completions(ddp, PROMPTS, **kwargs).completion_ids, expected)

        sharded = tiny_llama()
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        assert torch.equal(generate_completions(sharded, PROMPTS, **kwargs).completion_ids, expected)
        assert all(isinstance(p, DTensor) for p in sharded.parameters())  # resharded afterwards
        sharded.train()
        sharded(torch.tensor([PROMPTS[0]])).logits.sum().backward()  # still trains after generation
        assert all(p.grad is not None for p in sharded.parameters() if p.requires_grad)
    finally:
        if owns_group:
            dist.destroy_process_group()
