"""treadle.models: the forward signature (cached per class), eval mode, the frozen reference, PEFT and causal-LM
detection, gradient checkpointing, the generation context, a model whose embedding is smaller than its
tokenizer, and ``load_pretrained`` refusing a revision of a local folder."""

import inspect

import pytest
import torch
from _factories import tiny_llama
from torch import nn

from treadle import models
from treadle.models import (
    enable_gradient_checkpointing,
    eval_mode,
    forward_parameters,
    forward_signature,
    frozen_reference,
    is_causal_lm,
    is_peft_model,
    unwrapped_for_generation,
)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.dropout = nn.Dropout(0.5)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return self.linear(input_ids)


class Loose(nn.Module):
    def forward(self, input_ids, *args, **kwargs):
        return input_ids


class Wrapper(nn.Module):
    """Stands in for DDP: the user's model is ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class WithAdapters(Plain):
    def disable_adapter(self):
        return torch.no_grad()


@pytest.fixture
def count_signatures(monkeypatch):
    calls, real = [], inspect.signature

    def counting(fn, *args, **kwargs):
        calls.append(fn)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(models.inspect, "signature", counting)
    return calls


# ---- forward signature ------------------------------------------------------------------------------------
def test_forward_signature_names_the_parameters(count_signatures):
    signature = forward_signature(Plain())
    assert signature.names == {"input_ids", "attention_mask", "use_cache"}
    assert "use_cache" in signature and "logits_to_keep" not in signature and "self" not in signature
    assert not signature.takes_var_keyword
    loose = forward_signature(Loose())
    assert loose.names == {"input_ids"} and loose.takes_var_keyword


def test_forward_signature_is_read_once_per_class(count_signatures):
    class Fresh(Plain):  # a class no other test has asked about
        def forward(self, input_ids, position_ids=None):
            return input_ids

    first, second = Fresh(), Fresh()
    assert forward_signature(first) is forward_signature(second)
    assert len(count_signatures) == 1
    forward_signature(Wrapper(first))  # DDP's .module: the same class, still cached
    assert len(count_signatures) == 1
    assert forward_signature(Plain()).names != forward_signature(first).names  # another class, its own entry


def test_a_forward_assigned_to_the_instance_is_not_its_classs(count_signatures):
    patched = Plain()
    patched.forward = lambda input_ids, extra=None: input_ids  # as hook libraries do
    assert "extra" in forward_signature(patched)
    assert "extra" not in forward_signature(Plain())


def test_forward_parameters_trusts_named_parameters_unless_kwargs_take_anything():
    assert forward_parameters(Plain()) == {"input_ids", "attention_mask", "use_cache"}
    assert forward_parameters(Wrapper(Plain())) == {"input_ids", "attention_mask", "use_cache"}
    assert forward_parameters(Loose()) is None
    names = forward_parameters(tiny_llama())  # **kwargs too, but a transformers model: its names hold
    assert {"input_ids", "labels", "use_cache", "logits_to_keep"} <= names


# ---- eval mode --------------------------------------------------------------------------------------------
def test_eval_mode_restores_every_submodule_even_on_error():
    model = Plain().train()
    model.dropout.eval()  # kept in eval on purpose
    with pytest.raises(RuntimeError, match="boom"):
        with eval_mode(model) as inside:
            assert inside is model
            assert not any(m.training for m in model.modules())
            raise RuntimeError("boom")
    assert model.training and model.linear.training and not model.dropout.training
    frozen = Plain().eval()
    with eval_mode(frozen):
        pass
    assert not any(m.training for m in frozen.modules())


# ---- reference model --------------------------------------------------------------------------------------
def test_frozen_reference_copies_and_freezes_without_touching_the_policy():
    policy = Plain().train()
    reference = frozen_reference(Wrapper(policy), device="cpu")
    assert type(reference) is Plain and reference is not policy  # a copy of the unwrapped model
    assert not reference.training and not any(m.training for m in reference.modules())
    assert not any(p.requires_grad for p in reference.parameters())
    assert torch.equal(reference.linear.weight, policy.linear.weight)
    assert reference.linear.weight.data_ptr() != policy.linear.weight.data_ptr()
    assert policy.training and all(p.requires_grad for p in policy.parameters())


def test_frozen_reference_freezes_a_given_model_in_place():
    given = Plain().train()
    assert frozen_reference(Plain(), given, device="cpu") is given
    assert not given.training and not any(p.requires_grad for p in given.parameters())


def test_is_peft_model_looks_for_disable_adapter_inside_wrappers():
    assert is_peft_model(WithAdapters()) and is_peft_model(Wrapper(WithAdapters()))
    assert not is_peft_model(Plain())


# ---- kind of model ----------------------------------------------------------------------------------------
def test_is_causal_lm_from_the_config_where_there_is_one():
    from transformers import LlamaConfig, LlamaForSequenceClassification, T5Config, T5ForConditionalGeneration

    llama = tiny_llama()
    assert is_causal_lm(llama) and is_causal_lm(Wrapper(llama))
    assert not is_causal_lm(Plain())

    class MyForCausalLM(Plain):  # no config to ask: the transformers naming convention opts a plain module in
        pass

    assert is_causal_lm(MyForCausalLM()) and is_causal_lm(Wrapper(MyForCausalLM()))
    classifier = LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=16,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            pad_token_id=0,
        )
    )
    assert not is_causal_lm(classifier)  # cannot generate
    classifier.__class__ = type("MisnamedForCausalLM", (LlamaForSequenceClassification,), {})
    assert not is_causal_lm(classifier)  # a config decides, whatever the class is called
    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, decoder_start_token_id=0)
    )
    assert not is_causal_lm(t5)  # encoder-decoder: its labels are the decoder's targets, not shifted inputs


def test_gradient_checkpointing_needs_a_transformers_model():
    with pytest.raises(ValueError, match=r"needs a transformers model; Plain has no .*torch.utils.checkpoint"):
        enable_gradient_checkpointing(Plain())
    llama = tiny_llama()
    enable_gradient_checkpointing(Wrapper(llama))
    assert llama.is_activation_checkpointing and llama.config.use_cache is False


# ---- generation context -----------------------------------------------------------------------------------
def test_unwrapped_for_generation_gives_the_peft_base_and_refuses_fsdp1():
    base = Plain()

    class Peft(nn.Module):
        def get_base_model(self):
            return base

    with unwrapped_for_generation(Peft()) as inner:
        assert inner is base
    with unwrapped_for_generation(base) as inner:
        assert inner is base

    class FullyShardedDataParallel(nn.Module):
        pass

    with pytest.raises(ValueError, match="FSDP1.*fully_shard"):
        with unwrapped_for_generation(FullyShardedDataParallel()):
            pass


# ---- the model against its tokenizer ----------------------------------------------------------------------
def test_python_api_refuses_a_model_vocabulary_smaller_than_the_tokenizer_as_the_cli_does(tmp_path):
    from treadle.demos import toy
    from treadle.errors import PreflightError
    from treadle.trainers.sft import SFTConfig, SFTTrainer

    tok = toy.build_tokenizer()
    with pytest.raises(
        PreflightError,
        match=rf"the tokenizer of LlamaForCausalLM has {len(tok)} tokens but the model's "
        r"embedding has 16 rows; .*resize_token_embeddings",
    ):
        SFTTrainer(
            toy.build_model("tiny", vocab_size=16),
            args=SFTConfig(output_dir=str(tmp_path), report_to=[]),
            train_dataset=[{"prompt": "1+1=", "completion": "2"}],
            processing_class=tok,
        )


# ---- loading ----------------------------------------------------------------------------------------------
def test_a_revision_with_a_local_model_folder_is_refused_in_one_line(tmp_path, tok):
    from treadle.demos import toy
    from treadle.models import load_pretrained

    folder = tmp_path / "model"
    toy.build_model("tiny", tokenizer=tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    with pytest.raises(ValueError) as refused:
        load_pretrained(str(folder), revision="v1.0")
    assert str(refused.value) == (
        f"revision 'v1.0' picks a version of a Hugging Face Hub model, but {folder} is a local folder, which holds "
        f"one version; drop revision, or name the Hub id (org/name) to load that revision"
    )
    assert load_pretrained(str(folder))[0] is not None  # without it, the folder loads


# ---- the fourth hostile trial (issue 59): weights that were never loaded ----------------------------------------
def test_a_folder_whose_safetensors_lacks_tensors_is_refused_unless_strict_is_off(tmp_path):
    """Regression: a model folder whose model.safetensors lacks 12 of its 20 tensors trained the random weights and
    saved them, exit 0 (the trial's lacked 12 of 20; transformers' load report was the only hint)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from treadle.demos.toy import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    models.load_pretrained(str(tmp_path))  # whole: loads
    weights = load_file(tmp_path / "model.safetensors")
    assert len(weights) == 21  # 2 layers of 9, the embedding, the final norm, the head
    dropped = sorted(weights)[:12]
    save_file({k: v for k, v in weights.items() if k not in dropped}, tmp_path / "model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError) as error:
        models.load_pretrained(str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and "12 of its 21 weights are not in the files" in message
    assert dropped[0] in message and "model_init_kwargs: {strict: false}" in message
    model, _ = models.load_pretrained(str(tmp_path), strict=False)
    assert type(model).__name__ == "LlamaForCausalLM"
    weights["extra.weight"] = torch.zeros(2)
    save_file(weights, tmp_path / "model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match="1 weights in the files have no place in it \\(extra.weight\\)"):
        models.load_pretrained(str(tmp_path))


def test_a_reward_head_is_new_and_not_refused(tmp_path):
    """A sequence classifier from a causal LM's folder: its score head is new by design (not in the files)."""
    from transformers import AutoModelForSequenceClassification

    from treadle.demos.toy import build_model, build_tokenizer

    build_model("tiny").save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    model, _ = models.load_pretrained(str(tmp_path), model_class=AutoModelForSequenceClassification, num_labels=1)
    assert type(model).__name__ == "LlamaForSequenceClassification"
