"""Hints in errors: what the mistake most likely was, when the inputs say so.

- A dtype flashmetal has no kernel for (float64, int64, ...) is told which
  dtypes that argument takes (``TAKES``).
- A bfloat16 array whose DLPack export numpy cannot read (MLX's) is told how
  to pass its bits without a copy.
- Tensors whose shapes do not fit the op's layout (``[B, H, L, D]`` for the
  drop-in, ``sdpa``, ``flash_attn_prefill`` and the decode caches; ``[B, L,
  H, D]`` for flash-attn's functions) but fit the transposed one are told the
  layout looks transposed (``layout_hint``). Only a call that already failed
  gets a hint; shapes valid in both layouts run, as torch runs them.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import numpy as np

from ._errors import InvalidTypeError, InvalidValueError

_IO = "float32, float16 or bfloat16"

#: The dtypes each data argument takes, by (public function, the argument as
#: its messages name it). The library enforces them; tests/python/
#: test_error_hints.py runs every listed dtype and checks the library refuses
#: the others, so the two cannot drift apart.
TAKES: dict[tuple[str, str], str] = {
    ("flash_attn_prefill", "q"): _IO,
    ("flash_attn_prefill", "k"): f"q's dtype ({_IO})",
    ("flash_attn_prefill", "v"): f"q's dtype ({_IO})",
    ("flash_attn_prefill", "mask"): f"q's dtype ({_IO}; additive) or bool",
    ("sdpa", "q"): _IO,
    ("sdpa", "k"): f"q's dtype ({_IO})",
    ("sdpa", "v"): f"q's dtype ({_IO})",
    ("sdpa", "mask"): f"q's dtype ({_IO}; additive) or bool",
    ("scaled_dot_product_attention", "query"): _IO,
    ("scaled_dot_product_attention", "key"): f"query's dtype ({_IO})",
    ("scaled_dot_product_attention", "value"): f"query's dtype ({_IO})",
    ("flash_attn_decode", "q"): f"float32 or k_cache's dtype ({_IO})",
    ("flash_attn_decode", "k_cache"): _IO,
    ("flash_attn_decode", "v_cache"): _IO,
    ("flash_attn_func", "q"): _IO,
    ("flash_attn_func", "k"): f"q's dtype ({_IO})",
    ("flash_attn_func", "v"): f"q's dtype ({_IO})",
    ("flash_attn_varlen_func", "q"): _IO,
    ("flash_attn_varlen_func", "k"): f"q's dtype ({_IO})",
    ("flash_attn_varlen_func", "v"): f"q's dtype ({_IO})",
    ("flash_attn_with_kvcache", "q"): _IO,
    ("flash_attn_with_kvcache", "k_cache"): _IO,
    ("flash_attn_with_kvcache", "v_cache"): _IO,
    ("build_blk", "mask"): f"{_IO} (additive) or bool",
    ("KVCodec.encode", "x"): _IO,
}
#: What flashmetal reads at all, for an argument missing from TAKES.
_ANY = f"{_IO} data (bool or uint8 for masks and tile tables)"


def argument_name(name: str) -> str:
    """The parameter an argument's message name stands for ("k_cache
    codes" is k_cache)."""
    return name.split()[0]


def unsupported_dtype(op: str, name: str, dtype: Any) -> InvalidTypeError:
    """The error for an input of a dtype no flashmetal kernel reads."""
    takes = TAKES.get((op, name), _ANY)
    if isinstance(dtype, np.dtype) and dtype.kind == "f" and dtype.itemsize > 4:
        return InvalidTypeError(op, f"{name} is {dtype}, which flashmetal does not support (its kernels compute in "
                                f"float32 at most); {name} takes {takes}: convert it first (numpy: "
                                f"x.astype(...), torch: x.to(...))", argument=argument_name(name))
    return InvalidTypeError(op, f"{name} dtype {dtype} is not supported; {name} takes {takes}",
                            argument=argument_name(name))


def _exporter(x: Any) -> str:
    cls = type(x)
    return f"{cls.__module__}.{cls.__qualname__}"


def dlpack_unreadable(op: str, name: str, x: Any, exc: BaseException) -> InvalidTypeError:
    """The error for an array numpy cannot read through DLPack; a bfloat16
    one is told how to pass its bits (DLPack's bfloat16 is one numpy lacks)."""
    what = _exporter(x)
    message = f"{name} ({what}) could not be read through DLPack: {exc}"
    if "bfloat16" in str(getattr(x, "dtype", "")):
        if what.startswith("mlx."):
            how = (f"pass its bits without a copy, np.asarray({name}.view(mx.uint16)).view(ml_dtypes.bfloat16), "
                   "or use flashmetal.integrations.mlx.scaled_dot_product_attention (MLX arrays in and out, "
                   "bfloat16 too)")
        else:
            how = (f"view its bits as uint16 in its own library and pass them as ml_dtypes.bfloat16 without a copy: "
                   f"np.from_dlpack({name}.view(<uint16>)).view(ml_dtypes.bfloat16)")
        message = (f"{name} is a bfloat16 {what}, whose DLPack export numpy cannot read ({exc}); {how}")
    return InvalidTypeError(op, message, argument=argument_name(name))


