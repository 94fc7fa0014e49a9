"""The package's layout (docs/architecture.md), checked on the source with ``ast``: the layers written on the
architecture page (a file imports only its own layer and the layers before it; a folder's files share one layer), no
import cycle between files nor between rooms (imports inside functions count), imports at module top, and every file
and function small enough to read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "treadle"
PAGE = SRC.parent / "docs" / "architecture.md"
# the entry point whose imports inside functions are deliberate: each command imports what it needs (torch and
# transformers cost seconds). (treadle/__init__.py loads its public names lazily by module name, PEP 562.)
LAZY_IMPORTERS = {"treadle.cli.command", "treadle.cli.registry"}
LEAVES = {
    "treadle.errors": set(),
    "treadle.record.runfiles": {"treadle.errors"},
    "treadle.arguments": {"treadle.optim", "treadle.distributed"},  # a config imports only its validators
    "treadle.trainers.onpolicy.config": {
        "treadle.arguments",
        "treadle.errors",
        "treadle.engines.options",
        "treadle.generation.sampling",
        "treadle.generation.single",
        "treadle.generation.static",  # DecodeSettings validates cache_implementation
    },
    "treadle.trainers.grpo.config": {
        "treadle.trainers.onpolicy.config",
        "treadle.arguments",
        "treadle.errors",
        "treadle.losses",
    },
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(name: str) -> str | None:
    """The treadle module an import names (``treadle.losses.dpo_loss`` -> ``treadle.losses``, ``treadle`` itself: the
    package's ``__init__``), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported treadle module, line, inside a function) for every import statement of ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in child.names]
            for name in names:
                target = resolve(name)
                if target is not None and target != module:
                    found.append((target, child.lineno, in_function))
            visit(child, inside)

    visit(tree, False)
    return found


GRAPH = {m: {target for target, _, _ in imports(m)} for m in MODULES}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan): the import cycles of ``graph``."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def cycles() -> list[list[str]]:
    """The import cycles between files."""
    return strongly_connected(GRAPH)


