"""Loading what a config names: datasets (``toy:<task>[:N]``, files, save_to_disk folders, ``{reasoning_gym: ...}``
(treadle.tasks), with its verifier as the default reward), models (``toy:<size>``,
a local folder or a Hub id), reward functions (dotted paths or ``file.py:function``) and a saved adapter merged into
its base. The run side: the CLI and the demos call it; the trainers take the loaded objects.

``datasets`` (about 1 s to import) is imported by the functions that read data, not here: loading a model alone
(``treadle vllm-serve``, the real-model demos, a GPU image without ``datasets``) runs without it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from treadle import peft as treadle_peft, tasks
from treadle.arguments import expand_path
from treadle.data import DatasetFileError, check_text_columns
from treadle.demos import toy, toy_vision
from treadle.errors import shorten
from treadle.models import from_name
from treadle.record.runs import check_not_in_model
from treadle.rewards import RewardFunction, from_reward_model

DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")


def load_run_objects(config: dict[str, Any], *, kind, args, base_dir: Path) -> dict[str, Any]:
    """The trainer's keyword arguments that a config names (``kind``: the CLI's ``TrainerKind``): reward functions
    (GRPO), datasets, model and tokenizer (folder or Hub id, with ``args``' loading fields), the teacher
    (distillation) -- the cheap ones first: a wrong path fails before a load."""
    kwargs: dict[str, Any] = {}
    gym = is_gym(config.get("dataset"))
    if kind.takes_reward_funcs:  # a reasoning-gym dataset brings its own verifier when none is named
        named = config.get("reward_funcs") or (list(tasks.AUTO_REWARDS) if gym else None)
        kwargs["reward_funcs"] = load_reward_funcs(named, base_dir)
    if bool(config.get("teacher")) != kind.takes_teacher:
        raise ValueError(
            "a distillation config names its teacher: (a model folder, Hub id or toy:<size>)"
            if kind.takes_teacher
            else "teacher: is a distillation key; remove it or set trainer: distillation"
        )
    evaluation = config.get("eval_dataset")
    if gym and is_gym(evaluation):
        kwargs.update(gym_datasets(gym_spec(config["dataset"]), gym_spec(evaluation)))
    else:
        kwargs["train_dataset"] = load_dataset(config["dataset"], kind=kind.rows, split="train", base_dir=base_dir)
        if evaluation:
            kwargs["eval_dataset"] = load_dataset(evaluation, kind=kind.rows, split="test", base_dir=base_dir)
    if config.get("peft") is not None:
        kwargs["peft_config"] = treadle_peft.lora_config(config["peft"])
    kwargs["model"], kwargs["processing_class"] = load_model(
        model_spec(config["model"], base_dir), seed=args.seed, args=args, reward_head=kind.reward_head
    )
    if kind.takes_teacher:
        kwargs["teacher_model"] = load_teacher(
            model_spec(config["teacher"], base_dir), tokenizer=kwargs["processing_class"], seed=args.seed
        )
    return kwargs


def is_gym(spec) -> bool:
    """Whether a config's dataset is reasoning-gym's (``{reasoning_gym: {tasks: ..., size: ..., seed: ...}}``)."""
    return isinstance(spec, dict) and "reasoning_gym" in spec


def gym_spec(spec: dict) -> dict:
    """The ``reasoning_gym:`` mapping of a dataset written ``{reasoning_gym: {...}}``."""
    if set(spec) != {"reasoning_gym"} or not isinstance(spec["reasoning_gym"], dict):
        raise ValueError("a reasoning-gym dataset is written dataset: {reasoning_gym: {tasks: {...}, size: N}}")
    return spec["reasoning_gym"]


def gym_datasets(train: dict, evaluation: dict) -> dict[str, Any]:
    """The reasoning-gym training and evaluation datasets of a config: the evaluation items draw from the training
    seed + ``tasks.EVAL_SEED_OFFSET`` unless a seed is written (one line warns when both draw the same items), and no
    training row asks an evaluation question."""
    warning = tasks.overlap_warning(train, evaluation)
    if warning:
        print(warning, file=sys.stderr)
    eval_dataset = tasks.gym_dataset(evaluation, "test", train_seed=train.get("seed", 0))
    exclude = set(row["prompt"][-1]["content"] for row in eval_dataset)
    return {"train_dataset": tasks.gym_dataset(train, "train", exclude=exclude), "eval_dataset": eval_dataset}


def model_spec(spec, base_dir: Path) -> str:
    """A config's ``model:`` / ``teacher:``: a folder or ``.gguf`` file as datasets are found (the working folder,
    then the config's), else as written (``toy:<size>``, a Hub id, or a path whose error names it)."""
    spec = str(spec)
    path = None if spec.startswith("toy:") else existing_path(spec, base_dir)
    return str(path) if path is not None else spec


def load_teacher(spec: str, *, tokenizer, seed: int):
    """A distillation teacher: ``toy:<size>`` built here with the student's tokenizer and ``seed + 1`` (another
    model than a toy student), else the folder or Hub id itself, which the trainer loads with its own tokenizer
    (``teacher_model_init_kwargs``) and checks against the student's."""
    if spec.startswith("toy:"):
        return load_model(spec, tokenizer=tokenizer, seed=seed + 1)[0]
    return spec


def load_dataset(spec, *, kind: str = "sft", split: str = "train", base_dir: Path = Path(".")):
    """A ``datasets.Dataset`` from ``toy:<task>[:N]`` (the train split for ``dataset``, the held-out test split
    for ``eval_dataset``; N rows), a .json / .jsonl / .csv / .parquet file, or a save_to_disk folder. ``spec`` may
    also be a mapping ``{path: SPEC, streaming: true}``: the same data as a ``datasets.IterableDataset``, read
    as training goes (a file through ``datasets.load_dataset(..., streaming=True)``; see ``treadle.streaming``)."""
    import datasets

    if is_gym(spec):
        return tasks.gym_dataset(gym_spec(spec), split)
    if isinstance(spec, dict):
        return _dataset_from_mapping(spec, kind=kind, split=split, base_dir=base_dir)
    spec = str(spec)
    if spec.startswith("toy:"):
        return _toy_dataset(spec, kind=kind, split=split)
    path = existing_path(spec, base_dir)
    if path is None:
        raise ValueError(
            f"dataset {shorten(spec)} not found (a .json, .jsonl, .csv or .parquet file, a folder written by "
            f"Dataset.save_to_disk, or toy:addition)"
        )

    def from_rows(rows: list[dict]):  # checked before datasets infers (and refuses) a column type
        check_text_columns(
            rows, TEXT_COLUMNS.get(kind, ()), source=str(path), first_row=FIRST_LINE.get(path.suffix, 0)
        )
        return datasets.Dataset.from_list(rows)

    readers = {
        ".json": lambda: from_rows(_read_json_rows(path)),
        ".jsonl": lambda: _read_jsonl(path, kind, from_rows),
        ".csv": lambda: _read_csv(path),
        ".parquet": lambda: datasets.Dataset.from_parquet(str(path)),
    }
    if not path.is_dir() and path.suffix not in readers:
        raise ValueError(
            f"dataset {spec}: unsupported file type {path.suffix!r}; use one of {list(DATA_SUFFIXES)} "
            f"or a save_to_disk folder"
        )
    try:
        data = datasets.load_from_disk(str(path)) if path.is_dir() else readers[path.suffix]()
    except DatasetFileError:
        raise  # our own message names the file and line already
    except (OSError, ValueError, TypeError) as error:  # corrupt files: datasets raises a variety of types
        raise ValueError(f"cannot read dataset {spec}: {str(error).splitlines()[0]}") from None
    data = _one_split(data, split, spec) if path.is_dir() else data
    check_text_columns(data, TEXT_COLUMNS.get(kind, ()), source=str(path), first_row=FIRST_LINE.get(path.suffix, 0))
    return data


STREAM_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}  # datasets' names


