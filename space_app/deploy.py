"""Create or update the Hugging Face Docker Space that trains the Pi agent (see space_app/README.md).

    space_app/deploy_hf_space.sh --space USER/NAME --hardware a100x4 [--config CONFIG.yaml] [--dry-run]

Steps, in order: create the Space if it does not exist (Docker SDK, public: HF Jobs sandboxes reach it by its
public URL); set its secrets (HF_TOKEN, plus any `--secret NAME` and every name in `--secrets-file`); set
`--variable NAME=VALUE`s; upload the staged Space repository; request the hardware.

Guarantees:
- Secret values are read from `--secrets-file` (lines `NAME=VALUE`) or else the environment, never from the
  command line; they are sent only through `add_space_secret`, and never printed, staged or uploaded.
- `--dry-run` stages the Space repository locally, prints every step (secrets redacted) and the files it
  would upload, and makes no network call.
- What is uploaded is exactly the staged directory (`--stage-dir DIR` keeps it, e.g. to `docker build` it):
  Dockerfile, .dockerignore, a README.md with the Space front-matter, pyproject.toml, the package and
  examples/ as git sees them (tracked or untracked, never ignored), and space_app/'s runtime files with the
  chosen config as space_app/config.yaml. Stale files under swe_grpo/, examples/ and space_app/ are deleted.
The Hub token for the API calls is huggingface_hub's usual one (HF_TOKEN, or `hf auth login`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from huggingface_hub import HfApi, SpaceHardware

SPACE_APP = Path(__file__).resolve().parent
ROOT = SPACE_APP.parent
APP_PORT = 7860
DEFAULT_CONFIG = SPACE_APP / "config.yaml"
REQUIRED_SECRETS = ("HF_TOKEN",)
# space_app/ files the image runs or builds with; deploy.py, the wrapper, the Dockerfile and the README stay here.
RUNTIME_FILES = ("start.sh", "vllm_command.py", "install_pi.sh", "install_deps.sh")
PACKAGE_DIRS = ("swe_grpo", "examples")
# Directories the upload owns entirely: a file there that is not in the new upload is deleted from the Space.
MANAGED_DIRS = (*PACKAGE_DIRS, "space_app")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Action:
    """One deployment step: `description` is safe to print (it never holds a secret value), `run` does it."""

    description: str
    run: Callable[[HfApi], object]


def gpu_count(hardware: str) -> int:
    """GPUs of a Space hardware flavor by its name (`a100x4` -> 4, `a100-large` -> 1, `cpu-basic` -> 0)."""
    if hardware.startswith("cpu"):
        return 0
    match = re.search(r"x(\d+)$", hardware)
    return int(match.group(1)) if match else 1


def read_secrets(names: Sequence[str], secrets_file: Path | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The value of every secret: `names` plus every name in `secrets_file`; a value in the file wins over the
    environment. Raises `SystemExit` naming (never showing) what is missing or malformed."""
    from_file: dict[str, str] = {}
    if secrets_file is not None:
        for number, line in enumerate(secrets_file.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            name, sep, value = line.removeprefix("export ").partition("=")
            name = name.strip()
            if not sep or not _NAME.match(name):
                raise SystemExit(f"{secrets_file}:{number}: expected NAME=VALUE")
            from_file[name] = value
    wanted = list(dict.fromkeys([*names, *from_file]))
    values = {name: from_file.get(name, environ.get(name, "")) for name in wanted}
    if missing := [name for name, value in values.items() if not value]:
        raise SystemExit(f"no value for secret(s) {', '.join(missing)}: set them in the environment or --secrets-file")
    return values


def parse_variables(pairs: Sequence[str]) -> dict[str, str]:
    """`NAME=VALUE` pairs (Space variables: public settings, not secrets)."""
    variables = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not _NAME.match(name):
            raise SystemExit(f"--variable {pair!r}: expected NAME=VALUE")
        variables[name] = value
    return variables


def check_config(path: Path) -> None:
    """Fail early on a config the Space could not start with (the image reads it only at run time)."""
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict) or not config.get("model_name_or_path"):
        raise SystemExit(f"{path}: expected a YAML mapping with model_name_or_path (see space_app/config.yaml)")


def front_matter() -> str:
    """The Space card's metadata: a Docker Space whose app listens on `APP_PORT`. Port 7860 opens only once the
    trainer runs (after the model download and vLLM's start-up), hence the long start-up timeout."""
    return (
        "---\n"
        "title: swe_grpo GRPO trainer\n"
        "emoji: 🛠️\n"
        "colorFrom: indigo\n"
        "colorTo: gray\n"
        "sdk: docker\n"
        f"app_port: {APP_PORT}\n"
        "startup_duration_timeout: 1h\n"
        "pinned: false\n"
        "---\n\n"
    )


