"""A GGUF file as a model (``treadle.models.load_pretrained``, ``gguf_source``), on a tiny Llama written here with the
``gguf`` package's GGUFWriter: float32 tensors (so the dequantised weights must equal what was written, bit for bit),
q/k permuted as llama.cpp's converter permutes them, tied embeddings as SmolLM2's, and a byte-level BPE tokenizer with
a ChatML template inside the file (transformers builds the tokenizer from it; nothing is passed separately).

Loads by ``.gguf`` path and by folder + ``gguf_file``, trains a step and saves a folder plain transformers reloads,
the one-line errors, a LoRA adapter of a GGUF base merged by ``treadle merge``, and the CLI with ``model:`` a .gguf
file (beside the config, or missing). The real model's GGUF (SmolLM2, Q4_1): tests/real/test_real_model.py."""

import copy
import json

import numpy as np
import pytest
import torch
from test_run_errors import error_line, treadle, write_config

from treadle import modelfiles
from treadle.models import load_pretrained

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.usefixtures("one_thread")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2: pad, bos, eos
MERGES = ["h e", "Ġ t", "Ġt he"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SHAPE = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128)
GGUF_NAMES = {  # transformers' name -> llama.cpp's, inside blk.N
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return SPECIALS + [spelling[b] for b in range(256)] + [merge.replace(" ", "") for merge in MERGES]


def llama_weights(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny Llama's weights in transformers' names (tied embeddings: no lm_head)."""
    rng = np.random.default_rng(seed)
    hidden, ffn, heads, kv_heads = SHAPE["hidden"], SHAPE["ffn"], SHAPE["heads"], SHAPE["kv_heads"]
    head_dim = hidden // heads

    def w(*shape, base=0.0):
        return (base + 0.05 * rng.standard_normal(shape)).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": w(hidden, base=1.0)}
    for i in range(SHAPE["layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": w(hidden, base=1.0),
            p + "post_attention_layernorm.weight": w(hidden, base=1.0),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(ffn, hidden),
            p + "mlp.up_proj.weight": w(ffn, hidden),
            p + "mlp.down_proj.weight": w(hidden, ffn),
        }
    return weights


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``permute`` of q/k rows (rotary halves interleaved); transformers undoes it."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path, arch: str = "llama", seed: int = 0, with_tensors: bool = True) -> dict[str, torch.Tensor]:
    """Write a tiny GGUF model of architecture ``arch`` (float32 tensors, a ChatML byte-level BPE tokenizer) to
    ``path``; returns the weights as transformers names them."""
    vocab = tokens()
    weights = llama_weights(len(vocab), seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(128)
    writer.add_embedding_length(SHAPE["hidden"])
    writer.add_block_count(SHAPE["layers"])
    writer.add_feed_forward_length(SHAPE["ffn"])
    writer.add_head_count(SHAPE["heads"])
    writer.add_head_count_kv(SHAPE["kv_heads"])
    writer.add_rope_dimension_count(SHAPE["hidden"] // SHAPE["heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")  # byte-level BPE
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(vocab) - 3))
    writer.add_token_merges(MERGES)
    writer.add_pad_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML)
    for name, value in weights.items() if with_tensors else ():
        writer.add_tensor(gguf_name(name), permuted(name, value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: torch.from_numpy(value) for name, value in weights.items()}


def gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, *module, _ = name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.weight"


def permuted(name: str, value: np.ndarray) -> np.ndarray:
    if name.endswith("q_proj.weight"):
        return llama_cpp_permute(value, SHAPE["heads"])
    if name.endswith("k_proj.weight"):
        return llama_cpp_permute(value, SHAPE["kv_heads"])
    return value


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """``(path of tiny.gguf, the weights written)``; alone in its folder, as a downloaded GGUF often is."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_gguf(path)


@pytest.fixture(scope="module")
def loaded(tiny_gguf):
    model, tokenizer = load_pretrained(str(tiny_gguf[0]))
    return model, tokenizer


def logits(model, ids=((1, 119, 259, 35, 102, 100, 119, 2),)):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


# ---- loading ------------------------------------------------------------------------------------------------
def test_a_gguf_path_loads_the_weights_written_and_the_tokenizer_in_the_file(tiny_gguf, loaded):
    path, written = tiny_gguf
    model, tokenizer = loaded
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    state = model.state_dict()
    assert set(state) == set(written) | {"lm_head.weight"}
    for name, value in written.items():  # q/k too: transformers undoes llama.cpp's permutation
        assert torch.equal(state[name], value), name
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.vocab_size) == (2, 2, 262)
    assert getattr(model.config, "quantization_config", None) is None  # dequantised: an ordinary model
    assert model.name_or_path == model.config._name_or_path == str(path)  # an adapter names it as its base
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert len(tokenizer) == 262 and tokenizer.chat_template == CHATML
    assert tokenizer("the")["input_ids"] == [119, 259]  # t + he: the merges in the file are used
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tokenizer.decode(chat["input_ids"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_folder_with_gguf_file_loads_the_same_model(tiny_gguf, loaded):
    path, written = tiny_gguf
    model, tokenizer = load_pretrained(str(path.parent), gguf_file=path.name)
    assert model.name_or_path == model.config._name_or_path == str(path)
    torch.testing.assert_close(model.state_dict(), loaded[0].state_dict(), rtol=0, atol=0)
    assert tokenizer.get_vocab() == loaded[1].get_vocab()


# ---- training and saving ---------------------------------------------------------------------------------------
def test_a_gguf_model_trains_a_step_and_saves_a_folder_plain_transformers_reloads(tmp_path, tiny_gguf, loaded):
    from _factories import SFT_ROWS, sft_trainer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = copy.deepcopy(loaded[0]), loaded[1]
    trainer = sft_trainer(tmp_path / "run", tokenizer, SFT_ROWS, model, max_steps=1, per_device_train_batch_size=4)
    trainer.train()
    changed = [name for name, value in tiny_gguf[1].items() if not torch.equal(model.state_dict()[name], value)]
    assert len(changed) == len(tiny_gguf[1])  # every weight trained (no quantised weight kept frozen)
    trainer.save_model(str(tmp_path / "out"))

    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))  # no gguf_file, no treadle
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)
    assert not torch.allclose(logits(reloaded), logits(loaded[0]))
    saved_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert saved_tokenizer.chat_template == CHATML and saved_tokenizer.get_vocab() == tokenizer.get_vocab()
    text = "<|im_start|>user\nthe theme<|im_end|>\n"
    assert saved_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_a_lora_adapter_of_a_gguf_base_names_the_file_and_treadle_merge_merges_it(tmp_path, tiny_gguf, loaded):
    peft = pytest.importorskip("peft")
    from _factories import SFT_ROWS, sft_trainer
    from transformers import AutoModelForCausalLM

    from treadle.cli.command import main

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model = copy.deepcopy(loaded[0])
    trainer = sft_trainer(tmp_path / "run", loaded[1], SFT_ROWS, model, max_steps=1, peft_config=lora)
    trainer.train()
    trainer.save_model()
    adapter = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(tiny_gguf[0])

    assert main(["merge", str(tmp_path / "run")]) == 0  # loads the base from the .gguf file again
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "merged"))
    torch.testing.assert_close(logits(merged), logits(trainer.model), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(merged), logits(loaded[0]), atol=1e-4)  # the adapter trained