def _dataset_from_mapping(spec: dict, *, kind: str, split: str, base_dir: Path):
    """``{path: ..., streaming: true|false}``: ``path`` as ``load_dataset`` reads it, streamed when asked."""
    import datasets

    unknown = sorted(set(spec) - {"path", "streaming"})
    if unknown or not spec.get("path") or not isinstance(spec.get("streaming", False), bool):
        raise ValueError(
            f"a dataset mapping takes path: (a file, folder or toy:) and streaming: true/false, got "
            f"{dict(spec)!r}; e.g. dataset: {{path: data/train.jsonl, streaming: true}}"
        )
    path = existing_path(str(spec["path"]), base_dir)
    if not spec.get("streaming") or path is None or path.is_dir() or path.suffix not in STREAM_BUILDERS:
        data = load_dataset(str(spec["path"]), kind=kind, split=split, base_dir=base_dir)
        return data.to_iterable_dataset(num_shards=1) if spec.get("streaming") else data
    # a file is streamed: rows are read as training asks for them, never all at once; a .jsonl file by treadle's
    # own line reader (whose faults name the line), any other by datasets (its state_dict resumes exactly)
    if path.suffix == ".jsonl":  # a tuple: datasets would shard a list of gen_kwargs
        columns = tuple(TEXT_COLUMNS.get(kind, ()))
        return datasets.IterableDataset.from_generator(
            _streamed_jsonl, gen_kwargs={"path": str(path), "columns": columns}
        )
    return datasets.load_dataset(STREAM_BUILDERS[path.suffix], data_files=str(path), split="train", streaming=True)


