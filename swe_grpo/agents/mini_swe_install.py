"""Builds the mini-swe-agent bundle: a Python that runs in any x86-64 Linux sandbox, with mini-swe-agent.

`python -m swe_grpo.agents.mini_swe_install DIR` (run by `scripts/setup.sh`) copies the running interpreter's
CPython (its binary, its standard library but the test suite and Tk, and every shared library they and the
installed packages load, the dynamic loader and glibc included) into DIR, then installs the pinned
mini-swe-agent requirements into its site-packages and byte-compiles everything (the bundle is mounted
read-only). Nothing comes from outside the package registries: the portable CPython builds on npm download
their binaries from elsewhere at install time. Inside a sandbox the Python runs through the bundle's own
loader (`mini_swe.python_argv`), so it does not depend on what the task image has; the commands the agent
runs use the image's own tools.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REQUIREMENTS = Path(__file__).with_name("mini_swe_requirements.txt")
LOADER = "ld-linux-x86-64.so.2"
PY_VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"
# The standard library's parts no agent needs (the test suite alone is ~30 MB; Tk needs X11).
_SKIP_STDLIB = {"site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip"}


class BundleBuildError(RuntimeError):
    """The bundle could not be built (a shared library not found, pip failing, ...)."""


def _shared_libraries(binaries: list[Path], inside: Path) -> dict[str, Path]:
    """soname -> host path of every shared library `binaries` load (by `ldd`), but those in `inside`."""
    found: dict[str, Path] = {}
    for binary in binaries:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if "not found" in line:
                raise BundleBuildError(f"{binary}: {line.strip()}")
            match = re.match(r"\s*(\S+) => (/\S+)", line) or re.match(r"\s*(/\S+/(ld-linux\S+))", line)
            if match is None:
                continue
            name, path = (match.group(1), Path(match.group(2))) if "=>" in line else (LOADER, Path(match.group(1)))
            if not path.resolve().is_relative_to(inside):
                found[name] = path
    return found


def build(dest: Path) -> None:
    """Build the bundle in `dest` (its `python/` and `lib/` replaced whole)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    python_dir, lib_dir = dest / "python", dest / "lib"
    for part in (python_dir, lib_dir):
        shutil.rmtree(part, ignore_errors=True)
    binary = python_dir / "bin" / PY_VERSION
    binary.parent.mkdir(parents=True)
    shutil.copy2(Path(sys.base_prefix) / "bin" / PY_VERSION, binary)
    target_stdlib = python_dir / "lib" / PY_VERSION
    shutil.copytree(
        stdlib,
        target_stdlib,
        ignore=lambda d, names: [n for n in names if (Path(d) == stdlib and n in _SKIP_STDLIB) or "tkinter" in n],
    )
    site = target_stdlib / "site-packages"
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--no-compile"]
    if subprocess.run([*pip, "--no-deps", "--target", str(site), "-r", str(REQUIREMENTS)]).returncode != 0:
        raise BundleBuildError(f"pip could not install {REQUIREMENTS} into {site}")
    objects = [binary, *python_dir.rglob("*.so"), *python_dir.rglob("*.so.*")]
    lib_dir.mkdir()
    for name, path in _shared_libraries(objects, python_dir.resolve()).items():
        shutil.copy2(path.resolve(), lib_dir / name)
    # Byte-compile with the bundle's own Python as it will run (checks that it does), so a read-only
    # mount never recompiles; timestamps are kept by copy2, so the caches stay valid.
    compile_ = [str(lib_dir / LOADER), "--library-path", str(lib_dir), str(binary), "-I", "-m", "compileall"]
    # Test data directories hold deliberately invalid Python (lib2to3's Python 2 samples): not compiled.
    if subprocess.run([*compile_, "-q", "-j", "0", "-x", "/tests?/", str(python_dir / "lib")]).returncode != 0:
        raise BundleBuildError(f"the bundle's Python in {dest} cannot byte-compile its library")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.executable} -m swe_grpo.agents.mini_swe_install DIR")
    build(Path(sys.argv[1]).resolve())