# --- layouts -----------------------------------------------------------------

_TRANSPOSED = {"bhld": "blhd", "blhd": "bhld"}
_SPELLED = {"bhld": "[B, H, L, D]", "blhd": "[B, L, H, D]"}


@dataclass(frozen=True)
class _Reading:
    """A tensor's heads and positions when read in one layout."""
    name: str
    shape: tuple[int, ...]
    layout: str
    heads: int
    positions: int | None  # None: a decode query, which has no sequence axis

    def describe(self) -> str:
        at = "" if self.positions is None else f" x {self.positions} positions"
        return f"{self.name} {self.shape}: {self.heads} heads{at}"


def _read(name: str, shape: tuple[int, ...], layout: str, has_seq: bool = True) -> _Reading:
    """The heads and positions of a rank-3 or rank-4 tensor (a leading batch
    axis optional) in ``layout``; a decode query ``[(B,) H, D]`` has no
    sequence axis."""
    if not has_seq:
        return _Reading(name, shape, layout, shape[-2], None)
    h, s = (-3, -2) if layout == "bhld" else (-2, -3)
    return _Reading(name, shape, layout, shape[h], shape[s])


def _broadcasts(mask: tuple[int, ...], full: tuple[int, ...], cap: int) -> bool:
    """Whether a mask of shape ``mask`` broadcasts to ``full`` ([B, H, qL,
    kL]); its key axis may also span the whole capacity."""
    if len(mask) > len(full):
        return False
    for i, (m, want) in enumerate(zip(reversed(mask), reversed(full))):
        if m not in (1, want) and not (i == 0 and m == cap):
            return False
    return True


@dataclass(frozen=True)
class _Call:
    """The shapes of one failed call, as the hint reads them."""
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...] | None
    mask: tuple[int, ...] | None
    gqa: bool
    kv_len: int | None
    q_offset: int | None  # the query rows' offset, where the op needs them inside the keys
    positioned: bool = True  # causal or windowed: the rows' positions matter


@dataclass(frozen=True)
class _Spec:
    """Which parameters of a public function are its q, k, v and mask, the
    layout it expects, and the rules its shapes follow."""
    op: str
    q: str
    k: str
    v: str
    mask: str | None = None
    gqa: str | None = None  # the flag that allows Hkv < H (None: always allowed)
    layout: str | None = None  # the parameter naming the layout (None: ``expected`` always)
    expected: str = "bhld"
    decode: bool = False  # q is [(B,) H, D]; only the caches have a layout
    q_within_keys: bool = False  # q_offset + qL <= kv_len when causal or windowed (bottom-right by default)


def _fits(spec: _Spec, c: _Call, q_layout: str, k_layout: str) -> tuple[_Reading, _Reading] | None:
    """The two readings when the call's shapes fit these layouts, else None."""
    rank_q = 3 if spec.decode else 4
    if len(c.k) not in (3, 4) or len(c.q) not in (rank_q - 1, rank_q) or (c.v is not None and c.v != c.k):
        return None
    q = _read(spec.q, c.q, q_layout, has_seq=not spec.decode)
    k = _read(spec.k, c.k, k_layout)
    assert k.positions is not None
    kv = k.positions if c.kv_len is None else c.kv_len
    if k.heads <= 0 or q.heads % k.heads or (not c.gqa and q.heads != k.heads) or not 0 < kv <= k.positions:
        return None
    if spec.q_within_keys and c.positioned and q.positions is not None and q.positions + (c.q_offset or 0) > kv:
        return None
    if c.mask is not None and q.positions is not None:
        batch = c.q[0] if len(c.q) == 4 else 1
        if not _broadcasts(c.mask, (batch, q.heads, q.positions, kv), k.positions):
            return None
    return q, k


def _shape(x: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(d) for d in (x.shape if hasattr(x, "shape") else np.shape(x)))
    except (TypeError, ValueError):
        return None


