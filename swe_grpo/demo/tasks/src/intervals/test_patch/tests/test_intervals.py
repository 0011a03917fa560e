import pytest
from intervals import Interval, merge, total_length


def test_interval_rejects_reversed_bounds():
    with pytest.raises(ValueError):
        Interval(3, 1)


def test_overlaps():
    assert Interval(1, 3).overlaps(Interval(3, 5))
    assert not Interval(1, 3).overlaps(Interval(4, 5))


def test_len_counts_both_ends():
    assert len(Interval(2, 4)) == 3


def test_merge_sorted_input():
    assert merge([Interval(1, 3), Interval(2, 5), Interval(7, 8)]) == [Interval(1, 5), Interval(7, 8)]


def test_merge_unsorted_input():
    assert merge([Interval(5, 6), Interval(1, 2)]) == [Interval(1, 2), Interval(5, 6)]


def test_merge_bridging_interval():
    assert merge([Interval(1, 2), Interval(10, 12), Interval(2, 11)]) == [Interval(1, 12)]


def test_total_length():
    assert total_length([Interval(1, 3), Interval(2, 5)]) == 5
    assert total_length([Interval(1, 2), Interval(10, 12), Interval(2, 11)]) == 12
