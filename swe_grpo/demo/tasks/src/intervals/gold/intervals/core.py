"""Closed intervals [start, end] over the integers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Interval:
    """The integers from `start` to `end`, both included."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"empty interval [{self.start}, {self.end}]")

    def overlaps(self, other: Interval) -> bool:
        """Whether the two intervals share at least one integer."""
        return self.start <= other.end and other.start <= self.end

    def __len__(self) -> int:
        return self.end - self.start + 1


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as a sorted list of disjoint intervals."""
    merged: list[Interval] = []
    for interval in sorted(intervals):
        if merged and merged[-1].overlaps(interval):
            last = merged.pop()
            interval = Interval(min(last.start, interval.start), max(last.end, interval.end))
        merged.append(interval)
    return merged


def total_length(intervals: Iterable[Interval]) -> int:
    """How many integers the union of `intervals` covers."""
    return sum(len(interval) for interval in merge(intervals))
