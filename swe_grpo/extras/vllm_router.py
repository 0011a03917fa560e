"""Start and stop vllm-router (extra `swe_grpo[router]`) in front of vLLM servers, as a child process.

Used by tests/test_vllm_client.py and benchmarks/p10_router_affinity.py. vllm-router 0.1.17's `consistent_hash` and
`sticky_least_loaded` policies route by the `X-Session-ID` header that VLLMClient sends with every generation
(docs/scale.md); `cache_aware` (its default) and `round_robin` ignore it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from swe_grpo.extras.vllm_server import free_port, stop_process_group, wait_until_healthy

POLICIES = (
    "round_robin",
    "cache_aware",
    "consistent_hash",
    "sticky_least_loaded",
    "kv_aware",
    "power_of_two",
    "random",
)


def router_binary() -> str | None:
    """The `vllm-router` console script of this Python's environment (or on PATH); None when not installed."""
    return shutil.which("vllm-router", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


@dataclass
class VLLMRouter:
    """vllm-router on loopback in front of `worker_urls`, routing by `policy`. A context manager, or start()/stop().
    Its output goes to `log_path` (default: a temporary file)."""

    worker_urls: list[str]
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 0
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    startup_timeout_s: float = 60.0

    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown vllm-router policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        if not self.worker_urls:
            raise ValueError("vllm-router needs at least one worker URL")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, binary: str) -> list[str]:
        return [
            binary, "--host", self.host, "--port", str(self.port), "--policy", self.policy,
            "--worker-urls", *self.worker_urls, *self.extra_args,
        ]  # fmt: skip

    def start(self) -> VLLMRouter:
        if self._proc is not None:
            raise RuntimeError("router already started")
        binary = router_binary()
        if binary is None:
            raise FileNotFoundError("vllm-router is not installed: pip install 'swe_grpo[router]'")
        if not self.port:
            self.port = free_port(self.host)
        if self.log_path is None:
            self.log_path = Path(tempfile.mkstemp(prefix="swe_grpo-vllm-router-", suffix=".log")[1])
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(binary),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            wait_until_healthy("vllm-router", self.url, self._proc, self.startup_timeout_s, self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the router; idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process_group(proc, timeout_s)

    def __enter__(self) -> VLLMRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