FIRST_LINE = {".jsonl": 1, ".csv": 2}  # the file line of row 0, where rows are lines (a CSV has a header)
TEXT_COLUMNS = {
    "sft": ("prompt", "completion", "text", "messages"),
    "preference": ("prompt", "chosen", "rejected"),
    "rl": ("prompt",),
}  # per toy-dataset kind: the columns that hold text (or chat messages)


def _toy_dataset(spec: str, *, kind: str, split: str):
    import datasets

    task, _, size = spec.removeprefix("toy:").partition(":")
    if task == "count" and (not size or size.isdigit()):  # images: treadle.demos.toy_vision's canvases
        return datasets.Dataset.from_list(toy_vision.count_task(split, int(size or 512), kind=kind))
    if task not in toy.TASKS:
        raise ValueError(f"unknown toy task {spec!r}; use one of {['toy:' + t for t in toy.TASKS]}")
    if size and not size.isdigit():
        raise ValueError(f"toy dataset {spec!r}: the part after the task is a row count, e.g. toy:{task}:256")
    try:
        return toy.load_task(task, split, kind=kind, n=int(size) if size else None)
    except ValueError as error:
        raise ValueError(f"toy dataset {spec!r}: {error}") from None


def existing_path(spec: str, base_dir: Path) -> Path | None:
    """``spec`` as given (relative to the working directory) if it exists, else relative to ``base_dir`` (the
    config's folder), else None."""
    for candidate in (Path(spec), base_dir / spec):
        try:
            if candidate.exists():
                return candidate
        except OSError:  # a name too long for any file (a pasted text, an expanded YAML alias): not a path
            return None
    return None


