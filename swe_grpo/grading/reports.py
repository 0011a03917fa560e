"""Reading a pytest run's results: the JUnit XML report and the `-rA` short test summary on stdout.

`report_statuses` gives each test's status from both (the worst wins). `RunReports` keeps both apart so
that the grader can check that they agree with each other and with themselves: a real pytest run writes
the same verdicts into both, its summary's closing line counts exactly the status lines above it, and
its JUnit totals count the same. Disagreement means that something inside the run edited one of them.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

PASS_STATUSES = frozenset({"passed", "xfail", "xpass"})
# Worst first: when reports disagree about a test, the worst status wins.
_SEVERITY = ("error", "failed", "missing", "skipped", "xpass", "xfail", "passed")

_SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+$", re.MULTILINE)
_SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (.+)$")
_SKIPPED_LINE = re.compile(r"^SKIPPED \[(\d+)\] ")
# pytest's closing line ("=== 1 failed, 3 passed in 0.05s ===", without the rules under -q).
_FINAL_LINE = re.compile(r"^(?:=+ )?((?:\d+ [a-z]+(?:, )?)+) in [\d.]+s\b.*$")
_FINAL_COUNT = re.compile(r"(\d+) ([a-z]+)")
# The closing line's words -> the status its count is about.
_FINAL_WORDS = {
    "passed": "passed",
    "failed": "failed",
    "error": "error",
    "errors": "error",
    "xfailed": "xfail",
    "xpassed": "xpass",
    "skipped": "skipped",
}


def junit_key(test_id: str) -> tuple[str, str]:
    """The (classname, name) pytest's JUnit XML gives the test with this node id."""
    path, sep, tail = test_id.partition("::")
    names_part, bracket, params = tail.partition("[")
    names = [re.sub(r"\.py$", "", path.replace("/", ".")), *(names_part.split("::") if sep else [])]
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def _junit_statuses(xml_text: str) -> dict[tuple[str, str], list[str]] | None:
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError:
        return None
    if root.tag not in ("testsuites", "testsuite"):
        return None
    statuses: dict[tuple[str, str], list[str]] = {}
    for case in root.iter("testcase"):
        children = {child.tag: child for child in case}
        if "error" in children:
            status = "error"
        elif "failure" in children:
            status = "failed"
        elif "skipped" in children:
            status = "xfail" if children["skipped"].get("type") == "pytest.xfail" else "skipped"
        else:
            status = "passed"
        statuses.setdefault((case.get("classname", ""), case.get("name", "")), []).append(status)
    return statuses


def _summary_statuses(output: str, test_ids: Collection[str]) -> dict[str, list[str]] | None:
    # From the first summary header on: anything printed before it is captured test output (a test could
    # print fake lines), and a real status line after it always counts, so a fake one cannot hide it.
    header = _SUMMARY_HEADER.search(output)
    if header is None:
        return None
    statuses: dict[str, list[str]] = {}
    lengths = sorted({len(test_id) for test_id in test_ids}, reverse=True)
    for line in output[header.end() :].splitlines():
        match = _SUMMARY_LINE.match(line)
        if match:
            word, rest = match.groups()
            statuses.setdefault(_summary_test_id(word, rest, test_ids, lengths), []).append(word.lower())
    return statuses


def _summary_test_id(word: str, rest: str, test_ids: Collection[str], lengths: Sequence[int]) -> str:
    """The test a status line names: `rest` is "<id>" or "<id> - <message>", except an XPASS's reason, which
    pytest < 8 writes after one space ("XPASS t.py::test_x why"): the longest of `test_ids` (whose distinct
    lengths are `lengths`, longest first) that `rest` starts with, then a space, is the id (an id may hold
    spaces: "t.py::test_x[a b]")."""
    if rest in test_ids:
        return rest
    head = rest.split(" - ", 1)[0]
    if head in test_ids or word != "XPASS":
        return head
    for length in lengths:
        if rest[length : length + 1] == " " and rest[:length] in test_ids:
            return rest[:length]
    return head


def _worst(statuses: Sequence[str]) -> str:
    return min(statuses, key=_SEVERITY.index)


