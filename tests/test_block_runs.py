"""Unit tests for kvconnector.nixl.block_runs."""

from __future__ import annotations

import random

import pytest

from kvconnector.nixl.block_runs import block_runs, expand_runs


def test_empty() -> None:
    assert block_runs([], []) == []


def test_single_run() -> None:
    assert block_runs([4, 5, 6], [10, 11, 12]) == [(4, 10, 3)]


def test_mixed_runs() -> None:
    assert block_runs([3, 4, 5, 9, 12, 13], [0, 1, 2, 7, 20, 21]) == [
        (3, 0, 3),
        (9, 7, 1),
        (12, 20, 2),
    ]


def test_contiguous_on_one_side_only_breaks_run() -> None:
    assert block_runs([0, 1, 2], [5, 6, 8]) == [(0, 5, 2), (2, 8, 1)]
    assert block_runs([0, 2, 3], [5, 6, 7]) == [(0, 5, 1), (2, 6, 2)]


def test_descending_and_repeated_ids_are_not_merged() -> None:
    assert block_runs([3, 2, 1], [3, 2, 1]) == [(3, 3, 1), (2, 2, 1), (1, 1, 1)]
    assert block_runs([1, 1], [2, 3]) == [(1, 2, 1), (1, 3, 1)]


def test_length_mismatch_and_negative_ids() -> None:
    with pytest.raises(ValueError):
        block_runs([1, 2], [1])
    with pytest.raises(ValueError):
        block_runs([-1], [0])


def test_expand_is_inverse() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(0, 40)
        src = [rng.randint(0, 20) for _ in range(n)]
        dst = [rng.randint(0, 20) for _ in range(n)]
        runs = block_runs(src, dst)
        assert expand_runs(runs) == (src, dst)
        # maximal: adjacent runs never continue each other
        for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:], strict=False):
            assert not (s1 == s0 + n0 and d1 == d0 + n0)
    with pytest.raises(ValueError):
        expand_runs([(0, 0, 0)])
