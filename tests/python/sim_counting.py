"""Running a call with the simulator's dispatch counting on
(FLASHMETAL_SIM_COUNTS): one JSON record per dispatch, as the counted
simulator writes them (kernel, threadgroups, device and threadgroup traffic)."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_counted(path: Path, fn: Callable[[], Any]) -> tuple[Any, list[dict]]:
    """fn()'s result and the records of the dispatches it made, written to
    `path` (emptied first, kept after)."""
    path.unlink(missing_ok=True)
    os.environ["FLASHMETAL_SIM_COUNTS"] = str(path)
    try:
        out = fn()
    finally:
        del os.environ["FLASHMETAL_SIM_COUNTS"]
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return out, records
