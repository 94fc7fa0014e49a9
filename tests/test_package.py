"""``import treadle``, and the import of every module of it, changes nothing of the process: not glibc's allocator,
not torch's threads, not a signal handler, not logging, not the environment. The process's policy is its owner's
(treadle.allocator: the ``treadle`` command, ``Trainer.train``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_allocator import MiB, probe

SNAPSHOT = """
import json, logging, os, signal, sys
import torch, transformers, datasets  # treadle's dependencies: what they do at import is theirs


def snapshot():
    root = logging.getLogger()
    return {
        "threads": [torch.get_num_threads(), torch.get_num_interop_threads()],
        "signals": {name: repr(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGTERM", "SIGHUP")},
        "logging": [root.level, [type(h).__name__ for h in root.handlers], logging.getLogger("transformers").level],
        "environ": dict(os.environ),
        "excepthook": repr(sys.excepthook),
    }
"""

IMPORT_ALL = (
    SNAPSHOT
    + """
before = snapshot()
import importlib, pkgutil, treadle
names = [m.name for m in pkgutil.walk_packages(treadle.__path__, "treadle.") if m.name not in ("treadle.__main__",)]
for name in names:
    importlib.import_module(name)
print(json.dumps({"before": before, "after": snapshot(), "modules": len(names)}))
"""
)


def test_importing_every_module_changes_nothing_of_the_process():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TREADLE_KEEP", "MALLOC_"))}
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL], env=env, capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["modules"] > 80  # every module was imported
    assert seen["after"] == seen["before"]


def test_importing_every_module_leaves_glibcs_allocator_as_it_was():
    """A 64 MiB block is mapped afresh by glibc's defaults and handed back when freed: so after the imports too."""
    setup = "import importlib, pkgutil, treadle\n" + (
        "for m in pkgutil.walk_packages(treadle.__path__, 'treadle.'):\n"
        "    if m.name != 'treadle.__main__':\n"
        "        importlib.import_module(m.name)\n"
    )
    block = probe(setup)
    assert block["mapped"] >= 64 * MiB and block["kept"] < MiB, block