def room(module: str) -> str:
    """A module's room: the top-level module or folder of treadle it belongs to (``treadle.trainers.grpo.trainer`` ->
    ``trainers``; the package's own ``__init__``: ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def room_graph() -> dict[str, set[str]]:
    """Rooms and the rooms each imports (an import inside a function counts)."""
    graph: dict[str, set[str]] = {room(m): set() for m in GRAPH}
    for module, targets in GRAPH.items():
        graph[room(module)] |= {room(t) for t in targets} - {room(module)}
    return graph


def test_the_checker_sees_imports_inside_functions_and_finds_cycles():
    assert resolve("treadle.losses.dpo_loss") == "treadle.losses" and resolve("torch") is None
    inside_functions = {(target, inside) for target, _, inside in imports("treadle.cli.command")}
    assert ("treadle.resume", True) in inside_functions
    saved = {module: set(targets) for module, targets in GRAPH.items()}
    try:
        GRAPH["treadle.errors"].add("treadle.record.runfiles")  # runfiles imports errors: now a circle
        assert ["treadle.errors", "treadle.record.runfiles"] in cycles()
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def test_no_import_cycle():
    assert cycles() == []


def test_the_room_checker_finds_a_cycle_through_different_files():
    assert room("treadle.trainers.grpo.trainer") == "trainers" and room("treadle") == "__init__"
    assert room("treadle.callbacks") == "callbacks"
    saved = {module: set(targets) for module, targets in GRAPH.items()}
    try:
        # cli.loading imports demos.toy; demos.real importing cli.report would make a circle of rooms, no file circle
        GRAPH["treadle.demos.real"].add("treadle.cli.report")
        assert cycles() == [] and ["cli", "demos"] in strongly_connected(room_graph())
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def test_no_import_cycle_between_rooms():
    """Each top-level module and each top-level folder is a room: no two import each other, however far round."""
    assert strongly_connected(room_graph()) == []


def layers(page: str) -> dict[str, tuple[int, str]]:
    """``{module: (layer number, layer title)}`` from the page's ``### N. Title`` headings and the ``- `file.py`:``
    entries under each."""
    found, layer = {}, None
    for line in page.splitlines():
        heading = re.match(r"^### (\d+)\. (.*)$", line)
        if heading:
            layer = (int(heading.group(1)), heading.group(2))
            continue
        if line.startswith("## "):
            layer = None
        entry = re.match(r"^- `([\w/]+\.py)`:", line)
        if entry and layer is not None:
            found[module_name(PACKAGE / entry.group(1))] = layer
    return found


LAYERS = layers(PAGE.read_text())
RUN_SIDE = {module for module, (number, _) in LAYERS.items() if number == max(n for n, _ in LAYERS.values())}


def upward_imports(module: str) -> list[str]:
    """The imports of ``module`` that reach a higher layer than its own, as ``target (layer N)``."""
    own = LAYERS[module][0]
    return [f"{target} (layer {LAYERS[target][0]})" for target in sorted(GRAPH[module]) if LAYERS[target][0] > own]


def test_the_layer_reader_follows_the_page_and_the_rule_fails_an_upward_import():
    page = "### 1. Low\n- `errors.py`: x\n### 2. High\n- `trainer.py`: y\n## Other\n- `cli/command.py`: z\n"
    assert layers(page) == {"treadle.errors": (1, "Low"), "treadle.trainer": (2, "High")}
    assert LAYERS["treadle.errors"][0] == 1 and "treadle.cli.command" in RUN_SIDE
    assert "treadle.trainer" not in RUN_SIDE and len({n for n, _ in LAYERS.values()}) >= 6
    saved = set(GRAPH["treadle.errors"])
    try:
        GRAPH["treadle.errors"].add("treadle.trainer")
        assert upward_imports("treadle.errors") == [f"treadle.trainer (layer {LAYERS['treadle.trainer'][0]})"]
    finally:
        GRAPH["treadle.errors"] = saved


def test_every_module_has_a_layer():
    assert sorted(set(MODULES) - set(LAYERS)) == []


FOLDERS = sorted({room(m) for m in MODULES if MODULES[m].parent != PACKAGE})


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_file_of_a_folder_sits_in_one_layer(folder):
    found = {m: LAYERS[m][0] for m in MODULES if room(m) == folder and m in LAYERS}
    assert len(set(found.values())) == 1, f"{folder}/ spans layers {found}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_reach_only_the_same_or_lower_layers(module):
    assert upward_imports(module) == [], f"{MODULES[module]} is in layer {LAYERS[module]}"


@pytest.mark.parametrize("module", sorted(set(MODULES) - RUN_SIDE))
def test_the_core_never_imports_the_run_side(module):
    assert sorted(GRAPH[module] & RUN_SIDE) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_of_treadle_sit_at_the_module_top(module):
    inside = [(target, line) for target, line, in_function in imports(module) if in_function]
    if module not in LAZY_IMPORTERS:
        assert inside == [], f"{MODULES[module]}: imports inside functions {inside}"
        return
    lines = MODULES[module].read_text().splitlines()
    unexplained = [line for _, line in inside if "#" not in lines[line - 1]]
    assert unexplained == [], f"{MODULES[module]}: an import inside a function says why on its line: {unexplained}"


@pytest.mark.parametrize("module", sorted(LEAVES))
def test_leaves_import_only_their_own_validators(module):
    assert GRAPH[module] <= LEAVES[module]


def function_bodies(tree) -> list[tuple[str, int, int]]:
    """(name, line, body lines without the docstring) of every function."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            if body:
                out.append((node.name, node.lineno, body[-1].end_lineno - body[0].lineno + 1))
    return out


@pytest.mark.parametrize("module", sorted(MODULES))
def test_files_and_functions_stay_readable(module):
    path = MODULES[module]
    lines = len(path.read_text().splitlines())
    assert lines <= (500 if module == "treadle.trainer" else 600), f"{path}: {lines} lines"
    long = [(name, line, n) for name, line, n in function_bodies(ast.parse(path.read_text())) if n > 50]
    assert long == [], f"{path}: function bodies over 50 lines {long}"


def test_the_architecture_page_lists_every_file():
    page = PAGE.read_text()
    listed = set(re.findall(r"^- `([\w/]+\.py)`:", page, flags=re.MULTILINE))
    files = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    assert sorted(files - listed) == [], "files docs/architecture.md does not list"
    assert sorted(listed - files) == [], "files docs/architecture.md lists that are gone"
