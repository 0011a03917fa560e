"""Plug-in points (`swe_grpo.plugins`): `make_backend` and `make_agent` build a user's own class given as a
dotted path (`mod:Class` or `mod.Class`) as well as the built-in names; every entry point (`swe-grpo rollout`
/ `grade` flags, `WorkerConfig`) takes such a path without importing it and still refuses an unknown plain
name; each way a path can be wrong is refused with an error that names the path and the problem.

The user's classes live in real modules written to a temporary directory on sys.path; the backend is a real
`LocalBackend` subclass whose sandbox runs a real command.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sandbox_helpers import assert_nothing_left, calc_task, make_repo, no_sandbox_left_in_run_dir  # noqa: F401

from swe_grpo.agents import AGENTS, make_agent
from swe_grpo.agents.claude_code import ClaudeCodeAgent
from swe_grpo.agents.codex import CodexAgent
from swe_grpo.agents.mini_swe import MiniSweAgent
from swe_grpo.agents.opencode import OpenCodeAgent
from swe_grpo.agents.pi import PI_MOUNT, PiAgent
from swe_grpo.cli import parse_args
from swe_grpo.plugins import check_choice, load_object
from swe_grpo.sandbox import BACKENDS, SandboxBackend, make_backend
from swe_grpo.sandbox.docker import DockerBackend
from swe_grpo.sandbox.hf import HFBackend
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.worker.config import WorkerConfig

ROLLOUT = ["rollout", "--tasks", "t.jsonl", "--vllm-url", "http://127.0.0.1:9", "--model", "m"]

# A user's own module: a backend that is a LocalBackend with an option of its own and a file in every
# sandbox, a Pi harness under another name, and things that are not what a plug-in must be.
USER_MODULE = """
from swe_grpo.agents.pi import PiAgent
from swe_grpo.sandbox.local import LocalBackend


class MyBackend(LocalBackend):
    name = "mine"

    def __init__(self, *, greeting: str, **options):
        super().__init__(**options)
        self.greeting = greeting

    async def create(self, task, mounts=(), *, network=False):
        sandbox = await super().create(task, mounts, network=network)
        await sandbox.put_file("/tmp/greeting", self.greeting.encode())
        return sandbox


class MyAgent(PiAgent):
    name = "my-pi"


class Outer:
    class Backend(LocalBackend):
        pass


class NotABackend:
    pass


