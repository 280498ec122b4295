"""The test helpers themselves: a comparison that cannot fail, or a slow-test
list naming tests that no longer exist, would silently weaken the suite."""
from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from flashmetal import reference

from conftest import SLOW_TESTS
from numerics import F32, assert_close

HERE = pathlib.Path(__file__).parent


def test_every_slow_test_name_exists():
    defined = set()
    for f in HERE.glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)\(", f.read_text(), re.M))
    assert SLOW_TESTS <= defined, f"SLOW_TESTS names no test: {sorted(SLOW_TESTS - defined)}"


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
