"""Every ```python block of README.md and docs/*.md runs: the blocks of one page in order, in one namespace
(a later block may use what an earlier one defined), in a fresh working folder, offline."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line number, code) of each ```python block of ``page``."""
    text = page.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


def test_the_block_pattern_finds_blocks_and_nothing_else(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("intro\n```python\nx = 1\n```\n```bash\nls\n```\n```python title\ny = x + 1\nz = 2\n```\n")
    assert python_blocks(page) == [(3, "x = 1\n"), (9, "y = x + 1\nz = 2\n")]


def test_the_pages_exist_and_have_code():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/sft.md", "docs/subclassing.md", "docs/callbacks.md"} <= names
    for page in PAGES:
        if page.name in ("README.md", "sft.md", "subclassing.md", "callbacks.md"):
            assert python_blocks(page), f"{page} has no python block"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_block_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    namespace = {"__name__": f"docs_{page.stem}"}
    for line, code in python_blocks(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        try:
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 - running the docs is the point
        except Exception as error:
            raise AssertionError(f"the python block at {where} failed: {type(error).__name__}: {error}") from error