def package_files(root: Path) -> list[str]:
    """Files of `PACKAGE_DIRS` as git sees them in `root`: tracked or untracked, never ignored (no caches, no
    virtual environments, no local secrets kept out of git)."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *PACKAGE_DIRS],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # --cached also lists tracked files deleted from the working tree.
    return sorted(path for path in set(listed.split("\0")) if path and (root / path).is_file())


def stage(dest: Path, config: Path, root: Path = ROOT) -> list[str]:
    """Lay the Space repository out in the empty directory `dest`; returns its files, relative to `dest`."""
    copies = {
        "Dockerfile": SPACE_APP / "Dockerfile",
        ".dockerignore": SPACE_APP / ".dockerignore",
        "pyproject.toml": root / "pyproject.toml",
        "space_app/config.yaml": config,
    }
    copies |= {f"space_app/{name}": SPACE_APP / name for name in RUNTIME_FILES}
    copies |= {path: root / path for path in package_files(root)}
    for relative, source in copies.items():
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    readme = front_matter() + (SPACE_APP / "README.md").read_text(encoding="utf-8")
    (dest / "README.md").write_text(readme, encoding="utf-8")
    return sorted([*copies, "README.md"])


def plan(
    space: str,
    hardware: str,
    staged: Path,
    files: Sequence[str],
    secrets: Mapping[str, str],
    variables: Mapping[str, str],
) -> list[Action]:
    """The deployment steps, in order."""
    actions = [
        Action(
            f"create_repo: Docker Space {space} (public; kept as it is if it exists)",
            lambda api: api.create_repo(space, repo_type="space", space_sdk="docker", private=False, exist_ok=True),
        )
    ]
    for name, value in secrets.items():
        actions.append(
            Action(
                f"add_space_secret: {name} = <redacted>",
                lambda api, name=name, value=value: api.add_space_secret(space, name, value),
            )
        )
    for name, value in variables.items():
        actions.append(
            Action(
                f"add_space_variable: {name} = {value}",
                lambda api, name=name, value=value: api.add_space_variable(space, name, value),
            )
        )
    managed = [f"{directory}/*" for directory in MANAGED_DIRS]
    actions += [
        Action(
            f"upload_folder: {len(files)} files from {staged} to {space}"
            f" (deleting stale files under {', '.join(f'{d}/' for d in MANAGED_DIRS)})",
            lambda api: api.upload_folder(
                repo_id=space,
                repo_type="space",
                folder_path=staged,
                commit_message="Deploy the swe_grpo trainer",
                delete_patterns=managed,
            ),
        ),
        Action(
            f"request_space_hardware: {hardware}",
            lambda api: api.request_space_hardware(space, SpaceHardware(hardware)),
        ),
    ]
    return actions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deploy_hf_space.sh", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--space", required=True, help="the Space, USER/NAME (created if missing)")
    parser.add_argument(
        "--hardware",
        required=True,
        choices=[h.value for h in SpaceHardware if gpu_count(h.value) >= 2],
        metavar="FLAVOR",
        help="Space hardware with 2+ GPUs (GPU 0 serves, the rest train), e.g. a100x4, l40sx4, a10g-largex2",
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="training config (default: %(default)s)")
    parser.add_argument(
        "--secret", action="append", default=[], metavar="NAME", help="also set this secret (value from the env)"
    )
    parser.add_argument(
        "--secrets-file", type=Path, help="NAME=VALUE lines (value verbatim, no quoting); each becomes a Space secret"
    )
    parser.add_argument(
        "--variable", action="append", default=[], metavar="NAME=VALUE", help="a Space variable (public)"
    )
    parser.add_argument("--stage-dir", type=Path, help="stage into this new directory and keep it")
    parser.add_argument("--dry-run", action="store_true", help="print the steps; no network call")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", args.space):
        raise SystemExit(f"--space {args.space!r}: expected USER/NAME")
    check_config(args.config)
    secrets = read_secrets([*REQUIRED_SECRETS, *args.secret], args.secrets_file, os.environ)
    variables = parse_variables(args.variable)

    if args.stage_dir is not None:
        args.stage_dir.mkdir(parents=True)  # must be new: a leftover file would be uploaded
        staged = args.stage_dir
    else:
        staged = Path(tempfile.mkdtemp(prefix="swe-grpo-space-"))
    try:
        files = stage(staged, args.config)
        actions = plan(args.space, args.hardware, staged, files, secrets, variables)
        prefix = "[dry run] " if args.dry_run else ""
        api = None if args.dry_run else HfApi()
        for number, action in enumerate(actions, 1):
            print(f"{prefix}{number}. {action.description}", flush=True)
            if api is not None:
                action.run(api)
        if args.dry_run:
            print(f"{prefix}files to upload:\n" + "".join(f"  {path}\n" for path in files), end="")
        else:
            print(f"deployed: https://huggingface.co/spaces/{args.space}")
    finally:
        if args.stage_dir is None:
            shutil.rmtree(staged)
    return 0


if __name__ == "__main__":
    sys.exit(main())
