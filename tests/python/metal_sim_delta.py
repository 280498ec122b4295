"""The metal-sim runtime's counters moved since a reading, for tests that
count command buffers, wraps and copies per call."""
from __future__ import annotations

from flashmetal.registry import metal_sim_counters


def delta(before: dict[str, int]) -> dict[str, int]:
    """Each counter's change since `before` (a `metal_sim_counters()` reading)."""
    now = metal_sim_counters()
    return {k: now[k] - before[k] for k in now}
