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


def pytest_configure(config: pytest.Config) -> None:
    # Tests that take seconds each (fuzzing, RSS and thread soaks, forced-ISA
    # suites, multi-GiB scale checks) carry @pytest.mark.slow.
    config.addinivalue_line("markers", "slow: takes seconds; skipped by `make quick`, run by `make test`")


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
