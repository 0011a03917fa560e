"""An agent shipped as an npm package with a native linux-x64 binary (OpenCode, Codex, Claude Code): the host
directory `scripts/setup.sh` installs it into, found and checked once, then mounted read-only into sandboxes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Self


class BundleError(RuntimeError):
    """An agent's bundle is missing or incomplete (each agent raises a subclass of its own)."""


@dataclass(frozen=True)
class NpmBundle:
    """A host directory holding an agent's npm package and its linux-x64 binary, as `at` found it: the binary's
    path relative to `root` and the package's `version`. A subclass names the package, where its binary may be,
    how to name it in an error, and the variable that points at another directory."""

    root: Path
    binary: str
    version: str

    PACKAGE: ClassVar[str]  # the npm package, e.g. "@openai/codex"
    BINARIES: ClassVar[tuple[str, ...]]  # where its binary may be, relative to the root, in order
    LABEL: ClassVar[str]  # the agent's name in messages
    DIR_ENV: ClassVar[str]  # the variable that points rollouts at another install
    ERROR: ClassVar[type[BundleError]] = BundleError

    @classmethod
    def at(cls, root: Path) -> Self:
        """The bundle in `root`. Raises `ERROR` when the package or its binary is missing there."""
        package = root / "node_modules" / cls.PACKAGE / "package.json"
        binary = next((b for b in cls.BINARIES if (root / b).is_file()), None)
        if not package.is_file() or binary is None:
            raise cls.ERROR(
                f"{cls.LABEL} is not installed in {root} (no {cls.PACKAGE} with its linux-x64 binary); "
                f"run `bash scripts/setup.sh` (or set {cls.DIR_ENV})"
            )
        return cls(root, binary, json.loads(package.read_text())["version"])
