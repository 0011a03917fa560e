"""What the policy does inside its own sandbox is the policy's doing: a named outcome with reward 0.0, never
`infra_error` (reward None would take the rollout out of its GRPO group, so the policy would escape its
baseline). On the real `local` and `docker` backends, the agent's actions are run as the agent runs them
(`exec` in /testbed, or `run_agent` for the agent's own process), then the patch is taken and the outcome
decided by the rollout's own code (`swe_grpo.rollout.outcome_before_grading`); and whole rollouts
(`run_rollout`: real InterceptionServer and vLLM, the agent behind its door, grading in a fresh sandbox) with a
thin real agent (tests/script_agent.py) that asks its model, then does it."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from conftest import SERVED_NAME
from sandbox_helpers import calc_task, make_repo
from script_agent import ScriptAgent
from test_pi_integration import RecordingClient

from swe_grpo.agents.base import AgentConfig, AgentResult, Launch, run_launch
from swe_grpo.agents.pi import PiAgent
from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.evaluation.metrics import build_report
from swe_grpo.evaluation.run import attempt_record
from swe_grpo.evaluation.store import done
from swe_grpo.extras.vllm_server import VLLMServer
from swe_grpo.rollout import RolloutConfig, Trajectory, outcome_before_grading, run_rollout
from swe_grpo.sandbox.base import MAX_PATCH_LINES, PatchError, SandboxBackend
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import Generation, SamplingParams, VLLMClient
from swe_grpo.tasks import Task
from swe_grpo.types import RequestError, RolloutEndpoint
from swe_grpo.worker.telemetry import rollout_metrics

# What an agent can leave in its tree that git cannot read as a patch (each the policy's outcome, not infra_error).
UNREADABLE = {
    "fifo-replaces-a-tracked-file": "rm old.txt && mkfifo old.txt",
    "chmod-000-tracked-file": "chmod 000 calc.py",
    "chmod-000-new-file": "echo new > new.txt && chmod 000 new.txt",
    "chmod-000-directory": "mkdir -p pkg && echo x > pkg/a.py && chmod 000 pkg",
    "symlink-target-not-utf8": "ln -s $'\\xff\\xfe' badlink",
    # git read the object store's alternates through this FIFO and blocked until the diff's timeout (300 s).
    "fifo-alternates": "mkfifo .git/objects/info/alternates",
    "alternates-to-a-fifo-store": "mkdir -p /tmp/o/info && mkfifo /tmp/o/info/alternates"
    " && echo /tmp/o > .git/objects/info/alternates",
    "fifo-pack": "mkfifo .git/objects/pack/pack-" + "0" * 40 + ".idx",
    "symlinked-pack-to-a-fifo": "mkfifo /tmp/f && ln -s /tmp/f .git/objects/pack/pack-" + "1" * 40 + ".idx",
    "fifo-gitignore": "mkfifo sub.gitignore && mkdir d && mv sub.gitignore d/.gitignore",
    "fifo-gitattributes": "mkdir d && mkfifo d/.gitattributes",
}
# What an agent may leave that is harmless: git ignores untracked special files, so the patch is taken.
HARMLESS = "mkfifo untracked.fifo && python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"s.sock\")'"
# The diff must end well before any of these: nothing the agent left may make it wait.
QUICK_S = 30.0


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    return calc_task(make_repo(tmp_path_factory.mktemp("origin")))


async def act(sandbox, command: str) -> None:
    done = await sandbox.exec(command, timeout_s=60)
    assert done.exit_code == 0, done.stderr


@pytest.mark.parametrize("action", UNREADABLE)
async def test_a_tree_git_cannot_read_is_a_named_outcome_quickly(
    backend: SandboxBackend, task: Task, action: str
) -> None:
    async with await backend.create(task) as sandbox:
        await act(sandbox, f"echo changed >> calc.py && {UNREADABLE[action]}")
        start = time.monotonic()
        with pytest.raises(PatchError) as caught:
            await asyncio.wait_for(sandbox.diff(task.base_commit), QUICK_S * 2)
        assert time.monotonic() - start < QUICK_S
    assert caught.value.outcome == "diff_unreadable", caught.value
    decided = outcome_before_grading(finished(), [], turns=3, exhausted=None, unpatchable=caught.value)
    assert decided is not None and decided[:2] == ("diff_unreadable", 0.0)


async def test_untracked_special_files_are_left_out_of_the_patch(backend: SandboxBackend, task: Task) -> None:
    async with await backend.create(task) as sandbox:
        await act(sandbox, f"echo changed >> calc.py && {HARMLESS}")
        patch = await sandbox.diff(task.base_commit)
    assert "+changed" in patch and "fifo" not in patch and "sock" not in patch


async def test_a_diff_over_its_time_bound_is_a_named_outcome(backend: SandboxBackend, task: Task) -> None:
    async with await backend.create(task) as sandbox:
        await act(sandbox, "echo changed >> calc.py")
        with pytest.raises(PatchError) as caught:
            await sandbox.diff(task.base_commit, timeout_s=0.01)
    assert caught.value.outcome == "diff_timeout"


def finished(exit_code: int | None = 0) -> AgentResult:
    return AgentResult(exit_code, False, False, 1.0, "", "")


async def run_as_agent(sandbox, script: str) -> AgentResult:
    """`script` run the way every agent is run (`run_launch`, what `run_agent` runs: the agent's process in the
    sandbox)."""
    launch = Launch(argv=["bash", "-c", script], env={}, files={}, secret_env="TOKEN")
    config = AgentConfig(context_window=1024, max_tokens=16, timeout_s=60)
    return await run_launch(sandbox, launch, "secret", config, time.monotonic)


async def test_an_agent_killed_by_its_own_tool_is_a_named_outcome(backend: SandboxBackend, task: Task) -> None:
    """`kill -9 $PPID` from the agent's bash tool: the tool's parent is the agent."""
    async with await backend.create(task) as sandbox:
        ran = await run_as_agent(sandbox, "bash -c 'kill -9 $PPID'; echo survived")
    assert ran.exit_code == 137 and "survived" not in ran.stdout_tail
    decided = outcome_before_grading(ran, [], turns=2, exhausted=None, unpatchable=None)
    assert decided is not None and decided[:2] == ("agent_killed", 0.0), decided


def test_an_agent_that_exits_after_its_client_gave_up_is_named() -> None:
    gone = RequestError("client_disconnected", "the agent went away before its reply was sent", 2, 0.0)
    decided = outcome_before_grading(finished(1), [gone], turns=2, exhausted=None, unpatchable=None)
    assert decided is not None and decided[:2] == ("agent_disconnected", 0.0), decided
    # One that lost a reply, retried and finished is graded; so is one whose last turn failed otherwise.
    assert outcome_before_grading(finished(0), [gone], turns=3, exhausted=None, unpatchable=None) is None
    bad = RequestError("bad_request", "malformed messages", 3, 0.0)
    assert outcome_before_grading(finished(1), [bad], turns=2, exhausted=None, unpatchable=None) is None
    assert outcome_before_grading(finished(1), [gone, bad], turns=3, exhausted=None, unpatchable=None) is None
    # One that exits 1 while a request of its is still being served (the server had not looked at the connection
    # yet, so nothing is recorded) gave up as well; exiting 0, or before the policy's first turn, it did not.
    decided = outcome_before_grading(finished(1), [bad], turns=2, exhausted=None, unpatchable=None, abandoned=True)
    assert decided is not None and decided[:2] == ("agent_disconnected", 0.0), decided
    assert outcome_before_grading(finished(0), [], turns=2, exhausted=None, unpatchable=None, abandoned=True) is None
    decided = outcome_before_grading(finished(1), [], turns=0, exhausted=None, unpatchable=None, abandoned=True)
    assert decided is not None and decided[:2] == ("infra_error", None), decided


def test_host_failures_stay_infra() -> None:
    """What the policy cannot have caused: a generation failure, an agent that died before the model said
    anything (the policy had not acted yet), a sandbox process killed from the host (a negative status:
    `local`'s bwrap, which nothing inside can see)."""
    down = RequestError("server_unavailable", "vLLM is down", 0, 0.0)
    assert outcome_before_grading(finished(1), [down], turns=1, exhausted=None, unpatchable=None)[:2] == (
        "infra_error",
        None,
    )
    assert outcome_before_grading(finished(137), [], turns=0, exhausted=None, unpatchable=None)[:2] == (
        "infra_error",
        None,
    )
    assert outcome_before_grading(finished(-9), [], turns=2, exhausted=None, unpatchable=None)[:2] == (
        "infra_error",
        None,
    )


def ran(*, exit_code: int | None = 0, stalled: bool = False, timed_out: bool = False) -> AgentResult:
    return AgentResult(exit_code, timed_out, stalled, 1.0, "", "")


# How an agent's run can end that once took the rollout out of its group (reward None) after the policy's first
# turn: (how it ended, its request errors) -> the policy's named outcome, reward 0.0.
OVERFLOW = RequestError("context_overflow", "prompt of 9000 tokens is over the context of 8192", 2, 0.0)
CUT_SHORT = {
    "stalled": (ran(exit_code=None, stalled=True), [], "agent_stalled"),
    "wall-clock": (ran(exit_code=None, timed_out=True), [], "agent_timeout"),
    "exit-3": (ran(exit_code=3), [], "agent_crashed"),
    "exit-127": (ran(exit_code=127), [], "agent_crashed"),
    "context-overflow": (ran(exit_code=1), [OVERFLOW], "context_overflow"),
}


@pytest.mark.parametrize("case", CUT_SHORT)
def test_after_the_first_turn_the_clock_the_context_and_the_exit_status_are_the_policys(case: str) -> None:
    result, errors, outcome = CUT_SHORT[case]
    decided = outcome_before_grading(result, errors, turns=1, exhausted=None, unpatchable=None)
    assert decided is not None and decided[:2] == (outcome, 0.0), decided
    # Before the policy's first turn it had said nothing: the same ends are not its doing.
    before = outcome_before_grading(result, errors, turns=0, exhausted=None, unpatchable=None)
    assert before is not None and before[1] is None, before
    assert before[0] == ("context_overflow" if errors else "timeout" if result.exit_code is None else "infra_error")


def test_a_generation_failure_stays_infra_whatever_the_agent_did() -> None:
    """A failure our own server witnessed wins over any end the policy could choose: never trained on as 0."""
    down = RequestError("server_unavailable", "vLLM is down", 1, 0.0)
    for result, errors, _ in CUT_SHORT.values():
        decided = outcome_before_grading(result, [*errors, down], turns=2, exhausted=None, unpatchable=None)
        assert decided is not None and decided[:2] == ("infra_error", None), decided


# --- whole rollouts: a real agent, through its door, on the real stack -----------------------------------------


class HeldClient(VLLMClient):
    """The real vLLM client; every generation after the first starts `hold_s` late: a reply that takes a moment, so
    that the agent can give up while it is on its way."""

    def __init__(self, base_url: str, model: str, *, hold_s: float, **kwargs: Any) -> None:
        super().__init__(base_url, model, **kwargs)
        self.hold_s = hold_s
        self.generations = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams, model: str | None = None) -> Generation:
        self.generations += 1
        if self.generations > 1:
            await asyncio.sleep(self.hold_s)
        return await super().generate(prompt_ids, params, model)


