"""The test helpers themselves: a comparison that cannot fail, or a slow-test
list naming tests that no longer exist, would silently weaken the suite."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from flashmetal import reference

from numerics import F32, assert_close

HERE = pathlib.Path(__file__).parent


def test_every_slow_marker_decorates_a_test():
    """`slow` is a marker on the test itself; each one must reach a test
    function (not a helper), or `make quick` would run what it means to skip."""
    marked = 0
    for f in HERE.glob("test_*.py"):
        lines = f.read_text().split("\n")
        for i, line in enumerate(lines):
            if line.strip() == "@pytest.mark.slow":
                marked += 1
                target = next(x for x in lines[i + 1:] if x.startswith("def "))
                assert target.startswith("def test_"), f"{f.name}:{i + 1}: slow marks {target!r}"
    assert marked >= 13, marked


@pytest.mark.parametrize("actual, expected, ok", [
    (np.ones(3), np.full(3, np.inf), False),                  # inf expected, finite actual
    (np.full(3, np.inf), np.full(3, np.inf), True),
    (np.full(3, -np.inf), np.full(3, np.inf), False),
    (np.array([np.nan, 1.0]), np.array([np.nan, 1.0]), True),
    (np.array([np.nan, 1.0]), np.array([0.0, 1.0]), False),   # NaN on one side only
    (np.array([0.0, 1.0]), np.array([np.nan, 1.0]), False),
    (np.array([1.0, 2.0]), np.array([1.0, 2.0 + 1e-9]), True),
])
def test_close_matches_non_finite_values_exactly(actual, expected, ok):
    assert reference.close(actual, expected, 1e-5, 1e-4)[0] is ok


def test_assert_close_names_the_real_worst_element():
    a = np.array([np.nan, 1.0, 5.0])
    e = np.array([np.nan, 1.0, 1.0])
    with pytest.raises(AssertionError, match=r"worst at index \(2,\): actual 5\.0, expected 1\.0"):
        assert_close(a, e, F32, "probe")