def _layout_error(spec: _Spec, e: InvalidValueError, args: dict[str, Any]) -> InvalidValueError | None:
    """A hint for a failed call whose shapes fit the transposed layout (or
    None), or an error that names q instead of a q_offset nobody passed.
    A QuantizedKV's shape has no head-dim axis, so a call with one gets no
    layout hint."""
    from .kv_codec import QuantizedKV  # imported here: kv_codec's imports reach this module

    if any(isinstance(args.get(n), QuantizedKV) for n in (spec.q, spec.k, spec.v)):
        return None
    q, k = _shape(args[spec.q]), _shape(args[spec.k])
    if q is None or k is None or 0 in q or 0 in k:
        return None
    mask = None if spec.mask is None or args.get(spec.mask) is None else _shape(args[spec.mask])
    kv_len = args.get("kv_len")
    q_offset = args.get("q_offset")
    call = _Call(q, k, _shape(args[spec.v]), mask, True if spec.gqa is None else args[spec.gqa] is True,
                 kv_len if isinstance(kv_len, int) else None, q_offset if isinstance(q_offset, int) else None,
                 args.get("causal") is not False or args.get("window") is not None)
    expected = args.get(spec.layout, spec.expected) if spec.layout else spec.expected
    if not isinstance(expected, str) or expected not in _TRANSPOSED:
        return None
    reason = e.message
    unpassed_offset = e.argument == "q_offset" and "q_offset" in args and args["q_offset"] is None
    if _fits(spec, call, expected, expected) is None:
        other = _TRANSPOSED[expected]
        # Every tensor transposed, or (a token-major cache) only k and v.
        # The transposed shapes may be grouped-query ones the flag has not
        # allowed yet: the hint then says to pass it too.
        orders = [(expected, other)] if spec.decode else [(other, other), (expected, other)]
        relaxed = dataclasses.replace(call, gqa=True)
        fitting = [r for r in (_fits(spec, relaxed, ql, kl) for ql, kl in orders) if r is not None]
        if fitting:
            if unpassed_offset:
                reason = _rows_beyond_keys(spec, call, expected)
            return _transposed(spec, e, reason, fitting, expected, call.gqa)
    if unpassed_offset:
        return InvalidValueError(e.op, _rows_beyond_keys(spec, call, expected), e.status, spec.q)
    return None


def _rows_beyond_keys(spec: _Spec, c: _Call, layout: str) -> str:
    q, k = _read(spec.q, c.q, layout), _read(spec.k, c.k, layout)
    assert k.positions is not None
    kv = k.positions if c.kv_len is None else c.kv_len
    return (f"{spec.q} has {q.positions} query rows, more than the {kv} keys (kv_len); without q_offset the "
            "queries are the newest kv_len positions (bottom-right), so there can be at most kv_len of them")


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _transposed(spec: _Spec, e: InvalidValueError, reason: str, fitting: list[tuple[_Reading, _Reading]],
                expected: str, gqa: bool) -> InvalidValueError:
    """The hint: each reading that fits, with the swap that gives it."""
    alternative = _SPELLED[_TRANSPOSED[expected]]
    parts, first = [], None
    for q, k in fitting:
        names = ([] if spec.decode or q.layout == expected else [spec.q]) + [spec.k, spec.v]
        first = first or names[0]
        moved = k if spec.decode or q.layout == expected else q
        i, j = len(moved.shape) - 3, len(moved.shape) - 2
        fix = f"swap axes {i} and {j} of {_listed(names)} (torch: x.transpose({i}, {j}); numpy: x.swapaxes({i}, {j}))"
        if not gqa and q.heads != k.heads:
            fix += f" and pass {spec.gqa}=True"
        if spec.layout is not None and len(names) == 3:
            fix += f", or pass {spec.layout}={_TRANSPOSED[expected]!r}"
        parts.append(f"with {_listed(names)} read as {alternative} the shapes fit ({q.describe()}; {k.describe()}): "
                     f"{fix}")
    assert first is not None
    return InvalidValueError(e.op, f"{reason}. The layout looks transposed: {'; or '.join(parts)}", e.status, first)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def layout_hint(op: str, *, q: str, k: str, v: str, mask: str | None = None, gqa: str | None = None,
                layout: str | None = None, expected: str = "bhld", decode: bool = False,
                q_within_keys: bool = False) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorates a public function: a shape error of its own (not of a
    public function running it) whose shapes fit the transposed layout is
    raised again with that hint. Nothing changes for a call that succeeds."""
    spec = _Spec(op, q, k, v, mask, gqa, layout, expected, decode, q_within_keys)

    def decorate(f: Callable[_P, _R]) -> Callable[_P, _R]:
        signature = inspect.signature(f)

        @functools.wraps(f)
        def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return f(*args, **kwargs)
            except InvalidValueError as e:
                if e.op != spec.op:
                    raise
                try:
                    bound = signature.bind(*args, **kwargs)
                except TypeError:
                    raise e from None
                bound.apply_defaults()
                try:
                    hint = _layout_error(spec, e, dict(bound.arguments))
                except Exception:  # arguments of any type reach here: the hint is optional, the error is not
                    hint = None
                if hint is None:
                    raise
                raise hint from e

        return run

    return decorate