@pytest.fixture(scope="module")
def strutil() -> Task:
    """A demo task with tests, so a rollout that is graded is graded for real (an unchanged tree: unresolved)."""
    return next(t for t in demo_tasks() if t.instance_id == "swe-grpo-demo__strutil-1")


@pytest.fixture(scope="module")
def agent_home() -> Iterator[Path]:
    """Where the script agent is installed: a host directory every sandbox user can reach."""
    home = Path(tempfile.mkdtemp(prefix="swe_grpo-script-agent-"))
    home.chmod(0o755)
    yield home
    shutil.rmtree(home)


async def whole_rollout(
    vllm_server: VLLMServer,
    tokenizer,
    backend: SandboxBackend,
    task: Task,
    agent: ScriptAgent,
    hold_s: float = 0.0,
    stall_timeout_s: float = 300.0,
) -> Trajectory:
    """`agent` on `task` through `run_rollout`, as training runs it (with the door); nothing is left open."""
    client = HeldClient(vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id], hold_s=hold_s)
    async with client, InterceptionServer(client, tokenizer, model_name=SERVED_NAME) as server:
        limits = AgentConfig(
            context_window=client.max_model_len, max_tokens=8, timeout_s=120, stall_timeout_s=stall_timeout_s
        )
        config = RolloutConfig(agent=limits)
        trajectory = await run_rollout(task, server, backend, agent, config)
        assert server.open_rollouts == 0
    return trajectory


