"""Every numeric test runs on every backend this machine has."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

import flashmetal


def available_backends() -> list[str]:
    names = []
    for name in flashmetal.registry.backend_names():
        try:
            flashmetal.Registry(name).close()
        except (ValueError, flashmetal.BackendError):
            # Not built in (ValueError), or built but unable to open, e.g. a
            # Mac whose session sees no Metal device (BackendError).
            continue
        names.append(name)
    return names


def left_out() -> dict[str, str]:
    """Backends the environment keeps out of the run, each with why. CI's macOS
    job sets FLASHMETAL_TEST_METAL=0 when the runner has no real Apple GPU."""
    return {"metal": "FLASHMETAL_TEST_METAL=0"} if os.environ.get("FLASHMETAL_TEST_METAL") == "0" else {}


BACKENDS = [name for name in available_backends() if name not in left_out()]
# Backends whose GPU is the simulator (slow: tests give them small shapes).
SIMULATED = ("sim", "metal-sim")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--sample-cases", type=int, default=1, metavar="N",
                     help="keep about 1 in N parametrisations of each test function (a fixed choice by test id; "
                          "at least one per function): for the stages of `make test` that rerun the suite "
                          "under another schedule or host path after the main run has run every case")


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    n = config.getoption("--sample-cases")
    if n <= 1:
        return
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    seen: set[tuple[str, str]] = set()
    for item in items:
        function = (item.path.name, getattr(item, "originalname", item.name))
        first = function not in seen
        seen.add(function)
        if first or zlib.crc32(item.nodeid.encode()) % n == 0:
            kept.append(item)
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


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


def _metal_violations() -> int:
    return flashmetal.registry.metal_sim_counters()["violations"] if "metal-sim" in BACKENDS else 0


@pytest.fixture(autouse=True)
def _no_metal_rule_broken() -> None:
    """Every test fails if the metal-sim runtime saw a Metal rule broken
    while it ran (the planted-error tests run in tests/swift)."""
    if "metal-sim" not in BACKENDS:
        yield
        return
    before = _metal_violations()
    yield
    broken = _metal_violations() - before
    assert broken == 0, f"{broken} Metal rule(s) broken; the last: {flashmetal.registry.metal_sim_last_violation()}"


@pytest.fixture(scope="session")
def cpu() -> flashmetal.Registry:
    r = flashmetal.Registry("cpu")
    yield r
    r.close()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
