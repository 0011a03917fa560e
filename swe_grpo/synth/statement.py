"""The problem statement of a synthesised task: what an issue reporter would see, never the fix.

It names the failing tests, quotes each one's failure message from the test report (pytest's assertion
rewriting shows the values compared), and says how to reproduce them. It never shows the diff, the
mutated line or where the bug is: any message line that contains the mutated code (as it is, or as it
was) is left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from swe_grpo.grading import DEFAULT_TEST_CMD
from swe_grpo.synth.mutate import Mutation

_SHOWN = 5  # tests quoted in full
_LINES = 8  # lines of one failure message


def _reveals(line: str, mutation: Mutation) -> bool:
    code = [" ".join(text.split()) for text in (mutation.old, mutation.new)]
    flat = " ".join(line.split())
    return any(len(text) >= 4 and text in flat for text in code)


def problem_statement(
    project: str, failing: Sequence[str], messages: Mapping[str, str], test_cmd: str, mutation: Mutation
) -> str:
    """The statement for `failing` tests of `project` (their `messages` from the mutant's run)."""
    count = len(failing)
    parts = [f"{count} test{'s' if count != 1 else ''} of {project} fail{'s' if count == 1 else ''}:\n"]
    for test_id in failing[:_SHOWN]:
        parts.append(f"- `{test_id}`")
        message = [line for line in messages.get(test_id, "").splitlines() if line.strip()]
        message = [line for line in message if not _reveals(line, mutation)][:_LINES]
        if message:
            parts.append("  ```\n" + "".join(f"  {line}\n" for line in message) + "  ```")
    if count > _SHOWN:
        parts.append(f"- ... and {count - _SHOWN} more")
    command = test_cmd.replace(' --junitxml="$SWE_GRPO_JUNIT_XML"', "")
    if command == DEFAULT_TEST_CMD.replace(' --junitxml="$SWE_GRPO_JUNIT_XML"', ""):
        command = "python3 -m pytest -rA -p no:cacheprovider"
    shown = " ".join(f"'{test_id}'" for test_id in failing[:_SHOWN])
    parts.append(f"\nTo reproduce:\n\n    {command} {shown}\n")
    parts.append(
        "The tests describe the intended behaviour. Find the defect in the library code and fix it, so that"
        " these tests pass and the others keep passing."
    )
    return "\n".join(parts) + "\n"