def _read_json_rows(path: Path) -> list[dict]:
    """The rows of a .json file: a list of objects, or one object of equal-length column lists."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DatasetFileError(
            f"{path}:{error.lineno}: not valid JSON ({error.msg}); a .json dataset is one JSON "
            f"document (JSON lines go in a .jsonl file)"
        ) from None
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {k: len(v) for k, v in data.items()}
        if len(set(lengths.values())) != 1:
            raise DatasetFileError(
                f"{path} holds columns of different lengths {lengths}; give every column one "
                f"value per row, or write a list of row objects"
            )
        data = [dict(zip(data, values)) for values in zip(*data.values())]
    if not isinstance(data, list) or not data or not all(isinstance(r, dict) for r in data):
        raise DatasetFileError(
            f'{path} must hold rows: a JSON list of objects ([{{"prompt": ...}}, ...]) or an '
            f'object of equal-length column lists ({{"prompt": [...], ...}}); got '
            f"{_shape_of(data)}"
        )
    return data


def _read_jsonl(path: Path, kind: str, from_rows):
    """A .jsonl file through datasets' json loader (Arrow, memory-mapped, cached by the file's hash: a file larger
    than memory trains; the way to streaming). When it cannot read the file, reads no rows, or reads a text column
    that is not text (it casts a column to one type, so the row it blames may not be the one at fault), treadle's
    own reader of the same lines finds the line and says what is wrong with it (``from_rows`` checks the columns)."""
    import datasets

    try:
        data = datasets.Dataset.from_json(str(path))
        if len(data):
            check_text_columns(data, TEXT_COLUMNS.get(kind, ()), source=str(path), first_row=1)
            return data
    except Exception:  # noqa: BLE001 - datasets raises many types for a bad file; the reader below names the fault
        pass
    return from_rows(_read_jsonl_rows(path))


def _read_jsonl_rows(path: Path) -> list[dict]:
    """The rows of a .jsonl file: one JSON object per non-empty line, always (a one-line file is one row)."""
    rows = [row for _, row in _jsonl_lines(path)]
    if not rows:
        raise DatasetFileError(f"{path} holds no rows; write one JSON object per line")
    return rows


def _jsonl_lines(path: Path):
    """``(line number, row)`` of each non-empty line of a .jsonl file, read one line at a time; a line that is not
    a JSON object (cut by a crash, ``null``) is refused naming the file and the line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DatasetFileError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise DatasetFileError(
                    f"{path}:{number}: a JSON lines dataset holds one object per line, got {_shape_of(row)}"
                )
            yield number, row


def _streamed_jsonl(path: str, columns: tuple):
    """The rows of a streamed .jsonl file as training reads them, each line checked as a map-style file's are
    (a cut or null line, a text column that holds no text: one line naming the file and the line)."""
    for number, row in _jsonl_lines(Path(path)):
        check_text_columns([row], columns, source=path, first_row=number)
        yield row


def _shape_of(value) -> str:
    if isinstance(value, list):
        return "an empty list" if not value else f"a list of {type(value[0]).__name__}"
    return "an object that is not columns of lists" if isinstance(value, dict) else type(value).__name__


def _read_csv(path: Path):
    """A CSV file with every column read as text (a CSV has no types: "3" as a completion is text); an empty
    cell is null, which ``check_text_columns`` refuses in a text column."""
    import datasets
    import pandas  # pandas only for CSV files (~0.4 s to import)

    return datasets.Dataset.from_pandas(pandas.read_csv(path, dtype=str), preserve_index=False)


def _one_split(data, split: str, spec: str):
    if not hasattr(data, "keys"):  # a Dataset, not a DatasetDict
        return data
    wanted = ("train",) if split == "train" else ("test", "validation", "eval")
    for name in wanted:
        if name in data:
            return data[name]
    raise ValueError(f"dataset folder {spec} holds splits {list(data)}, none of them {' / '.join(wanted)}")


