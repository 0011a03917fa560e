"""The shape of the package, checked: which room may import which, no circles, no module over 500 lines,
and only the data path and its face at the top level. Every import counts, also those inside functions,
under `TYPE_CHECKING`, the names a package loads lazily (`_LAZY`) and the `module:Class` strings of a plug-in
registry (`BACKENDS`, `AGENTS`): a function-local import is how a circle hides, and a string is how an arrow
hides, so the data path imports nothing by any other string.

The layers, lowest first (a room may import rooms on lower layers, never one on its own layer or above):

    types, paths, plugins, _compat, console (where the commands print)
    tasks | tokens
    sandbox | serving    (the model server knows no sandbox: it serves the door's socket it is handed)
    agents | grading     (an agent runs in a sandbox, the grader runs tests in one; neither knows the other)
    rollout | synth (tasks made from a project's code)
    evaluation (a checkpoint on held-out tasks)
    worker (its held-out eval while training reuses evaluation's arithmetic)
    cli, swe_grpo/__init__ (the face)

This is the design's line, types -> tokens -> sandbox -> serving -> agents -> grading -> rollout -> worker -> cli, with
rooms that need nothing of each other set side by side, so that the rule also says what they must not know:
serving no sandbox (nor a sandbox the server), agents no grading. Rooms side by side inside a room
(`SIDE_BY_SIDE`: the sandbox backends, the agent harnesses) import nothing of each other either: what two of them
share lives in the room beside them.

`extras`, `testing` and `demo` stand beside the data path: they may import it, it never imports them
(only the face may, to offer `swe-grpo demo`). `_compat` keeps old paths working: the face installs it, and
only it and the rooms beside the data path import it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "swe_grpo"
SKIP = PACKAGE / "demo" / "tasks" / "src"  # the demo tasks' own repositories, not our code
MAX_LINES = 500

LAYERS = [
    {"types", "paths", "plugins", "_compat", "console"},
    {"tasks", "tokens"},
    {"sandbox", "serving"},
    {"agents", "grading"},
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
#: Parts of a room that stand side by side: none imports another (a part is a module and the modules under it).
SIDE_BY_SIDE = {
    "sandbox backends": ("swe_grpo.sandbox.local", "swe_grpo.sandbox.docker", "swe_grpo.sandbox.hf"),
    "agent harnesses": ("swe_grpo.agents.pi", "swe_grpo.agents.mini_swe"),
}
#: Calls that import by a string the import graph cannot see.
STRING_IMPORTS = {"import_module", "__import__", "moved_name"}
#: The one module of the data path that imports by a string: the plug-in loader, which imports the dotted path
#: it is given (the built-in registries' `module:Class` strings count as imports where they are written).
PLUGIN_LOADER = "swe_grpo.plugins"
_REGISTRY_ENTRY = re.compile(r"(swe_grpo(?:\.\w+)+):\w+(?:\.\w+)*")


@dataclass
class Tree:
    """A package's modules by name, and the swe_grpo modules each imports (`imported`)."""

    modules: dict[str, Path]
    lazy: dict[str, dict[str, str]] = field(default_factory=dict)
    graph: dict[str, set[str]] = field(default_factory=dict)

    @classmethod
    def read(cls, package: Path) -> Tree:
        """The package in `package` (a directory named `swe_grpo`)."""
        tree = cls(dict(modules(package)))
        tree.lazy = {name: lazy_names(path) for name, path in tree.modules.items() if path.name == "__init__.py"}
        tree.graph = {name: imported(tree, name, path) for name, path in tree.modules.items()}
        return tree


