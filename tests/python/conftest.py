"""Every numeric test runs on every backend this machine has."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal


def available_backends() -> list[str]:
    names = []
    for name in ("cpu", "sim", "metal"):
        try:
            flashmetal.Registry(name).close()
        except (ValueError, flashmetal.BackendError):
            # Not built in (ValueError), or built but unable to open, e.g. a
            # Mac whose session sees no Metal device (BackendError).
            continue
        names.append(name)
    return names


BACKENDS = available_backends()

# Tests that take seconds each (fuzzing, RSS and thread soaks, forced-ISA
# suites, multi-GiB scale checks). `make check` deselects them with
# -m "not slow"; `make test` runs everything. Marked here by name so the
# files that hold them need no edit.
SLOW_TESTS = frozenset({
    "test_abi_fuzz", "test_decode_api", "test_mask_blk_api", "test_prefill_api", "test_sdpa_api",
    "test_front_door_api", "test_long_window_mask_prefill", "test_repeated_calls_rss_flat",
    "test_suite_under_forced_isa", "test_gil_released", "test_mixed_ops_cpu", "test_mixed_ops_sim",
    "test_serving_api",
})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes seconds; skipped by `make check`, run by `make test`")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if getattr(item, "originalname", item.name) in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", params=BACKENDS)
def registry(request: pytest.FixtureRequest) -> flashmetal.Registry:
    """One registry per available backend, shared by the session."""
    r = flashmetal.Registry(request.param)
    yield r
    r.close()


@pytest.fixture(scope="session")
def cpu() -> flashmetal.Registry:
    r = flashmetal.Registry("cpu")
    yield r
    r.close()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
