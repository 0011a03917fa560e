"""A project's test environment: what its tests need installed, and (for `docker`) an image that has it.

`requirements(tree)` reads what the project declares: its runtime requirements and those of a test extra
(`test`, `tests` or `testing`), from the sdist's `PKG-INFO` (`Requires-Dist`), else from `pyproject.toml`
(`[project]` dependencies, optional dependencies and PEP 735 dependency groups of those names). Markers stay
(pip evaluates them); a test extra's `extra == "test"` is made true, any other extra's stays false.

`environment_image(backend, name, requirements)` is the project's image for `docker` sandboxes, built once
and kept: the backend's default image (Debian, python3, pytest, git) with the requirements installed into
its `/usr/local/lib/python3.X/dist-packages` (pip runs here, on the host, for the image's Python version and
binary wheels only: the engine's containers have no network), labelled `swe_grpo.environment=1` (an
environment image: the docker backend puts each task's repository into it; see
`swe_grpo.sandbox.docker.images`). Its tag names the project and a hash of the default image's id and the
requirements: `swe-grpo-synth-env:<project>-<hash>`. A task row's `image` is that tag.

For `local` sandboxes the tests run on the host's `python3` and what it has installed; a task row's
`synth.requirements` says what the project asked for.
"""

from __future__ import annotations

import email.parser
import hashlib
import io
import re
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

from swe_grpo.sandbox.docker import DockerBackend
from swe_grpo.sandbox.docker.images import ENVIRONMENT_LABEL
from swe_grpo.synth.source import SynthError

TEST_EXTRAS = ("test", "tests", "testing")
_EXTRA = re.compile(r"""extra\s*==\s*["']([A-Za-z0-9._-]+)["']""")
REPOSITORY = "swe-grpo-synth-env"


def _with_test_extras(requirement: str) -> str:
    """`requirement` with a test extra's marker made true (pip evaluates the rest; a marker that was only the
    test extra is dropped)."""
    made = _EXTRA.sub(lambda m: '"a" == "a"' if m.group(1).lower() in TEST_EXTRAS else m.group(0), requirement)
    return re.sub(r'\s*;\s*"a" == "a"\s*$', "", made)


def requirements(tree: Path) -> list[str]:
    """What the project in `tree` declares for running its tests (see the module docstring)."""
    pkg_info = tree / "PKG-INFO"
    if pkg_info.is_file():
        message = email.parser.Parser().parsestr(pkg_info.read_text(errors="replace"), headersonly=True)
        found = [_with_test_extras(value) for value in message.get_all("Requires-Dist") or ()]
        return [r for r in found if _EXTRA.search(r) is None or '"a" == "a"' in r]
    pyproject = tree / "pyproject.toml"
    if not pyproject.is_file():
        return []
    try:
        data = tomllib.loads(pyproject.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SynthError(f"{pyproject.name}: {exc}") from None
    project = data.get("project", {})
    found = list(project.get("dependencies", []))
    for table in (project.get("optional-dependencies", {}), data.get("dependency-groups", {})):
        for extra in TEST_EXTRAS:
            found += [r for r in table.get(extra, []) if isinstance(r, str)]
    return found


def _python_version(backend: DockerBackend, image: str) -> str:
    out = backend.client.containers.run(
        image, ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], remove=True, network_mode="none"
    )
    return out.decode().strip()


def _build(backend: DockerBackend, base: str, tag: str, wanted: list[str], name: str) -> None:
    version = _python_version(backend, base)
    with tempfile.TemporaryDirectory(prefix="synth-env-") as tmp:
        site = Path(tmp) / "site"
        if wanted:
            pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
            pip += ["--target", str(site), "--only-binary", ":all:", "--python-version", version]
            done = subprocess.run([*pip, *wanted], capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise SynthError(f"{name}: cannot install its test requirements {wanted}: {done.stderr[-1500:]}")
        site.mkdir(exist_ok=True)
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            tar.add(site, arcname=".")
        target = f"/usr/local/lib/python{version}/dist-packages"
        container = backend.client.containers.create(base, ["mkdir", "-p", target], network_mode="none")
        try:
            container.start()
            if container.wait()["StatusCode"] != 0:
                raise SynthError(f"{name}: cannot make {target} in {base}")
            container.put_archive(target, archive.getvalue())
            repository, _, label = tag.partition(":")
            container.commit(repository, label, conf={"Labels": {ENVIRONMENT_LABEL: "1"}})
        finally:
            container.remove(force=True)


async def environment_image(backend: DockerBackend, name: str, wanted: list[str]) -> str:
    """The tag of `name`'s environment image with `wanted` installed, built on first use (see the module
    docstring). `SynthError` when pip cannot install them."""
    base = backend.default_image
    image = await backend.submit(backend.client.images.get, base)
    digest = hashlib.sha256("\0".join([image.id or "", *wanted]).encode()).hexdigest()[:12]
    tag = f"{REPOSITORY}:{re.sub(r'[^a-z0-9_.-]', '-', name.lower())[:100]}-{digest}"
    if not await backend.images.exists(tag):
        await backend.submit(_build, backend, base, tag, wanted, name)
    return tag
