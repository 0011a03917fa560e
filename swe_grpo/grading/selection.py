"""The graded run's test selection, kept off the runner's command line and environment (issue 32 §3).

Why: the patch's code runs inside the runner and can read `sys.argv`, `/proc/self/cmdline` and
`os.environ`. Were the test ids there, a flip could spare exactly the ids the project's own files do not
explain (the canaries) and flip the rest. So the command line names only the test FILES of the selection
(the canaries live in those same files, beside the task's tests: a file list tells nothing apart), and
the ids, the task's and the canaries' in the grader's order, reach pytest through a piece of the grader's
`sitecustomize.py` (`select_source`), which runs before any repository code:

- it takes a secret file's path from the environment and, in a process that is a pytest runner by its
  own command line, reads the ids and deletes the file at once (else lazily, when pytest first calls the
  plugin below; a process that never runs pytest leaves it for the one that does);
- it registers, through `PYTEST_PLUGINS` (the one way to load a plugin that needs no argument and
  works with plugin autoload off), a module object of its own (never a file the patch could read or
  shadow) whose `pytest_load_initial_conftests` replaces the file arguments at the end of pytest's
  arguments with the ids, in place, before pytest parses them for good and before any conftest of the
  repository is imported; then it restores `PYTEST_PLUGINS` and drops the secret's variable, so a
  process started later inherits neither.

Why this and not the alternatives: an `@argsfile` leaves its path on argv and needs pytest >= 8.2; a
`-p plugin` on the command line makes pytest fail where the plugin is not importable (a runner started
by absolute path, which the grader's shims do not reach); deselecting in `pytest_collection_modifyitems`
changes the summary's counts. Here, a runner that the boot does not reach runs the whole of each file
(a superset: every selected test still runs); the probe sees that and the task's graded runs then put
the ids on the command line, without canaries (`swe_grpo.grading.probe`).

What stays visible: the file list, and each test's own id while it runs (`PYTEST_CURRENT_TEST`, a
traceback): the canaries' names and places are shaped like the project's for that reason
(`swe_grpo.grading.canaries`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

SELECT_ENV = "SWE_GRPO_SELECT"

_SELECT = r"""
def _swe_grpo_select():
    import os, sys

    if not os.environ.get("SWE_GRPO_SELECT"):
        return
    name, before = "_swe_grpo_selection", os.environ.get("PYTEST_PLUGINS")
    held = []

    def claim():
        path = os.environ.pop("SWE_GRPO_SELECT", "")
        if not path or held:
            return
        try:
            with open(path, encoding="utf-8") as f:
                import json

                held.append(json.load(f))
            os.unlink(path)
        except (OSError, ValueError):
            return

    def pytest_load_initial_conftests(early_config, parser, args):
        claim()
        if before is None:
            os.environ.pop("PYTEST_PLUGINS", None)
        else:
            os.environ["PYTEST_PLUGINS"] = before
        if not held:
            return
        selection = held.pop()
        files, ids = selection["files"], selection["ids"]
        if files and args[-len(files):] == files:
            args[-len(files):] = ids

    # The docstring's mark keeps pytest from warning that it cannot rewrite a module already imported
    # (a warning that `-W error` would turn into a failed start).
    plugin = type(sys)(name, "PYTEST_DONT_REWRITE: the grader's test selection")
    plugin.pytest_load_initial_conftests = pytest_load_initial_conftests
    sys.modules[name] = plugin
    os.environ["PYTEST_PLUGINS"] = ",".join(p for p in (before, name) if p)
    if any("pytest" in os.path.basename(arg) for arg in getattr(sys, "orig_argv", [])[:3]):
        claim()


_swe_grpo_select()
del _swe_grpo_select
"""


def select_source() -> str:
    """The piece of the grader's `sitecustomize.py` that hands the selection to pytest (runs before the boot)."""
    return _SELECT


def selection_files(ids: Sequence[str]) -> list[str]:
    """The files the runner's command line names for `ids`: each id's file, once, in order."""
    return list(dict.fromkeys(test_id.split("::", 1)[0] for test_id in ids))


def selection_secret(ids: Sequence[str]) -> str:
    """The secret file's text: the file arguments to replace and the ids to put in their place."""
    return json.dumps({"files": selection_files(ids), "ids": list(ids)})
