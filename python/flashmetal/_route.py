"""Which kernel computes a call: the library's router (fm_route_attention,
AttentionRouter.swift) owns the rule, its reasons and its refusals; the
front door (attention.py) and the serving functions' short-query route
(serving.py) ask it."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import _native
from ._arrays import dtype_code

_OP = "scaled_dot_product_attention"
#: The values of ``Route.kernel``: the public function of each kernel family
#: the front door runs, and "none" for a call that runs no kernel (an empty
#: batch, or no keys: zeros).
DECODE, PREFILL, GENERAL, NONE = "flash_attn_decode", "flash_attn_prefill", "sdpa", "none"
ROUTES = (DECODE, PREFILL, GENERAL, NONE)
_KERNELS = {"FM_ROUTE_DECODE": DECODE, "FM_ROUTE_PREFILL": PREFILL, "FM_ROUTE_SDPA": GENERAL}


@dataclass(frozen=True)
class Route:
    """Which kernel ran (or would run) and why: ``kernel`` is one of
    ``ROUTES`` ("flash_attn_decode", "flash_attn_prefill", "sdpa", "none"),
    the public function of that kernel."""
    kernel: str
    reason: str

    def __str__(self) -> str:
        return f"{self.kernel}: {self.reason}"


def choose(dtype: np.dtype, rows: int, d: int, keys: int, *, mask: bool = False, key_ranges: bool = False,
           causal: bool = False, q_offset: int = 0, window: int | None = None, sinks: bool = False,
           dv: int | None = None) -> Route:
    """The fastest kernel that computes exactly a call of `rows` query rows
    at positions `q_offset`... over `keys` keys (q/k of head dim d, v of dv,
    default d). `mask`: an attn_mask applies; `key_ranges`: it keeps one key
    range per batch row for the one query row. Sinks no kernel applies to the call are an
    UnsupportedFeatureError, a head dim above every kernel's a ValueError."""
    return _choose(np.dtype(dtype), int(rows), int(d), int(keys), bool(mask), bool(key_ranges), bool(causal),
                   int(q_offset), None if window is None else int(window), bool(sinks),
                   int(d if dv is None else dv), _native.public_op(_OP))


@functools.lru_cache(maxsize=512)
def _choose(dtype: np.dtype, rows: int, d: int, keys: int, mask: bool, key_ranges: bool, causal: bool,
            q_offset: int, window: int | None, sinks: bool, dv: int,
            op: str) -> Route:
    """choose(), remembered: a pure function of its arguments (the layers
    of a model ask it the same question at every step)."""
    ffi = _native.ffi()
    call = _native.options("FMRouteCall", dtype=dtype_code(dtype), head_dim=d, head_dim_v=dv,
                           window=0 if window is None else window, query_rows=rows, keys=keys, query_offset=q_offset,
                           mask=int(mask), mask_is_key_ranges=int(key_ranges), causal=int(causal), sinks=int(sinks))
    out = ffi.new(_native.ctype("FMRoute *"))
    _native.call_static("fm_route_attention", call, out, op=op)
    return Route(_kernels()[int(out.kernel)], ffi.string(out.reason).decode())


@functools.cache
def _kernels() -> dict[int, str]:
    """FMRouteKernel values -> the kernel family names of Route.kernel."""
    return {_native.constant(name): kernel for name, kernel in _KERNELS.items()}


def short_query_runs(dtype: np.dtype, rows: int, d: int, dv: int) -> bool:
    """Whether `rows` > 1 query rows at the newest positions (the serving
    functions' short query: q, k and v of `dtype`) take the split-KV decode
    kernel: the router's rule for such a call."""
    if d < 1 or dv < 1:  # a shape the kernel's own checks refuse, naming the call's function
        return False
    return choose(dtype, rows, d, rows, causal=True, q_offset=0, dv=dv).kernel == DECODE
