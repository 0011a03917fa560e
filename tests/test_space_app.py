"""The HF Space deploy (`space_app/`): the deploy script's dry run, the shell scripts, start.sh's process
orchestration, and a real `docker build` of the Space image.

Nothing here reaches Hugging Face or a GPU. The dry run runs with every outbound connection refused. start.sh
runs against stand-ins, named as such: `nvidia-smi` reporting four GPUs, and a `python` wrapper that answers
`-m vllm.entrypoints.cli.main` and `-m accelerate.commands.launch` with small recording programs (everything
else goes to the real interpreter). The docker build uses the real Dockerfile on a CPU stand-in for the vLLM
base image: the offline Debian image of the docker tests plus python3-venv and CPU torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest
import yaml

from swe_grpo.agents.pi import DEFAULT_PI_VERSION
from swe_grpo.sandbox.docker import DEFAULT_IMAGE

ROOT = Path(__file__).resolve().parent.parent
SPACE_APP = ROOT / "space_app"
SCRIPTS = sorted(SPACE_APP.glob("*.sh"))
PYTHON = Path(sys.executable)
SECRET = "hf_DRYRUNSECRET_must_never_be_printed"

sys.path.insert(0, str(SPACE_APP))
from vllm_command import TRL_DEFAULTS, vllm_arguments  # noqa: E402

# --------------------------------------------------------------------------- deploy dry run

_NO_NETWORK = """\
import socket

def _refuse(*args, **kwargs):
    raise OSError("network access in a dry run")

