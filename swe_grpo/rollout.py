"""One rollout, start to finish: sandbox -> interception session -> agent -> diff -> fresh-sandbox grade.

Everything a rollout creates (its sandbox, its interception session, the agent's process tree) is released
however it ends, cancellation included. The result is a `Trajectory`: the training rows and per-turn
records from the TokenChain, the reward, and an outcome with its provenance:

    resolved / unresolved / patch_apply_failed   graded; reward 1.0 / 0.0 / 0.0 (`unresolved` earns the
                       share of FAIL_TO_PASS tests passing under the "fraction" reward mode)
    setup_failed       the task's `setup_cmd` failed, timed out, exhausted the sandbox or changed the
                       repository: the task's (or the host's) failure, the agent never ran   reward None
    context_overflow   the conversation outgrew the model's context: after the policy's first turn reward 0.0,
                       the task's first prompt alone (before it)                         reward None
    budget_exceeded    the policy's conversations would have taken the rollout past its caps of training rows or
                       tokens (`ServingLimits.rollout_rows`, `rollout_tokens`: a new conversation each request);
                       after its first turn reward 0.0, the task's first prompt alone   reward None
    agent_stalled      after the policy's first turn, no model request within the stall limit  reward 0.0
    agent_timeout      after the policy's first turn, the agent's wall-clock limit, its waits for generations
                       left out (a slow vLLM is the host's: `RolloutView.waiting_s`)   reward 0.0
    agent_crashed      after the policy's first turn, the agent exited with a status that is neither 0, 1
                       nor a signal's (a crash, `process.exit(3)` reached through Node's inspector)  reward 0.0
    timeout            the agent stalled or hit its limit before its first model request was served, grading
                       timed out without a verdict, or the rollout outlived the worker's limit  reward None
    infra_error        vLLM unreachable or unusable (at any turn), a sandbox failure, the agent ending
                       before its first turn, or killed from the host (a negative status: `local`'s bwrap
                       was signalled, which nothing inside can reach): the host's doing   reward None
    resource_exhausted the agent ran its own sandbox out of memory, processes or disk,   reward 0.0
                       or its patch's code ran the grading sandbox out (`swe_grpo.grading`)
    agent_killed       the agent's process died of a signal after its first turn (`kill -9 $PPID` from
                       its own bash tool): nothing of the host signals it but the limits above   reward 0.0
    agent_disconnected the agent exited 1 with a reply on its way: one of its requests was still being served
                       as it exited, or its last error is `client_disconnected` (its client gave up on a
                       reply, then the agent): it gave up, it did not finish   reward 0.0
    patch_too_large    the agent's patch is over `RolloutConfig.max_patch_bytes`         reward 0.0
    base_commit_lost   the agent deleted the base commit's objects (`rm -rf .git`)       reward 0.0
    diff_unreadable    what the agent left cannot be read as a patch: a tracked file made a FIFO or
                       unreadable, an unreadable directory, a symlink target that is not UTF-8, an object
                       store with FIFOs, links or alternates in it (`Sandbox.diff`)       reward 0.0
    diff_timeout       taking the patch took longer than its bound (`Sandbox.diff`)      reward 0.0

`resource_exhausted` (`Sandbox.exhausted()` names the limit in `error`) is the policy's doing, as a wrong
patch is: a fork bomb, a memory hog or a disk filler is trained on as 0, so the policy learns not to; the
sandbox's own limits kept it from harming any other rollout, and it is not graded (what it left is not
the agent's intended work, and may not even give a diff). It takes precedence over the outcomes above
but a sandbox failure; the outcome keeps it apart from `unresolved` in the metrics.

A reward of None means "do not train on this as 0": the worker keeps such rollouts out of group
baselines. So it is kept for what the host did (decision 4), as our own components witness it (a failed
generation, a status only the host can give, a limit of ours that did not hold): whatever happens inside
the agent's sandbox, to the agent's own processes, its clock or its context after the policy's first turn
is the policy's doing, a named outcome with reward 0.0, or a policy could leave its group (and its negative
advantage) at will: `sleep 3600` or `kill -STOP $PPID` from its bash tool, a conversation grown past the
context, `exit 3`. Before the first turn the policy has said nothing, so nothing can be its doing. Masking
the truncations (`TRUNCATED_OUTCOMES`) instead is `WorkerConfig.mask_truncated`, never the default.

The patch is the agent's final tree against the task's base commit (`Sandbox.diff`: whatever the agent
did to git), never cut. `patch_too_large`, `base_commit_lost`, `diff_unreadable` and `diff_timeout` are
model failures, not missing data: the sandbox starts at the base commit and only the agent's commands
write to it, so a patch far larger than any fix (32 MiB by default: generated data, a virtualenv, build
output left in the tree), a repository whose base objects are gone or a tree git cannot read in bounded
time is the agent's doing. SWE-bench fails such predictions too, and a reward of None would let a policy
that floods, wipes or booby-traps the tree escape the group baseline instead of learning not to. None is
graded: there is no patch to grade. The agent's own outcomes above (context overflow, timeout, a kill, a
crash) take precedence, as their rollouts are not graded either.

Task setup: a task's `setup_cmd` (the task author's shell command, only ever from the task row, never from
the repository) runs in the agent's sandbox, in the repository, before the agent starts, within
`Task.setup_timeout_s`, with the sandbox's network (none, with the door). Its output goes nowhere near the
agent (only a failure's tail, into `error`). Before the agent starts, the agents' per-rollout directory
(`AGENT_FILES`) is removed, so nothing setup (or repository code it ran) left there configures the agent,
and the tree must diff empty against `base_commit` (what setup writes belongs in ignored paths or outside
the repository: anything else would be the agent's patch). On `docker`, a background process setup leaves
keeps running (on `local` every exec's processes end with it): a setup_cmd must not start daemons.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from swe_grpo.agents.base import Agent, AgentConfig, AgentResult, run_agent
from swe_grpo.grading import DEFAULT_TIMEOUT_S, GradeResult, grade
from swe_grpo.sandbox.base import DIFF_TIMEOUT_S, MAX_PATCH_BYTES, PatchError, Sandbox, SandboxBackend, SandboxError
from swe_grpo.sandbox.door import Door, check_allow
from swe_grpo.serving.handle import RolloutServer, RolloutView
from swe_grpo.tasks import Task
from swe_grpo.tasks.task import REWARD_MODES, RewardMode
from swe_grpo.tokens.chain import TrainingRow, TurnRecord, oldest_version
from swe_grpo.tokens.messages import Message
from swe_grpo.types import RequestError

log = logging.getLogger(__name__)

_INFRA_REQUEST_ERRORS = ("server_unavailable", "bad_response", "internal")
# An agent whose exit status is above this died of signal (status - 128): the shell's and docker's convention.
_SIGNALLED = 128
# Where every agent writes its per-rollout files in its sandbox's private /tmp (swe_grpo/agents/pi.py, mini_swe.py).
AGENT_FILES = "/tmp/swe_grpo"


@dataclass
class Trajectory:
    """One finished rollout."""

    instance_id: str
    rollout_id: str
    outcome: str
    reward: float | None
    rows: list[TrainingRow] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)  # the conversation through the last reply
    request_errors: list[RequestError] = field(default_factory=list)
    malformed_tool_calls: int = 0
    patch: str = ""
    grade: GradeResult | None = None
    agent: AgentResult | None = None
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    agent_name: str = ""  # the harness that ran it (`Agent.name`)

    @property
    def sandbox_failed_to_start(self) -> bool:
        """The task's sandbox could not be created: the task, or the backend, cannot run at all."""
        return self.outcome == "infra_error" and "sandbox_create" not in self.timings

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version that produced any of its tokens (None: it generated none)."""
        return oldest_version(self.rows)

    def summary(self) -> dict[str, Any]:
        """The one-line JSON record `swe-grpo rollout` writes."""
        g = self.grade
        completion = sum(sum(r.completion_mask) for r in self.rows)
        return {
            "instance_id": self.instance_id,
            "rollout_id": self.rollout_id,
            "reward": self.reward,
            "reward_mode": g.reward_mode if g else None,  # the mode that produced a graded reward
            "witnesses": list(g.witnesses) if g else [],  # the grader's tamper witnesses armed for this grade
            "outcome": self.outcome,
            "agent_name": self.agent_name,
            "f2p_passed": g.f2p_passed if g else 0,
            "f2p_total": g.f2p_total if g else 0,
            "p2p_passed": g.p2p_passed if g else 0,
            "p2p_total": g.p2p_total if g else 0,
            "num_turns": len(self.turns),
            "clean_turns": sum(t.kind == "clean" for t in self.turns),
            "retried_turns": sum(t.retries for t in self.turns),
            "forks": sum(t.kind == "fork" for t in self.turns),
            "prompt_tokens": sum(len(r.input_ids) for r in self.rows) - completion,
            "completion_tokens": completion,
            "malformed_tool_calls": self.malformed_tool_calls,
            "wall_s": round(self.timings.get("total", 0.0), 3),
            "error": self.error,
        }

    def to_json(self) -> dict[str, Any]:
        """Everything, with rows as plain lists (for `--save-trajectories`)."""
        return {
            **self.summary(),
            "rows": [r.as_dict() for r in self.rows],
            "turns": [asdict(t) for t in self.turns],
            "messages": self.messages,
            "request_errors": [asdict(e) for e in self.request_errors],
            "patch": self.patch,
            "grade": asdict(self.grade) if self.grade else None,
            "agent": asdict(self.agent) if self.agent else None,
            "timings": self.timings,
        }


@dataclass(frozen=True)
class RolloutConfig:
    agent: AgentConfig
    grade_timeout_s: float = DEFAULT_TIMEOUT_S
    plugin_autoload: bool = True  # pytest plugin autoload when grading; a task's own setting wins
    reward_mode: RewardMode = "binary"  # or "fraction" (swe_grpo.grading); a task's own setting wins
    max_patch_bytes: int = MAX_PATCH_BYTES
    # How long taking the agent's patch may take before it is `diff_timeout` (the policy's); raise it for much
    # larger repositories.
    diff_timeout_s: float = DIFF_TIMEOUT_S
    # The agent's sandbox has no network but its one door to its own endpoint (`swe_grpo.sandbox.door`); False:
    # it shares the backend's network. Backends whose mounts are copies (`hf`) cannot have a door: their
    # agents reach the server's public, token-authenticated endpoint.
    door: bool = True
    # With the door: the `host:port`s the agent may also reach, through an HTTPS proxy (`swe_grpo.sandbox.door`).
    allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_allow(self.allow, self.door)
        if self.reward_mode not in REWARD_MODES:
            raise ValueError(f"unknown reward_mode {self.reward_mode!r}: choose one of {', '.join(REWARD_MODES)}")


async def run_setup(sandbox: Sandbox, task: Task, config: RolloutConfig) -> str | None:
    """Run `task.setup_cmd` in the agent's sandbox, as the module docstring says; None when the agent may
    start, else why not (the rollout is then `setup_failed`)."""
    assert task.setup_cmd
    done = await sandbox.exec(task.setup_cmd, timeout_s=task.setup_timeout_s, cwd=sandbox.workdir)
    tail = (done.stdout + done.stderr).strip()[-1000:]
    if done.timed_out:
        return f"setup_cmd timed out after {task.setup_timeout_s:g}s: {tail}"
    if done.exit_code != 0:
        return f"setup_cmd failed (exit {done.exit_code}): {tail}"
    exhausted = await sandbox.exhausted()  # else the agent would be blamed for it
    if exhausted is not None:
        return f"setup_cmd ran the sandbox out of {exhausted} (its {exhausted} limit)"
    cleared = await sandbox.exec(["rm", "-rf", "--", AGENT_FILES], timeout_s=60)
    if cleared.exit_code != 0:
        return f"setup_cmd left {AGENT_FILES} that cannot be removed: {cleared.stderr.strip()[-300:]}"
    try:
        left = await sandbox.diff(task.base_commit, max_bytes=config.max_patch_bytes, timeout_s=config.diff_timeout_s)
    except PatchError as e:
        return f"setup_cmd left a tree that cannot be diffed ({e.outcome}): {e}"
    if left:
        changed = sorted(set(re.findall(r"^diff --git a/(\S+)", left, re.MULTILINE)))
        return f"setup_cmd changed the repository (it would be the agent's patch): {', '.join(changed[:10])}"
    return None


#: The policy's outcomes that are a limit cutting its run short, not a verdict on its work: what
#: `WorkerConfig.mask_truncated` (DeepSWE's "compact filtering") masks instead of training on as 0.
TRUNCATED_OUTCOMES = frozenset({"context_overflow", "agent_timeout", "agent_stalled"})


def outcome_before_grading(
    agent: AgentResult,
    errors: list[RequestError],
    turns: int,
    exhausted: str | None,
    unpatchable: PatchError | None,
    abandoned: bool = False,
) -> tuple[str, float | None, str] | None:
    """The (outcome, reward, error) the agent's run already settles, before any grading; None: grade it.
    `abandoned`: one of the agent's requests was still in flight when it exited (`RolloutView.in_flight`).

    Reward None only for what our own components witnessed (a generation that failed, a status only the host
    can give) or before the policy's first turn; after it, the clock, the context, the exit status and the
    agent's processes are the policy's (the module docstring's table)."""
    if exhausted:
        return "resource_exhausted", 0.0, f"the agent ran its sandbox out of {exhausted} (its {exhausted} limit)"
    code, tail = agent.exit_code, agent.stderr_tail[-500:]
    overflow = next((e.message for e in errors if e.kind == "context_overflow"), None)
    over_budget = next((e.message for e in errors if e.kind == "rollout_budget"), None)
    infra = [e for e in errors if e.kind in _INFRA_REQUEST_ERRORS]
    if turns == 0:  # the policy had not said anything yet: nothing that happened can be its doing
        if overflow is not None:
            return "context_overflow", None, f"the task's first prompt does not fit the context: {overflow}"
        if over_budget is not None:
            return "budget_exceeded", None, f"the task's first prompt is over the rollout's caps: {over_budget}"
        if infra:
            return "infra_error", None, f"generation failed: {infra[-1].kind}: {infra[-1].message}"
        if agent.stalled:
            return "timeout", None, "agent stalled before its first model request was served"
        if agent.timed_out:
            return "timeout", None, "agent hit its wall-clock limit before its first model request was served"
        return "infra_error", None, f"agent made no model request (exit {code}): {tail}"
    if infra:  # witnessed by our own server: never the policy's, whatever else happened
        return "infra_error", None, f"generation failed: {infra[-1].kind}: {infra[-1].message}"
    if overflow is not None:
        return "context_overflow", 0.0, overflow
    if over_budget is not None:
        return "budget_exceeded", 0.0, over_budget
    if agent.stalled:
        return "agent_stalled", 0.0, "agent stalled: no model request within the stall limit"
    if agent.timed_out:
        return "agent_timeout", 0.0, "agent hit its wall-clock limit"
    if code is not None and code < 0:  # bwrap itself signalled: nothing inside the sandbox can reach it
        return "infra_error", None, f"the agent's sandbox process was killed from the host (status {code}): {tail}"
    if code is not None and code > _SIGNALLED:
        return "agent_killed", 0.0, f"the agent's process died of signal {code - _SIGNALLED}: {tail}"
    if code not in (0, 1):
        return "agent_crashed", 0.0, f"the agent exited with status {code}: {tail}"
    if code == 1 and abandoned:
        return "agent_disconnected", 0.0, f"the agent exited while its reply was on its way: {tail}"
    if code == 1 and errors and errors[-1].kind == "client_disconnected":
        return "agent_disconnected", 0.0, f"the agent gave up after its connection was lost: {tail}"
    if unpatchable is not None:
        return unpatchable.outcome, 0.0, str(unpatchable)
    return None


async def run_rollout(
    task: Task,
    server: RolloutServer,
    backend: SandboxBackend,
    agent: Agent,
    config: RolloutConfig,
    rollout_id: str | None = None,
    on_grading: Callable[[Trajectory], None] | None = None,
    on_session: Callable[[RolloutView], None] | None = None,
) -> Trajectory:
    """Run `agent` on `task` in a sandbox, grade its diff in a fresh one, and return the Trajectory.
    `on_session` is called with the rollout's handle on `server` once it is open (the worker's hook to watch its
    tokens' versions, `oldest_version()`); `on_grading` as grading starts, with the trajectory so far (its rows
    are final): the worker's hook to track, and cancel as stale, rollouts whose handle is already closed."""
    rollout_id = rollout_id or f"{task.instance_id.replace('/', '_')[:64]}-{uuid.uuid4().hex[:12]}"
    timings: dict[str, float] = {}
    start = time.monotonic()
    ran: AgentResult | None = None
    patch, error, exhausted, setup_error = "", None, None, None
    abandoned = False
    unpatchable: PatchError | None = None
    door = replace(Door.make(rollout_id), allow=config.allow) if config.door and backend.live_mounts else None
    proxy: asyncio.Server | None = None
    try:
        async with server.rollout(rollout_id, socket=door.socket if door else None) as session:
            if on_session is not None:
                on_session(session)
            try:
                proxy = await door.serve_allowlist() if door and door.allow else None
                mounts = [agent.mount(), *([door.mount()] if door else [])]
                sandbox = await backend.create(task, mounts=mounts, network=door is None)
                timings["sandbox_create"] = time.monotonic() - start
                try:
                    if task.setup_cmd:
                        setup_started = time.monotonic()
                        setup_error = await run_setup(sandbox, task, config)
                        timings["setup"] = time.monotonic() - setup_started
                    if setup_error is None:
                        ran = await run_agent(
                            agent,
                            sandbox,
                            session.endpoint,
                            task.problem_statement,
                            config.agent,
                            session.last_activity,
                            door=door,
                            waiting_s=session.waiting_s,
                        )
                        timings["agent"] = ran.wall_s
                        abandoned = session.in_flight()
                        exhausted = await sandbox.exhausted()
                        if exhausted is None:
                            try:
                                patch = await sandbox.diff(
                                    task.base_commit, max_bytes=config.max_patch_bytes, timeout_s=config.diff_timeout_s
                                )
                            except PatchError as e:
                                unpatchable = e
                finally:
                    await sandbox.destroy()
            except SandboxError as e:
                error = f"sandbox: {e}"
    finally:
        if proxy is not None:
            proxy.close()
        if door is not None:
            door.remove()
    record = session.record
    assert record is not None  # the block closed the rollout
    timings["generation"] = record.generation_s

    trajectory = Trajectory(
        instance_id=task.instance_id,
        rollout_id=rollout_id,
        outcome="infra_error",
        reward=None,
        rows=record.rows,
        turns=record.turns,
        messages=record.messages,
        request_errors=record.errors,
        malformed_tool_calls=record.malformed_tool_calls,
        patch=patch,
        agent=ran,
        error=error,
        timings=timings,
        agent_name=agent.name,
    )
    decided = (
        outcome_before_grading(ran, record.errors, len(record.turns), exhausted, unpatchable, abandoned)
        if ran and not error
        else None
    )
    if setup_error is not None and not error:  # the task's failure, not the policy's: never trained on
        trajectory.outcome, trajectory.reward, trajectory.error = "setup_failed", None, setup_error
    elif decided:
        trajectory.outcome, trajectory.reward, trajectory.error = decided
    elif not error:  # a sandbox failure at any point (even after the agent ran) is infra_error, never a graded 0
        if on_grading is not None:
            on_grading(trajectory)
        result = await grade(
            task,
            patch,
            backend,
            timeout_s=config.grade_timeout_s,
            plugin_autoload=config.plugin_autoload,
            reward_mode=config.reward_mode,
        )
        trajectory.grade = result
        trajectory.outcome, trajectory.reward, trajectory.error = result.outcome, result.reward, result.error
    timings["total"] = time.monotonic() - start
    return trajectory


async def run_rollout_within(
    limit_s: float,
    task: Task,
    server: RolloutServer,
    backend: SandboxBackend,
    agent: Agent,
    config: RolloutConfig,
    rollout_id: str,
    on_grading: Callable[[Trajectory], None] | None = None,
    on_session: Callable[[RolloutView], None] | None = None,
) -> Trajectory:
    """`run_rollout` within `limit_s` seconds, for a caller that runs many (the worker's training and held-out
    rollouts): whatever goes wrong inside it is its outcome, never an exception: `timeout` past the limit, else
    `rollout_error`, reward None, logged. Cancellation passes through.

    Past the limit is the host's (reward None), even after the policy's first turn: every stage the policy
    paces has its own, shorter bound inside, and each is the policy's outcome when it passes (the agent's
    wall clock and stall limit, the diff's, grading's); the worker's limit is their sum plus an allowance
    for our sandboxes (`WorkerConfig.rollout_limit_s`). Reaching it means a bound of ours did not hold (a
    sandbox that would not start or go, a hung component): our failure, witnessed by our clock."""
    deadline = asyncio.timeout(limit_s)
    try:
        async with deadline:
            return await run_rollout(
                task, server, backend, agent, config, rollout_id, on_grading=on_grading, on_session=on_session
            )
    except Exception as e:
        if isinstance(e, TimeoutError) and deadline.expired():
            outcome, error = "timeout", f"the rollout exceeded the worker's limit of {limit_s:.0f}s"
        else:
            outcome, error = "rollout_error", f"{type(e).__name__}: {e}"
        log.warning("rollout %s of %s ended as %s: %s", rollout_id, task.instance_id, outcome, error, exc_info=e)
        return Trajectory(
            instance_id=task.instance_id,
            rollout_id=rollout_id,
            outcome=outcome,
            reward=None,
            error=error,
            agent_name=agent.name,
        )
