#!/usr/bin/env bash
# Image build step: creates the virtual environment VENV over the base image's Python and installs into it the
# dependencies of PYPROJECT (its `dependencies` plus the comma-separated EXTRAS), not the package itself: the
# package is installed in a later layer, so a code change does not re-download them.
#
#   install_deps.sh VENV PYPROJECT [EXTRAS]
#
# The venv sees the packages of the base's python3 (after its own), and the base's torch and vLLM are pinned for
# the resolver: they are built for the base's CUDA (or CPU) and multi-GB, so a requirement they do not meet
# fails the build instead of silently pulling other builds.
set -euo pipefail

venv=${1:?usage: install_deps.sh VENV PYPROJECT [EXTRAS]}
pyproject=${2:?usage: install_deps.sh VENV PYPROJECT [EXTRAS]}
extras=${3:-}

base_python=$(command -v python3)  # resolved before the venv exists: the image's PATH lists the venv first
"$base_python" -m venv "$venv"
# A .pth rather than `venv --system-site-packages`: it also works where the base's python3 is itself a
# virtual environment (the flag would look past it, to the interpreter it was made from).
site_dir=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$base_python" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site_dir/base_image_packages.pth"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$venv/bin/python" - "$work/constraints.txt" <<'PY'
import importlib.metadata, sys

pins = []
for name in ("torch", "vllm"):
    try:
        pins.append(f"{name}=={importlib.metadata.version(name)}\n")
    except importlib.metadata.PackageNotFoundError:
        pass
with open(sys.argv[1], "w") as out:
    out.writelines(pins)
PY

"$venv/bin/python" - "$pyproject" "$extras" "$work/requirements.txt" <<'PY'
import sys, tomllib

pyproject, extras, path = sys.argv[1:]
with open(pyproject, "rb") as f:
    project = tomllib.load(f)["project"]
requirements = list(project["dependencies"])
for extra in filter(None, (e.strip() for e in extras.split(","))):
    requirements += project["optional-dependencies"][extra]  # an unknown extra fails the build
with open(path, "w") as out:
    out.writelines(f"{r}\n" for r in requirements)
PY

echo "constraints from the base image:" && cat "$work/constraints.txt"
"$venv/bin/python" -m pip install --no-cache-dir --disable-pip-version-check \
    -c "$work/constraints.txt" -r "$work/requirements.txt"
