"""The third hostile trial (issue 44), the data cases: KTO labels as users write them, a distillation teacher that
is the student, the note when prompts are cut to max_prompt_length, a huge image, a chat template that cannot render
a tool-call turn, a tokenizer without a chat template given chat prompts. Each test failed on 2a6f17d; docs/runs.md
holds the table."""

import copy
import struct
import warnings
import zlib

import pytest
from _factories import add, grpo_trainer, sft_trainer

import treadle
from treadle import vision
from treadle.demos import toy, toy_vision as tv
from treadle.errors import PreflightError, UserError
from treadle.rollouts.runner import RolloutRunner
from treadle.text import render_chat_prompt
from treadle.trainers.kto import tokenize_row

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- 1. KTO labels: what users write is read, anything else refused by row, one class warned -------------------
@pytest.mark.parametrize(
    "label, expected",
    [
        (True, True),
        (False, False),
        (1, True),
        (0, False),
        (-1, False),
        (1.0, True),
        (0.0, False),
        ("True", True),
        ("False", False),
        (" false ", False),
        ("TRUE", True),
        ("1", True),
        ("0", False),
    ],
)
def test_kto_labels_as_users_write_them(tok, label, expected):
    row = tokenize_row({"prompt": "1+1=", "completion": "2", "label": label}, 0, tokenizer=tok, max_length=None)
    assert row["label"] is expected  # bool("False") and bool(-1) are True: the rejected answer pushed up


@pytest.mark.parametrize("label", [None, "yes", "-", 2, 0.5, float("nan"), [True]])
def test_kto_labels_that_are_not_labels_are_refused_naming_the_row(tok, label):
    with pytest.raises(ValueError, match=r"^row 3: label .* is neither desirable nor undesirable; give"):
        tokenize_row({"prompt": "1+1=", "completion": "2", "label": label}, 3, tokenizer=tok, max_length=None)


def kto(tmp_path, tok, labels):
    rows = [{"prompt": f"1+{i}=", "completion": str(i + 1), "label": label} for i, label in enumerate(labels)]
    args = treadle.KTOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to="none", disable_tqdm=True
    )
    model = toy.build_model("tiny", tokenizer=tok)
    return treadle.KTOTrainer(model, args=args, train_dataset=rows, processing_class=tok)


def test_kto_csv_labels_train_both_classes_and_one_class_is_warned(tmp_path, tok):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # two classes: no warning
        trainer = kto(tmp_path / "a", tok, ["True", "False", "true", "false"])
    assert [bool(x) for x in trainer.train_dataset["label"]] == [True, False, True, False]
    with pytest.warns(UserWarning, match="every one of the 4 KTO training rows is labelled desirable"):
        kto(tmp_path / "b", tok, [1, 1, 1, 1])
    with pytest.raises(ValueError, match="row 1: label None"):
        kto(tmp_path / "c", tok, [True, None, False, True])


# ---- 2. a distillation teacher that is the student ----------------------------------------------------------------
@pytest.mark.parametrize(
    "teacher, needle", [("same", "is the student model itself"), ("copy", "has the student.s very weights")]
)
def test_a_teacher_that_is_the_student_is_refused(tmp_path, tok, teacher, needle):
    student = toy.build_model("tiny", tokenizer=tok)
    args = treadle.DistillationConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1)
    with pytest.raises(PreflightError, match=f"teacher_model {needle}.*would train on nothing"):
        treadle.DistillationTrainer(
            student,
            student if teacher == "same" else copy.deepcopy(student),
            args=args,
            train_dataset=[{"prompt": "1+1="}] * 4,
            processing_class=tok,
        )
    assert all(p.requires_grad for p in student.parameters())  # the "frozen teacher" did not freeze the student


# ---- 3. prompts cut to max_prompt_length: one note, the start cut (TRL's side) -------------------------------------
CHAT = [{"role": "system", "content": "You add."}, {"role": "user", "content": "12+34="}]