@pytest.mark.integration
async def test_an_agent_that_gives_up_on_its_reply_and_exits_is_named_end_to_end(
    vllm_server, tokenizer, backend: SandboxBackend, strutil: Task, agent_home: Path
) -> None:
    """After the policy's first turn, the agent's client gives up on its second reply while it is being generated
    (it closes its connection without reading it) and the agent exits 1, as Pi does once its retries are spent:
    `agent_disconnected`, reward 0.0, counted under its own name; not graded, not `infra_error`. The generation is
    held for longer than the server's keep-alive, so the agent is gone (and its rollout closed) before the server
    looks at its connection again."""
    agent = ScriptAgent(agent_home, "drop")
    trajectory = await whole_rollout(vllm_server, tokenizer, backend, strutil, agent, hold_s=30.0)
    assert trajectory.agent is not None and trajectory.agent.exit_code == 1, trajectory.agent
    assert "gave up waiting" in trajectory.agent.stderr_tail
    assert (trajectory.outcome, trajectory.reward) == ("agent_disconnected", 0.0), trajectory.error
    assert trajectory.grade is None and len(trajectory.turns) == 1
    assert rollout_metrics(trajectory)["rollout/outcome_agent_disconnected_total"] == 1.0


@pytest.mark.integration
@pytest.mark.parametrize(("behaviour", "status"), [("finish", 0), ("finish_1", 1), ("drop_0", 0)])
async def test_an_agent_that_read_its_reply_or_exits_0_is_graded_end_to_end(
    vllm_server, tokenizer, backend: SandboxBackend, strutil: Task, agent_home: Path, behaviour: str, status: int
) -> None:
    """The same agent with its reply read whole, then exiting 0 or 1 (it lost no reply), or giving up on its second
    reply but exiting 0 (it says it finished): its tree is graded (left unchanged: `unresolved`), never
    `agent_disconnected`."""
    agent = ScriptAgent(agent_home, behaviour)
    trajectory = await whole_rollout(vllm_server, tokenizer, backend, strutil, agent, hold_s=30.0)
    assert trajectory.agent is not None and trajectory.agent.exit_code == status, trajectory.agent
    assert len(trajectory.turns) == 1
    assert all(e.kind == "client_disconnected" for e in trajectory.request_errors) and (
        behaviour == "drop_0" or trajectory.request_errors == []
    )
    assert (trajectory.outcome, trajectory.reward) == ("unresolved", 0.0), trajectory.error
    assert trajectory.grade is not None


