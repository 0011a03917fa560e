"""Which paths a patch may not change (`is_protected`), and what the test runner imports (`RunnerImports`,
measured per task by the grader's probe), so that a patch cannot edit tests, configure the runner or
shadow what it imports: every protected path keeps its `base_commit` (or test-patch) contents."""

from __future__ import annotations

import ast
import doctest
import itertools
import shlex
import sys
from collections.abc import Collection
from dataclasses import dataclass

# --- which paths a patch may not change --------------------------------------------------------------

_RUNNER_CONFIG = frozenset(
    {"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg"}
    | {"pyproject.toml", "sitecustomize.py", "usercustomize.py", ".gitattributes"}
)
# Only when the probe reports nothing (a runner that is not Python, user site-packages disabled): pytest
# and some of what it imports besides the standard library (pytest 7 also imports `attr`, for one).
_FALLBACK_RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging"})


@dataclass(frozen=True)
class RunnerImports:
    """Where a patch could shadow what the test runner imports: `search_dirs` are the repository
    directories on the runner's `sys.path` ("" = the root), `names` the top-level modules it loads from
    OUTSIDE the repository. Measured per grade by a probe run (see `grade`); the standard library and
    names starting with "pytest" are always in, whatever the probe saw (they are imported lazily)."""

    search_dirs: frozenset[str] = frozenset({""})
    names: frozenset[str] = _FALLBACK_RUNNER_MODULES

    def shadows(self, path: str) -> bool:
        """Whether `path` would be a top-level module (`name.py`, `name.so`, `name/__init__.*`) in a
        search directory, named like a module the runner loads from outside the repository."""
        for directory in self.search_dirs:
            if directory and not path.startswith(directory + "/"):
                continue
            parts = (path[len(directory) + 1 :] if directory else path).lower().split("/")
            if len(parts) == 1 and parts[0].endswith((".py", ".so")):
                module = parts[0].split(".")[0]
            elif len(parts) == 2 and parts[1].split(".")[0] == "__init__":
                module = parts[0]
            else:
                continue
            if module in self.names or module in sys.stdlib_module_names or module.startswith("pytest"):
                return True
        return False


def is_protected(path: str, explicit: Collection[str] = (), runner: RunnerImports = RunnerImports()) -> bool:
    """Whether a patch may not add, change or delete `path` (relative to the repository root, "/"-separated).

    Protected: (1) `explicit` paths (the files the test patch touches, the test files and non-Python
    doctest files the test ids name, the scripts `test_cmd` names), their parent directories and anything
    under them; (2) test code by name: a directory component starting with "test" (tests/, testing/,
    test-data/...) or equal to "e2e", a file named test_*, *_test.py, *_tests.py or tests.py; (3)
    test-runner configuration and interpreter start-up hooks at any depth: conftest.py, pytest.ini,
    .pytest.ini, pytest.toml, .pytest.toml, tox.ini, setup.cfg, pyproject.toml, sitecustomize.py,
    usercustomize.py, .gitattributes, *.pth; (4) bytecode and package metadata: *.pyc, *.pyo,
    __pycache__/, *.dist-info/, *.egg-info/, *.egg-link; (5) a module that would shadow one the runner
    imports (`runner.shadows`)."""
    for protected in explicit:
        if path == protected or path.startswith(protected + "/") or protected.startswith(path + "/"):
            return True
    parts = path.lower().split("/")
    *dirs, name = parts
    if any(part.startswith("test") or part == "e2e" for part in dirs):
        return True
    if name.startswith("test_") or name.endswith(("_test.py", "_tests.py")) or name == "tests.py":
        return True
    if name in _RUNNER_CONFIG or name.endswith((".pth", ".pyc", ".pyo", ".egg-link")):
        return True
    if any(part == "__pycache__" or part.endswith((".dist-info", ".egg-info")) for part in dirs):
        return True
    return runner.shadows(path)


def _test_file(test_id: str) -> str:
    return test_id.split("::", 1)[0]


def doctest_examples(source: str) -> list[tuple[str, str]]:
    """The (source, expected output) of every doctest example in the docstrings of a Python module's
    text (the module's, its classes' and functions'), in order; a module that does not parse gives its
    whole text, so any change to it counts as a change."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return [(source, "")]
    parser = doctest.DocTestParser()
    examples = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            try:
                examples += [(e.source, e.want) for e in parser.get_examples(docstring or "")]
            except ValueError:  # malformed examples: the docstring itself is what must not change
                examples.append((docstring or "", ""))
    return examples


def command_words(test_cmd: str) -> list[str]:
    """The words of `test_cmd` that could name a file in the repository (not options, assignments or
    variables), as repository-relative paths; `-m pkg.mod` gives pkg/mod.py."""
    try:
        words = shlex.split(test_cmd)
    except ValueError:
        words = test_cmd.split()
    paths = []
    for before, word in itertools.pairwise(["", *words]):
        if before == "-m":
            paths.append(word.replace(".", "/") + ".py")
        elif not word.startswith(("-", "/")) and "=" not in word and "$" not in word:
            paths.append(word.removeprefix("./"))
    return paths