NOT_A_CLASS = 42
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """Writes a module of the given source under a fresh name into a directory on sys.path; its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def write(source: str) -> str:
        name = f"swe_grpo_user_{uuid.uuid4().hex[:12]}"
        (tmp_path / f"{name}.py").write_text(source)
        made.append(name)
        return name

    yield write
    for name in made:
        sys.modules.pop(name, None)


def test_the_registries_name_the_builtin_classes() -> None:
    assert list(BACKENDS) == ["local", "docker", "hf"] and list(AGENTS) == [
        "pi",
        "mini-swe-agent",
        "opencode",
        "codex",
        "claude-code",
    ]
    loaded = {name: load_object(spec, "sandbox backend", base=SandboxBackend) for name, spec in BACKENDS.items()}
    assert loaded == {"local": LocalBackend, "docker": DockerBackend, "hf": HFBackend}
    assert {name: load_object(spec, "agent") for name, spec in AGENTS.items()} == {
        "pi": PiAgent,
        "mini-swe-agent": MiniSweAgent,
        "opencode": OpenCodeAgent,
        "codex": CodexAgent,
        "claude-code": ClaudeCodeAgent,
    }


@pytest.mark.parametrize("form", [":", "."])
async def test_a_users_own_backend_is_built_and_makes_working_sandboxes(
    form: str, user_module: Callable[[str], str], tmp_path: Path, run_dir: Path
) -> None:
    module = user_module(USER_MODULE)
    backend = make_backend(f"{module}{form}MyBackend", greeting="hello", cache_dir=tmp_path / "cache", run_dir=run_dir)
    assert type(backend).__name__ == "MyBackend" and isinstance(backend, LocalBackend)
    assert (backend.name, backend.greeting, backend.run_dir) == ("mine", "hello", run_dir)  # type: ignore[attr-defined]
    await backend.start()
    task = calc_task(make_repo(tmp_path))
    async with await backend.create(task) as sandbox:
        result = await sandbox.exec("cat /tmp/greeting; echo; git rev-parse HEAD", timeout_s=60)
        assert result.stdout.split() == ["hello", task.base_commit], result
    assert_nothing_left(backend, run_dir)


def test_a_nested_class_is_reached_with_the_colon_form(user_module: Callable[[str], str], run_dir: Path) -> None:
    module = user_module(USER_MODULE)
    assert type(make_backend(f"{module}:Outer.Backend", run_dir=run_dir)).__qualname__ == "Outer.Backend"


def test_a_users_own_agent_is_built(user_module: Callable[[str], str]) -> None:
    module = user_module(USER_MODULE)
    for spec in (f"{module}:MyAgent", f"{module}.MyAgent"):
        agent = make_agent(spec)
        assert type(agent).__name__ == "MyAgent" and isinstance(agent, PiAgent)
        assert agent.name == "my-pi" and agent.mount().sandbox_path == PI_MOUNT and not agent.mount().writable


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("opencode", r"unknown sandbox backend 'opencode': choose one of local, docker, hf, or give a class of"),
        ("{m}:", r"bad sandbox backend path '{m}:': write it as 'package\.module:Class'"),
        ("{m}:My-Backend", r"bad sandbox backend path '{m}:My-Backend'"),
        ("{m}..MyBackend", r"bad sandbox backend path '{m}\.\.MyBackend'"),
        ("swe_grpo_no_such_module:MyBackend", r"'swe_grpo_no_such_module:MyBackend': no module named "),
        ("{m}.sub:MyBackend", r"'{m}\.sub:MyBackend': no module named '{m}\.sub'"),
        ("{broken}:MyBackend", r"'{broken}:MyBackend': importing module '{broken}' failed: No module named 'swe_gr"),
        ("{raising}:MyBackend", r"'{raising}:MyBackend': importing module '{raising}' failed: RuntimeError\('boom'\)"),
        ("{m}:Missing", r"sandbox backend '{m}:Missing': module '{m}' has no attribute 'Missing'"),
        ("{m}.Missing", r"sandbox backend '{m}\.Missing': module '{m}' has no attribute 'Missing'"),
        ("{m}:NOT_A_CLASS", r"sandbox backend '{m}:NOT_A_CLASS' is not a class but int 42"),
        ("{m}:NotABackend", r"sandbox backend '{m}:NotABackend': NotABackend is not a subclass of SandboxBackend"),
    ],
)
def test_each_bad_backend_is_refused_with_what_is_wrong(
    spec: str, error: str, user_module: Callable[[str], str]
) -> None:
    names = {
        "m": user_module(USER_MODULE),
        "broken": user_module("import swe_grpo_no_such_dependency\n"),
        "raising": user_module("raise RuntimeError('boom')\n"),
    }
    with pytest.raises(ValueError, match=error.format(**names)):
        make_backend(spec.format(**names))


def test_bad_agents_are_refused_with_what_is_wrong(user_module: Callable[[str], str]) -> None:
    module = user_module(USER_MODULE)
    with pytest.raises(
        ValueError,
        match=r"unknown agent 'gemini-cli': choose one of pi, mini-swe-agent, opencode, codex, claude-code, or give",
    ):
        make_agent("gemini-cli")
    with pytest.raises(ValueError, match=rf"agent '{module}:Missing': module '{module}' has no attribute"):
        make_agent(f"{module}:Missing")
    with pytest.raises(ValueError, match=rf"agent '{module}:NOT_A_CLASS' is not a class"):
        make_agent(f"{module}:NOT_A_CLASS")


def test_the_command_line_takes_a_class_path_and_refuses_an_unknown_name(
    user_module: Callable[[str], str], capsys: pytest.CaptureFixture[str], run_dir: Path
) -> None:
    module = user_module(USER_MODULE)
    args = parse_args([*ROLLOUT, "--sandbox", f"{module}:MyBackend", "--agent", f"{module}.MyAgent"])
    assert (args.sandbox, args.agent) == (f"{module}:MyBackend", f"{module}.MyAgent")
    assert type(make_backend(args.sandbox, greeting="hi", run_dir=run_dir)).__name__ == "MyBackend"
    assert type(make_agent(args.agent)).__name__ == "MyAgent"
    assert parse_args(ROLLOUT).sandbox == "local" and parse_args([*ROLLOUT, "--sandbox", "docker"]).sandbox == "docker"
    grade = ["grade", "--tasks", "t.jsonl", "--predictions", "p.jsonl", "--output", "o.jsonl"]
    assert parse_args([*grade, "--sandbox", "mypkg.sandboxes:Mine"]).sandbox == "mypkg.sandboxes:Mine"  # not imported
    for flags, error in (
        (["--sandbox", "nope"], "argument --sandbox: unknown sandbox backend 'nope': choose one of local, docker, hf"),
        (
            ["--agent", "gemini-cli"],
            "argument --agent: unknown agent 'gemini-cli': "
            "choose one of pi, mini-swe-agent, opencode, codex, claude-code",
        ),
        (["--sandbox", "a..b"], "argument --sandbox: bad sandbox backend path 'a..b'"),
    ):
        with pytest.raises(SystemExit):
            parse_args([*ROLLOUT, *flags])
        assert error in capsys.readouterr().err


def test_worker_config_takes_an_agent_path_without_importing_it() -> None:
    assert WorkerConfig(agent="mypkg.agents:MyAgent").agent == "mypkg.agents:MyAgent"
    assert "mypkg" not in sys.modules
    with pytest.raises(
        ValueError, match="unknown agent 'gemini-cli': choose one of pi, mini-swe-agent, opencode, codex, claude-code"
    ):
        WorkerConfig(agent="gemini-cli")
    with pytest.raises(ValueError, match="bad agent path 'mypkg:'"):
        WorkerConfig(agent="mypkg:")
    assert check_choice("mini-swe-agent", AGENTS, "agent") == "mini-swe-agent"
