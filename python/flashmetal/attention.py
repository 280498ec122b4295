"""The front door: torch's ``scaled_dot_product_attention``, on the best
flashmetal kernel for the inputs.

Positions and the two causal conventions. Query row i sits at position
``t = q_offset + i`` and key j at position j; ``is_causal`` keeps keys
``j <= t`` and ``window`` w keeps keys with ``t - j < w``. ``align`` says
where the query block sits:

- ``"top_left"`` (default; torch's ``is_causal``): ``q_offset = 0``. With
  qL < kL the queries are the *first* qL positions.
- ``"bottom_right"`` (a KV cache, flash-attn's ``causal``): ``q_offset =
  kv_len - qL``: the queries are the *newest* qL positions. Rows with t < 0
  (qL > kv_len) see no key and output zeros.

Both agree when qL == kv_len.
"""
from __future__ import annotations

import math
import numbers
import sys
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from . import _native
from ._arrays import BF16, BOOL, as_input, out_shape, tensor
from ._native import INT64
from ._errors import InvalidTypeError, InvalidValueError
from ._hints import layout_hint
from ._serving_args import attn_options, flag, no_dropout, seq_tensors, sinks_arg
from ._interop import is_torch_tensor, to_numpy, wrapper_like
from ._route import DECODE, NONE, PREFILL, Route, choose
from ._route import ROUTES as ROUTES  # the values of Route.kernel, offered here beside last_route
from .prefill import flash_attn_prefill
from .registry import Registry, RegistryLike, resolve
from .sdpa import sdpa

_OP = "scaled_dot_product_attention"
_ALIGNS = ("top_left", "bottom_right")


_last = threading.local()


def last_route() -> Route | None:
    """The route of this thread's last ``scaled_dot_product_attention`` call."""
    return getattr(_last, "route", None)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _check_types(dropout_p: Any, is_causal: Any, scale: Any, enable_gqa: Any, softcap: Any,
                 window: Any, kv_len: Any, align: Any) -> None:
    """torch's argument types, strictly: a wrong type is a TypeError naming
    it (the values are the library's to check: fm_plan_attention)."""
    no_dropout(_OP, dropout_p)
    flag(_OP, "is_causal", is_causal)
    flag(_OP, "enable_gqa", enable_gqa)
    if scale is not None and not _is_real(scale):
        raise InvalidTypeError(_OP, f"scale must be a float or None, got {type(scale).__name__}", argument="scale")
    if not _is_real(softcap):
        raise InvalidTypeError(_OP, f"softcap must be a float, got {type(softcap).__name__}", argument="softcap")
    for name, val in (("window", window), ("kv_len", kv_len)):
        if val is not None and not _is_int(val):
            raise InvalidTypeError(_OP, f"{name} must be an int or None, got {type(val).__name__}", argument=name)
    if align not in _ALIGNS:
        raise InvalidValueError(_OP, f"align must be 'top_left' or 'bottom_right', got {align!r}", argument="align")


def _saturating_cast(m: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """An additive mask in `dtype`, converted once; finite values beyond the
    dtype's range saturate to its finite min/max (a cast would make them
    -inf, which means 'masked': a row of only such keys must still see them)."""
    if m.dtype == dtype:
        return m
    f = m.astype(np.float32)
    lim = float(ml_dtypes.finfo(dtype).max)  # type: ignore[no-untyped-call]
    big = np.isfinite(f) & (np.abs(f) > lim)
    if big.any():
        f = np.where(big, np.sign(f) * lim, f)
    return f.astype(dtype)


def _mask_operand(mask: Any, io: np.dtype, shape: tuple[int, int, int, int], cap: int) -> np.ndarray:
    """The caller's mask as the kernels take it: rank 4 with each of B, H, qL
    either full or 1 (read with stride 0: no expansion), bool or additive in
    the I/O dtype. Axes a caller expanded with stride 0 (torch's
    ``expand``) are collapsed back to 1; only a mask broadcast along the key
    axis, or a dtype conversion, makes a copy, of the mask's own size."""
    B, H, qL, kl = shape
    m = to_numpy(mask, _OP, "attn_mask")
    given = tuple(m.shape)
    if m.dtype != BOOL and m.dtype.kind != "f" and m.dtype != BF16:
        raise InvalidTypeError(_OP, f"attn_mask must be bool (True = attend) or a float additive mask, got {m.dtype}")
    if not 0 <= m.ndim <= 4:
        raise InvalidValueError(_OP, f"attn_mask has rank {m.ndim}; it must broadcast to [B, H, qL, kL] "
                         f"= {[B, H, qL, kl]}")
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)
    dims: tuple[int, ...] = tuple(m.shape)
    if any(d not in (1, want) for d, want in zip(dims[:3], (B, H, qL))) or dims[3] not in (1, kl, cap):
        raise InvalidValueError(_OP, f"attn_mask shape {given} does not broadcast to [B, H, qL, kL] "
                         f"= {[B, H, qL, kl]}")
    keep: tuple[slice, ...] = tuple(slice(0, 1) if n > 1 and st == 0 else slice(None)
                                    for n, st in zip(dims[:3], m.strides[:3]))
    m = m[keep]
    if m.shape[3] == cap != kl:
        m = m[..., :kl]  # a mask over the whole cache: the valid keys only
    if m.shape[3] == 1 and kl > 1:
        m = np.broadcast_to(m, m.shape[:3] + (kl,))
    if m.dtype != BOOL:
        m = _saturating_cast(m, io)
    return np.ascontiguousarray(m)