# ---- models
def load_model(spec: str, *, tokenizer=None, seed: int = 0, args=None, reward_head: bool = False):
    """``(model, tokenizer)`` from ``toy:<size>`` (``treadle.toy``, built here with ``seed``), a local folder in
    transformers layout or a Hugging Face Hub id (``models.from_name``: ``args.model_init_kwargs`` with its
    ``revision``, ``args.trust_remote_code``, the HF cache, ``HF_HUB_OFFLINE``). A causal LM, or with
    ``reward_head`` a sequence classifier with one label (``trainer: reward``). The tokenizer is read with the
    model unless one is given. ValueError names what is wrong."""
    if spec.removeprefix("toy:") in toy_vision.VISION_TOKENS:  # a tiny VLM and its processor (toy:llava ...)
        processor = tokenizer if tokenizer is not None else toy_vision.build_processor(spec.removeprefix("toy:"))
        dtype = toy.init_dtype(spec, getattr(args, "model_init_kwargs", None))
        model = toy_vision.build_model(spec.removeprefix("toy:"), processor, seed=seed).to(dtype)
        model.name_or_path = spec  # an adapter names its base (treadle merge), as for toy:<size>
        return model, processor
    if spec.startswith("toy:"):
        size = spec.removeprefix("toy:")
        if size not in toy.MODEL_SIZES:
            raise ValueError(f"unknown toy model {spec!r}; use one of {['toy:' + s for s in toy.MODEL_SIZES]}")
        tokenizer = tokenizer if tokenizer is not None else toy.build_tokenizer()
        model = toy.build_model(size, seed=seed, tokenizer=tokenizer, reward_head=reward_head)
        model.to(toy.init_dtype(spec, getattr(args, "model_init_kwargs", None)))  # the dtype the run record says
        model.name_or_path = spec  # an adapter trained on it names its base (adapter_config.json; treadle merge)
        return model, tokenizer
    if tokenizer is None and os.path.isdir(spec):  # a saved toy Qwen2-VL: its processor is not AutoProcessor's
        tokenizer = toy_vision.saved_processor(spec)
    if not reward_head:
        return from_name(spec, tokenizer, args)
    from transformers import AutoModelForSequenceClassification  # transformers' model classes load ~5 s

    return from_name(spec, tokenizer, args, model_class=AutoModelForSequenceClassification, num_labels=1)


def merge_adapter_folder(adapter_dir: str, output_dir: str | None = None) -> str:
    """Merge the adapter saved in ``adapter_dir`` (``adapter_config.json``; a run folder) into its base model
    (``base_model_name_or_path``: a local folder or ``toy:<size>``, built with the run's seed) and write a
    transformers model folder to ``output_dir`` (default ``adapter_dir/merged``); returns its path."""
    treadle_peft.require_peft()  # before anything is read: peft missing is the first thing to say
    config_path = os.path.join(adapter_dir, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise ValueError(
            f"{adapter_dir} holds no adapter_config.json, so it holds no adapter to merge; treadle merge "
            f"takes the output_dir of a run trained with peft: (a full fine-tune is already a whole model)"
        )
    with open(config_path) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"{config_path} names no base_model_name_or_path; merge in Python: "
            f"PeftModel.from_pretrained(base_model, {adapter_dir!r}).merge_and_unload()"
        )
    args_path, seed = os.path.join(adapter_dir, "training_args.json"), 0
    if os.path.isfile(args_path):  # a toy base is rebuilt from the run's seed, as `treadle train` built it
        with open(args_path) as f:
            seed = json.load(f).get("seed", 0)
    output_dir = expand_path(output_dir) if output_dir else os.path.join(adapter_dir, treadle_peft.MERGED_DIR)
    check_not_in_model(output_dir, base, what="--output-dir")  # as train refuses it: the base weights stay
    if os.path.realpath(output_dir) == os.path.realpath(adapter_dir):
        raise ValueError(
            f"--output-dir {output_dir} is the run folder itself: the merged model would mix with the "
            f"adapter; leave --output-dir out (it writes {os.path.join(adapter_dir, treadle_peft.MERGED_DIR)})"
        )
    merged, tokenizer = load_adapter_folder(adapter_dir, base, seed)
    merged.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def load_adapter_folder(adapter_dir: str, base: str, seed: int = 0):
    """``(model, tokenizer)``: the adapter saved in ``adapter_dir`` merged into its base model ``base``."""
    peft = treadle_peft.require_peft()
    model, tokenizer = load_model(base, seed=seed)
    return peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload(), tokenizer


