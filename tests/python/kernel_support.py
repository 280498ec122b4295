"""Skips a test on a backend that does not have an op's kernels yet (e.g. the
simulator before the Metal sources of that op exist). Any other failure of
the probe is re-raised."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import BackendError

_PROBES = {
    "mask": lambda r: fm.build_mask(1, 1, registry=r),
    "blk": lambda r: fm.build_blk(np.zeros((1, 1), fm._arrays.BF16), 128, registry=r),
    "vec": lambda r: fm.flash_attn_decode(np.zeros((1, 64), np.float32), np.zeros((1, 1, 64), np.float32),
                                          np.zeros((1, 1, 64), np.float32), 1, registry=r),
    "vec_fwht": lambda r: fm.flash_attn_decode(np.zeros((1, 64), np.float32), np.zeros((1, 1, 64), np.float32),
                                               np.zeros((1, 1, 64), np.float32), 1, fwht=True, registry=r),
    "sdpa": lambda r: fm.sdpa(np.zeros((1, 1, 1, 8), np.float32), np.zeros((1, 1, 1, 8), np.float32),
                              np.zeros((1, 1, 1, 8), np.float32), registry=r),
}
_missing: dict[tuple[str, str], str | None] = {}


def require(registry: fm.Registry, *ops: str) -> None:
    for op in ops:
        key = (registry.backend, op)
        if key not in _missing:
            try:
                _PROBES[op](registry)
                _missing[key] = None
            except BackendError as e:
                if "no kernel named" not in str(e) and "unknown kernel" not in str(e):
                    raise
                _missing[key] = str(e)
        if _missing[key]:
            pytest.skip(f"{registry.backend} lacks the {op} kernels: {_missing[key]}")
