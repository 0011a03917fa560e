"""Closed integer intervals and operations on lists of them."""

from intervals.core import Interval, merge, total_length

__all__ = ["Interval", "merge", "total_length"]
