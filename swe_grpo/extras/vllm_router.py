"""Start and stop vllm-router (extra `swe_grpo[router]`) in front of vLLM servers, as a child process.

Used by tests/test_vllm_client.py and benchmarks/p10_router_affinity.py. vllm-router 0.1.17's `consistent_hash` and
`sticky_least_loaded` policies route by the `X-Session-ID` header that VLLMClient sends with every generation
(docs/scale.md); `cache_aware` (its default) and `round_robin` ignore it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from swe_grpo.extras.vllm_server import free_port

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
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with code {self._proc.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"vllm-router not healthy after {self.startup_timeout_s}s; log: {self.log_path}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the router; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> VLLMRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