# The cases of issue 23 §2, as an agent's bash tool runs them after the policy's first turn: (command, outcome).
# Each but the huge file once took the rollout out of its group (infra_error, reward None), or hung its diff.
AGENT_ACTIONS = {
    "fifo-replaces-readme": ("rm README.md && mkfifo README.md", "diff_unreadable"),
    "chmod-000-tracked-file": ("chmod 000 strutil.py", "diff_unreadable"),
    "chmod-000-new-file": ("echo new > new.txt && chmod 000 new.txt", "diff_unreadable"),
    "symlink-target-not-utf8": ("ln -s $'\\xff\\xfe' badlink", "diff_unreadable"),
    "fifo-alternates": ("mkfifo .git/objects/info/alternates", "diff_unreadable"),
    "kill-9-ppid": ("kill -9 $PPID", "agent_killed"),  # the tool's parent is the agent
    # 40 MB of text: over the patch limit (`MAX_PATCH_BYTES`, 32 MiB).
    "huge-file": ("head -c 30000000 /dev/urandom | base64 > noise.txt", "patch_too_large"),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", AGENT_ACTIONS)
async def test_what_the_agent_does_to_its_sandbox_is_named_end_to_end(
    vllm_server, tokenizer, backend: SandboxBackend, strutil: Task, agent_home: Path, case: str
) -> None:
    """Whole rollouts whose agent, after the policy's first turn, runs one of the cases above: the named outcome,
    reward 0.0, counted under its own name, not graded, and well within the diff's own time bound."""
    action, outcome = AGENT_ACTIONS[case]
    trajectory = await whole_rollout(
        vllm_server, tokenizer, backend, strutil, ScriptAgent(agent_home, "finish", action)
    )
    assert (trajectory.outcome, trajectory.reward) == (outcome, 0.0), (trajectory.error, trajectory.agent)
    assert len(trajectory.turns) == 1 and trajectory.grade is None
    assert rollout_metrics(trajectory)[f"rollout/outcome_{outcome}_total"] == 1.0
    assert trajectory.timings["total"] < QUICK_S * 3


# Ends the policy once chose from its bash tool after its first turn, each a rollout out of its group (reward None):
# (behaviour, action, outcome). A stall limit of 3 s keeps the stalls short.
POLICY_ENDS = {
    "sleep-3600": ("finish", "sleep 3600", "agent_stalled"),  # the agent waits on its tool for ever
    "stop-the-agent": ("finish", "kill -STOP $PPID", "agent_stalled"),  # the tool's parent is the agent
    "exit-3": ("finish_3", "", "agent_crashed"),
    "context-overflow": ("overflow", "", "context_overflow"),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", POLICY_ENDS)
async def test_the_policys_own_end_is_its_outcome_end_to_end(
    vllm_server, tokenizer, backend: SandboxBackend, strutil: Task, agent_home: Path, case: str
) -> None:
    """Whole rollouts whose agent, after the policy's first turn, stalls for ever, is stopped by its own tool,
    exits 3 or outgrows the context: the policy's named outcome, reward 0.0, in its group's baseline, not graded;
    and in `swe-grpo eval`, an unresolved attempt (not an infra failure, never re-run by --retry-infra)."""
    behaviour, action, outcome = POLICY_ENDS[case]
    agent = ScriptAgent(agent_home, behaviour, action)
    trajectory = await whole_rollout(vllm_server, tokenizer, backend, strutil, agent, stall_timeout_s=3.0)
    assert (trajectory.outcome, trajectory.reward) == (outcome, 0.0), (trajectory.error, trajectory.agent)
    assert len(trajectory.turns) == 1 and trajectory.grade is None
    assert rollout_metrics(trajectory)[f"rollout/outcome_{outcome}_total"] == 1.0
    assert trajectory.timings["total"] < QUICK_S * 3
    record = attempt_record(trajectory, 0, None)
    assert not record["infra"] and done([record], retry_infra=True) == {(strutil.instance_id, 0)}
    report = build_report([record], k=1)
    assert (report["attempts_scored"], report["infra_failures"], report["resolved_rate"]) == (1, 0, 0.0)


# Pi's bash tool, as the policy's first turn: signal every Node in the sandbox (Pi's) with SIGUSR1, which opens Node's
# inspector (and through it, `process.exit(3)` in Pi) unless Node runs with --disable-sigusr1; look for the inspector;
# then outlast the per-command limit.
REACH_INTO_PI = (
    "for p in /proc/[0-9]*; do case $(readlink $p/exe) in */node) kill -USR1 ${p#/proc/};; esac; done; sleep 1; "
    "(exec 3<>/dev/tcp/127.0.0.1/9229) 2>/dev/null && echo INSPECTOR_OPEN || echo INSPECTOR_CLOSED; "
    "sleep 3600; echo OUTLASTED"
)


@pytest.mark.integration
async def test_pis_commands_cannot_open_its_inspector_and_end_at_their_limit(
    vllm_server, tokenizer, pi_bundle, local_backend: SandboxBackend, strutil: Task
) -> None:
    """The real Pi behind its door: its bash tool's `kill -USR1` of Pi opens no inspector (it did without
    `--disable-sigusr1`: INSPECTOR_OPEN), and its `sleep 3600` is killed at the per-command limit (3 s), the model
    told so, long before the stall limit (120 s: Pi's start on this loaded box once took 30): the rollout goes on to
    its next turn and is the policy's outcome (reward 0.0), never None."""
    call = "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": REACH_INTO_PI}}) + "\n</tool_call>"
    client = RecordingClient(vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id], guided=[call])
    sampling = SamplingParams(max_tokens=512)
    async with client, InterceptionServer(client, tokenizer, model_name=SERVED_NAME, sampling=sampling) as server:
        limits = AgentConfig(
            context_window=client.max_model_len, max_tokens=512, timeout_s=300, stall_timeout_s=120, command_timeout_s=3
        )
        trajectory = await run_rollout(strutil, server, local_backend, PiAgent(pi_bundle), RolloutConfig(agent=limits))
    results = json.dumps([m for m in trajectory.messages if m.get("role") == "tool"])
    assert "INSPECTOR_CLOSED" in results and "OUTLASTED" not in results, results
    assert "ran past its limit of 3 s" in results, results
    assert len(trajectory.turns) >= 2 and trajectory.reward == 0.0, (trajectory.outcome, trajectory.error)


