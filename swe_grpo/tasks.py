"""Tasks: a repository at a commit, a problem statement, and the tests that decide success.

`Task` is the SWE-Gym/SWE-bench row shape. Loaders (HF Hub via `datasets`, local JSONL) live here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Task:
    """One SWE task. `repo` is a GitHub "owner/name" or an absolute path to a local git repository;
    `image` is the container image holding the repository at `base_commit` (docker/hf backends);
    `test_cmd` overrides the test runner (default: pytest); FAIL_TO_PASS / PASS_TO_PASS are test ids."""

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    test_patch: str = ""
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    image: str | None = None
    test_cmd: str | None = None
    patch: str = ""  # the reference ("gold") fix, when known
    metadata: dict = field(default_factory=dict, compare=False, hash=False)
