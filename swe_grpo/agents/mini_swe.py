"""mini-swe-agent (PyPI `mini-swe-agent`, `MINI_SWE_AGENT_VERSION`) as a rollout's agent, run inside a sandbox.

Its bundle is built once on the host by `scripts/setup.sh` (`swe_grpo.agents.mini_swe_install`: a Python
that runs in any x86-64 Linux image through its own loader, with the pinned mini-swe-agent) into
`swe_grpo.paths.mini_swe_agent_dir()`, and mounted read-only at `MINI_MOUNT`. Nothing is installed inside a sandbox.

Per rollout, mini's `mini` CLI runs non-interactively (yolo mode, exit on submit) with its built-in
tool-calling config (`mini.yaml`: one `bash` tool) plus ours, a file in the sandbox's private /tmp: the
task, litellm's OpenAI-compatible provider with `api_base` = the rollout's endpoint, its local
environment in the repository, no cost limit. The key reaches litellm only through its environment
(`OPENAI_API_KEY`). Requests are plain (not streamed) `chat/completions` with `tools`.

A repository cannot configure it: both configs are named by absolute path (mini would look for a relative
one in the working directory), its global config directory (`.env`) is ours, litellm does not load a
`.env` (`LITELLM_MODE=PRODUCTION`), and the Python runs isolated (`-I`: no `PYTHON*` variables, no
working directory on `sys.path`, so a repository's `litellm/` or `yaml.py` shadows nothing). litellm's
network calls (the cost map) are off.
"""

from __future__ import annotations

import json
from pathlib import Path

from swe_grpo.agents.base import AgentConfig, Launch
from swe_grpo.agents.mini_swe_install import LOADER, PY_VERSION
from swe_grpo.paths import mini_swe_agent_dir
from swe_grpo.sandbox.base import Mount
from swe_grpo.types import RolloutEndpoint

MINI_SWE_AGENT_VERSION = "2.4.6"  # the pin in mini_swe_requirements.txt
MINI_MOUNT = "/opt/swe_grpo/mini"
API_KEY_ENV = "OPENAI_API_KEY"  # what litellm's OpenAI provider reads
_PYTHON = f"python/bin/{PY_VERSION}"
_BUILTIN_CONFIG = f"python/lib/{PY_VERSION}/site-packages/minisweagent/config/mini.yaml"
_DIR = "/tmp/swe_grpo/mini"
_CONFIG_FILE = f"{_DIR}/config.yaml"


class MiniSweAgentBundleError(RuntimeError):
    """The mini-swe-agent bundle is missing or incomplete."""


class MiniSweAgent:
    """mini-swe-agent as a rollout's `Agent` (`swe_grpo.agents.base`), from the bundle in `root`
    (default: `swe_grpo.paths.mini_swe_agent_dir()`). Raises MiniSweAgentBundleError when it is not there."""

    name = "mini-swe-agent"

    def __init__(self, root: Path | None = None):
        self.root = root or mini_swe_agent_dir()
        missing = [p for p in (f"lib/{LOADER}", _PYTHON, _BUILTIN_CONFIG) if not (self.root / p).is_file()]
        if missing:
            raise MiniSweAgentBundleError(
                f"mini-swe-agent is not installed in {self.root} (no {', '.join(missing)}); "
                "run `bash scripts/setup.sh` (or set SWE_GRPO_MINI_DIR)"
            )

    def mount(self) -> Mount:
        return Mount(self.root, MINI_MOUNT)

    def launch(self, workdir: str, endpoint: RolloutEndpoint, problem_statement: str, config: AgentConfig) -> Launch:
        """What runs in the sandbox, with `endpoint` as the agent sees it."""
        overrides = {
            "agent": {"mode": "yolo", "confirm_exit": False, "cost_limit": 0, "output_path": f"{_DIR}/trajectory.json"},
            "model": {
                "model_class": "litellm",
                "model_name": f"openai/{endpoint.model}",
                "cost_tracking": "ignore_errors",
                "model_kwargs": {"api_base": endpoint.base_url, "max_tokens": config.max_tokens, "drop_params": True},
            },
            "environment": {"environment_class": "local", "cwd": workdir, "timeout": config.command_timeout_s},
            "run": {"task": problem_statement},
        }
        python = [f"{MINI_MOUNT}/lib/{LOADER}", "--library-path", f"{MINI_MOUNT}/lib", f"{MINI_MOUNT}/{_PYTHON}", "-I"]
        env = {
            "MSWEA_GLOBAL_CONFIG_DIR": _DIR,
            "MSWEA_CONFIGURED": "true",
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_GLOBAL_COST_LIMIT": "0",
            "MSWEA_GLOBAL_CALL_LIMIT": "0",
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": str(config.max_retries + 1),
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_MODE": "PRODUCTION",
        }
        configs = ["-c", f"{MINI_MOUNT}/{_BUILTIN_CONFIG}", "-c", _CONFIG_FILE]
        return Launch(
            argv=[*python, "-m", "minisweagent.run.mini", "--exit-immediately", "--yolo", *configs],
            env=env,
            files={_CONFIG_FILE: json.dumps(overrides).encode()},  # JSON is YAML
            secret_env=API_KEY_ENV,
        )