def test_cut_prompts_are_noted_once_with_what_was_lost(tmp_path, tok, capsys):
    rows = [{"prompt": CHAT}] * 4 + [{"prompt": "1+1="}] * 4
    trainer = grpo_trainer(tmp_path, tok, rows, max_prompt_length=8)
    prompts = trainer.encode_prompts(rows)
    assert tok.decode(prompts.ids[0]) == "12+34=\n<|assistant|>"  # the last 8 tokens: the end is kept, as TRL
    trainer.encode_prompts(rows)
    err = capsys.readouterr().err
    assert err.count("treadle: 1 of 2 prompts is longer than max_prompt_length=8 tokens") == 1
    assert "the first lost '<|system|>You add." in err and "raise max_prompt_length to " in err


def test_the_tool_runners_cut_prompts_are_noted_too(tok, capsys):
    runner = RolloutRunner(tok, tools=[add])
    assert runner.encode_prompts([CHAT, "1+1="], 5)[1] == tok("1+1=")["input_ids"]
    assert "1 of 2 prompts is longer than max_prompt_length=5" in capsys.readouterr().err
    runner.close()


# ---- 4. a huge image ----------------------------------------------------------------------------------------------
def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` pixels (PIL reads the size from the header alone)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def test_a_huge_image_is_one_line_naming_the_row_and_the_limit(tmp_path):
    from datasets import Dataset

    huge = tmp_path / "huge.png"
    huge.write_bytes(png_header(20000, 20000))
    with pytest.raises(vision.VisionDataError, match=r"row 5 of x: image .*huge\.png' is too large for PIL .*"):
        vision.load_image(str(huge), row=5, where="x")
    rows = tv.count_task("train", 2)
    rows[1]["images"] = [str(huge)]
    with pytest.raises(vision.VisionDataError, match="row 1 of the dataset: .* raise PIL.Image.MAX_IMAGE_PIXELS"):
        vision.check_vision_dataset(Dataset.from_list(rows))


# ---- 5. a chat template that cannot render a row's tool-call turn -------------------------------------------------
def test_a_tool_call_turn_the_template_cannot_render_names_the_row(tmp_path, tok):
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{}"}}]}
    good = [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": "5"}]
    rows = [{"messages": good}, {"messages": good}, {"messages": [good[0], call, good[1]]}]
    with pytest.raises(UserError, match=r"^row 2: the chat template of .* cannot render the tool-call turn .*'add'"):
        sft_trainer(tmp_path, tok, rows=rows)
    rows[2]["messages"][1] = {**call, "content": ""}  # rendered as an empty turn: the call silently dropped
    with pytest.raises(UserError, match=r"^row 2: .* renders the tool-call turn .* without its call to 'add'"):
        sft_trainer(tmp_path, tok, rows=rows)
    adding = copy.copy(tok)
    adding.chat_template = "{% for m in messages %}{{ m['role'] + 1 }}{% endfor %}"  # a TypeError of the template's
    with pytest.raises(UserError, match=r"cannot render the chat \[\{'role': 'user'.*\(TypeError: .*\); fix the row"):
        render_chat_prompt(adding, good[:1])


# ---- 6. a tokenizer folder without a chat template given chat prompts ---------------------------------------------
def test_a_tokenizer_without_a_chat_template_is_named_before_training(tmp_path, dataset):
    from transformers import AutoTokenizer

    plain = toy.build_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "tokenizer")
    plain = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in dataset["prompt"][:8]]
    needle = rf"tokenizer '{tmp_path / 'tokenizer'}' has no chat template; set tokenizer.chat_template"
    with pytest.raises(UserError, match=needle):
        grpo_trainer(tmp_path, plain, rows, model=toy.build_model("tiny", tokenizer=plain))
    with pytest.raises(UserError, match=needle):  # SFT's chat rows too
        sft_trainer(tmp_path, plain, rows=[{"messages": rows[0]["prompt"] + [{"role": "assistant", "content": "2"}]}])