def load_any_model(spec: str, base_dir: Path = Path(".")):
    """``(model, tokenizer)`` of anything treadle loads (``treadle eval MODEL``): ``toy:<size>``, a model folder, a
    Hub id, a ``.gguf`` file, a run folder (its final model) or one of its ``checkpoint-N`` folders, or a LoRA
    adapter folder (merged into its base, as ``treadle merge`` does, in memory)."""
    spec = model_spec(spec, base_dir)
    folder = Path(spec)
    if folder.is_dir() and (folder / "adapter_config.json").is_file():
        with open(folder / "adapter_config.json") as f:
            base = json.load(f).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{folder / 'adapter_config.json'} names no base_model_name_or_path to load it on")
        seed = 0
        if (folder / "training_args.json").is_file():  # a toy base is rebuilt from the run's seed
            seed = json.loads((folder / "training_args.json").read_text()).get("seed", 0)
        return load_adapter_folder(spec, base, seed)
    if folder.is_dir() and not (folder / "config.json").is_file():
        checkpoints = sorted(p.name for p in folder.glob("checkpoint-*") if p.is_dir())
        raise ValueError(
            f"{spec} holds no model (config.json) nor adapter (adapter_config.json)"
            + (f"; name one of its checkpoints: {', '.join(checkpoints[-3:])}" if checkpoints else "")
        )
    return load_model(spec)


# ---- reward functions
def load_reward_funcs(spec, base_dir: Path = Path(".")) -> list[RewardFunction]:
    """Callables from dotted paths (``package.module.function``), ``file.py:function`` (a path relative to
    the working directory or ``base_dir``) or ``model:PATH_OR_ID`` (a reward model saved by ``treadle train``
    with ``trainer: reward``, or a Hub id: ``rewards.from_reward_model``), as a config names them. ValueError
    names what is missing."""
    if not spec:
        raise ValueError(
            "the grpo trainer needs reward_funcs: a list of dotted paths to functions, e.g. "
            "[treadle.toy.addition_reward]"
        )
    specs = [spec] if isinstance(spec, str) else list(spec)
    return [
        _reward_model(str(s), base_dir) if str(s).startswith("model:") else _import_callable(str(s), base_dir)
        for s in specs
    ]


def _reward_model(spec: str, base_dir: Path) -> RewardFunction:
    name = spec.removeprefix("model:")
    path = existing_path(name, base_dir)  # a folder beside the config, as other paths are; else a Hub id
    try:
        return from_reward_model(str(path) if path is not None else name)
    except ValueError as error:
        raise ValueError(f"reward model {spec}: {error}") from None


def _import_callable(spec: str, base_dir: Path):
    if ":" in spec:
        file, _, name = spec.rpartition(":")
        path = existing_path(file, base_dir)
        if path is None:
            raise ValueError(f"reward function {shorten(spec)}: file {shorten(file)} not found")
        if path.suffix != ".py" or not path.is_file():
            raise ValueError(
                f"reward function {shorten(spec)}: {shorten(file)} is not a Python file; name a .py file "
                f"and a function in it (rewards.py:my_reward), or a dotted path (package.module.function)"
            )
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except SyntaxError as error:
            raise ValueError(
                f"reward function {spec}: {path} line {error.lineno}: {error.msg}; fix the file"
            ) from error
        except Exception as error:  # the file's own code failed at import: the user's to fix, not treadle's
            raise ValueError(
                f"reward function {spec}: importing {path} raised {type(error).__name__}: {error}; fix "
                f"the file (--debug shows the traceback)"
            ) from error
    else:
        module_name, _, name = spec.rpartition(".")
        try:
            module = importlib.import_module(module_name) if module_name else None
        except (ImportError, SyntaxError) as error:
            raise ValueError(f"reward function {spec}: cannot import {module_name} ({error})") from error
        if module is None:
            raise ValueError(
                f"reward function {spec!r} must be a dotted path (package.module.function) or file.py:function"
            )
    fn = getattr(module, name, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:10]
        raise ValueError(
            f"reward function {shorten(spec)}: {module.__name__} has no function {name!r}; its functions: {names}"
        )
    return fn