socket.socket.connect = _refuse
socket.socket.connect_ex = _refuse
socket.create_connection = _refuse
socket.getaddrinfo = _refuse
"""


def test_dry_run_prints_the_plan_and_makes_no_network_call(tmp_path: Path) -> None:
    """Offline by configuration (HF_HUB_OFFLINE, an unresolvable HF_ENDPOINT) and by force (a sitecustomize
    that makes every socket connection raise): the dry run still succeeds, lists every step, redacts the
    secret, and stages exactly the files it says it would upload."""
    (tmp_path / "guard").mkdir()
    (tmp_path / "guard" / "sitecustomize.py").write_text(_NO_NETWORK)
    secrets_file = tmp_path / "secrets.env"
    secrets_file.write_text(f"# extra secrets\nWANDB_API_KEY={SECRET}-wandb\n")
    stage_dir = tmp_path / "stage"
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "PYTHON": str(PYTHON),
        "PYTHONPATH": str(tmp_path / "guard"),
        "HF_TOKEN": SECRET,
        "HF_HUB_OFFLINE": "1",
        "HF_ENDPOINT": "http://hub.invalid",
    }
    argv = [
        "bash", str(SPACE_APP / "deploy_hf_space.sh"),
        "--space", "someone/swe-grpo-test", "--hardware", "a100x4", "--dry-run",
        "--secrets-file", str(secrets_file), "--variable", "VLLM_MAX_MODEL_LEN=32768",
        "--stage-dir", str(stage_dir),
    ]  # fmt: skip
    probe = subprocess.run(
        [str(PYTHON), "-c", "import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert "network access in a dry run" in probe.stderr, "the network guard is not in force"
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert SECRET not in out + done.stderr
    steps = [line for line in out.splitlines() if line.startswith("[dry run] ") and line[10:11].isdigit()]
    assert [step.split(": ")[0].split(". ")[1] for step in steps] == [
        "create_repo",
        "add_space_secret",
        "add_space_secret",
        "add_space_variable",
        "upload_folder",
        "request_space_hardware",
    ]
    assert "Docker Space someone/swe-grpo-test" in steps[0]
    assert steps[1].endswith("HF_TOKEN = <redacted>") and steps[2].endswith("WANDB_API_KEY = <redacted>")
    assert steps[3].endswith("VLLM_MAX_MODEL_LEN = 32768")
    assert steps[5].endswith("a100x4")

    listed = out.split("files to upload:\n", 1)[1].split()
    staged = sorted(str(p.relative_to(stage_dir)) for p in stage_dir.rglob("*") if p.is_file())
    assert listed == staged
    for needed in ("Dockerfile", ".dockerignore", "README.md", "pyproject.toml", "examples/train.py",
                   "swe_grpo/cli.py", "space_app/start.sh", "space_app/config.yaml"):  # fmt: skip
        assert needed in staged
    assert not [p for p in staged if p.startswith(("tests/", ".venv/", ".git/")) or "__pycache__" in p]
    assert not [p for p in staged if SECRET.encode() in (stage_dir / p).read_bytes()]
    front = yaml.safe_load((stage_dir / "README.md").read_text().split("---\n")[1])
    assert front["sdk"] == "docker" and front["app_port"] == 7860


def test_deploy_refuses_a_missing_secret_and_single_gpu_hardware(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHON": str(PYTHON), "HF_HUB_OFFLINE": "1"}
    base = ["bash", str(SPACE_APP / "deploy_hf_space.sh"), "--space", "someone/x", "--dry-run"]
    no_token = subprocess.run([*base, "--hardware", "a100x4"], env=env, capture_output=True, text=True, timeout=120)
    assert no_token.returncode != 0 and "HF_TOKEN" in no_token.stderr
    one_gpu = subprocess.run(
        [*base, "--hardware", "a100-large"],
        env={**env, "HF_TOKEN": SECRET},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert one_gpu.returncode != 0 and "invalid choice" in one_gpu.stderr


# --------------------------------------------------------------------------- shell scripts


def test_shell_scripts_are_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not installed: scripts/setup.sh installs it (apt package `shellcheck`)"
    assert {p.name for p in SCRIPTS} >= {"start.sh", "deploy_hf_space.sh", "install_pi.sh", "install_deps.sh"}
    done = subprocess.run([shellcheck, "--severity=style", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    for script in SCRIPTS:
        assert "set -euo pipefail" in script.read_text(), script.name


# --------------------------------------------------------------------------- the vLLM command


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_vllm_command_follows_the_training_config() -> None:
    """LoRA rank, resident adapters, precision and served name come from the config; NCCL stays available."""
    config = yaml.safe_load((SPACE_APP / "config.yaml").read_text())
    args = vllm_arguments(config, {"VLLM_PORT": "8123"})
    assert args[:2] == ["serve", config["model_name_or_path"]]
    assert _flag(args, "--host") == "127.0.0.1" and _flag(args, "--port") == "8123"
    assert _flag(args, "--logprobs-mode") == "processed_logprobs" and _flag(args, "--dtype") == "bfloat16"
    assert json.loads(_flag(args, "--weight-transfer-config")) == {"backend": "nccl"}
    assert "--enable-lora" in args
    assert _flag(args, "--max-lora-rank") == str(config["lora_r"])
    assert _flag(args, "--max-loras") == str(config["max_staleness"] + 2)

    full = vllm_arguments({"model_name_or_path": "m", "served_model_name": "policy"}, {})
    assert "--enable-lora" not in full and "--weight-transfer-config" in full
    assert _flag(full, "--served-model-name") == "policy"
    assert _flag(full, "--dtype") == "float32"  # no bf16: the trainer's own dtype


def test_vllm_command_defaults_are_trls() -> None:
    from trl import ModelConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig

    fields = {f.name: f.default for cls in (ModelConfig, AsyncGRPOConfig) for f in dataclasses.fields(cls)}
    # AsyncGRPOConfig second: on a name both have (dtype), its field is the one the trainer uses.
    assert {key: fields[key] for key in TRL_DEFAULTS} == dict(TRL_DEFAULTS)


# --------------------------------------------------------------------------- start.sh with stand-ins

_FAKE_VLLM = """\
# Stand-in for `python -m vllm.entrypoints.cli.main`: records how it was started, holds a child process (as the
# real engine core would), answers /health after a second; with FAKE_VLLM_CRASH, dies once the trainer runs.
import http.server, json, os, subprocess, sys, threading, time
child = subprocess.Popen(["sleep", "300"])
record = {"argv": sys.argv[1:], "pid": os.getpid(), "child": child.pid,
          "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "dev_mode": os.environ.get("VLLM_SERVER_DEV_MODE")}
path = os.path.join(os.environ["FAKE_RECORDS"], "vllm.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
time.sleep(1)
port = int(sys.argv[sys.argv.index("--port") + 1])


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def crash_once_the_trainer_runs():
    while not os.path.exists(os.path.join(os.environ["FAKE_RECORDS"], "trainer.json")):
        time.sleep(0.2)
    os._exit(3)


server = http.server.HTTPServer(("127.0.0.1", port), Health)
if os.environ.get("FAKE_VLLM_CRASH"):
    threading.Thread(target=crash_once_the_trainer_runs, daemon=True).start()
server.serve_forever()
"""

_FAKE_ACCELERATE = """\
# Stand-in for `python -m accelerate.commands.launch`: records its arguments and whether vLLM was already
# healthy, holds a child process (as the ranks would), then exits 0 or, with FAKE_TRAINER_FOREVER, runs on.
import json, os, subprocess, sys, time, urllib.request
child = subprocess.Popen(["sleep", "300"])
try:
    urllib.request.urlopen(f"http://127.0.0.1:{os.environ['VLLM_PORT']}/health", timeout=2)
    healthy = True
except OSError:
    healthy = False
record = {"argv": sys.argv[1:], "pid": os.getpid(), "child": child.pid, "vllm_healthy": healthy,
          "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}
path = os.path.join(os.environ["FAKE_RECORDS"], "trainer.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
time.sleep(3600 if os.environ.get("FAKE_TRAINER_FOREVER") else 1)
child.kill()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@contextlib.contextmanager
def _start_sh(tmp_path: Path, **extra_env: str) -> Iterator[tuple[subprocess.Popen, Path]]:
    """start.sh running against the stand-ins; yields the process and the directory the stand-ins record in.
    Whatever is left of its session is killed at the end."""
    bin_dir, records = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    records.mkdir()
    (tmp_path / "fake_vllm.py").write_text(_FAKE_VLLM)
    (tmp_path / "fake_accelerate.py").write_text(_FAKE_ACCELERATE)
    (bin_dir / "nvidia-smi").write_text(
        '#!/bin/sh\n# stand-in: four GPUs\nfor i in 0 1 2 3; do echo "GPU $i: Fake GPU (UUID: GPU-$i)"; done\n'
    )
    (bin_dir / "python").write_text(
        textwrap.dedent(f"""\
            #!/usr/bin/env bash
            # stand-in: vLLM and accelerate are answered by recording programs, the rest by the real python
            case "$1 ${{2:-}}" in
                "-m vllm.entrypoints.cli.main") shift 2; exec {PYTHON} {tmp_path / "fake_vllm.py"} "$@" ;;
                "-m accelerate.commands.launch") shift 2; exec {PYTHON} {tmp_path / "fake_accelerate.py"} "$@" ;;
            esac
            exec {PYTHON} "$@"
        """)
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "SWE_GRPO_APP_DIR": str(ROOT),
        "SWE_GRPO_OUTPUT_DIR": str(tmp_path / "output"),
        "HF_HOME": str(tmp_path / "hf"),
        "SPACE_HOST": "someone-swe-grpo.hf.space",
        "HF_TOKEN": SECRET,
        "VLLM_PORT": str(_free_port()),
        "STOP_GRACE_S": "5",
        "FAKE_RECORDS": str(records),
        **extra_env,
    }
    proc = subprocess.Popen(["bash", str(SPACE_APP / "start.sh")], env=env, start_new_session=True)
    try:
        yield proc, records
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for name in ("vllm.json", "trainer.json"):
            if (records / name).exists():
                record = json.loads((records / name).read_text())
                for pid in (record["pid"], record["child"]):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)


def _wait_for(path: Path, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.2)
    return json.loads(path.read_text())  # the stand-ins write it whole (rename)


def _assert_all_gone(*records: dict, timeout_s: float = 10) -> None:
    pids = [pid for record in records for pid in (record["pid"], record["child"])]
    deadline = time.monotonic() + timeout_s
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"processes left behind: {alive}"


def test_start_sh_runs_vllm_then_the_trainer_and_stops_vllm_when_training_ends(tmp_path: Path) -> None:
    with _start_sh(tmp_path) as (proc, records):
        assert proc.wait(timeout=180) == 0
        vllm, trainer = _wait_for(records / "vllm.json"), _wait_for(records / "trainer.json")
    _assert_all_gone(vllm, trainer)

    assert vllm["cuda"] == "0" and vllm["dev_mode"] == "1"
    assert vllm["argv"][:2] == ["serve", "Qwen/Qwen3-8B"] and "--enable-lora" in vllm["argv"]
    assert _flag(vllm["argv"], "--host") == "127.0.0.1"

    assert trainer["vllm_healthy"], "the trainer started before vLLM was healthy"
    assert trainer["cuda"] == "1,2,3"
    argv = trainer["argv"]
    assert _flag(argv, "--num_processes") == "3" and _flag(argv, "--gpu_ids") == "1,2,3"
    assert "--multi_gpu" in argv
    train = argv.index(str(ROOT / "examples" / "train.py"))
    options = dict(zip(argv[train + 1 :: 2], argv[train + 2 :: 2], strict=True))
    assert options == {
        "--config": str(SPACE_APP / "config.yaml"),
        "--output_dir": str(tmp_path / "output"),
        "--vllm_server_base_url": f"http://127.0.0.1:{_flag(vllm['argv'], '--port')}",
        "--sandbox": "hf",
        "--hf_accept_network": "true",  # grading's sandboxes keep HF's network (the hf backend refuses them otherwise)
        "--interception_host": "0.0.0.0",
        "--interception_port": "7860",
        "--public_base_url": "https://someone-swe-grpo.hf.space",
    }
    assert SECRET not in json.dumps([vllm, trainer]), "a secret reached a command line"


def test_start_sh_stops_everything_on_sigterm(tmp_path: Path) -> None:
    with _start_sh(tmp_path, FAKE_TRAINER_FOREVER="1") as (proc, records):
        vllm, trainer = _wait_for(records / "vllm.json"), _wait_for(records / "trainer.json")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
    _assert_all_gone(vllm, trainer)


def test_start_sh_stops_the_trainer_when_vllm_dies(tmp_path: Path) -> None:
    with _start_sh(tmp_path, FAKE_TRAINER_FOREVER="1", FAKE_VLLM_CRASH="1") as (proc, records):
        assert proc.wait(timeout=180) == 1
        vllm, trainer = _wait_for(records / "vllm.json"), _wait_for(records / "trainer.json")
    _assert_all_gone(vllm, trainer)


def test_start_sh_refuses_to_start_without_its_inputs(tmp_path: Path) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SWE_GRPO_APP_DIR": str(ROOT)}
    start = ["bash", str(SPACE_APP / "start.sh")]
    no_host = subprocess.run(start, env=env, capture_output=True, text=True, timeout=60)
    assert no_host.returncode == 1 and "SPACE_HOST is not set" in no_host.stderr
    no_token = subprocess.run(start, env={**env, "SPACE_HOST": "x.hf.space"}, capture_output=True, text=True)
    assert no_token.returncode == 1 and "HF_TOKEN" in no_token.stderr


# --------------------------------------------------------------------------- docker build (CPU base)

# Debian bookworm's python3 is 3.11: the CPU torch wheel must match it.
_BASE_PYTHON = "3.11"
_CPU_BASE_DOCKERFILE = f"""\
# A CPU stand-in for vllm/vllm-openai: Python with venv and pip, and torch (CPU), over the offline Debian image.
# The host's CA bundle replaces the image's, so pip, npm and Python trust what this machine trusts.
FROM {DEFAULT_IMAGE}
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt \\
    NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \\
        python3-venv python3-pip >/dev/null && rm -rf /var/lib/apt/lists/*
COPY wheels /tmp/wheels
RUN pip3 install -q --no-cache-dir --break-system-packages /tmp/wheels/*.whl && rm -rf /tmp/wheels
"""
_CPU_BASE_REPO = "swe-grpo-space-cpubase"
_HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def _build(client: docker.DockerClient, context: Path, tag: str, buildargs: dict[str, str] | None = None) -> None:
    """`docker build` with the classic builder, on the host network (the engine runs without a bridge)."""
    log: list[str] = []
    for chunk in client.api.build(
        path=str(context), tag=tag, buildargs=buildargs, network_mode="host", rm=True, forcerm=True, decode=True
    ):
        log.append(chunk.get("stream", ""))
        if "error" in chunk:
            tail = "".join(log)[-6000:]
            raise AssertionError(f"docker build of {tag} failed: {chunk['error']}\n{tail}")


def _cpu_base(client: docker.DockerClient, tmp_path: Path) -> str:
    """The CPU stand-in base, built once and kept (named after its inputs; older builds are untagged)."""
    torch_version = importlib.metadata.version("torch")
    digest = hashlib.sha256(
        f"{_CPU_BASE_DOCKERFILE}{torch_version}".encode() + _HOST_CA_BUNDLE.read_bytes()
    ).hexdigest()[:12]
    tag = f"{_CPU_BASE_REPO}:{digest}"
    if client.images.list(name=tag):
        return tag
    context = tmp_path / "cpu_base"
    (context / "wheels").mkdir(parents=True)
    (context / "Dockerfile").write_text(_CPU_BASE_DOCKERFILE)
    shutil.copy(_HOST_CA_BUNDLE, context / "ca-certificates.crt")
    # The torch this environment runs (setup.sh installs the CPU build), for the image's Python.
    subprocess.run(
        [str(PYTHON), "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
         _BASE_PYTHON, "--platform", "manylinux_2_28_x86_64", "-d", str(context / "wheels"), f"torch=={torch_version}"],
        check=True,
    )  # fmt: skip
    _build(client, context, tag)
    for old in client.images.list(name=_CPU_BASE_REPO):
        for old_tag in set(old.tags) - {tag}:
            # Untagged; its layers go once no cached build above it remains (the engine refuses before).
            with contextlib.suppress(docker.errors.APIError):
                client.images.remove(old_tag)
    return tag


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_space_image_builds_on_a_cpu_base_and_runs(docker_url: str, tmp_path: Path) -> None:
    """The real Dockerfile, built from the staged Space repository with a CPU base and no vLLM extra: the image
    assembles (Pi bundle, venv, package), `swe-grpo --help` runs in it as uid 1000, and its entrypoint starts.
    The image is removed afterwards; its build cache stays in the engine's data root, so the next build reuses
    every layer above what changed."""
    context = tmp_path / "space"
    staged = subprocess.run(
        ["bash", str(SPACE_APP / "deploy_hf_space.sh"), "--space", "someone/x", "--hardware", "a100x4",
         "--dry-run", "--stage-dir", str(context)],
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHON": str(PYTHON), "HF_TOKEN": SECRET,
             "HF_HUB_OFFLINE": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert staged.returncode == 0, staged.stderr
    tag = f"swe-grpo-space-test:{uuid.uuid4().hex[:8]}"
    client = docker.DockerClient(base_url=docker_url, timeout=600)
    try:
        base = _cpu_base(client, tmp_path)
        started = time.monotonic()
        _build(client, context, tag, {"BASE_IMAGE": base, "EXTRAS": ""})
        print(f"space image built in {time.monotonic() - started:.0f} s")

        def run(*command: str, entrypoint: str | None = None) -> tuple[int, str]:
            container = client.containers.run(
                tag, list(command), entrypoint=entrypoint, detach=True, network_mode="none"
            )
            try:
                code = container.wait(timeout=300)["StatusCode"]
                return code, container.logs().decode()
            finally:
                container.remove(force=True)

        code, out = run("swe-grpo", "--help", entrypoint="")
        assert code == 0 and "serve-vllm" in out, out
        pi = 'python -c "from swe_grpo.agents.pi import PiBundle; print(PiBundle.default().version)"'  # Node checked
        # uid 1000 owns everything in its home (the build, as root, left nothing there) and nothing of the app.
        script = f'id -u; {pi}; find "$HOME" ! -user 1000; find /opt/swe_grpo -user 1000'
        code, out = run("sh", "-c", script, entrypoint="")
        assert code == 0 and out.split() == ["1000", DEFAULT_PI_VERSION], out
        code, out = run()  # the entrypoint, start.sh, outside a Space: refuses with the reason
        assert code == 1 and "SPACE_HOST is not set" in out, out
        code, out = run("sh", "-c", "ls -a /opt/swe_grpo/app; env", entrypoint="")
        assert "tests" not in out.split() and ".venv" not in out.split() and SECRET not in out, out
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.remove(tag, noprune=True)
        client.close()