@dataclass
class _Call:
    """One call's validated operands and decided route."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None
    causal: bool
    q_offset: int
    kv_len: int
    route: Route
    squeeze: bool  # rank-3 inputs: the batch axis was added here
    sinks: np.ndarray | None = None  # float32 [H] sink logits (prefill route only)
    key_ranges: np.ndarray | None = None  # int32 [2, B]: each row's visible keys [start, end) (masked decode)


def _causal_bias(attn_mask: Any) -> tuple[str, int, int] | None:
    """torch's CausalBias (torch.nn.attention.bias.causal_upper_left /
    causal_lower_right) as (align, seq_len_q, seq_len_kv): a causal mask
    aligned top-left or bottom-right, whose storage holds nothing."""
    if not is_torch_tensor(attn_mask) or type(attn_mask).__name__ != "CausalBias":
        return None
    bias = sys.modules.get("torch.nn.attention.bias")
    if bias is None or not isinstance(attn_mask, bias.CausalBias):
        return None
    align = {bias.CausalVariant.UPPER_LEFT: "top_left", bias.CausalVariant.LOWER_RIGHT: "bottom_right"}.get(
        attn_mask.variant)
    if align is None:
        raise InvalidValueError(_OP, f"attn_mask is a CausalBias of unknown variant {attn_mask.variant!r}")
    return align, int(attn_mask.seq_len_q), int(attn_mask.seq_len_kv)


class _Plan(NamedTuple):
    """fm_plan_attention's FMAttentionPlan, as Python ints."""
    kind: int
    batch: int
    heads: int
    query_rows: int
    head_dim: int
    head_dim_v: int
    capacity: int
    keys: int
    query_offset: int
    reason: str


#: Plans by everything fm_plan_attention reads (the descriptors' dtypes and
#: shapes, the options): a pure function, asked the same question by every
#: layer of a model at every step. Refusals are not kept.
_PLANS: dict[tuple[Any, ...], _Plan] = {}
_PLANS_KEPT = 512


def _checked(qa: np.ndarray, ka: np.ndarray, va: np.ndarray, sk: np.ndarray | None, scale: Any, softcap: Any,
             window: Any, kv_len: Any, align: str, enable_gqa: Any, bias: tuple[str, int, int] | None) -> _Plan:
    """The library's check of the call (fm_plan_attention)."""
    key = (qa.dtype, qa.shape, ka.dtype, ka.shape, va.dtype, va.shape, None if sk is None else sk.shape, scale,
           softcap, window, kv_len, align, bool(enable_gqa), bias)
    kept = _PLANS.get(key)
    if kept is not None:
        return kept
    ffi = _native.ffi()
    given = {"has_scale": scale is not None, "has_window": window is not None, "has_kv_len": kv_len is not None,
             "has_causal_bias": bias is not None}
    call = _native.options(
        "FMAttentionCall", scale=0.0 if scale is None else float(scale), softcap=float(softcap),
        window=0 if window is None else _native.index_arg(_OP, "window", window, *INT64),
        kv_len=0 if kv_len is None else _native.index_arg(_OP, "kv_len", kv_len, *INT64),
        bias_query_rows=bias[1] if bias else 0, bias_keys=bias[2] if bias else 0, enable_gqa=int(bool(enable_gqa)),
        bottom_right=int(align == "bottom_right"), **{name: int(v) for name, v in given.items()})
    out = ffi.new(_native.ctype("FMAttentionPlan *"))
    _native.call_static("fm_plan_attention", tensor(ffi, qa), tensor(ffi, ka), tensor(ffi, va), tensor(ffi, sk), call,
                        out, op=_OP)
    plan = _Plan(int(out.kind), int(out.batch), int(out.heads), int(out.query_rows), int(out.head_dim),
                 int(out.head_dim_v), int(out.capacity), int(out.keys), int(out.query_offset),
                 ffi.string(out.reason).decode())
    if len(_PLANS) >= _PLANS_KEPT:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


