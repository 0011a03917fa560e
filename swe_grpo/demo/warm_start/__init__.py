"""A warm-started tiny policy for the CPU learning demo: the tiny model, fine-tuned so that Pi can drive it.

A randomly initialised tiny model never writes a tool call, so GRPO has nothing to reinforce. This package
teaches it, by supervised fine-tuning on CPU, one small repertoire per bundled demo task: when Pi runs
it on the task, its first turn is one of a few candidate `bash` tool calls (one fixes the task, the
others are plausible wrong fixes; see `swe_grpo/demo/tasks/warm_start/candidates.json`), drawn roughly
uniformly, and after the tool result its second turn is `Done.` and the end-of-turn token, so Pi exits.
RL then has a real choice to learn: which candidate.

The training tokens are exactly the tokens a rollout puts in its training row. The conversations are
the default Pi's real requests (`pi_requests.json` beside it, captured by running the real Pi in
a `local` sandbox against an InterceptionServer answering with the candidate, see `capture_pi_requests`),
replayed through the same TokenChain and ResponseParser the server uses. Nothing in them varies between
runs of Pi on these tasks (the working directory is always /testbed, Pi's documentation paths are under
the fixed bundle mount, and the default Pi puts no date in its prompt), so one replay serves every step.

Fine-tuning is fast because the twelve sequences of a step (3 tasks x 4 candidates, both turns) are
mostly one shared prompt: the prefix all prompts share (Pi's system prompt and tool schemas) is
forwarded once, each task's remainder (its problem statement) once, and only the two turns once per
sequence, each level reusing the key/value cache of the level before (see `completion_loss`).
The result is cached on disk under a key of the tiny model's files, the capture, the spec and
`BUILDER_VERSION`. The repository ships the policy too (`SHIPPED_DIR`, made by `python -m
swe_grpo.demo.warm_start ship`), used wherever the build would make it (the same key): a fresh machine's
demo starts training without the minutes of fine-tuning, and a test checks it against a fresh build.

The modules, in the order a build runs: `data` (the shipped files: candidates, capture, policy),
`capture` (re-capturing Pi's requests), `build` (episodes from a capture), `sft` (the fine-tuning),
`evaluate` (sampling the policy, counting what it does) and `policy` (the cached build, `ship`, and
`main`, which `python -m swe_grpo.demo.warm_start build|ship|capture` runs). The harness that drives the
real Pi with scripted turns is `swe_grpo.testing.pi_capture`.
"""

from __future__ import annotations

from swe_grpo._compat import moved_name
from swe_grpo.demo.warm_start.build import Episode, EpisodeBuilder, bash_command
from swe_grpo.demo.warm_start.capture import capture_pi_requests
from swe_grpo.demo.warm_start.data import (
    BUILDER_VERSION,
    CANDIDATES_PATH,
    CAPTURE_PATH,
    CLOSING_MESSAGE,
    CLOSING_TEXT,
    DATA_DIR,
    METADATA_FILE,
    SHIPPED_DIR,
    Candidate,
    WarmStartError,
    action_message,
    load_candidates,
    load_capture,
)
from swe_grpo.demo.warm_start.evaluate import TaskStats, evaluate_policy, sample
from swe_grpo.demo.warm_start.policy import build_warm_policy, main, one_torch_thread, ship
from swe_grpo.demo.warm_start.sft import Progress, WarmStartSpec, completion_loss, fine_tune, padded, prefix_cache

__all__ = [
    "BUILDER_VERSION",
    "CANDIDATES_PATH",
    "CAPTURE_PATH",
    "CLOSING_MESSAGE",
    "CLOSING_TEXT",
    "DATA_DIR",
    "METADATA_FILE",
    "SHIPPED_DIR",
    "Candidate",
    "Episode",
    "EpisodeBuilder",
    "Progress",
    "TaskStats",
    "WarmStartError",
    "WarmStartSpec",
    "action_message",
    "bash_command",
    "build_warm_policy",
    "capture_pi_requests",
    "completion_loss",
    "evaluate_policy",
    "fine_tune",
    "load_candidates",
    "load_capture",
    "main",
    "one_torch_thread",
    "padded",
    "prefix_cache",
    "sample",
    "ship",
]


def __getattr__(name: str) -> object:
    return moved_name(__name__, name)  # the Pi capture harness, now in swe_grpo.testing.pi_capture
