"""Where the `swe-grpo` commands print, and how their long runs show progress.

`make_console()` is the one console of every command (`swe_grpo.cli`, `swe-grpo eval`, `swe-grpo tasks`,
`swe-grpo demo`): stderr, and a message or a plain line is never wrapped, whatever the width. rich wraps
at 80 columns when stderr is not a terminal (a log, a CI page, a test's pipe), which breaks an error in
the middle of the words a user greps for; tables still fit the width.

`progress(console)` is the progress display of a long command, with rich's `Progress` API (`add_task`,
`update`, `stop_task`; a task's `detail` field is shown after its count). On an interactive terminal it
is rich's live display. Anywhere else a live display shows nothing until the end, so a log would be
silent for the whole run: there it prints one plain line at least every `interval_s` seconds and once at
the end, e.g. `progress 0:02:30 | rollouts 5/12: resolved 3 of 5 (0.60)`. `SWE_GRPO_PROGRESS_S` sets that
interval (seconds, default 30).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

INTERVAL_S = 30.0
INTERVAL_ENV = "SWE_GRPO_PROGRESS_S"


def make_console() -> Console:
    """The console the commands print to: stderr, messages and plain lines unwrapped (tables may wrap)."""
    return Console(stderr=True, soft_wrap=True)


class DetailColumn(ProgressColumn):
    """A task's `detail` field (empty when it has none)."""

    def render(self, task: Task) -> Text:
        return Text(str(task.fields.get("detail", "")))


def progress(console: Console) -> Progress:
    """The progress display for `console`: live on an interactive terminal, else plain lines (`LogProgress`)
    every `SWE_GRPO_PROGRESS_S` seconds."""
    if console.is_terminal and not console.is_dumb_terminal:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        return Progress(*columns, DetailColumn(), console=console)
    return LogProgress(console, interval_s=interval_from_env())


def interval_from_env() -> float:
    """`SWE_GRPO_PROGRESS_S` as seconds (default `INTERVAL_S`); a value that is not a positive number is refused
    by name."""
    text = os.environ.get(INTERVAL_ENV, "")
    if not text:
        return INTERVAL_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{INTERVAL_ENV} must be a positive number of seconds, got {text!r}")
    return seconds


def resolved_so_far(resolved: int, finished: int) -> str:
    """The detail of a run of graded attempts: `resolved 3 of 5 (0.60)`."""
    rate = f" ({resolved / finished:.2f})" if finished else ""
    return f"resolved {resolved} of {finished}{rate}"


def elapsed(seconds: float) -> str:
    """`H:MM:SS`, as rich's elapsed column shows it."""
    whole = int(max(seconds, 0))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def plain_line(tasks: Iterable[Task], seconds: float) -> str:
    """One line for a log: the elapsed time, then each task's name, count and detail."""
    parts = []
    for task in tasks:
        count = f" {task.completed:.0f}/{task.total:.0f}" if task.total is not None else ""
        detail = task.fields.get("detail", "")
        parts.append(f"{task.description}{count}{': ' + detail if detail else ''}")
    return " | ".join([f"progress {elapsed(seconds)}", *parts])


class LogProgress(Progress):
    """rich's `Progress` with no live display: it prints `plain_line` of the tasks not stopped when at least
    `interval_s` has passed since the last line (checked every second by a thread while it is started, or by
    a call to `tick`), and once more when it stops, if it has any task. `clock` is its time source (a fake one
    in tests)."""

    def __init__(
        self, console: Console, *, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        super().__init__(console=console, disable=True, get_time=clock)
        self.interval_s = interval_s
        self._clock = clock
        self._started = self._last = clock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> bool:
        """Print a line if one is due; returns whether it printed."""
        now = self._clock()
        if now - self._last < self.interval_s:
            return False
        self._print(now)
        return True

    def _print(self, now: float) -> None:
        self._last = now
        shown = [task for task in self.tasks if task.stop_time is None]
        self.console.print(plain_line(shown, now - self._started), markup=False, highlight=False, soft_wrap=True)

    def _watch(self) -> None:
        while not self._stopping.wait(min(1.0, self.interval_s)):
            self.tick()

    def start(self) -> None:
        self._started = self._last = self._clock()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._watch, name="progress-log", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join()
        self._thread = None
        if self.tasks:  # a run refused before it started anything has no progress to tell
            self._print(self._clock())
