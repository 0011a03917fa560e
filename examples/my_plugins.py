"""A user's own sandbox backend and agent, plugged in by dotted path (examples/ on PYTHONPATH):

swe-grpo rollout --tasks demo --sandbox my_plugins:TimedBackend --agent my_plugins:CarefulPi ...
WorkerConfig(agent="my_plugins:CarefulPi"), SWERolloutWorker(..., sandbox="my_plugins:TimedBackend")
"""

import logging
import time

from swe_grpo.agents.pi import PiAgent
from swe_grpo.sandbox.local import LocalBackend

log = logging.getLogger(__name__)


class TimedBackend(LocalBackend):
    """bubblewrap sandboxes, each one's start time logged."""

    async def create(self, task, mounts=(), *, network=False):
        start = time.monotonic()
        sandbox = await super().create(task, mounts, network=network)
        log.info("%s: sandbox ready in %.2f s", task.instance_id, time.monotonic() - start)
        return sandbox


class CarefulPi(PiAgent):
    """Pi, asked to run the repository's tests before it finishes."""

    name = "pi-careful"

    def launch(self, workdir, endpoint, problem_statement, config):
        statement = f"{problem_statement}\n\nRun the repository's tests before you finish."
        return super().launch(workdir, endpoint, statement, config)
