"""The harness seam: each name in `AGENTS` makes its real harness from its real host install, and every entry
point (`WorkerConfig`, `swe-grpo rollout`, examples/train.py) takes the choice or refuses an unknown one by
name. A harness class of one's own (a dotted path) is in tests/test_plugins.py. The end-to-end runs are in
tests/test_rollout.py (Pi) and tests/test_mini_swe_agent.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_examples import load_train_module, parse

from swe_grpo.agents import AGENTS, make_agent, make_agents
from swe_grpo.agents.claude_code import CLAUDE_CODE_MOUNT, ClaudeCodeAgent
from swe_grpo.agents.codex import CODEX_MOUNT, CodexAgent
from swe_grpo.agents.mini_swe import MINI_MOUNT, MiniSweAgent, MiniSweAgentBundleError
from swe_grpo.agents.opencode import OPENCODE_MOUNT, OpenCodeAgent
from swe_grpo.agents.pi import PI_MOUNT, PiAgent
from swe_grpo.cli import parse_args
from swe_grpo.rollout import Trajectory
from swe_grpo.worker.config import WorkerConfig
from swe_grpo.worker.telemetry import rollout_metrics

ROLLOUT = ["rollout", "--tasks", "t.jsonl", "--vllm-url", "http://127.0.0.1:9", "--model", "m"]


def test_each_agent_is_made_from_its_install_and_mounted_read_only() -> None:
    agents = [make_agent(name) for name in AGENTS]
    classes = [PiAgent, MiniSweAgent, OpenCodeAgent, CodexAgent, ClaudeCodeAgent]
    assert [type(a) for a in agents] == classes
    mounts = [(a.mount().sandbox_path, a.mount().writable) for a in agents]
    assert mounts == [(m, False) for m in (PI_MOUNT, MINI_MOUNT, OPENCODE_MOUNT, CODEX_MOUNT, CLAUDE_CODE_MOUNT)]
    assert [a.name for a in agents] == list(AGENTS)  # each registry name is its harness's own name


def test_an_unknown_agent_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown agent 'codx': choose one of pi, mini-swe-agent, opencode, codex"):
        make_agent("codx")
    with pytest.raises(ValueError, match="unknown agent 'codx'"):
        WorkerConfig(agent="codx")
    with pytest.raises(ValueError, match="unknown agent 'codx'"):
        WorkerConfig(agent={"pi": 1, "codx": 1})
    with pytest.raises(SystemExit):
        parse_args([*ROLLOUT, "--agent", "x"])


def test_a_missing_mini_bundle_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWE_GRPO_MINI_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(MiniSweAgentBundleError, match=r"not installed in .*nowhere.*scripts/setup\.sh"):
        make_agent("mini-swe-agent")


def test_the_entry_points_choose_the_agent() -> None:
    assert parse_args(ROLLOUT).agent == "pi" and WorkerConfig().agent == "pi"
    assert parse_args([*ROLLOUT, "--agent", "mini-swe-agent"]).agent == "mini-swe-agent"
    train = load_train_module()
    for flags, agent in (([], "pi"), (["--agent", "mini-swe-agent"], "mini-swe-agent")):
        swe, args, _ = parse(train, "cpu_tiny.yaml", *flags)
        assert train.worker_config(swe, args).agent == agent


def test_a_mix_of_agents_takes_turns_by_group() -> None:
    """`WorkerConfig.agent` as a mix: each group runs one agent, in turn, each as often as its weight; the flag's
    form `pi=2,opencode=1` is the same mix; a bad weight or an empty mix is refused by name."""
    mix = WorkerConfig(agent={"pi": 2, "opencode": 1})
    assert mix.agent_schedule() == ("pi", "pi", "opencode") and WorkerConfig().agent_schedule() == ("pi",)
    assert WorkerConfig(agent="pi=2,opencode=1").agent == {"pi": 2, "opencode": 1}
    for bad, match in (({"pi": 0}, "whole number >= 1"), ({}, "empty mix"), ("pi=2,opencode", "NAME=WEIGHT")):
        with pytest.raises(ValueError, match=match):
            WorkerConfig(agent=bad)
    train = load_train_module()
    swe, args, _ = parse(train, "cpu_tiny.yaml", "--agent", "pi=2,opencode=1")
    assert train.worker_config(swe, args).agent == {"pi": 2, "opencode": 1}
    agents = make_agents(mix.agent_schedule())
    assert [a.name for a in agents] == ["pi", "pi", "opencode"] and agents[0] is agents[1]


def test_the_rollout_flag_takes_a_mix_and_eval_one_agent(capsys: pytest.CaptureFixture[str]) -> None:
    """`swe-grpo rollout --agent` takes the mix `WorkerConfig.agent` takes, refused for the same causes by name;
    `swe-grpo eval --agent` takes one agent and refuses a mix by name (a report's pass@k is one agent's)."""
    assert parse_args([*ROLLOUT, "--agent", "pi=2,codex=1"]).agent == "pi=2,codex=1"
    bad_mixes = {"pi=0": "whole number >= 1", "pi=2,codex": "NAME=WEIGHT", "pi=1,codx=1": "unknown agent 'codx'"}
    for bad, cause in bad_mixes.items():
        with pytest.raises(SystemExit):
            parse_args([*ROLLOUT, "--agent", bad])
        assert cause in capsys.readouterr().err, bad
    evaluate = ["eval", "--tasks", "t.jsonl", "--model", "m", "--out", "o"]
    assert parse_args([*evaluate, "--agent", "claude-code"]).agent == "claude-code"
    with pytest.raises(SystemExit):
        parse_args([*evaluate, "--agent", "pi=2,codex=1"])
    assert "eval runs one agent, not a mix ('pi=2,codex=1')" in capsys.readouterr().err


def test_each_rollout_is_counted_under_its_agent() -> None:
    """A trajectory carries the harness that ran it; its metrics repeat under `rollout/agent_<name>/`."""
    trajectory = Trajectory("t-1", "r-1", "resolved", 1.0, agent_name="opencode")
    metrics = rollout_metrics(trajectory)
    assert trajectory.summary()["agent_name"] == "opencode"
    for name in ("finished_total", "turns", "fork_rate", "resolved_rate"):
        assert metrics[f"rollout/agent_opencode/{name}"] == metrics[f"rollout/{name}"], name
