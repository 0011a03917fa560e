"""The shape of the package, checked: which room may import which, no circles, no module over 500 lines,
and only the data path and its face at the top level. Every import counts, also those inside functions
and under `TYPE_CHECKING`: a function-local import is how a circle hides.

The layers, lowest first (a room may import rooms on lower layers, never one on its own layer or above):

    types, paths, plugins, _compat, console (where the commands print)
    tasks | tokens
    sandbox
    serving | grading
    agents
    rollout | synth (tasks made from a project's code)
    evaluation (a checkpoint on held-out tasks)
    worker (its held-out eval while training reuses evaluation's arithmetic)
    cli, swe_grpo/__init__ (the face)

`extras`, `testing` and `demo` stand beside the data path: they may import it, it never imports them
(only the face may, to offer `swe-grpo demo`)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "swe_grpo"
SKIP = PACKAGE / "demo" / "tasks" / "src"  # the demo tasks' own repositories, not our code
MAX_LINES = 500

LAYERS = [
    {"types", "paths", "plugins", "_compat", "console"},
    {"tasks", "tokens"},
    {"sandbox"},
    {"serving", "grading"},
    {"agents"},
    {"rollout", "synth"},
    {"evaluation"},
    {"worker"},
    {"cli", "__init__"},
]
BESIDE = {"extras", "testing", "demo"}  # not the data path
LAYER = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}
FACE = LAYER["cli"]
TOP_LEVEL = {
    *("__init__.py", "py.typed", "types.py", "paths.py", "plugins.py", "_compat.py", "rollout.py", "cli.py"),
    "console.py",
    *("tasks", "tokens", "sandbox", "serving", "grading", "agents", "worker", "synth", "evaluation", *BESIDE),
}


def modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if SKIP in path.parents:
            continue
        parts = path.relative_to(REPO).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


MODULES = dict(modules())


def lazy_names(path: Path) -> dict[str, str]:
    """A package's `_LAZY = {name: module}`: the names its `__getattr__` imports on first use."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


LAZY = {name: lazy_names(path) for name, path in MODULES.items() if path.name == "__init__.py"}


def imported(name: str, path: Path) -> set[str]:
    """The swe_grpo modules `name` imports anywhere in its source (`from a import b` counts `a.b` when that
    is a module, the module that `a` loads `b` from lazily when it does, else `a`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            lazy = LAZY.get(base, {})
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else lazy.get(alias.name, base)
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import swe_grpo.x.y` names a module, or a name in one
                target = target.rpartition(".")[0]
            if target.startswith("swe_grpo") and target != name:
                found.add(target)
    return found | set(LAZY.get(name, {}).values())


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def room(module: str) -> str:
    """`swe_grpo.sandbox.door` -> `sandbox`; the package's own `__init__` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def arrows() -> set[tuple[str, str]]:
    """Room -> room imports."""
    return {(room(a), room(b)) for a, targets in GRAPH.items() for b in targets if room(a) != room(b)}


def test_every_room_is_placed() -> None:
    rooms = {room(name) for name in MODULES}
    assert rooms <= set(LAYER) | BESIDE, f"rooms on no layer: {sorted(rooms - set(LAYER) - BESIDE)}"


@pytest.mark.parametrize("arrow", sorted(arrows()), ids=lambda a: f"{a[0]}->{a[1]}")
def test_imports_run_down_the_layers(arrow: tuple[str, str]) -> None:
    importer, target = arrow
    culprits = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if (room(a), room(b)) == arrow)
    if importer in BESIDE:
        return  # extras, testing and demo may use anything
    if target in BESIDE:
        assert LAYER[importer] == FACE, f"the data path imports {target}: {culprits}"
        return
    assert LAYER[target] < LAYER[importer], f"{importer} imports {target} on its own layer or above: {culprits}"


def find_circle() -> list[str] | None:
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for target in sorted(GRAPH.get(name, ())):
            # A package's __init__ importing its own modules is how a package offers its names; the circle
            # that matters is between modules (a module importing its package's __init__ back counts).
            offers = MODULES[name].name == "__init__.py" and target.startswith(f"{name}.")
            if not offers and (circle := visit(target, [*path, name])):
                return circle
        done.add(name)
        return None

    for name in sorted(GRAPH):
        if circle := visit(name, []):
            return circle
    return None


def test_no_import_circle() -> None:
    assert find_circle() is None, " -> ".join(find_circle() or [])


def test_engine_never_imports_the_worker_facade() -> None:
    facade = "swe_grpo.worker.rollout_worker"
    importers = sorted(name for name, targets in GRAPH.items() if facade in targets and room(name) == "worker")
    assert importers in ([], ["swe_grpo.worker"]), importers


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_over_500_lines(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(REPO)} has {lines} lines"


def test_top_level_holds_only_the_data_path_and_its_face() -> None:
    present = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and not p.name.endswith(".egg-info")}
    assert present == TOP_LEVEL, f"unexpected: {sorted(present - TOP_LEVEL)}; missing: {sorted(TOP_LEVEL - present)}"


def test_the_drawing_in_the_development_guide_is_the_code() -> None:
    """docs/development.md draws the rooms and their arrows; the drawing is regenerated from the code by
    this test's failure message when it drifts."""
    drawn = re.search(r"<!-- arrows -->\n```\n(.*?)```", (REPO / "docs" / "development.md").read_text(), re.S)
    assert drawn, "docs/development.md has no <!-- arrows --> block"
    expected = drawing()
    assert drawn.group(1) == expected, f"redraw docs/development.md's arrows as:\n{expected}"


def drawing() -> str:
    by_importer: dict[str, set[str]] = {}
    for importer, target in arrows():
        if importer != "_compat":
            by_importer.setdefault(importer, set()).add(target)
    order = [r for rooms in LAYERS for r in sorted(rooms)] + sorted(BESIDE)
    rank = {r: i for i, r in enumerate(order)}
    return "".join(
        f"{importer:<11}-> {', '.join(sorted(by_importer[importer], key=rank.__getitem__))}\n"
        for importer in order
        if importer in by_importer
    )