@layout_hint(_OP, q="query", k="key", v="value", mask="attn_mask", gqa="enable_gqa")
def _plan(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any, is_causal: Any, scale: Any,
          enable_gqa: Any, softcap: Any, window: Any, kv_len: Any, align: Any, sinks: Any = None) -> _Call:
    """Checks a call (the library's rules, fm_plan_attention) and picks its
    route (fm_route_attention)."""
    _check_types(dropout_p, is_causal, scale, enable_gqa, softcap, window, kv_len, align)
    bias = _causal_bias(attn_mask)
    if bias is not None:  # the causal pattern it means, not its (empty) storage
        attn_mask, is_causal, align = None, True, bias[0]
    qa, ka, va = (as_input(x, _OP, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    sk = sinks_arg(_OP, sinks)
    plan = _checked(qa, ka, va, sk, scale, softcap, window, kv_len, align, enable_gqa, bias)
    squeeze = qa.ndim == 3
    if squeeze:
        qa, ka, va = qa[None], ka[None], va[None]
    causal = bool(is_causal)
    kl, q_offset = plan.keys, plan.query_offset
    if plan.kind == _native.constant("FM_PLAN_EMPTY"):
        return _Call(qa, ka, va, None, causal, 0, kl, Route(NONE, plan.reason), squeeze)
    B, H, qL, D, Dv = plan.batch, plan.heads, plan.query_rows, plan.head_dim, plan.head_dim_v
    ma = None if attn_mask is None else _mask_operand(attn_mask, qa.dtype, (B, H, qL, kl), plan.capacity)
    if plan.kind == _native.constant("FM_PLAN_NO_KEYS"):  # zeros, once the mask is known to broadcast
        return _Call(qa, ka, va, None, causal, 0, kl, Route(NONE, plan.reason), squeeze)
    ranges = None
    if qL == 1 and ma is not None and sk is None and _native.runs_head_dims(DECODE, D, Dv):
        ranges = key_ranges(ma, causal=causal, q_pos=q_offset, window=window)
    route = choose(qa.dtype, qL, D, kl, mask=ma is not None, key_ranges=ranges is not None, causal=causal,
                   q_offset=q_offset, window=window, sinks=sk is not None, dv=Dv)
    if ranges is not None and route.kernel == DECODE:
        return _Call(qa, ka, va, None, causal, q_offset, kl, route, squeeze, None, ranges)
    return _Call(qa, ka, va, ma, causal, q_offset, kl, route, squeeze, sk)


def key_ranges(mask: np.ndarray, *, causal: bool = False, q_pos: int = 0,
               window: int | None = None) -> np.ndarray | None:
    """The keys a single query row at position `q_pos` sees under `mask`
    ([B or 1, H or 1, 1, kL], bool or additive), causal and the window, as
    int32 [2, B] (row 0 each batch row's end, row 1 its start) when they are
    one contiguous range [start, end) per batch row, the same for every
    head, with no bias other than 0 on them; else None (a hole, a finite
    bias, heads that differ). A row that sees nothing is the range [0, 0).
    The library's rule (fm_mask_key_ranges)."""
    if mask.ndim != 4 or mask.shape[2] != 1:
        return None
    m = np.ascontiguousarray(mask)
    ffi = _native.ffi()
    out = np.empty((2, m.shape[0]), dtype=np.int32)
    found = ffi.new("int32_t *")
    _native.call_static("fm_mask_key_ranges", tensor(ffi, m), int(causal), int(q_pos), int(window or 0),
                        tensor(ffi, out), found, op=_OP)
    return out if found[0] else None


class _Batch(NamedTuple):
    """How a call's batch axes became the kernels' one batch axis: the
    output's axes before its last (H, L, Ev), and whether it has the head
    axis (inputs of rank 2, [L, E], have none)."""
    lead: tuple[int, ...]
    heads: bool

    def restore(self, out: np.ndarray) -> np.ndarray:
        """The kernels' [n, H, L, Ev] output in the caller's axes."""
        return out.reshape(self.lead + (out.shape[1:] if self.heads else out.shape[2:]))


def _heads_broadcast(heads: tuple[int, ...] | list[int]) -> bool:
    """Whether torch broadcasts these head axes (q's, k's, v's) together:
    they differ, and every one that is not 1 has one value."""
    return len(set(heads)) > 1 and len(set(heads) - {1}) == 1


def _as_given(shapes: list[tuple[int, ...]], mask: tuple[int, ...] | None, gqa: bool) -> bool:
    """Whether the kernels take the inputs' axes as they are: q, k and v of
    one rank, 3 or 4, with the same batch axis and a head axis no one
    broadcasts, and a mask adding no batch axis."""
    sq, sk, sv = shapes
    if not (len(sq) == len(sk) == len(sv) and len(sq) in (3, 4) and sq[:-3] == sk[:-3] == sv[:-3]):
        return False
    if not gqa and _heads_broadcast((sq[-3], sk[-3], sv[-3])):
        return False
    batch = sq[0] if len(sq) == 4 else 1
    return mask is None or len(mask) < 4 or len(mask) == 4 and mask[0] in (1, batch)


def _merge_batch_axes(query: Any, key: Any, value: Any, attn_mask: Any, enable_gqa: Any
                      ) -> tuple[Any, Any, Any, Any, Any, _Batch | None]:
    """torch's batch axes (all but each input's last three: ``(N, ..., H, L,
    E)``), broadcast together as torch broadcasts them, merged into the one
    batch axis the kernels take (a view when nothing is broadcast), the mask
    broadcast over them. A head axis of 1 broadcasts too: one key/value head
    serves every query head as grouped-query attention (no copy); otherwise
    the inputs with one head are repeated. Returns q, k, v, the mask,
    enable_gqa as the kernels need it, and how to give the output the
    caller's axes (None: the inputs are taken as given)."""
    shapes = [tuple(getattr(x, "shape", ())) for x in (query, key, value)]
    bias = attn_mask is not None and _causal_bias(attn_mask) is not None
    mask_shape = None if attn_mask is None or bias else tuple(getattr(attn_mask, "shape", ()))
    gqa = isinstance(enable_gqa, (bool, np.bool_)) and bool(enable_gqa)
    if _as_given(shapes, mask_shape, gqa) or min(len(x) for x in shapes) < 2:
        return query, key, value, attn_mask, enable_gqa, None  # the library checks them as they are
    qa, ka, va = (as_input(x, _OP, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    m = None if attn_mask is None or bias else to_numpy(attn_mask, _OP, "attn_mask")

    def batch(a: np.ndarray | None) -> tuple[int, ...]:
        return () if a is None or a.ndim <= 3 else tuple(a.shape[:-3])

    try:
        lead = tuple(np.broadcast_shapes(batch(qa), batch(ka), batch(va)))
    except ValueError:
        raise InvalidValueError(_OP, f"the batch axes (all but the last three) of query {qa.shape}, key {ka.shape} "
                                f"and value {va.shape} do not broadcast together", argument="key") from None
    heads = [a.shape[-3] if a.ndim >= 3 else 1 for a in (qa, ka, va)]
    if not gqa and _heads_broadcast(heads):
        h = max(heads)
        if heads[1] == heads[2] == 1:
            enable_gqa = True  # one key/value head for every query head: grouped-query attention, no copy
        else:
            heads = [h, h, h]
    n = math.prod(lead)

    def merged(a: np.ndarray, h: int) -> np.ndarray:
        full = a.reshape((1,) * (len(lead) + 3 - a.ndim) + a.shape)
        return np.broadcast_to(full, lead + (h,) + a.shape[-2:]).reshape((n, h) + a.shape[-2:])

    q4, k4, v4 = (merged(a, h) for a, h in zip((qa, ka, va), heads))
    mask: Any = attn_mask
    if m is not None and m.ndim > 3:  # broadcast to the batch axes (it adds none, as torch's)
        tail: tuple[int, ...] = m.shape[-3:]
        if m.ndim > len(lead) + 3:
            mask = m  # the library's rank error
        elif math.prod(m.shape[:-3]) == 1:  # every batch axis of the mask is 1
            mask = m.reshape((1,) + tail)
        else:
            try:
                mask = np.broadcast_to(m, lead + tail).reshape((n,) + tail)
            except ValueError:
                raise InvalidValueError(_OP, f"attn_mask shape {m.shape} does not broadcast to the batch axes "
                                        f"{lead}", argument="attn_mask") from None
    return q4, k4, v4, mask, enable_gqa, _Batch(lead, max(a.ndim for a in (qa, ka, va)) >= 3)


def explain(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
            is_causal: bool = False, *, scale: float | None = None, enable_gqa: bool = False,
            softcap: float = 0.0, window: int | None = None, kv_len: int | None = None,
            align: str = "top_left", sinks: Any = None) -> Route:
    """The route ``scaled_dot_product_attention`` would take for these
    arguments, without running it (the same checks and errors)."""
    query, key, value, attn_mask, enable_gqa, _ = _merge_batch_axes(query, key, value, attn_mask, enable_gqa)
    return _plan(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, softcap, window, kv_len,
                 align, sinks).route


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    softcap: float = 0.0,
    window: int | None = None,
    kv_len: int | None = None,
    align: str = "top_left",
    sinks: Any = None,
    registry: RegistryLike = None,
) -> Any:
    """``torch.nn.functional.scaled_dot_product_attention``, same arguments in
    the same order (scale and enable_gqa keyword-only, as torch's are), on
    the best flashmetal kernel. Always finds a kernel:

    - ``flash_attn_decode`` (split-KV decode): one query row at the newest
      position, no ``attn_mask``, any D up to 512 or a tile
      ``supported_head_dims("flash_attn_decode")`` lists; or one query row
      whose ``attn_mask`` (bool, or 0/-inf) keeps one key range per batch
      row, the same for every head (left padding, a sliding window,
      causal), without sinks (``key_ranges``); or a few query rows at the
      newest positions (bottom-right), no ``attn_mask``, no sinks;
    - ``flash_attn_prefill`` (tiled flash attention): bfloat16/float16/float32,
      any D up to 512 or a tile ``supported_head_dims("flash_attn_prefill")``
      lists, causal or windowed rows inside the keys (without causal and a
      window, any number of query rows);
    - ``sdpa`` (the general kernel) for everything else: any head dim
      (640, 1024, ... up to 65536), causal or windowed rows outside the
      keys.

    ``last_route()`` says which ran and why; ``explain(...)`` says it without running.

    Args:
        query: ``[B, H, qL, D]`` (or ``[H, qL, D]``, ``[qL, D]``, or
            torch's ``[N, ..., H, qL, D]`` with more batch axes; the batch
            axes of query, key and value broadcast together as torch's do,
            a head axis of 1 too); float32, float16 or bfloat16. numpy
            arrays, torch CPU tensors (bfloat16 too) or any DLPack /
            buffer-protocol object; read without copying when C-contiguous.
        key: ``[B, Hkv, kL, D]``, value: ``[B, Hkv, kL, Ev]`` (Ev may differ
            from D, as torch allows: the output then has Ev), query's dtype.
        attn_mask: bool (True = attend) or additive (any float dtype: 0
            attend, -inf masked, any finite bias; converted once to the I/O
            dtype), broadcastable to ``[B, H, qL, kL]`` as in torch. Axes of
            size 1 (or expanded with stride 0) are read in place. Combines
            with ``is_causal`` and ``window`` (torch raises for is_causal +
            attn_mask; here both apply).
        dropout_p: must be 0.0 (no dropout: an inference library).
        is_causal: keep keys at positions <= the query's (see ``align``).
        scale: score scale; default ``1/sqrt(D)``.
        enable_gqa: allow Hkv < H (H a multiple of Hkv), as in torch.
        softcap: logit softcap c > 0: ``c*tanh(s/c)`` before the mask; 0 = off.
        window: sliding window w: keys p with ``t - p < w``; None = none.
        kv_len: valid K/V length when key/value are a cache with more slots;
            default kL.
        align: ``"top_left"`` (torch: query i at position i) or
            ``"bottom_right"`` (KV cache: query i at ``kv_len - qL + i``).
        sinks: ``[H]`` per-head sink logits (gpt-oss; converted to float32),
            or None: each joins its head's softmax denominators without a
            value, beside the mask. Applied by the prefill kernel; a call it
            cannot take (an unsupported head dim, causal rows outside the
            keys) is refused.
        registry: a Registry or a backend name; default ``Registry("auto")``.

    Returns:
        ``[B, H, qL, Ev]`` in query's dtype and type: a torch tensor (sharing
        the result's memory) for a torch query, else a numpy array.
    """
    reg = resolve(registry, _OP)
    q, k, v, mask, gqa, batch = _merge_batch_axes(query, key, value, attn_mask, enable_gqa)
    call = _plan(q, k, v, mask, dropout_p, is_causal, scale, gqa, softcap, window, kv_len, align, sinks)
    with _native.running(_OP):
        out = _run(call, scale, softcap, window, reg)
    _last.route = call.route
    if batch is not None:
        out = batch.restore(out)
    return wrapper_like(query)(out[0] if call.squeeze else out)


def _run(c: _Call, scale: float | None, softcap: float, window: int | None, reg: Registry) -> np.ndarray:
    qa, ka, va, kl = c.q, c.k, c.v, c.kv_len
    kernel = c.route.kernel
    if kernel == NONE:
        return np.zeros(out_shape(qa, va), qa.dtype)
    if kernel == DECODE and c.key_ranges is not None:
        return _decode_ranges(c, scale, softcap, reg)
    if kernel == DECODE:
        return _decode_newest(c, scale, softcap, window, reg)
    if kernel == PREFILL:
        # The position matters only to causal and the window, both applied in the kernel.
        q_offset = c.q_offset if c.causal or window is not None else 0
        prefilled: np.ndarray = flash_attn_prefill(qa, ka, va, mask=c.mask, causal=c.causal, q_offset=q_offset,
                                                   window=window, scale=scale, softcap=softcap, kv_len=kl,
                                                   sinks=c.sinks, registry=reg)
        return prefilled
    # The position only when it matters and is not sdpa's default (kv_len - qL): a call
    # without the extension parameters can take the cpu backend's fast float32 path.
    positioned = (c.causal or window is not None) and c.q_offset != kl - qa.shape[2]
    general: np.ndarray = sdpa(qa, ka, va, mask=c.mask, causal=c.causal, scale=scale, kv_len=kl,
                               q_offset=c.q_offset if positioned else None, window=window, softcap=softcap,
                               registry=reg)
    return general


def _decode_newest(c: _Call, scale: float | None, softcap: float, window: int | None, reg: Registry) -> np.ndarray:
    """The qL query rows at the newest positions (kv_len - qL + i) on the
    serving decode kernel: each batch row a sequence of kv_len keys."""
    return _decode_in_place(reg, c, np.full(c.q.shape[0], c.kv_len, dtype=np.int32), scale, softcap, c.causal,
                            -1 if window is None else window - 1)


def _decode_ranges(c: _Call, scale: float | None, softcap: float, reg: Registry) -> np.ndarray:
    """One query row per (batch row, head) over each batch row's key range
    [start, end) on the serving decode kernel."""
    assert c.key_ranges is not None
    ranges = np.ascontiguousarray(np.broadcast_to(c.key_ranges, (2, c.q.shape[0])), dtype=np.int32)
    return _decode_in_place(reg, c, ranges, scale, softcap, False, -1)


def _decode_in_place(reg: Registry, c: _Call, seqlens_k: np.ndarray, scale: float | None, softcap: float,
                     causal: bool, window_left: int) -> np.ndarray:
    """The serving decode kernel (fm_dispatch_vec_seq) reading q [B, H, qL,
    D] and the caches [B, Hkv, cap, D] as they are (head-major: no copy when
    contiguous) and writing the output [B, H, qL, Dv] in q's dtype; batch
    row b is a sequence with seqlens_k[b] keys (int32 [B], or [2, B]: those,
    then each sequence's first key), each row seeing keys back to
    window_left before it (-1: unbounded)."""
    q, k, v = (np.ascontiguousarray(x) for x in (c.q, c.k, c.v))
    opts = attn_options(_OP, head_dim=q.shape[3], softmax_scale=scale, softcap=softcap, causal=causal,
                        window_size=(window_left, -1), head_major=True)
    out = np.empty(out_shape(q, v), dtype=q.dtype)
    ffi = _native.ffi()
    seq, keep = seq_tensors(ffi, seqlens_k=seqlens_k)
    _native.call(reg, "fm_dispatch_vec_seq", tensor(ffi, q), tensor(ffi, k), tensor(ffi, v), seq, ffi.NULL,
                 tensor(ffi, out), opts, op=_OP, keep=(q, k, v, seqlens_k, out, keep))
    return out