def report_statuses(test_ids: Sequence[str], junit_xml: str | None, output: str) -> dict[str, str] | None:
    """Each test's status from a pytest JUnit XML report and/or the `-rA` short summary in `output`;
    None when neither is usable (missing, garbled). With a JUnit report, a test must be in it (else
    "missing") and a summary line can only make it worse; without one, the summary decides (the grader
    never resolves a run without a JUnit report: see `swe_grpo.grading`). When a test is reported more
    than once, the worst status wins."""
    junit = _junit_statuses(junit_xml) if junit_xml is not None else None
    summary = _summary_statuses(output, set(test_ids))
    if junit is None and summary is None:
        return None
    result: dict[str, str] = {}
    for test_id in test_ids:
        seen = (junit.get(junit_key(test_id)) or ["missing"]) if junit is not None else []
        reported = summary.get(test_id, []) if summary is not None else []
        result[test_id] = _worst([*seen, *reported] or ["missing"])
    return result


@dataclass
class RunReports:
    """Both reports of one run, kept apart. `junit` / `summary` are None when missing or unreadable."""

    junit: dict[tuple[str, str], list[str]] | None
    summary: dict[str, list[str]] | None
    junit_totals: Counter[str] = field(default_factory=Counter)  # status -> testcases
    summary_lines: Counter[str] = field(default_factory=Counter)  # status -> status lines (skips by [n])
    final_lines: list[Counter[str]] = field(default_factory=list)  # each closing line's counts

    @classmethod
    def parse(cls, test_ids: Collection[str], junit_xml: str | None, output: str) -> RunReports:
        junit = _junit_statuses(junit_xml) if junit_xml is not None else None
        reports = cls(junit=junit, summary=_summary_statuses(output, test_ids))
        for statuses in (junit or {}).values():
            reports.junit_totals.update(statuses)
        header = _SUMMARY_HEADER.search(output)
        for line in output[header.end() :].splitlines() if header else ():
            if match := _SUMMARY_LINE.match(line):
                reports.summary_lines[match.group(1).lower()] += 1
            elif match := _SKIPPED_LINE.match(line):
                reports.summary_lines["skipped"] += int(match.group(1))
            elif match := _FINAL_LINE.match(line):
                counts: Counter[str] = Counter()
                for number, word in _FINAL_COUNT.findall(match.group(1)):
                    if word in _FINAL_WORDS:
                        counts[_FINAL_WORDS[word]] += int(number)
                reports.final_lines.append(counts)
        return reports

    def junit_status(self, test_id: str) -> str:
        return _worst(self.junit.get(junit_key(test_id)) or ["missing"]) if self.junit is not None else "missing"

    def summary_status(self, test_id: str) -> str | None:
        """The summary's status for the test; None when the summary cannot name it (a skip's line names a
        location, not a test)."""
        if self.summary is None:
            return "missing"
        seen = self.summary.get(test_id)
        return _worst(seen) if seen else None

    def disagreements(self, test_ids: Sequence[str]) -> list[str]:
        """Test ids whose status the two reports give differently (both must be present; a JUnit pass is a
        summary's XPASS too: JUnit writes a non-strict XPASS as a testcase without children)."""
        differ = []
        for test_id in test_ids:
            junit, summary = self.junit_status(test_id), self.summary_status(test_id)
            if summary is None:
                if junit not in ("skipped", "missing"):
                    differ.append(f"{test_id} ({junit} in the JUnit report, absent from the summary)")
            elif junit != summary and (junit, summary) != ("passed", "xpass"):  # JUnit has no word for XPASS
                differ.append(f"{test_id} ({junit} in the JUnit report, {summary} in the summary)")
        return differ

    def count_mismatch(self) -> str | None:
        """Why the counts of the summary's closing line, its status lines and the JUnit report's testcases
        do not agree; None when they do."""
        if len(self.final_lines) != 1:
            return f"the summary has {len(self.final_lines)} closing count lines, not 1"
        final = self.final_lines[0]
        lines = self.summary_lines
        for status in ("passed", "failed", "error", "xfail", "xpass", "skipped"):
            if final[status] != lines[status]:
                return f"the summary counts {final[status]} {status} but lists {lines[status]}"
        junit = self.junit_totals
        # A JUnit testcase without children is a pass or a non-strict XPASS; an xfail is "skipped" there.
        if junit["passed"] != final["passed"] + final["xpass"] or junit["failed"] != final["failed"]:
            return (
                f"the JUnit report has {junit['passed']} passed and {junit['failed']} failed testcases, the summary"
                f" {final['passed'] + final['xpass']} and {final['failed']}"
            )
        return None
