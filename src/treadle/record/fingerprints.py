"""What a checkpoint provably is: treadle's marker file and the content fingerprints in it, and the fingerprint of
the settings that shaped its run.

Every checkpoint folder treadle writes holds ``treadle_checkpoint.json`` (written after every other file, inside
the same atomic save): the SHA-256 of each file of the folder, and the fingerprint of the dataset the run trained
on (``streaming.sampled_dataset_fingerprint``). It serves twice:

- ``overwrite_output_dir`` deletes a ``checkpoint-<step>`` folder only when this marker is there and lists every
  file the folder holds (a folder named like a checkpoint that holds anything else is not treadle's);
- resuming verifies it (``verify``): a weights file swapped with an earlier checkpoint's, an edited
  ``trainer_state.json`` or a different dataset of the same length is refused, naming the file (or the dataset)
  and the override, ``ignore_checkpoint_fingerprints: true``.

The settings that shape the trained weights (``config_fingerprint``: all but the cadence, length and output of a
run) are fingerprinted in ``trainer_state.json``; a resumed run names those that changed since its checkpoint
(``changed_settings``).

A leaf: hashlib and json only.
"""

from __future__ import annotations

import hashlib
import json
import os

MARKER = "treadle_checkpoint.json"
CHUNK = 1 << 20


def file_digest(path: str) -> str:
    """The SHA-256 of one file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def folder_files(folder: str) -> list[str]:
    """Every file below ``folder`` as a relative path with ``/``, sorted; symbolic links are never followed
    (a link is listed as a file, so it never matches a marker's digests)."""
    found = []
    for root, dirs, files in os.walk(folder):
        rel = os.path.relpath(root, folder)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return sorted(found)


def folder_digests(folder: str) -> dict[str, str]:
    """relative path -> SHA-256 of every file below ``folder`` but the marker."""
    return {rel: file_digest(os.path.join(folder, rel)) for rel in folder_files(folder) if rel != MARKER}


# --- a run's settings: their fingerprint (in trainer_state.json) and those changed since a checkpoint (on resume)
# settings that do not shape the trained weights: a resumed run may change them without a note
NOT_FINGERPRINTED = frozenset(
    {
        "output_dir",
        "run_name",
        "overwrite_output_dir",
        "max_steps",
        "num_train_epochs",
        "logging_strategy",
        "logging_steps",
        "logging_first_step",
        "eval_strategy",
        "eval_steps",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "save_only_model",
        "load_best_model_at_end",
        "report_to",
        "disable_tqdm",
        "per_device_eval_batch_size",
        "prediction_loss_only",
        "dataloader_num_workers",
        "dataloader_pin_memory",
        "ddp_timeout",
        "skip_nonfinite_steps",
        "ignore_checkpoint_fingerprints",
        "keep_freed_memory",
    }
)


def fingerprinted_settings(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k not in NOT_FINGERPRINTED}


def config_fingerprint(args) -> str | None:
    """A short hash of the settings of ``args`` that shape the trained weights (not its cadence or length);
    None for arguments that are not a TrainingArguments."""
    if not hasattr(args, "to_dict"):
        return None
    text = json.dumps(fingerprinted_settings(args.to_dict()), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def changed_settings(saved: dict, args) -> list[str]:
    """``name: old -> new`` for each fingerprinted setting of ``args`` that differs from ``saved`` (a
    checkpoint's training_args.json)."""
    now = fingerprinted_settings(json.loads(args.to_json_string()))
    return [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in sorted(now.items()) if k in saved and saved[k] != v]


def write_marker(folder: str, dataset: str | None = None) -> None:
    """Write ``folder/treadle_checkpoint.json``: the digests of every other file in it, and ``dataset``."""
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump({"treadle_checkpoint": 1, "files": folder_digests(folder), "dataset": dataset}, f, indent=1)
        f.write("\n")


def read_record(path: str, kind: str) -> dict | None:
    """The JSON object treadle wrote at ``path`` with ``{kind: 1}`` in it (a checkpoint marker, a run manifest);
    None when there is none, it is a link (never followed), unreadable, or of another shape."""
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get(kind) == 1 else None


def read_marker(folder: str) -> dict | None:
    """The marker of ``folder``, None when there is none or it is not treadle's (unreadable, another shape)."""
    marker = read_record(os.path.join(folder, MARKER), "treadle_checkpoint")
    return marker if marker is not None and isinstance(marker.get("files"), dict) else None


def foreign_files(folder: str) -> list[str] | None:
    """The files of checkpoint ``folder`` that its marker does not list; None when it has no marker."""
    marker = read_marker(folder)
    if marker is None:
        return None
    return [rel for rel in folder_files(folder) if rel != MARKER and rel not in marker["files"]]


def verify(folder: str, dataset: str | None = None) -> list[str]:
    """What in checkpoint ``folder`` differs from its marker: files changed, missing or added, and the dataset
    (when both it and the marker's are known). [] when all matches; ``["no marker"]`` without one."""
    marker = read_marker(folder)
    if marker is None:
        return [f"no {MARKER}"]
    recorded, now = marker["files"], folder_digests(folder)
    problems = [
        f"{rel} changed since it was saved" for rel in sorted(recorded) if rel in now and now[rel] != recorded[rel]
    ]
    problems += [f"{rel} is missing" for rel in sorted(set(recorded) - set(now))]
    problems += [f"{rel} was added" for rel in sorted(set(now) - set(recorded))]
    if dataset and marker.get("dataset") and dataset != marker["dataset"]:
        problems.append("the training dataset differs from the one it trained on (other rows)")
    return problems