# ---- one-line errors --------------------------------------------------------------------------------------------
def one_line_error(*args, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        load_pretrained(*args, **kwargs)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_missing_gguf_file(tmp_path):
    message = one_line_error(str(tmp_path / "nowhere.gguf"))
    assert f"GGUF file {tmp_path / 'nowhere.gguf'} not found" in message
    message = one_line_error(str(tmp_path), gguf_file="absent.gguf")
    assert f"GGUF file {tmp_path / 'absent.gguf'} not found" in message


def test_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 a zip, say")
    assert "is not a GGUF file (it does not start with the bytes GGUF)" in one_line_error(str(tmp_path / "model.gguf"))


def test_a_gguf_file_cut_short_in_its_metadata(tmp_path, tiny_gguf):
    """Regression: an interrupted download (the bytes GGUF, then the metadata cut off) was a struct.error traceback
    from transformers' reader."""
    (tmp_path / "cut.gguf").write_bytes(tiny_gguf[0].read_bytes()[:100])
    message = one_line_error(str(tmp_path / "cut.gguf"))
    assert "is not a whole GGUF file, its metadata cannot be read" in message and "copy it again" in message


def test_an_architecture_transformers_does_not_know(tmp_path):
    write_gguf(tmp_path / "odd.gguf", arch="notallama", with_tensors=False)
    message = one_line_error(str(tmp_path / "odd.gguf"))
    assert "holds a 'notallama' model, which transformers' GGUF loader does not know" in message
    assert "llama" in message.split("it knows ")[1] and "general" not in message.split("it knows ")[1]


@pytest.mark.parametrize("arch", ["qwen35", "qwen3moe", "gpt-oss", "llama"])
def test_every_architecture_transformers_loads_passes_the_check(tmp_path, arch):
    """Regression: llama.cpp's names that transformers loads under another spelling (qwen3moe, gpt-oss) or through
    its newer reader (qwen35: Qwen3.5) were refused as unknown."""
    write_gguf(tmp_path / "m.gguf", arch=arch, with_tensors=False)
    modelfiles.check_gguf_file(str(tmp_path / "m.gguf"))  # raises when refused
    assert "general" not in modelfiles.gguf_architectures()  # a metadata section, not an architecture


def test_without_the_gguf_package(tmp_path, tiny_gguf, monkeypatch):
    monkeypatch.setattr(modelfiles, "GGUF_PACKAGE", "gguf_is_not_installed")
    message = one_line_error(str(tiny_gguf[0]))
    assert "needs the gguf_is_not_installed package" in message and "pip install 'treadle[gguf]'" in message


# ---- the CLI ----------------------------------------------------------------------------------------------------
def test_the_cli_trains_a_model_named_by_its_gguf_file(tmp_path, tiny_gguf, loaded):
    from transformers import AutoModelForCausalLM

    from treadle.cli.command import main

    config = tmp_path / "sft.yaml"
    config.write_text(
        f"trainer: sft\nmodel: {tiny_gguf[0]}\ndataset: toy:addition:8\noutput_dir: {tmp_path / 'run'}\n"
        "max_steps: 1\nper_device_train_batch_size: 4\nlearning_rate: 1.0e-2\nsave_strategy: 'no'\n"
        "disable_tqdm: true\nlogging_steps: 1\n"
    )
    assert main(["train", str(config)]) == 0
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run"))
    assert reloaded.config.vocab_size == 262
    assert not torch.allclose(logits(reloaded), logits(loaded[0]))


def test_a_config_names_a_gguf_file_beside_it_and_a_missing_one_is_a_gguf_error(tmp_path):
    pytest.importorskip("gguf")
    from treadle.cli.command import main

    beside = tmp_path / "configs"
    beside.mkdir()
    write_gguf(beside / "tiny.gguf")
    config = write_config(beside, model="tiny.gguf", output_dir=str(tmp_path / "run"), max_steps=1)
    config.write_text(config.read_text().replace("data.jsonl", str(beside / "data.jsonl")) + 'save_strategy: "no"\n')
    assert main(["train", str(config)]) == 0  # found beside the config, as a dataset is
    assert (tmp_path / "run" / "model.safetensors").exists()
    for missing in ("nope.gguf", str(tmp_path / "nope.gguf")):
        result = treadle("train", config, "--model", missing, "--output_dir", tmp_path / "run2", cwd=tmp_path)
        line = error_line(result)
        assert f"GGUF file {tmp_path / 'nope.gguf'} not found; name an existing .gguf file" in line
        assert "model folder" not in line


# ---- the fourth hostile trial (issue 59): files that are not what they say -------------------------------------
@pytest.mark.parametrize("arch, missing", [("qwen2", "self_attn.q_proj.bias"), ("mamba", "backbone.layers.0.mixer")])
def test_a_gguf_whose_header_names_another_architecture_is_refused_unless_strict_is_off(tmp_path, arch, missing):
    """Regression: a llama GGUF whose header says qwen2 (biases never loaded) or mamba (every layer never loaded)
    trained and saved the random weights, exit 0."""
    write_gguf(tmp_path / f"{arch}.gguf", arch=arch)
    message = one_line_error(str(tmp_path / f"{arch}.gguf"))
    assert f"{tmp_path / f'{arch}.gguf'} does not fit the " in message and "weights are not in the files" in message
    assert missing in message and "model_init_kwargs: {strict: false}" in message
    model, _ = load_pretrained(str(tmp_path / f"{arch}.gguf"), strict=False)  # the user's opt-in: loads
    assert type(model).__name__.lower().startswith(arch)


def test_a_gguf_file_is_found_by_its_magic_bytes_not_its_name(tmp_path, tiny_gguf, loaded):
    """Regression: a GGUF file renamed x.bin or named UPPER.GGUF was "model folder not found, and it is not a Hub
    id"."""
    for name in ("x.bin", "UPPER.GGUF"):
        (tmp_path / name).write_bytes(tiny_gguf[0].read_bytes())
        model, _ = load_pretrained(str(tmp_path / name))
        assert model.name_or_path == str(tmp_path / name)
        torch.testing.assert_close(model.state_dict(), loaded[0].state_dict(), rtol=0, atol=0)


def test_a_gguf_of_a_newer_format_version_says_so(tmp_path, tiny_gguf):
    """Regression: version 99 was "not a whole GGUF file ... copy it again"; the file is whole, its format is newer."""
    data = bytearray(tiny_gguf[0].read_bytes())
    data[4:8] = (99).to_bytes(4, "little")
    (tmp_path / "v99.gguf").write_bytes(bytes(data))
    message = one_line_error(str(tmp_path / "v99.gguf"))
    assert "is a GGUF file of format version 99, newer than the installed gguf" in message
    assert "copy it again" not in message and "pip install -U gguf transformers" in message


def test_a_gguf_cut_in_its_tensor_data_names_the_file_and_its_size(tmp_path, tiny_gguf):
    """Regression: an interrupted download cut in the tensor data was numpy's "cannot reshape array of size ...",
    naming the folder."""
    whole = tiny_gguf[0].read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) - 1000])
    message = one_line_error(str(tmp_path / "cut.gguf"))
    assert f"{tmp_path / 'cut.gguf'} is cut short: {len(whole) - 1000} bytes of the {len(whole)}" in message
    assert "reshape" not in message


def test_an_empty_folder_and_a_folder_holding_only_a_gguf_file(tmp_path, tiny_gguf):
    """Regression: `model: dir.gguf` (an empty folder) and a folder holding only a .gguf file both said "has no
    tokenizer files"."""
    (tmp_path / "dir.gguf").mkdir()
    message = one_line_error(str(tmp_path / "dir.gguf"))
    assert (
        f"model folder {tmp_path / 'dir.gguf'} is empty: it has no config.json, no weights and no tokenizer" in message
    )
    message = one_line_error(str(tiny_gguf[0].parent))
    only = f"holds the GGUF file tiny.gguf and no config.json; name the file itself (model: {tiny_gguf[0]})"
    assert only in message
    assert "tokenizer" not in message