class Neighbour(threading.Thread):
    """Another rollout on the same InterceptionServer, asking its own models route every 20 ms from a thread of its
    own (its clock is not the server's loop): how long each answer took."""

    def __init__(self, endpoint: RolloutEndpoint) -> None:
        super().__init__(daemon=True)
        url = urlsplit(endpoint.base_url)
        self.address, self.path = (url.hostname, url.port), f"{url.path}/models"
        self.headers = {"Authorization": f"Bearer {endpoint.token}"}
        self.latencies: list[float] = []
        self.done = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection(*self.address, timeout=60)
        while not self.done.is_set():
            started = time.monotonic()
            conn.request("GET", self.path, headers=self.headers)
            reply = conn.getresponse()
            reply.read()
            assert reply.status == 200, reply.status
            self.latencies.append(time.monotonic() - started)
            self.done.wait(0.02)
        conn.close()


@pytest.mark.integration
async def test_a_patch_of_ten_million_lines_is_refused_before_parsing_and_stalls_no_neighbour(
    vllm_server, tokenizer, local_backend: SandboxBackend, strutil: Task, agent_home: Path
) -> None:
    """Issue 35: 10 M one-character lines (30 MB of patch, under the byte bound) were parsed on the serving loop for
    18.5 s (a neighbour's request waited that long) and graded `resolved`. Now the line bound refuses the patch
    before anything parses it: `patch_too_large`, reward 0.0, while a neighbour rollout's requests on the same
    server are answered within 100 ms."""
    action = "python3 -c \"open('lines.txt', 'w').write('a\\n' * 10_000_000)\""
    agent = ScriptAgent(agent_home, "finish", action)
    client = HeldClient(vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id], hold_s=0.0)
    async with (
        client,
        InterceptionServer(client, tokenizer, model_name=SERVED_NAME) as server,
        server.rollout() as other,
    ):
        neighbour = Neighbour(other.endpoint)
        neighbour.start()
        try:
            limits = AgentConfig(context_window=client.max_model_len, max_tokens=8, timeout_s=120)
            trajectory = await run_rollout(strutil, server, local_backend, agent, RolloutConfig(agent=limits))
        finally:
            neighbour.done.set()
            await asyncio.to_thread(neighbour.join)
    assert (trajectory.outcome, trajectory.reward) == ("patch_too_large", 0.0), (trajectory.error, trajectory.agent)
    assert f"larger than {MAX_PATCH_LINES} lines" in trajectory.error and trajectory.grade is None
    assert trajectory.timings["total"] < QUICK_S * 3
    # On this shared 2-core box (load 20-35 while measured) any thread waits for a core now and then, whatever the
    # loop does: 2 of 3,193 answers took 0.12-0.23 s, the slowest loop callbacks were plain answers to the
    # neighbour. So: 99 % within 100 ms, none near the seconds the parse took.
    latencies = sorted(neighbour.latencies)
    assert len(latencies) > 10 and latencies[len(latencies) * 99 // 100] < 0.1 and latencies[-1] < 1.0, latencies[-5:]


def test_a_rollout_over_its_rows_or_tokens_cap_is_the_policys_outcome() -> None:
    """The server refuses a rollout's request past its rows or tokens cap (`ServingLimits.rollout_rows`,
    `rollout_tokens`; recorded `rollout_budget`): once the policy has spoken that is its doing, reward 0, whatever
    the agent did next; before its first turn (the task's first prompt alone over the cap) it is not."""
    over = RequestError("rollout_budget", "the rollout holds 64 training rows, its cap", 5, 0.0)
    for ran in (finished(0), finished(1), finished(3)):
        decided = outcome_before_grading(ran, [over], turns=5, exhausted=None, unpatchable=None)
        assert decided is not None and decided[:2] == ("budget_exceeded", 0.0), decided
    decided = outcome_before_grading(finished(1), [over], turns=0, exhausted=None, unpatchable=None)
    assert decided is not None and decided[1] is None, decided


async def test_the_time_an_agent_waits_for_generations_is_not_on_its_clock(backend: SandboxBackend, task: Task) -> None:
    """A slow vLLM is the host's, not the policy's: the agent's wall-clock limit counted the time it waited for its
    replies, so a slow server turned into `agent_timeout`, reward 0. Its clock now leaves out `waiting_s()` (the
    rollout's generations: `RolloutView.waiting_s`): an agent that ran 3 s under a 2 s limit, all but 0.5 s of it
    waiting, finishes; the same run with no wait is still ended at its limit."""
    launch = Launch(argv=["bash", "-c", "sleep 3; echo finished"], env={}, files={}, secret_env="TOKEN")
    config = AgentConfig(context_window=1024, max_tokens=16, timeout_s=2)
    async with await backend.create(task) as sandbox:
        started = time.monotonic()
        waited = await run_launch(
            sandbox,
            launch,
            "secret",
            config,
            time.monotonic,
            waiting_s=lambda: max(0.0, time.monotonic() - started - 0.5),
        )
        own = await run_launch(sandbox, launch, "secret", config, time.monotonic)
    assert waited.exit_code == 0 and not waited.timed_out and "finished" in waited.stdout_tail, waited
    assert own.timed_out and "finished" not in own.stdout_tail, own
