"""The harness seam: each name in `AGENTS` makes its real harness from its real host install, and every entry
point (`WorkerConfig`, `swe-grpo rollout`, examples/train.py) takes the choice or refuses an unknown one by
name. A harness class of one's own (a dotted path) is in tests/test_plugins.py. The end-to-end runs are in
tests/test_rollout.py (Pi) and tests/test_mini_swe_agent.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_examples import load_train_module, parse

from swe_grpo.agents import AGENTS, make_agent
from swe_grpo.agents.mini_swe import MINI_MOUNT, MiniSweAgent, MiniSweAgentBundleError
from swe_grpo.agents.opencode import OPENCODE_MOUNT, OpenCodeAgent
from swe_grpo.agents.pi import PI_MOUNT, PiAgent
from swe_grpo.cli import parse_args
from swe_grpo.worker.config import WorkerConfig

ROLLOUT = ["rollout", "--tasks", "t.jsonl", "--vllm-url", "http://127.0.0.1:9", "--model", "m"]


def test_each_agent_is_made_from_its_install_and_mounted_read_only() -> None:
    pi, mini, opencode = (make_agent(name) for name in AGENTS)
    assert isinstance(pi, PiAgent) and isinstance(mini, MiniSweAgent) and isinstance(opencode, OpenCodeAgent)
    mounts = [(a.mount().sandbox_path, a.mount().writable) for a in (pi, mini, opencode)]
    assert mounts == [(PI_MOUNT, False), (MINI_MOUNT, False), (OPENCODE_MOUNT, False)]
    assert [a.name for a in (pi, mini, opencode)] == list(AGENTS)  # each registry name is its harness's own name


def test_an_unknown_agent_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown agent 'codex': choose one of pi, mini-swe-agent, opencode"):
        make_agent("codex")
    with pytest.raises(ValueError, match="unknown agent 'codex'"):
        WorkerConfig(agent="codex")
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