def modules(package: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(package.rglob("*.py")):
        if SKIP in path.parents:
            continue
        parts = path.relative_to(package.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def lazy_names(path: Path) -> dict[str, str]:
    """A package's `_LAZY = {name: module}`: the names its `__getattr__` imports on first use."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def imported(tree: Tree, name: str, path: Path) -> set[str]:
    """The swe_grpo modules `name` imports anywhere in its source (`from a import b` counts `a.b` when that
    is a module, the module that `a` loads `b` from lazily when it does, else `a`), the modules it loads lazily
    and those its plug-in registry names (`"swe_grpo.x.y:Class"`)."""
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
            lazy = tree.lazy.get(base, {})
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in tree.modules else lazy.get(alias.name, base)
                for alias in node.names
            ]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _REGISTRY_ENTRY.fullmatch(node.value):
            targets = [node.value.partition(":")[0]]
        else:
            continue
        for target in targets:
            while target and target not in tree.modules:  # `import swe_grpo.x.y` names a module, or a name in one
                target = target.rpartition(".")[0]
            if target.startswith("swe_grpo") and target != name:
                found.add(target)
    return found | set(tree.lazy.get(name, {}).values())


def room(module: str) -> str:
    """`swe_grpo.sandbox.door` -> `sandbox`; the package's own `__init__` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def arrows(tree: Tree) -> set[tuple[str, str]]:
    """Room -> room imports."""
    return {(room(a), room(b)) for a, targets in tree.graph.items() for b in targets if room(a) != room(b)}


def wrong_way(tree: Tree, arrow: tuple[str, str]) -> str | None:
    """Why the room -> room `arrow` breaks the layers (naming the imports that make it), or None."""
    importer, target = arrow
    culprits = sorted(f"{a} -> {b}" for a, bs in tree.graph.items() for b in bs if (room(a), room(b)) == arrow)
    if importer in BESIDE:
        return None  # extras, testing and demo may use anything
    if target in BESIDE or target == "_compat":
        return None if LAYER[importer] == FACE else f"the data path imports {target}: {culprits}"
    if LAYER[target] < LAYER[importer]:
        return None
    return f"{importer} imports {target} on its own layer or above: {culprits}"


def imports_by_string(tree: Tree) -> list[str]:
    """The calls in the data path that import by a string (`importlib.import_module`, `__import__`,
    `_compat.moved_name`), as `module:line: call`; but for a lazy name's (`importlib.import_module(_LAZY[name])`,
    counted in the graph) and the plug-in loader's."""
    found = []
    for name, path in tree.modules.items():
        if room(name) in BESIDE | {"_compat"} or name == PLUGIN_LOADER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            first = node.args[0] if node.args else None
            lazy = isinstance(first, ast.Subscript) and getattr(first.value, "id", "") == "_LAZY"
            if called in STRING_IMPORTS and not lazy:
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def part_of(module: str, parts: tuple[str, ...]) -> str | None:
    return next((p for p in parts if module == p or module.startswith(f"{p}.")), None)


def across(tree: Tree) -> list[str]:
    """Imports from one part of a room to another that stands beside it (`SIDE_BY_SIDE`)."""
    found = []
    for what, parts in SIDE_BY_SIDE.items():
        for importer, targets in tree.graph.items():
            for target in targets:
                mine, theirs = part_of(importer, parts), part_of(target, parts)
                if mine and theirs and mine != theirs:
                    found.append(f"{importer} -> {target} ({what})")
    return sorted(found)


def find_circle(tree: Tree) -> list[str] | None:
    """An import circle, every import counted: a package's `__init__` that imports its module `x`, which imports
    the package's `__init__` back, is one."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        for target in sorted(tree.graph.get(name, ())):
            if circle := visit(target, [*path, name]):
                return circle
        done.add(name)
        return None

    for name in sorted(tree.graph):
        if circle := visit(name, []):
            return circle
    return None


TREE = Tree.read(PACKAGE)


def test_every_room_is_placed() -> None:
    rooms = {room(name) for name in TREE.modules}
    assert rooms <= set(LAYER) | BESIDE, f"rooms on no layer: {sorted(rooms - set(LAYER) - BESIDE)}"


@pytest.mark.parametrize("arrow", sorted(arrows(TREE)), ids=lambda a: f"{a[0]}->{a[1]}")
def test_imports_run_down_the_layers(arrow: tuple[str, str]) -> None:
    assert wrong_way(TREE, arrow) is None, wrong_way(TREE, arrow)


def test_serving_imports_no_sandbox_code() -> None:
    """The design's rule in its own words (the layers say it too): the model server serves a socket it is handed."""
    assert ("serving", "sandbox") not in arrows(TREE)


def test_no_import_circle() -> None:
    assert find_circle(TREE) is None, " -> ".join(find_circle(TREE) or [])


def test_the_data_path_imports_nothing_by_string() -> None:
    assert imports_by_string(TREE) == []


def test_parts_side_by_side_import_nothing_of_each_other() -> None:
    assert across(TREE) == []


def test_importing_the_package_loads_nothing_heavy() -> None:
    """`import swe_grpo` (what the CLI, a rollout host and `from swe_grpo import Task` pay first) imports no torch,
    transformers, TRL, vLLM or aiohttp: the package's names load on first use (its `_LAZY`)."""
    heavy = ("torch", "transformers", "trl", "vllm", "aiohttp")
    code = f"import sys, swe_grpo; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert loaded.stdout.strip() == "[]", loaded.stdout


def test_engine_never_imports_the_worker_facade() -> None:
    facade = "swe_grpo.worker.rollout_worker"
    importers = sorted(name for name, targets in TREE.graph.items() if facade in targets and room(name) == "worker")
    assert importers in ([], ["swe_grpo.worker"]), importers


@pytest.mark.parametrize("name", sorted(TREE.modules))
def test_no_module_over_500_lines(name: str) -> None:
    lines = len(TREE.modules[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{TREE.modules[name].relative_to(REPO)} has {lines} lines"


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
    for importer, target in arrows(TREE):
        if importer != "_compat":
            by_importer.setdefault(importer, set()).add(target)
    order = [r for rooms in LAYERS for r in sorted(rooms)] + sorted(BESIDE)
    rank = {r: i for i, r in enumerate(order)}
    return "".join(
        f"{importer:<11}-> {', '.join(sorted(by_importer[importer], key=rank.__getitem__))}\n"
        for importer in order
        if importer in by_importer
    )


# ----------------------------------------------------------------- each rule catches what it is for


def synthetic(tmp_path: Path, files: dict[str, str]) -> Tree:
    """A package tree made of `files` ({"sandbox/local/x.py": source}; every directory gets an `__init__.py`)."""
    package = tmp_path / "swe_grpo"
    for relative, source in {"__init__.py": "", **files}.items():
        path = package / relative
        for directory in [package, *reversed(path.relative_to(package).parents[:-1])]:
            (package / directory).mkdir(parents=True, exist_ok=True)
            (package / directory / "__init__.py").touch()
        path.write_text(source)
    return Tree.read(package)


def test_an_import_by_string_in_the_data_path_is_caught(tmp_path: Path) -> None:
    tree = synthetic(
        tmp_path,
        {
            "tasks/__init__.py": "from swe_grpo._compat import moved_name\n"
            "def __getattr__(name):\n    return moved_name(__name__, name)\n",
            "sandbox/base.py": "import importlib\nDEMO = importlib.import_module('swe_grpo.demo')\n",
            "serving/x.py": "def f():\n    return __import__('swe_grpo.worker')\n",
            "worker/__init__.py": "import importlib\n_LAZY = {'W': 'swe_grpo.worker.w'}\n"
            "def __getattr__(name):\n    return getattr(importlib.import_module(_LAZY[name]), name)\n",
            "worker/w.py": "",
            "demo/__init__.py": "import importlib\nimportlib.import_module('swe_grpo.worker')\n",
        },
    )
    # Not the lazy name, not the room beside the data path.
    assert sorted(line.split(":")[0] for line in imports_by_string(tree)) == [
        "swe_grpo.sandbox.base",
        "swe_grpo.serving.x",
        "swe_grpo.tasks",
    ]
    assert wrong_way(tree, ("tasks", "_compat")) is not None  # and the data path may not reach _compat


def test_a_registry_entry_counts_as_an_import(tmp_path: Path) -> None:
    registry = "BACKENDS = {'x': 'swe_grpo.worker.w:Backend'}\n"
    tree = synthetic(tmp_path, {"sandbox/__init__.py": registry, "worker/w.py": ""})
    assert tree.graph["swe_grpo.sandbox"] == {"swe_grpo.worker.w"}
    assert wrong_way(tree, ("sandbox", "worker")) is not None


def test_a_backend_importing_another_is_caught(tmp_path: Path) -> None:
    tree = synthetic(
        tmp_path,
        {
            "sandbox/base.py": "",
            "sandbox/local/filter.py": "from swe_grpo.sandbox.base import *\n",
            "sandbox/docker/backend.py": "from swe_grpo.sandbox.local.filter import program\n",
            "sandbox/hf.py": "from swe_grpo.sandbox import base\n",
        },
    )
    assert across(tree) == ["swe_grpo.sandbox.docker.backend -> swe_grpo.sandbox.local.filter (sandbox backends)"]


def test_a_circle_through_a_packages_init_is_caught(tmp_path: Path) -> None:
    tree = synthetic(
        tmp_path,
        {
            "sandbox/__init__.py": "from swe_grpo.sandbox.x import X\nY = 1\n",
            "sandbox/x.py": "from swe_grpo.sandbox import Y\n",
        },
    )
    assert find_circle(tree) == ["swe_grpo.sandbox", "swe_grpo.sandbox.x", "swe_grpo.sandbox"]


def test_serving_reaching_into_the_sandbox_is_caught(tmp_path: Path) -> None:
    reach = "def f():\n    from swe_grpo.sandbox.door import Door\n"
    tree = synthetic(tmp_path, {"serving/x.py": reach, "sandbox/door.py": ""})
    assert wrong_way(tree, ("serving", "sandbox")) is not None
