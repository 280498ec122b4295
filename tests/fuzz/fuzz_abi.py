"""C-ABI fuzz harness (used by test_fuzz.py and tests/fuzz/run_fuzz.py).

One case = a valid call of one entry point (small random shapes, random
values), then 0..3 mutations of its descriptors, options or scalar
arguments (null pointers, bad dtype codes, ndim out of range, zero /
negative / huge / overflowing dims, undersized or absurd nbytes, garbage
options). Every buffer the library sees sits in the middle of a larger
numpy buffer whose guard bytes hold a random pattern.

Contract checked for every case:
  - the call returns 0, 1 (value) or 2 (type) -- 3 only for "no kernel
    named" on a backend that lacks an op; never crashes;
  - an error message is "op: what" with a known op name;
  - on error no byte of any buffer changed (validation precedes kernels);
  - on success inputs are unchanged, nothing outside `out` (or tmp) was
    written, and with finite inputs the output matches the float64
    reference computed from the descriptors the library accepted;
  - a case without mutations must succeed.
The library never gets a descriptor whose nbytes exceeds its real buffer
unless nbytes > INT64_MAX (which must be rejected before any access).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from flashmetal import _loader, quant_reference, reference

G = 64  # guard bytes on each side
BF16 = np.dtype(ml_dtypes.bfloat16)
NP = {0: np.dtype(np.float32), 1: np.dtype(np.float16), 2: BF16, 3: np.dtype(np.bool_), 4: np.dtype(np.uint8),
      5: np.dtype(np.int32)}
SIZE = {0: 4, 1: 2, 2: 2, 3: 1, 4: 1, 5: 4}


def geom(d: int) -> tuple[int, int]:
    """(BQ, BK) of the prefill (and its blk) for head dim d: the narrow
    body's tiles up to 256, the 512 tile's above."""
    return (8, 8) if d > 256 else (32, 16)


def prefill_dims() -> tuple[int, ...]:
    """The prefill head dims, from the library's capability table."""
    from flashmetal._native import head_dims
    return head_dims("flash_attn_prefill")


def vec_dims() -> tuple[int, ...]:
    """The decode head dims, from the library's capability table."""
    from flashmetal._native import head_dims
    return head_dims("flash_attn_vec")


def pick_dim(rng, dims: tuple[int, ...]) -> int:
    """A head dim of `dims`: 64 (the cheapest) 40% of the time, 512 (the
    dearest) 10%, the others evenly; or (15%) one without a tile of its own
    that runs on the next tile up (flash-attn's 32, 40, 59, 111, 160, 224, or any D <= 512)."""
    if rng.random() < 0.15:
        return int(rng.choice([32, 40, 59, 111, 160, 224, int(rng.integers(1, 257)), int(rng.integers(257, 513))]))
    w = np.array([0.4 if d == 64 else 0.1 if d == 512 else 0.0 for d in dims])
    rest = [i for i, d in enumerate(dims) if d not in (64, 512)]
    w[rest] = (1.0 - w.sum()) / max(len(rest), 1)
    return int(rng.choice(dims, p=w / w.sum()))


INT64_MAX = 2**63 - 1
OPS = {
    "prefill": ("flash_attn_prefill",),
    "vec": ("flash_attn_vec", "flash_attn_vec_reduce_tq_hb_undo", "flash_attn_vec_reduce"),
    "sdpa": ("sdpa",),
    "mask": ("flash_attn_prefill_mask",),
    "blk": ("flash_attn_prefill_blk",),
    "blk_byte_len": ("blk_byte_len",),
    "alloc_blk": ("alloc_blk", "free_blk", "blk_byte_len"),  # see test_alloc_blk_names_its_op
    # fm_dispatch_attn names the flash-attn function its tables make the call
    "attn": ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"),
    "vec_seq": ("flash_attn_vec_seq", "flash_attn_vec", "flash_attn_vec_reduce"),
    "kv_append": ("kv_append",),
    "rotary": ("rotary",),
    "kv_codes_attn": ("kv_codes_attn",),
    "kv_encode": ("kv_encode", "kv_codec"),
    "kv_dequantize": ("kv_dequantize", "kv_codec"),
    "kv_codes_decode": ("kv_codes_decode", "kv_codec"),
    "kv_codes_append": ("kv_codes_append", "kv_codec"),
    "mask_key_ranges": ("mask_key_ranges",),
}
SEQ_FIELDS = ("cu_seqlens_q", "cu_seqlens_k", "seqlens_k", "block_table", "sinks", "lse", "seqused_q", "k_new",
              "v_new", "cu_seqlens_k_new", "alibi_slopes", "cache_batch_idx")
# Values a mutated int32 index entry takes (out of range for any table here).
BAD_ENTRIES = (-1, -2**31, 2**31 - 1, 4096, 65)
TOL = {0: (1e-4, 1e-3), 1: (1e-3, 5e-3), 2: (5e-3, 2e-2)}

HUGE_DIMS = (2**31, 2**31 + 1, 2**32 + 1, 2**40, 2**62, INT64_MAX, 3037000500)
BAD_DTYPES = (-1, 5, 6, 255, 2**31 - 1, -2**31)
BAD_NDIMS = (-1, -2**31, 9, 64, 2**31 - 1)
BAD_FLOATS = (math.nan, math.inf, -math.inf, -1.0, 0.0, 1e38, -0.0, 1e-45)
BAD_INTS = (-1, -2**31, 2**31 - 1, 2, 3, 1000, 0, 2**16)


class Buf:
    """A byte buffer of `n` bytes between two random guard zones."""

    def __init__(self, n: int, rng: np.random.Generator, payload: np.ndarray | None = None):
        self.n = n
        self.raw = rng.integers(0, 256, n + 2 * G, dtype=np.uint8)
        if payload is not None:
            b = payload.view(np.uint8).reshape(-1)[:n]
            self.raw[G:G + len(b)] = b
        self.snap = self.raw.copy()

    @property
    def addr(self) -> int:
        return self.raw.ctypes.data + G

    def mid(self) -> np.ndarray:
        return self.raw[G:G + self.n]

    def guards_ok(self) -> bool:
        return (np.array_equal(self.raw[:G], self.snap[:G])
                and np.array_equal(self.raw[G + self.n:], self.snap[G + self.n:]))

    def unchanged(self) -> bool:
        return np.array_equal(self.raw, self.snap)


@dataclass
class TSpec:
    """An FMTensor description. data None = NULL data pointer."""
    dtype: int
    shape: list[int]
    nbytes: int
    buf: Buf | None
    ndim: int | None = None  # overrides len(shape)
    null: bool = False       # the FMTensor pointer itself is NULL
    role: str = "in"         # "in", "out" (may be written), "tmp" (scratch, may be written)
    buf_null: bool = False   # the descriptor's data pointer is NULL

    @property
    def passed(self) -> bool:
        """Whether the library gets a pointer to this tensor's buffer: a NULL
        descriptor or a NULL data pointer hands it no memory to read or write."""
        return self.buf is not None and not self.null and not self.buf_null

    def array(self) -> np.ndarray:
        """The descriptor's view of its buffer (only for accepted descriptors):
        its shape as passed, ndim dims of it (dims past the list read 0)."""
        shape = list(self.shape) if self.ndim is None else (list(self.shape) + [0] * 8)[:max(self.ndim, 0)]
        n = int(np.prod(shape)) if shape else 1
        return self.buf.mid()[: n * SIZE[self.dtype]].view(NP[self.dtype]).reshape(shape)


@dataclass
class Case:
    op: str
    backend: str
    tensors: dict[str, TSpec]
    opts: dict[str, Any] = field(default_factory=dict)  # option struct fields; None = NULL options
    args: dict[str, Any] = field(default_factory=dict)  # scalar arguments
    registry: str = "live"  # "live", "null", "dead", "garbage"
    mutations: list[str] = field(default_factory=list)
    finite: bool = True
    status: int = -1
    notes: list[str] = field(default_factory=list)  # what the checks covered, counted by run_fuzz.py


def _tensor(rng: np.random.Generator, dtype: int, shape: list[int], *, role: str = "in",
            values: np.ndarray | None = None, nonfinite: bool = False) -> TSpec:
    n = int(np.prod(shape)) * SIZE[dtype]
    if values is None:
        if dtype in (3,):
            values = rng.integers(0, 2, shape).astype(np.bool_)
        elif dtype == 4:
            values = rng.integers(0, 256, shape).astype(np.uint8)
        else:
            values = rng.standard_normal(shape).astype(np.float32)
            if nonfinite and values.size:
                idx = rng.integers(0, values.size, max(1, values.size // 50))
                values.reshape(-1)[idx] = rng.choice([np.nan, np.inf, -np.inf], idx.size)
            values = values.astype(NP[dtype])
    payload = None if role != "in" else np.ascontiguousarray(np.asarray(values).astype(NP[dtype]))
    return TSpec(dtype, list(shape), n, Buf(n, rng, payload), role=role)


# ---------------------------------------------------------------- valid calls

def gen_prefill(rng, backend):
    small = backend != "cpu"
    dt = int(rng.choice([1, 2]))
    d = 64 if small else pick_dim(rng, prefill_dims())
    b = 1 if small else int(rng.integers(1, 3))
    hkv = int(rng.integers(1, 3))
    h = hkv * int(rng.choice([1, 2]))
    cap = int(rng.integers(1, 33 if small else 81))
    kvl = int(rng.integers(1, cap + 1)) if rng.random() < 0.3 else 0
    kl = kvl or cap
    ql = int(rng.integers(1, min(kl, 16 if small else 40) + 1))
    qoff = int(rng.integers(0, kl - ql + 1))
    layout = int(rng.integers(0, 2))
    nonfinite = rng.random() < 0.05
    # v of its own head dim (head_dim_v) 20% of the time: unequal dims both <= 512; 4% MLA's 576 over 512
    dv = int(rng.choice([24, 40, 64, 128, 200, 300])) if not small and d <= 512 and rng.random() < 0.2 else d
    if not small and rng.random() < 0.04:
        d, dv = 576, 512
    qs = [b, h, ql, d] if layout == 0 else [b, ql, h, d]
    ks = [b, hkv, cap, d] if layout == 0 else [b, cap, hkv, d]
    t = {"q": _tensor(rng, dt, qs, nonfinite=nonfinite), "k": _tensor(rng, dt, ks),
         "v": _tensor(rng, dt, ks[:-1] + [dv]), "out": _tensor(rng, dt, qs[:-1] + [dv], role="out")}
    mk = rng.choice(["none", "add2", "bool2", "add4", "bool4"], p=[0.4, 0.25, 0.15, 0.1, 0.1])
    if mk != "none":
        ms = [ql, kl] if mk.endswith("2") else [b, h, ql, kl]
        if mk.startswith("bool"):
            t["mask"] = _tensor(rng, 3, ms)
        else:
            vals = np.where(rng.random(ms) < 0.3, -np.inf, rng.choice([0.0, 0.0, 0.5, -2.0], ms))
            if rng.random() < 0.3:  # whole -inf blocks so blk has class-0 tiles
                vals[: ql // 2] = -np.inf
            t["mask"] = _tensor(rng, dt, ms, values=vals.astype(np.float32))
        if mk.endswith("2") and rng.random() < 0.5:
            m = t["mask"].array()
            add = np.where(m, 0.0, -np.inf) if m.dtype == np.bool_ else m.astype(np.float64)
            cls = reference.blk_classes(add, *geom(max(d, dv)))
            t["blk"] = _tensor(rng, 4, list(cls.shape), values=cls)
    opts = dict(scale=float(rng.choice([1 / math.sqrt(d), 0.05, 4 / math.sqrt(d)])),
                softcap=float(rng.choice([0.0, 0.0, 0.0, 5.0, 30.0])), causal=int(rng.integers(0, 2)),
                q_offset=qoff, kv_len=kvl, layout=layout)
    return Case("prefill", backend, t, opts, finite=not nonfinite)


def gen_vec(rng, backend):
    small = backend != "cpu"
    d = 64 if small else pick_dim(rng, vec_dims())
    kv = int(rng.choice([0, 1, 2]))
    batched = rng.random() < 0.5
    b = int(rng.integers(1, 3)) if batched else 1
    hkv = int(rng.integers(1, 3))
    h = hkv * int(rng.choice([1, 2, 4]))
    cap = int(rng.integers(1, 40 if small else 300))
    kvl = int(rng.integers(1, cap + 1))
    qs = [b, h, d] if batched else [h, d]
    ks = [b, hkv, cap, d] if batched else [hkv, cap, d]
    # v of its own head dim 20% of the time (the tile of the larger runs: 576 over 512 is MLA's)
    dv = (512 if d == 576 else int(rng.choice([32, 64, 100, 256]))) if not small and rng.random() < 0.2 else d
    nonfinite = rng.random() < 0.05
    t = {"q": _tensor(rng, 0, qs, nonfinite=nonfinite), "k": _tensor(rng, kv, ks),
         "v": _tensor(rng, kv, ks[:-1] + [dv]), "out": _tensor(rng, 0, qs[:-1] + [dv], role="out")}
    fwht = int(rng.random() < 0.3 and dv & (dv - 1) == 0 and dv in vec_dims())  # the FWHT reduce: power-of-two tiles
    if fwht and rng.random() < 0.6:
        t["signs"] = _tensor(rng, 4, [dv // 8])
    if rng.random() < 0.3:
        t["tmp"] = _tensor(rng, 0, [b * h * 32 * (dv + 2)], role="tmp")
    mt = int(rng.integers(0, 3))
    opts = dict(scale=float(rng.choice([1 / math.sqrt(d), 0.1])), softcap=float(rng.choice([0.0, 0.0, 10.0])),
                mask_type=mt, window=int(rng.integers(1, cap + 5)) if mt == 2 else 0, kv_len=kvl, fwht=fwht)
    return Case("vec", backend, t, opts, finite=not nonfinite)


def gen_sdpa(rng, backend):
    dt = int(rng.choice([0, 1, 2]))
    d = int(rng.choice([1, 7, 8, 33, 64, 128, 512]))
    b = int(rng.integers(1, 3))
    hkv = int(rng.integers(1, 3))
    h = hkv * int(rng.choice([1, 2]))
    cap = int(rng.integers(1, 48))
    kvl = int(rng.integers(1, cap + 1)) if rng.random() < 0.3 else 0
    ql = int(rng.integers(1, 40))
    dv = int(rng.choice([1, 9, 64, 512])) if rng.random() < 0.2 else d  # v of its own head dim
    t = {"q": _tensor(rng, dt, [b, h, ql, d]), "k": _tensor(rng, dt, [b, hkv, cap, d]),
         "v": _tensor(rng, dt, [b, hkv, cap, dv]), "out": _tensor(rng, dt, [b, h, ql, dv], role="out")}
    opts = dict(scale=float(rng.choice([1 / math.sqrt(d), 0.3])), causal=int(rng.integers(0, 2)), kv_len=kvl)
    if rng.random() < 0.5:  # the extension: explicit position (any int32), window, softcap
        opts.update(has_q_offset=1, q_offset=int(rng.choice([0, -5, 3, 2**31 - 1, -2**31])),
                    window=int(rng.choice([0, 1, 4, 2**31 - 1])), softcap=float(rng.choice([0.0, 2.0])))
    return Case("sdpa", backend, t, opts)


def gen_mask(rng, backend):
    dt = int(rng.choice([1, 2]))
    ql, kl = int(rng.integers(1, 70)), int(rng.integers(1, 300))
    w = int(rng.integers(1, kl + 3)) if rng.random() < 0.5 else 0
    opts = dict(causal=int(rng.integers(0, 2)), window=w, q_offset=int(rng.integers(0, kl + 3)))
    return Case("mask", backend, {"out": _tensor(rng, dt, [ql, kl], role="out")}, opts)


def gen_blk(rng, backend):
    dt = int(rng.choice([1, 2]))
    d = pick_dim(rng, prefill_dims())
    ql, kl = int(rng.integers(1, 100)), int(rng.integers(1, 100))
    vals = rng.choice([0.0, 0.0, -np.inf, 1.0, -1e31], [ql, kl])
    vals[rng.random([ql, kl]) < 0.5] = 0.0
    bq, bk = geom(d)
    n = -(-ql // bq) * -(-kl // bk)
    t = {"mask": _tensor(rng, dt, [ql, kl], values=vals.astype(np.float32)),
         "blk_out": _tensor(rng, 4, [n + int(rng.integers(0, 40))], role="out")}
    return Case("blk", backend, t, args=dict(head_dim=d))


def gen_ints(rng, backend, op):
    ext = [0, 1, -1, 7, 64, 300, 2**31 - 1, 2**31, 2**40, -2**63, INT64_MAX]
    ql = int(rng.choice(ext)) if rng.random() < 0.3 else int(rng.integers(1, 5000))
    kl = int(rng.choice(ext)) if rng.random() < 0.3 else int(rng.integers(1, 5000))
    hd = pick_dim(rng, prefill_dims()) if rng.random() < 0.8 else int(rng.choice([0, -1, 513, 575, 600, 2**31 - 1, -2**31]))
    return Case(op, backend, {}, args=dict(q_len=ql, k_len=kl, head_dim=hd))


def gen_attn(rng, backend):
    """fm_dispatch_attn: one of flash_attn_func, varlen (packed or paged keys)
    or with_kvcache (contiguous or paged cache with seqlens), with random
    causal/window/softcap/sinks/lse."""
    small = backend != "cpu"
    dt = int(rng.choice([1, 2]))
    d = 64 if small else pick_dim(rng, prefill_dims())
    dv = d
    if not small and rng.random() < 0.04:  # MLA's q/k 576 over v 512
        d, dv = 576, 512
    b = int(rng.integers(1, 3 if small else 4))
    hkv = int(rng.integers(1, 3))
    h = hkv * int(rng.choice([1, 2]))
    mode = str(rng.choice(["func", "varlen", "varlen_paged", "kvcache", "kvcache_paged"]))
    top = 8 if small else 40
    q_lens = [int(rng.integers(0 if mode.startswith("varlen") else 1, top // 2 + 1)) for _ in range(b)]
    k_lens = [int(rng.integers(0, top + 1)) for _ in range(b)]
    t: dict[str, TSpec] = {}
    ql, kl = max(q_lens), max(max(k_lens), 1)
    if mode.startswith("varlen"):
        q_shape = [sum(q_lens), h, d]
        t["cu_seqlens_q"] = _tensor(rng, 5, [b + 1], values=np.concatenate([[0], np.cumsum(q_lens)]))
        t["cu_seqlens_k"] = _tensor(rng, 5, [b + 1], values=np.concatenate([[0], np.cumsum(k_lens)]))
        if rng.random() < 0.3:  # flash-attn 3's seqused_q: the first rows of each sequence attend
            t["seqused_q"] = _tensor(rng, 5, [b], values=[int(rng.integers(0, n + 1)) for n in q_lens])
    else:
        q_lens = [ql] * b
        q_shape = [b, ql, h, d]
    if mode.endswith("paged"):
        page = int(rng.choice([16, 32]))
        per = max(-(-max(k_lens) // page), 1)
        num_pages = b * per + int(rng.integers(0, 3))
        k_shape = [num_pages, page, hkv, d]
        table = rng.permutation(num_pages)[:b * per].reshape(b, per)
        t["block_table"] = _tensor(rng, 5, [b, per], values=table)
    elif mode == "varlen":
        k_shape = [sum(k_lens), hkv, d]
    else:
        k_shape = [b, kl + int(rng.integers(0, 4)), hkv, d]
        if mode == "func":
            k_lens = [k_shape[1]] * b
    if mode.startswith("kvcache"):
        cap = k_shape[1] * (table.shape[1] if mode.endswith("paged") else 1)
        t["seqlens_k"] = _seqlens_table(rng, k_lens, cap)
    if mode.startswith("kvcache") and rng.random() < 0.25:
        _batch_idx_case(rng, t, k_shape, b)
    nonfinite = rng.random() < 0.05
    t.update(q=_tensor(rng, dt, q_shape, nonfinite=nonfinite), k=_tensor(rng, dt, k_shape),
             v=_tensor(rng, dt, k_shape[:-1] + [dv]), out=_tensor(rng, dt, q_shape[:-1] + [dv], role="out"))
    if rng.random() < 0.3:
        t["sinks"] = _tensor(rng, 0, [h])
    if rng.random() < 0.5:
        t["lse"] = _tensor(rng, 0, [h, sum(q_lens)] if mode.startswith("varlen") else [b, h, ql], role="out")
    window = [(-1, -1), (-1, -1), (3, 0), (0, 2), (5, -1)][int(rng.integers(0, 5))]
    opts = dict(scale=float(rng.choice([1 / math.sqrt(d), 0.3])), softcap=float(rng.choice([0.0, 0.0, 4.0])),
                causal=int(rng.integers(0, 2)), window_left=window[0], window_right=window[1],
                max_seqlen_q=max(q_lens) + int(rng.integers(0, 2)), max_seqlen_k=max(k_lens) + int(rng.integers(0, 2)),
                attention_chunk=int(rng.choice([0, 0, 0, 1, 5, 16])))
    if mode.startswith("kvcache") and rng.random() < 0.3:
        _new_rows(rng, t, k_lens, cap, hkv, d, dv, dt)
    case = Case("attn", backend, t, opts, finite=not nonfinite)
    case.args = dict(mode=mode, k_lens=k_lens)
    return case


def _new_rows(rng, t: dict[str, TSpec], lens: list[int], cap: int, hkv: int, d: int, dv: int, dt: int) -> None:
    """flash_attn_with_kvcache's k/v for a kvcache attn case, appended into
    k/v (the caches) before the attention: [B, n, Hkv, D], or (50%) ragged
    [total, Hkv, D] split by cu_seqlens_k_new (at least one row in all); no
    more rows than each sequence's cache has room for (none when one has no
    room)."""
    room = [cap - n for n in lens]
    if min(room) < 1:
        return
    b = len(lens)
    if rng.random() < 0.5:
        n = int(rng.integers(1, min(min(room), 3) + 1))
        t.update(k_new=_tensor(rng, dt, [b, n, hkv, d]), v_new=_tensor(rng, dt, [b, n, hkv, dv]))
    else:
        counts = [int(rng.integers(0, min(r, 3) + 1)) for r in room]
        counts[int(np.argmax(room))] += sum(counts) == 0  # some row, so the caches are written (an alias refused)
        t.update(k_new=_tensor(rng, dt, [sum(counts), hkv, d]), v_new=_tensor(rng, dt, [sum(counts), hkv, dv]),
                 cu_seqlens_k_new=_tensor(rng, 5, [b + 1], values=np.concatenate([[0], np.cumsum(counts)])))
    t["k"].role = t["v"].role = "inout"


def _cache_case(rng, small: bool, kv_dtypes: list[int], heads_per_kv: list[int]):
    """A batch of B sequences of random lengths in a contiguous [B, cap, Hkv, D]
    or a shuffled paged [num_pages, page, Hkv, D] cache: (tensors, lengths,
    paged, dims). Room for `room` more keys per sequence is left."""
    d = 64 if small else pick_dim(rng, vec_dims())
    b = int(rng.integers(1, 3 if small else 4))
    hkv = int(rng.integers(1, 3))
    h = hkv * int(rng.choice(heads_per_kv))
    room = int(rng.integers(1, 4))
    lens = [int(rng.integers(0, 24 if small else 70)) for _ in range(b)]
    dt = int(rng.choice(kv_dtypes))
    t: dict[str, TSpec] = {}
    paged = rng.random() < 0.5
    if paged:
        page = int(rng.choice([16, 32]))
        per = max(-(-(max(lens) + room) // page), 1)
        num_pages = b * per + int(rng.integers(0, 3))
        shape = [num_pages, page, hkv, d]
        t["block_table"] = _tensor(rng, 5, [b, per], values=rng.permutation(num_pages)[:b * per].reshape(b, per))
    else:
        shape = [b, max(lens) + room, hkv, d]
    return t, lens, shape, dict(d=d, b=b, h=h, hkv=hkv, dt=dt, room=room)


def _batch_idx_case(rng, t: dict[str, TSpec], shape: list[int], b: int, extra: int | None = None) -> None:
    """Makes a cache case flash_attn_with_kvcache's cache_batch_idx case:
    sequence b reads cache row idx[b] (distinct rows) among `extra` (else
    0-2) rows more than the batch: rows of the contiguous cache (`shape`,
    whose tensors are made after, grows in place), or of the block table
    (the extra rows any pages)."""
    extra = int(rng.integers(0, 3)) if extra is None else extra
    rows = b + extra
    if "block_table" in t:
        table = t["block_table"].array()
        more = rng.integers(0, shape[0], (extra, table.shape[1]))
        order = rng.permutation(rows)
        full = np.concatenate([table, more])[np.argsort(order)]
        t["block_table"] = _tensor(rng, 5, list(full.shape), values=full)
        idx = order[:b]
    else:
        shape[0] = rows
        idx = rng.permutation(rows)[:b]
    t["cache_batch_idx"] = _tensor(rng, 5, [b], values=idx)


def _pages_read(case: Case) -> np.ndarray | None:
    """The block table the kernels read: block_table; with cache_batch_idx
    its rows idx[b], or without one idx[b] itself (a cache row is one page)."""
    t = case.tensors
    table = t["block_table"].array() if _seq_present(case, "block_table") else None
    if not _seq_present(case, "cache_batch_idx"):
        return table
    idx = t["cache_batch_idx"].array()
    return idx[:, None] if table is None else table[idx]


def _seqlens_table(rng, lens: list[int], cap: int | None = None) -> TSpec:
    """seqlens_k: int32 [B] lengths, or (30%) [2, B]: the lengths, then each
    sequence's first key (cache_leftpad), up to one past its length where the
    cache has room for it (`cap` keys per sequence; None: room for every length + 1)."""
    if rng.random() < 0.3:
        starts = [int(rng.integers(0, (n + 2) if cap is None else min(n + 2, cap + 1))) for n in lens]
        return _tensor(rng, 5, [2, len(lens)], values=np.array([lens, starts]))
    return _tensor(rng, 5, [len(lens)], values=np.array(lens))


def _lens_and_starts(case: Case) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The accepted seqlens_k table as (lengths, first keys or None)."""
    if not _seq_present(case, "seqlens_k"):
        return None, None
    a = case.tensors["seqlens_k"].array()
    return (a[0], a[1]) if a.ndim == 2 else (a, None)


def gen_vec_seq(rng, backend):
    """fm_dispatch_vec_seq: float32 q [B, H, D] over per-sequence caches, or
    (30%) a short query [B, L, H, D] (see _short_query)."""
    t, lens, shape, g = _cache_case(rng, backend != "cpu", [0, 1, 2], [1, 2, 4])
    if rng.random() < 0.25:
        _batch_idx_case(rng, t, shape, g["b"])
    t["seqlens_k"] = _seqlens_table(rng, lens)
    nonfinite = rng.random() < 0.05
    t.update(q=_tensor(rng, 0, [g["b"], g["h"], g["d"]], nonfinite=nonfinite), k=_tensor(rng, g["dt"], shape),
             v=_tensor(rng, g["dt"], shape), out=_tensor(rng, 0, [g["b"], g["h"], g["d"]], role="out"))
    if rng.random() < 0.3:
        t["sinks"] = _tensor(rng, 0, [g["h"]])
    if rng.random() < 0.5:
        t["lse"] = _tensor(rng, 0, [g["b"], g["h"]], role="out")
    left = int(rng.choice([-1, -1, 0, 3, 20]))
    opts = dict(scale=float(rng.choice([1 / math.sqrt(g["d"]), 0.3])), softcap=float(rng.choice([0.0, 0.0, 4.0])),
                causal=int(rng.integers(0, 2)), window_left=left, window_right=int(rng.choice([-1, 0])),
                max_seqlen_q=0, max_seqlen_k=0, attention_chunk=int(rng.choice([0, 0, 0, 1, 5, 16])))
    case = Case("vec_seq", backend, t, opts, finite=not nonfinite)
    if rng.random() < 0.3:
        _short_query(rng, case, g, nonfinite)
    if rng.random() < 0.25:  # flash_attn_with_kvcache's k/v: appended into k/v, then attended
        new = [g["b"], int(rng.integers(1, g["room"] + 1)), g["hkv"], g["d"]]
        t.update(k_new=_tensor(rng, g["dt"], new), v_new=_tensor(rng, g["dt"], new))
        t["k"].role = t["v"].role = "inout"
    elif "cache_batch_idx" not in t and rng.random() < 0.25:
        _head_major(case)
    return case


def _head_major(case: Case) -> None:
    """Makes a vec_seq case read torch's head-major layouts (head_major 1):
    k/v [B, Hkv, cap, D] or pages [num_pages, Hkv, page, D], and a short
    query's q/out [B, H, L, D] and lse [B, H, L] (the same random bytes
    viewed with the two axes swapped)."""
    t = case.tensors
    names = ["k", "v"] + (["q", "out"] + (["lse"] if "lse" in t else []) if len(t["q"].shape) == 4 else [])
    for name in names:
        shape = t[name].shape
        shape[1], shape[2] = shape[2], shape[1]
    case.opts["head_major"] = 1


def _short_query(rng, case: Case, g: dict, nonfinite: bool) -> None:
    """Makes a vec_seq case a short query: q/out [B, L, H, D] and lse [B, L, H]
    with L in 1..FM_SHORT_QUERY_ROWS + 1 (one past the most the library takes,
    which it must refuse naming q), and a right window bound that a row
    left of the newest one can have keys beyond. Drawn after every choice of
    the single-row case, whose q, out, lse and window_right it replaces."""
    rows = int(rng.integers(1, max_query_rows() + 2))
    b, h, d = g["b"], g["h"], g["d"]
    t = case.tensors
    t["q"] = _tensor(rng, 0, [b, rows, h, d], nonfinite=nonfinite)
    t["out"] = _tensor(rng, 0, [b, rows, h, d], role="out")
    if "lse" in t:
        t["lse"] = _tensor(rng, 0, [b, rows, h], role="out")
    case.opts["window_right"] = int(rng.choice([-1, 0, 1, 2, 5]))
    case.args["q_rows"] = rows
    if rows > max_query_rows():
        case.mutations.append(f"q.rows={rows}")


def gen_kv_append(rng, backend):
    """fm_dispatch_kv_append: n_new rows per sequence written at seqlens[b]."""
    t, lens, shape, g = _cache_case(rng, backend != "cpu", [0, 1, 2], [1])
    n_new = int(rng.integers(1, g["room"] + 1))
    t["cache_seqlens"] = _tensor(rng, 5, [g["b"]], values=np.array(lens))
    new = [g["b"], n_new, g["hkv"], g["d"]]
    t.update(k_new=_tensor(rng, g["dt"], new), v_new=_tensor(rng, g["dt"], new),
             k_cache=_tensor(rng, g["dt"], shape, role="inout"), v_cache=_tensor(rng, g["dt"], shape, role="inout"))
    return Case("kv_append", backend, t)


def gen_rotary(rng, backend):
    """fm_dispatch_rotary: x [B, L, H, D] rotated at offsets[b] (+ i per row)."""
    b, rows, h = int(rng.integers(1, 3)), int(rng.integers(0, 4)), int(rng.integers(1, 3))
    d = int(rng.choice([8, 64, 80]))
    half = int(rng.integers(1, d // 2 + 1))
    per_row, interleaved = int(rng.integers(0, 2)), int(rng.integers(0, 2))
    offsets = rng.integers(0, 12, b).astype(np.int32)
    ro = int(offsets.max()) + (rows if per_row else 1) + int(rng.integers(0, 3))
    dt, ct = int(rng.integers(0, 3)), int(rng.integers(0, 3))
    angle = rng.random((ro, half)) * 2 * np.pi
    t = dict(x=_tensor(rng, dt, [b, rows, h, d]), cos=_tensor(rng, ct, [ro, half], values=np.cos(angle)),
             sin=_tensor(rng, ct, [ro, half], values=np.sin(angle)),
             offsets=_tensor(rng, 5, [b], values=offsets), out=_tensor(rng, dt, [b, rows, h, d], role="out"))
    return Case("rotary", backend, t, args=dict(interleaved=interleaved, per_row=per_row))


def gen_kv_codes_attn(rng, backend):
    """fm_dispatch_kv_codes_attn: float32 q [B, qL, H, D] over quantized K
    and V caches (2-8 bits each, separately; one side may be a dense float32
    cache), contiguous or paged, lengths [B] or [2, B] (cache_leftpad), and
    (30%) k_new/v_new encoded into them first, or (paged 35%, or packed
    keys [1, total_k, Hkv]) packed query rows with key counts (varlen,
    seqused_q / seqused_k); causal,
    window, softcap, sinks, lse, ALiBi slopes at random."""
    d = int(rng.choice([64, 128]))
    b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    h = hkv * int(rng.choice([1, 2]))
    widths = [int(rng.choice([2, 3, 4, 5, 6, 8])) for _ in range(2)]
    if rng.random() < 0.2:
        widths[int(rng.integers(0, 2))] = 0  # a dense float32 side
    lens = [int(rng.integers(0, 20)) for _ in range(b)]
    room = int(rng.integers(0, 4))
    t: dict[str, TSpec] = {}
    packed_k = rng.random() < 0.15  # varlen keys packed [1, total_k, Hkv], no pages
    if packed_k:
        cap = sum(lens) + int(rng.integers(0, 3))
        lead = [1, cap, hkv]
    elif rng.random() < 0.5:
        page = int(rng.choice([4, 8]))
        per = max(-(-(max(lens) + room) // page), 1)
        num_pages = b * per + int(rng.integers(0, 3))
        lead = [num_pages, page, hkv]
        t["block_table"] = _tensor(rng, 5, [b, per], values=rng.permutation(num_pages)[:b * per].reshape(b, per))
        cap = per * page
    else:
        cap = max(lens) + room
        lead = [b, cap, hkv]
    codecs = []
    for side, bits in zip("kv", widths):
        if bits == 0:
            t[f"{side}_codes"] = _tensor(rng, 0, lead + [d])
            codecs.append(None)
            continue
        seed = int(rng.integers(0, 2**63))
        norms = np.abs(rng.standard_normal(lead + [d // quant_reference.BLOCKS[d]])) + 0.1
        t[f"{side}_codes"] = _tensor(rng, 4, lead + [quant_reference.row_bytes(d, bits)])
        t[f"{side}_norms"] = _tensor(rng, 0, lead + [d // quant_reference.BLOCKS[d]], values=norms.astype(np.float32))
        codecs.append(dict(head_dim=d, bits=bits, seed=seed))
    varlen = packed_k or ("block_table" in t and rng.random() < 0.35)
    # A permutation of the rows (the codes are made); a row is read as one page, of at least one key.
    if not varlen and lead[1] > 0 and rng.random() < 0.25:
        _batch_idx_case(rng, t, list(lead), b, extra=0 if "block_table" not in t else None)
    max_q = max_k = 0
    if varlen:
        # Packed query rows (a padded tail no sequence owns), key counts in
        # cu_seqlens_k, flash-attn 3's seqused_q / seqused_k at random.
        q_lens = [int(rng.integers(0, 5)) for _ in range(b)]
        total = sum(q_lens) + int(rng.integers(0, 3))
        max_q, max_k = max(q_lens), max(lens)
        t["cu_seqlens_q"] = _tensor(rng, 5, [b + 1], values=np.cumsum([0] + q_lens))
        t["cu_seqlens_k"] = _tensor(rng, 5, [b + 1], values=np.cumsum([0] + lens))
        if rng.random() < 0.4:
            t["seqused_q"] = _tensor(rng, 5, [b], values=[int(rng.integers(0, n + 1)) for n in q_lens])
        if rng.random() < 0.4:
            t["seqlens_k"] = _tensor(rng, 5, [b], values=[int(rng.integers(0, n + 1)) for n in lens])
        t.update(q=_tensor(rng, 0, [total, h, d]), out=_tensor(rng, 0, [total, h, d], role="out"))
        if rng.random() < 0.5:
            t["lse"] = _tensor(rng, 0, [h, total], role="out")
    elif rng.random() < 0.3:
        # flash_attn_with_kvcache's ragged queries (packed, a padded tail) over
        # the cache lengths, and (half the time) ragged new rows.
        q_lens = [int(rng.integers(0, 4)) for _ in range(b)]
        total = sum(q_lens) + int(rng.integers(0, 2))
        max_q = max(q_lens)
        t["seqlens_k"] = _seqlens_table(rng, lens, cap)
        t["cu_seqlens_q"] = _tensor(rng, 5, [b + 1], values=np.cumsum([0] + q_lens))
        t.update(q=_tensor(rng, 0, [total, h, d]), out=_tensor(rng, 0, [total, h, d], role="out"))
        if rng.random() < 0.5:
            t["lse"] = _tensor(rng, 0, [h, total], role="out")
        if room > 0 and rng.random() < 0.5:
            new = [int(rng.integers(0, room + 1)) for _ in range(b)]
            t["cu_seqlens_k_new"] = _tensor(rng, 5, [b + 1], values=np.cumsum([0] + new))
            t.update(k_new=_tensor(rng, 0, [sum(new), hkv, d]), v_new=_tensor(rng, 0, [sum(new), hkv, d]))
    else:
        t["seqlens_k"] = _seqlens_table(rng, lens, cap)
        ql = int(rng.integers(1, 5))
        t.update(q=_tensor(rng, 0, [b, ql, h, d]), out=_tensor(rng, 0, [b, ql, h, d], role="out"))
        if rng.random() < 0.5:
            t["lse"] = _tensor(rng, 0, [b, h, ql], role="out")
        if room > 0 and rng.random() < 0.3:
            n = int(rng.integers(1, room + 1))
            t.update(k_new=_tensor(rng, 0, [b, n, hkv, d]), v_new=_tensor(rng, 0, [b, n, hkv, d]))
    if rng.random() < 0.3:
        t["sinks"] = _tensor(rng, 0, [h])
    if rng.random() < 0.3:
        t["alibi_slopes"] = _tensor(rng, 0, [b, h], values=rng.uniform(0.0, 0.5, (b, h)).astype(np.float32))
    writes = "k_new" in t and int(np.prod(t["k_new"].shape[:-2])) > 0
    for name, ts in t.items():  # the caches, written when rows are appended (no row: nothing is written)
        if name.endswith(("_codes", "_norms")) and writes:
            ts.role = "inout"
    window = [(-1, -1), (-1, -1), (3, 0), (0, 2), (5, -1)][int(rng.integers(0, 5))]
    opts = dict(scale=float(rng.choice([1 / math.sqrt(d), 0.3])), softcap=float(rng.choice([0.0, 0.0, 4.0])),
                causal=int(rng.integers(0, 2)), window_left=window[0], window_right=window[1], max_seqlen_q=max_q,
                max_seqlen_k=max_k, attention_chunk=int(rng.choice([0, 0, 0, 1, 5])))
    return Case("kv_codes_attn", backend, t, opts, args=dict(codecs=codecs))


def _codec(rng, d: int) -> dict[str, int]:
    """An FMKVCodec's fields: head dim d, a width of 2-8 bits, a seed."""
    return dict(head_dim=d, bits=int(rng.choice([2, 3, 4, 5, 6, 8])), seed=int(rng.integers(0, 2**63)))


def _code_rows(rng, t: dict[str, TSpec], side: str, lead: list[int], c: dict[str, int], role: str = "in") -> None:
    """Random codes (every pattern is a code) and positive norms of rows of leading shape `lead`."""
    d = c["head_dim"]
    blocks = d // quant_reference.BLOCKS[d]
    t[f"{side}_codes"] = _tensor(rng, 4, lead + [quant_reference.row_bytes(d, c["bits"])])
    t[f"{side}_norms"] = _tensor(rng, 0, lead + [blocks],
                                 values=(np.abs(rng.standard_normal(lead + [blocks])) + 0.1).astype(np.float32))
    t[f"{side}_codes"].role = t[f"{side}_norms"].role = role


def gen_kv_encode(rng, backend):
    """fm_dispatch_kv_encode: rows [..., D] (float32, float16 or bfloat16)
    to codes and norms of a codec of any width; head dims with blockwise
    rotations (80, 96, 192) too."""
    d = int(rng.choice([64, 80, 96, 128, 192, 256]))
    c = _codec(rng, d)
    lead = [int(x) for x in rng.integers(1, 4, int(rng.integers(1, 3)))]
    t = {"x": _tensor(rng, int(rng.integers(0, 3)), lead + [d])}
    t["codes"] = _tensor(rng, 4, lead + [quant_reference.row_bytes(d, c["bits"])], role="out")
    t["norms"] = _tensor(rng, 0, lead + [d // quant_reference.BLOCKS[d]], role="out")
    return Case("kv_encode", backend, t, args=dict(codec=c))


def gen_kv_dequantize(rng, backend):
    """fm_dispatch_kv_dequantize: codes and norms back to float32 rows."""
    d = int(rng.choice([64, 80, 96, 128, 192, 256]))
    c = _codec(rng, d)
    lead = [int(x) for x in rng.integers(1, 4, int(rng.integers(1, 3)))]
    t: dict[str, TSpec] = {}
    _code_rows(rng, t, "x", lead, c)
    t["codes"], t["norms"] = t.pop("x_codes"), t.pop("x_norms")
    t["out"] = _tensor(rng, 0, lead + [d], role="out")
    return Case("kv_dequantize", backend, t, args=dict(codec=c))


def gen_kv_codes_decode(rng, backend):
    """fm_dispatch_kv_codes_decode: one query row per head (q [H, D] or
    [B, H, D], float32) over K and V codes of widths of their own, leading
    shape [Hkv, cap] or [B, Hkv, cap]; kv_len, window, softcap at random."""
    d = int(rng.choice([64, 128]))
    batched = rng.random() < 0.5
    b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    h = hkv * int(rng.choice([1, 2, 4]))
    cap = int(rng.integers(1, 40))
    lead = ([b] if batched else []) + [hkv, cap]
    codecs = [_codec(rng, d), _codec(rng, d)]
    t: dict[str, TSpec] = {}
    for side, c in zip("kv", codecs):
        _code_rows(rng, t, side, lead, c)
    qs = ([b] if batched else []) + [h, d]
    t.update(q=_tensor(rng, 0, qs), out=_tensor(rng, 0, qs, role="out"))
    kvl = int(rng.integers(1, cap + 1))
    opts = dict(scale=float(rng.choice([1 / math.sqrt(d), 0.3])), softcap=float(rng.choice([0.0, 0.0, 4.0])),
                kv_len=kvl, window=int(rng.choice([0, 0, 1, 3, cap + 2, 2**31 - 1])))
    return Case("kv_codes_decode", backend, t, opts, args=dict(codecs=codecs))


def gen_kv_codes_append(rng, backend):
    """fm_dispatch_kv_codes_append: k_new/v_new [B, n, Hkv, D] (float32,
    float16 or bfloat16) encoded into quantized caches (or copied into one
    dense side of their dtype) at each sequence's length, contiguous or paged."""
    d = int(rng.choice([64, 128]))
    b, hkv = int(rng.integers(1, 3)), int(rng.integers(1, 3))
    lens = [int(rng.integers(0, 12)) for _ in range(b)]
    n = int(rng.integers(1, 4))
    t: dict[str, TSpec] = {}
    if rng.random() < 0.5:
        page = int(rng.choice([4, 8]))
        per = -(-(max(lens) + n) // page)
        num_pages = b * per + int(rng.integers(0, 3))
        lead = [num_pages, page, hkv]
        t["block_table"] = _tensor(rng, 5, [b, per], values=rng.permutation(num_pages)[:b * per].reshape(b, per))
    else:
        lead = [b, max(lens) + n + int(rng.integers(0, 3)), hkv]
    dt = int(rng.integers(0, 3))
    codecs = [_codec(rng, d), _codec(rng, d)]
    if rng.random() < 0.2:
        codecs[int(rng.integers(0, 2))] = None
    for side, c in zip("kv", codecs):
        if c is None:
            t[f"{side}_codes"] = _tensor(rng, dt, lead + [d])
            t[f"{side}_codes"].role = "inout"
        else:
            _code_rows(rng, t, side, lead, c, role="inout")
    t["seqlens_k"] = _tensor(rng, 5, [b], values=np.array(lens))
    t.update(k_new=_tensor(rng, dt, [b, n, hkv, d]), v_new=_tensor(rng, dt, [b, n, hkv, d]))
    return Case("kv_codes_append", backend, t, args=dict(codecs=codecs))


def gen_mask_key_ranges(rng, backend):
    """fm_mask_key_ranges: a one-row mask [B, H, 1, kL] (bool or additive
    0/-inf, with holes, finite biases and heads that differ at times), causal,
    a position and a window; out int32 [2, B]."""
    b, h, kl = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 40))
    vis = np.zeros((b, 1, 1, kl), bool)
    for i in range(b):
        lo = int(rng.integers(0, kl + 1))
        vis[i, 0, 0, lo:int(rng.integers(lo, kl + 1))] = True
        if rng.random() < 0.15:
            vis[i, 0, 0, int(rng.integers(0, kl))] ^= True
    vis = np.repeat(vis, h, axis=1)
    if rng.random() < 0.1:
        vis[int(rng.integers(0, b)), int(rng.integers(0, h)), 0, int(rng.integers(0, kl))] ^= True
    dt = int(rng.choice([3, 0, 1, 2]))
    if dt == 3:
        mask = _tensor(rng, 3, [b, h, 1, kl], values=vis)
    else:
        vals = np.where(vis, 0.0, -np.inf)
        if rng.random() < 0.1:
            vals[tuple(int(rng.integers(0, n)) for n in vals.shape)] = float(rng.choice([1.5, -0.0, np.nan, np.inf]))
        mask = _tensor(rng, dt, [b, h, 1, kl], values=vals.astype(np.float32))
    t = {"mask": mask, "out": _tensor(rng, 5, [2, b], role="out")}
    args = dict(causal=int(rng.integers(0, 2)), q_pos=int(rng.integers(-2, kl + 2)),
                window=int(rng.choice([0, 0, 1, 3, kl + 1, 2**31 - 1])))
    return Case("mask_key_ranges", backend, t, args=args)


GENERATORS = {"prefill": gen_prefill, "vec": gen_vec, "sdpa": gen_sdpa, "mask": gen_mask, "blk": gen_blk,
              "blk_byte_len": lambda r, b: gen_ints(r, b, "blk_byte_len"),
              "alloc_blk": lambda r, b: gen_ints(r, b, "alloc_blk"), "attn": gen_attn, "vec_seq": gen_vec_seq,
              "kv_append": gen_kv_append, "rotary": gen_rotary, "kv_codes_attn": gen_kv_codes_attn,
              "kv_encode": gen_kv_encode, "kv_dequantize": gen_kv_dequantize, "kv_codes_decode": gen_kv_codes_decode,
              "kv_codes_append": gen_kv_codes_append, "mask_key_ranges": gen_mask_key_ranges}

# --------------------------------------------------------------- mutations


def kind_alias(case: Case, rng: np.random.Generator, chosen: bool) -> bool:
    """When `chosen`: an output (out, lse, tmp, a cache the append writes)
    and another argument (an input or a table) made to share one buffer, the
    smaller one's claim inside the larger one's bytes: the library must
    refuse it, naming both. Returns whether a mutation was made."""
    if not chosen:
        return False
    outs = sorted(n for n, t in case.tensors.items() if t.role != "in" and t.passed)
    others = sorted(n for n, t in case.tensors.items() if t.role == "in" and t.passed)
    if not outs or not others:
        return False
    o, x = case.tensors[str(rng.choice(outs))], case.tensors[str(rng.choice(others))]
    small, big = (x, o) if x.buf.n <= o.buf.n else (o, x)
    if small.buf.n == 0 or 0 in x.shape or 0 in o.shape:  # no byte described: nothing to share
        return False
    big.buf.raw[G:G + small.buf.n] = small.buf.mid()  # the smaller one's bytes, now inside the larger buffer
    big.buf.snap[:] = big.buf.raw
    small.buf = big.buf
    case.mutations.append(f"alias:{[n for n, t in case.tensors.items() if t is o][0]}~"
                          f"{[n for n, t in case.tensors.items() if t is x][0]}")
    return True


def mutate(case: Case, rng: np.random.Generator) -> None:
    kinds = ["tensor"] * 6 + ["opts"] * 2 + ["registry", "alias"]
    if case.op in ("blk_byte_len", "alloc_blk"):
        return  # already extreme scalars
    if kind_alias(case, rng, rng.choice(kinds) == "alias"):
        return
    if case.op == "blk":
        kinds += ["arg"]
    if "codec" in case.args or "codecs" in case.args:
        kinds += ["codec"] * 2
    kind = rng.choice(kinds)
    if kind == "codec":  # a codec the library must refuse (or NULL: a dense side where codes are passed)
        holder, key = (case.args, "codec") if "codec" in case.args else (case.args["codecs"], int(rng.integers(0, 2)))
        c = holder[key]
        if c is None or rng.random() < 0.2:
            holder[key] = None
            case.mutations.append(f"codec[{key}]=NULL")
            return
        field_name = str(rng.choice(["head_dim", "bits"]))
        c = dict(c)
        c[field_name] = int(rng.choice(BAD_INTS + (1, 7, 9, 100, 1024, 32, 16)))
        holder[key] = c
        case.mutations.append(f"codec[{key}].{field_name}={c[field_name]}")
        return
    if kind == "registry":
        case.registry = str(rng.choice(["null", "dead", "garbage"]))
        case.mutations.append(f"registry={case.registry}")
        return
    if kind == "arg":
        case.args["head_dim"] = int(rng.choice(BAD_INTS + (63, 100, 1024)))
        case.mutations.append(f"head_dim={case.args['head_dim']}")
        return
    if kind == "opts" and case.opts:
        if rng.random() < 0.1:
            case.opts = None
            case.mutations.append("options=NULL")
            return
        key = str(rng.choice(sorted(case.opts)))
        if isinstance(case.opts[key], float):
            case.opts[key] = float(rng.choice(BAD_FLOATS))
        else:
            case.opts[key] = int(rng.choice(BAD_INTS + (case.opts[key] + 1, case.opts[key] - 1)))
        case.mutations.append(f"opts.{key}={case.opts[key]}")
        return
    if not case.tensors:
        return
    name = str(rng.choice(sorted(case.tensors)))
    t = case.tensors[name]
    m = rng.choice(["null", "data", "dtype", "ndim", "dim", "dim", "dim", "nbytes", "nbytes", "swapdtype"])
    if t.dtype == 5 and t.buf is not None and t.buf.n and rng.random() < 0.6:
        m = "entry"
    if m == "entry":  # an index table entry the library must catch before a kernel reads through it
        i = int(rng.integers(0, t.buf.n // 4))
        # one past the entry, wrapping as int32 does (an earlier mutation may have left 2**31 - 1 there)
        after = (int(t.buf.mid()[4 * i:4 * i + 4].view(np.int32)[0]) + 1 + 2**31) % 2**32 - 2**31
        bad = np.array([rng.choice(BAD_ENTRIES + (after,))], np.int32)
        t.buf.raw[G + 4 * i:G + 4 * i + 4] = bad.view(np.uint8)
        t.buf.snap[:] = t.buf.raw
        desc = f"[{i}]={int(bad[0])}"
    elif m == "null":
        t.null = True
        desc = "NULL"
    elif m == "data":
        t.buf_null = True
        desc = "data=NULL"
    elif m == "dtype":
        t.dtype = int(rng.choice(BAD_DTYPES))
        desc = f"dtype={t.dtype}"
    elif m == "swapdtype":
        t.dtype = int(rng.integers(0, 5))
        desc = f"dtype={t.dtype}"
    elif m == "ndim":
        t.ndim = int(rng.choice(BAD_NDIMS + (len(t.shape) - 1, len(t.shape) + 1, 0)))
        desc = f"ndim={t.ndim}"
    elif m == "dim" and t.shape:
        i = int(rng.integers(0, len(t.shape)))
        t.shape[i] = min(int(rng.choice((0, -1, -2**63, t.shape[i] + 1, max(t.shape[i] - 1, 0), 2 * t.shape[i])
                                        + HUGE_DIMS)), INT64_MAX)
        desc = f"shape={t.shape}"
    else:
        real = t.buf.n  # never claim more than the real buffer unless the claim is > INT64_MAX
        t.nbytes = int(rng.choice((0, max(real - 1, 0), real // 2, 2**63, 2**64 - 1, INT64_MAX + 2)))
        desc = f"nbytes={t.nbytes}"
    case.mutations.append(f"{name}.{desc}")


# ------------------------------------------------------------------ running

_FFI = None
_LIB = None


def lib():
    global _FFI, _LIB
    if _LIB is None:
        _FFI, _LIB = _loader.load()
    return _FFI, _LIB


def max_query_rows() -> int:
    """fm_dispatch_vec_seq's most rows of q: FM_SHORT_QUERY_ROWS of the header."""
    return int(lib()[1].FM_SHORT_QUERY_ROWS)


class Registries:
    """One live registry per backend plus a destroyed handle, for the run."""

    def __init__(self, backends):
        ffi, L = lib()
        self.live = {}
        err = ffi.new("FMError *")
        for b in backends:
            h = ffi.new("FMRegistry **")
            assert L.fm_create_registry(b.encode(), h, err) == 0, (ffi.string(err.op) + b": " + ffi.string(err.message))
            self.live[b] = h[0]
        h = ffi.new("FMRegistry **")
        assert L.fm_create_registry(b"cpu", h, err) == 0
        self.dead = h[0]
        assert L.fm_destroy_registry(self.dead) == 0
        self.garbage = ffi.cast("FMRegistry *", 0x12345678)

    def get(self, case: Case):
        ffi, _ = lib()
        return {"live": lambda: self.live[case.backend], "null": lambda: ffi.NULL, "dead": lambda: self.dead,
                "garbage": lambda: self.garbage}[case.registry]()

    def close(self):
        _, L = lib()
        for h in self.live.values():
            L.fm_destroy_registry(h)


def _fm_tensor(t: TSpec | None, keep: list):
    ffi, _ = lib()
    if t is None or t.null:
        return ffi.NULL
    c = ffi.new("FMTensor *")
    keep.append(c)
    nb = t.nbytes
    assert nb <= t.buf.n or nb > INT64_MAX, "harness bug: claimed nbytes beyond the real buffer"
    c.data = ffi.NULL if t.buf_null else ffi.cast("void *", t.buf.addr)
    c.nbytes = nb % 2**64
    c.dtype = t.dtype
    c.ndim = len(t.shape) if t.ndim is None else t.ndim
    for i, d in enumerate(t.shape[:8]):
        c.shape[i] = (d + 2**63) % 2**64 - 2**63  # as a C caller's int64 would wrap
    return c


def _opts(ctype: str, fields: dict | None, keep: list):
    ffi, _ = lib()
    if fields is None:
        return ffi.NULL
    o = ffi.new(ctype)
    keep.append(o)
    int32_fields = {name for name, f in ffi.typeof(o).item.fields if f.type.cname == "int32_t"}
    for k, v in fields.items():
        if k in int32_fields and isinstance(v, int):
            v = (v + 2**31) % 2**32 - 2**31  # an out-of-range option wraps as a C caller's int32 would
        setattr(o, k, v)
    return o


def call(case: Case, regs: Registries) -> tuple[int, str, Any]:
    ffi, L = lib()
    keep: list = []
    err = ffi.new("FMError *")
    T = lambda n: _fm_tensor(case.tensors.get(n), keep)  # noqa: E731
    extra = None
    if case.op == "prefill":
        s = L.fm_dispatch_prefill(regs.get(case), T("q"), T("k"), T("v"), T("mask"), T("blk"), T("out"),
                                  _opts("FMPrefillOptions *", case.opts, keep), err)
    elif case.op == "vec":
        s = L.fm_dispatch_vec(regs.get(case), T("q"), T("k"), T("v"), T("signs"), T("tmp"), T("out"),
                              _opts("FMVecOptions *", case.opts, keep), err)
    elif case.op == "sdpa":
        s = L.fm_dispatch_sdpa(regs.get(case), T("q"), T("k"), T("v"), ffi.NULL, T("out"),
                               _opts("FMSdpaOptions *", case.opts, keep), err)
    elif case.op == "attn":
        seq = ffi.new("FMSeqTensors *")
        keep.append(seq)
        for f in SEQ_FIELDS:
            setattr(seq, f, T(f))
        s = L.fm_dispatch_attn(regs.get(case), T("q"), T("k"), T("v"), seq, T("out"),
                               _opts("FMAttnOptions *", case.opts, keep), err)
    elif case.op == "vec_seq":
        seq = ffi.new("FMSeqTensors *")
        keep.append(seq)
        for f in SEQ_FIELDS:
            setattr(seq, f, T(f))
        s = L.fm_dispatch_vec_seq(regs.get(case), T("q"), T("k"), T("v"), seq, ffi.NULL, T("out"),
                                  _opts("FMAttnOptions *", case.opts, keep), err)
        extra = ffi.string(err.argument).decode(errors="replace")  # the argument an error names
    elif case.op == "kv_codes_attn":
        seq = ffi.new("FMSeqTensors *")
        keep.append(seq)
        for f in SEQ_FIELDS:
            setattr(seq, f, T(f))
        codecs = [ffi.NULL if c is None else ffi.new("FMKVCodec *", c) for c in case.args["codecs"]]
        keep.extend(codecs)
        s = L.fm_dispatch_kv_codes_attn(regs.get(case), T("q"), codecs[0], T("k_codes"), T("k_norms"), codecs[1],
                                        T("v_codes"), T("v_norms"), seq, T("out"),
                                        _opts("FMAttnOptions *", case.opts, keep), err)
    elif case.op in ("kv_encode", "kv_dequantize"):
        c = case.args["codec"]
        codec = ffi.NULL if c is None else ffi.new("FMKVCodec *", c)
        keep.append(codec)
        if case.op == "kv_encode":
            s = L.fm_dispatch_kv_encode(regs.get(case), codec, T("x"), T("codes"), T("norms"), err)
        else:
            s = L.fm_dispatch_kv_dequantize(regs.get(case), codec, T("codes"), T("norms"), T("out"), err)
    elif case.op == "kv_codes_decode":
        codecs = [ffi.NULL if c is None else ffi.new("FMKVCodec *", c) for c in case.args["codecs"]]
        keep.extend(codecs)
        s = L.fm_dispatch_kv_codes_decode(regs.get(case), T("q"), codecs[0], T("k_codes"), T("k_norms"), codecs[1],
                                          T("v_codes"), T("v_norms"), T("out"),
                                          _opts("FMKVCodesDecodeOptions *", case.opts, keep), err)
    elif case.op == "kv_codes_append":
        codecs = [ffi.NULL if c is None else ffi.new("FMKVCodec *", c) for c in case.args["codecs"]]
        keep.extend(codecs)
        s = L.fm_dispatch_kv_codes_append(regs.get(case), T("k_new"), T("v_new"), codecs[0], T("k_codes"),
                                          T("k_norms"), codecs[1], T("v_codes"), T("v_norms"), T("seqlens_k"),
                                          T("block_table"), err)
    elif case.op == "mask_key_ranges":
        found = ffi.new("int32_t *", -7)
        a = case.args
        s = L.fm_mask_key_ranges(T("mask"), a["causal"], a["q_pos"], a["window"], T("out"), found, err)
        extra = int(found[0])
    elif case.op == "kv_append":
        s = L.fm_dispatch_kv_append(regs.get(case), T("k_new"), T("v_new"), T("k_cache"), T("v_cache"),
                                    T("cache_seqlens"), T("block_table"), err)
    elif case.op == "rotary":
        s = L.fm_dispatch_rotary(regs.get(case), T("x"), T("cos"), T("sin"), T("offsets"), T("out"),
                                 case.args["interleaved"], case.args["per_row"], ffi.NULL, err)
    elif case.op == "mask":
        s = L.fm_build_mask(regs.get(case), T("out"), _opts("FMMaskOptions *", case.opts, keep), err)
    elif case.op == "blk":
        s = L.fm_dispatch_blk(regs.get(case), T("mask"), T("blk_out"), case.args["head_dim"], err)
    elif case.op == "blk_byte_len":
        out = ffi.new("size_t *")
        s = L.fm_blk_byte_len(case.args["q_len"], case.args["k_len"], case.args["head_dim"], out, err)
        extra = int(out[0])
    else:  # alloc_blk + free_blk
        t = ffi.new("FMTensor *")
        s = L.fm_alloc_blk(case.args["q_len"], case.args["k_len"], case.args["head_dim"], t, err)
        if s == 0:
            nb = int(t.nbytes)  # may be GiBs of untouched calloc pages: read at most 1 MiB
            head = min(nb, 1 << 20)
            extra = (nb, int(t.shape[0]), int(t.shape[1]), bytes(ffi.buffer(t.data, head)) == bytes(head))
            s2 = L.fm_free_blk(t, err)
            assert s2 == 0, (ffi.string(err.op) + b": " + ffi.string(err.message))
            assert t.data == ffi.NULL
            assert L.fm_free_blk(t, err) == 0  # data NULL: no-op
    return s, (ffi.string(err.op) + b": " + ffi.string(err.message)).decode(errors="replace"), extra


# ---------------------------------------------------------------- reference

def _blk_expect(ql, kl, d):
    bq, bk = geom(d)
    n = -(-ql // bq) * -(-kl // bk)
    return n, max((n + 31) // 32 * 32, 32), -(-ql // bq), -(-kl // bk)


def expected(case: Case, extra: Any):
    """(array, written TSpec name, dtype code) of the expected output, or a
    scalar check for the size ops. Raises if the accepted call is not one
    the reference understands (a finding)."""
    t, o = case.tensors, case.opts
    if case.op == "prefill":
        q, k, v = t["q"].array(), t["k"].array(), t["v"].array()
        if o["layout"] == 1:
            q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        kl = o["kv_len"] or k.shape[2]
        mask = None
        if "mask" in t and not t["mask"].null:
            mask = t["mask"].array()
            if mask.dtype != np.bool_:
                mask = mask.astype(np.float64)
        e = reference.attention(q, k[:, :, :kl], v[:, :, :kl], scale=o["scale"], causal=bool(o["causal"]),
                                q_offset=o["q_offset"], mask=mask, softcap=o["softcap"])
        if o["layout"] == 1:
            e = e.transpose(0, 2, 1, 3)
        return e, "out", t["q"].dtype
    if case.op == "vec":
        q, k, v = t["q"].array(), t["k"].array(), t["v"].array()
        _values_comparable(case, q)
        w = o["window"] if o["mask_type"] == 2 else None
        e = reference.decode(q, k, v, o["kv_len"], scale=o["scale"], window=w, softcap=o["softcap"])
        if o["fwht"]:
            sg = t["signs"].array() if "signs" in t and not t["signs"].null else None
            e = reference.fwht_undo(e, sg)
        # q is read exactly, whatever its dtype: the output's rounding is the tolerance.
        return e, "out", t["out"].dtype
    if case.op == "sdpa":
        q, k, v = t["q"].array(), t["k"].array(), t["v"].array()
        kl = o["kv_len"] or k.shape[2]
        i32 = lambda x: (x + 2**31) % 2**32 - 2**31  # noqa: E731 - the library saw the wrapped int32
        off = i32(o["q_offset"]) if o.get("has_q_offset") else kl - q.shape[2]
        e = reference.attention(q, k[:, :, :kl], v[:, :, :kl], scale=o["scale"], causal=bool(o["causal"]),
                                q_offset=off, window=i32(o.get("window", 0)) or None, softcap=o.get("softcap", 0.0))
        return e, "out", t["q"].dtype
    if case.op == "attn":
        return _attn_expected(case), "out", t["q"].dtype
    if case.op == "vec_seq":
        _values_comparable(case, t["q"].array())
        return _attn_expected(case), "out", t["out"].dtype  # q read exactly: the output's rounding
    if case.op == "kv_append":
        return _kv_append_expected(case), "k_cache", -3
    if case.op == "kv_codes_attn":
        return _codes_attn_expected(case), "out", 0
    if case.op == "kv_encode":
        return None, "codes", -4  # checked by _check_encode
    if case.op == "kv_codes_append":
        return None, "k_codes", -5  # checked by _check_codes_append
    if case.op == "mask_key_ranges":
        return _key_ranges(case), "out", -6
    if case.op == "kv_dequantize":
        c = case.args["codec"]
        codes = quant_reference.unpack(t["codes"].array(), c["bits"], c["head_dim"])
        e = quant_reference.decode(codes, t["norms"].array(), c["bits"], c["seed"])
        if not np.isfinite(e).all():
            case.finite = False  # norms relabelled to another dtype: only the safety contract
        return e, "out", 0
    if case.op == "kv_codes_decode":
        k, v = _codes_sides(case)
        _values_comparable(case, t["q"].array())
        if not (np.isfinite(k).all() and np.isfinite(v).all()):
            case.finite = False
        w = o["window"] if 0 < o["window"] < 2**31 else None
        e = reference.decode(t["q"].array(), k, v, o["kv_len"], scale=o["scale"], window=w, softcap=o["softcap"])
        return e, "out", 0
    if case.op == "rotary":
        x, cos, sin = t["x"].array(), t["cos"].array(), t["sin"].array()
        off = t["offsets"].array()
        if x.size == 0:  # no rows: no position is read
            return x.astype(np.float64), "out", t["x"].dtype
        if case.args["per_row"]:
            return reference.apply_rotary_emb(x, cos, sin, off, interleaved=bool(case.args["interleaved"])), "out", \
                t["x"].dtype
        b, rows, h, d = x.shape
        e = reference.apply_rotary_emb(x.reshape(b, 1, rows * h, d), cos, sin, off,
                                       interleaved=bool(case.args["interleaved"])).reshape(x.shape)
        return e, "out", t["x"].dtype
    if case.op == "mask":
        ql, kl = t["out"].shape
        w = o["window"] or None
        e = reference.mask_additive(ql, kl, causal=bool(o["causal"]), q_offset=o["q_offset"], window=w)
        return e, "out", -1  # exact
    if case.op == "blk":
        m = t["mask"].array()
        # A bool mask (any nonzero byte = attend) classifies as 0 / -inf.
        m = np.where(m.view(np.uint8) != 0, 0.0, -np.inf) if m.dtype == np.bool_ else m.astype(np.float64)
        e = reference.blk_classes(m, *geom(case.args["head_dim"])).reshape(-1)
        return e, "blk_out", -2
    raise AssertionError(case.op)


def _seq_present(case: Case, name: str) -> bool:
    return name in case.tensors and not case.tensors[name].null


def _attn_reference(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) of an accepted fm_dispatch_attn call, from the tables as the
    library accepted them (mutated entries included)."""
    t, o = case.tensors, case.opts
    i32 = lambda x: (x + 2**31) % 2**32 - 2**31  # noqa: E731 - the library saw the wrapped int32
    kw = dict(scale=o["scale"], causal=bool(o["causal"]), softcap=o["softcap"],
              window_size=(i32(o["window_left"]), i32(o["window_right"])),
              attention_chunk=i32(o.get("attention_chunk", 0)),
              sinks=t["sinks"].array() if _seq_present(case, "sinks") else None)
    q, k, v = t["q"].array(), t["k"].array(), t["v"].array()
    table = _pages_read(case)
    lens, starts = _lens_and_starts(case)
    if _seq_present(case, "k_new"):  # the caches after the reference's append, the lengths grown
        k, v, lens = _appended(case)
    if case.op == "vec_seq":
        # q [B, H, D] is one row per sequence, [B, 1, H, D]; q [B, L, H, D] is
        # L rows, row i at seqlens_k[b] - L + i (bottom-right, as flash-attn's
        # kvcache). lse in the library's layout: [B, H], or [B, L, H]. Head-major:
        # q/out [B, H, L, D], lse [B, H, L], k/v with their axes 1 and 2 swapped.
        short, head_major = q.ndim == 4, o.get("head_major", 0) == 1
        if head_major:
            k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
            q = q.swapaxes(1, 2) if short else q
        out, lse = reference.flash_attn_kvcache(q if short else q[:, None], k, v, cache_seqlens=lens,
                                                block_table=table, cache_leftpad=starts, **kw)
        if short and head_major:
            return out.swapaxes(1, 2), lse
        return (out, lse.transpose(0, 2, 1)) if short else (out[:, 0], lse[..., 0])
    if _seq_present(case, "cu_seqlens_q") and not _seq_present(case, "cu_seqlens_k"):
        return _varlen_q_over_caches(case, q, k, v, table, kw)
    if _seq_present(case, "cu_seqlens_q"):
        used_q = t["seqused_q"].array() if _seq_present(case, "seqused_q") else None
        return reference.flash_attn_varlen(q, k, v, t["cu_seqlens_q"].array(), t["cu_seqlens_k"].array(),
                                           block_table=table, seqused_q=used_q, **kw)
    return reference.flash_attn_kvcache(q, k, v, cache_seqlens=lens, block_table=table, cache_leftpad=starts, **kw)


def _varlen_q_over_caches(case: Case, q, k, v, table, kw) -> tuple[np.ndarray, np.ndarray]:
    """Packed queries over per-sequence caches (cu_seqlens_q without
    cu_seqlens_k): sequence b holds seqlens_k[b] keys, else every key its
    cache (or its block-table row) has room for."""
    t = case.tensors
    cq = t["cu_seqlens_q"].array()
    lens, starts = _lens_and_starts(case)
    out = np.zeros(q.shape[:-1] + v.shape[-1:], dtype=np.float64)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cq) - 1):
        cap = k.shape[1] * (table.shape[1] if table is not None else 1)
        n = int(lens[b]) if lens is not None else cap
        if table is None:
            kb, vb = k[b, :n], v[b, :n]
        else:
            kb, vb = reference.paged_rows(k, table[b], n), reference.paged_rows(v, table[b], n)
        qs, qe = int(cq[b]), int(cq[b + 1])
        f = 0 if starts is None else int(starts[b])
        out[qs:qe], lse[:, qs:qe] = reference.attend_sequence(q[qs:qe], kb[f:], vb[f:], **kw)
    return out, lse


def _appended(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An accepted call's caches after the reference appends k_new/v_new at
    each sequence's length (split by cu_seqlens_k_new when given), from
    their bytes before the call, and the lengths grown by the rows."""
    t = case.tensors
    table = _pages_read(case)
    ends = _lens_and_starts(case)[0]
    kn, vn = t["k_new"].array(), t["v_new"].array()
    if not _seq_present(case, "cu_seqlens_k_new"):
        k, v = reference.kv_append(_before(t["k"]), _before(t["v"]), kn, vn, ends, table)
        return k, v, ends + kn.shape[1]
    cu = t["cu_seqlens_k_new"].array().astype(np.int64)
    k, v = np.array(_before(t["k"])), np.array(_before(t["v"]))
    for b, end in enumerate(ends.tolist()):
        one = slice(int(cu[b]), int(cu[b + 1]))
        rows = None if table is None else table[b:b + 1]
        whole = (k[b:b + 1], v[b:b + 1]) if table is None else (k, v)
        kk, vv = reference.kv_append(*whole, kn[None, one], vn[None, one], np.array([end]), rows)
        if table is None:
            k[b], v[b] = kk[0], vv[0]
        else:
            k, v = kk, vv
    return k, v, ends + np.diff(cu).astype(ends.dtype)


def _before(ts: TSpec) -> np.ndarray:
    """A tensor's bytes before the call (an inout tensor's input)."""
    n = int(np.prod(ts.shape)) * SIZE[ts.dtype]
    return ts.buf.snap[G:G + n].view(NP[ts.dtype]).reshape(ts.shape)


def _kv_append_expected(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """The caches' bytes after the append, from their bytes before it."""
    t = case.tensors
    table = t["block_table"].array() if _seq_present(case, "block_table") else None
    return reference.kv_append(_before(t["k_cache"]), _before(t["v_cache"]), t["k_new"].array(),
                               t["v_new"].array(), t["cache_seqlens"].array(), table)


def _values_comparable(case: Case, q: np.ndarray) -> None:
    """A decode's q relabelled to the caches' 16-bit dtype (a valid call)
    holds whatever its bytes mean there: beyond |q| 1e4 the float32 scores
    may overflow where the float64 reference does not, so such a case is
    checked as a non-finite one (no byte outside out, no crash)."""
    x = np.asarray(q, np.float64)
    if x.size and not (np.isfinite(x).all() and np.abs(x).max() <= 1e4):
        case.finite = False


def _codes_sides(case: Case) -> list[np.ndarray]:
    """Each side's rows as the attention reads them, float64 lead + [D]: the
    codes (as the call left them) decoded by the reference codec, or the
    dense cache."""
    t = case.tensors
    rows = []
    for side, c in zip("kv", case.args["codecs"]):
        if c is None:
            rows.append(t[f"{side}_codes"].array().astype(np.float64))
        else:
            codes = quant_reference.unpack(t[f"{side}_codes"].array(), c["bits"], c["head_dim"])
            rows.append(quant_reference.decode(codes, t[f"{side}_norms"].array(), c["bits"], c["seed"]))
    return rows


def _codes_new_counts(case: Case) -> np.ndarray:
    """The rows k_new/v_new append to each sequence: cu_seqlens_k_new's
    counts, else k_new's dim 1 for every one."""
    t = case.tensors
    if _seq_present(case, "cu_seqlens_k_new"):
        return np.diff(t["cu_seqlens_k_new"].array().astype(np.int64))
    return np.full(t["seqlens_k"].shape[-1], t["k_new"].shape[1])


def _codes_appended_slots(case: Case) -> list[tuple[int, int, int, int]]:
    """(storage index 0, index 1, sequence, row of k_new/v_new flattened to
    [rows, Hkv, D]) of every row k_new/v_new land in."""
    t = case.tensors
    if not _seq_present(case, "k_new"):
        return []
    table = _pages_read(case)
    ends = _lens_and_starts(case)[0]
    page = t["k_codes"].shape[1]
    counts = _codes_new_counts(case)
    first = np.concatenate([[0], np.cumsum(counts)])
    slots = []
    for b, end in enumerate(ends.tolist()):
        for i in range(int(counts[b])):
            pos, row = end + i, int(first[b]) + i
            slots.append((b, pos, b, row) if table is None else (int(table[b, pos // page]), pos % page, b, row))
    return slots


def _check_codes_append(case: Case, ctx: str) -> None:
    """The caches after an accepted call: rows outside the appended slots as
    they were; appended rows the reference encoding of k_new/v_new (codes
    equal except within 1e-5 of a boundary, norms to 1e-5 relative), a dense
    side's rows the new rows' bytes."""
    t = case.tensors
    slots = _codes_appended_slots(case)
    for side, c in zip("kv", case.args["codecs"]):
        parts = ["codes"] if c is None else ["codes", "norms"]
        new = t[f"{side}_new"].array() if slots else None
        if new is not None:
            new = new.reshape(-1, *new.shape[-2:])
        for part in parts:
            got, was = t[f"{side}_{part}"].array().copy(), _before(t[f"{side}_{part}"]).copy()
            for p0, p1, _, _ in slots:
                got[p0, p1] = was[p0, p1] = 0
            assert got.tobytes() == was.tobytes(), f"{side} {part} changed outside the appended rows: {ctx}"
        for p0, p1, b, i in slots:
            x = new[i].astype(np.float64)
            if c is None:
                assert t[f"{side}_codes"].array()[p0, p1].tobytes() == new[i].tobytes(), ctx
                continue
            want, norms, u = quant_reference.encode(x, c["bits"], c["seed"])
            got = quant_reference.unpack(t[f"{side}_codes"].array()[p0, p1], c["bits"], c["head_dim"])
            _, bounds, _ = quant_reference.design(c["bits"])
            near = np.min(np.abs(u[..., None] - bounds), axis=-1) < 1e-5
            assert np.array_equal(got[~near], want[~near]), f"{side} codes of new row {b},{i}: {ctx}"
            ok, _ = reference.close(t[f"{side}_norms"].array()[p0, p1], norms, 0.0, 1e-5)
            assert ok, f"{side} norms of new row {b},{i}: {ctx}"


def _key_ranges(case: Case) -> np.ndarray | None:
    """The rule of fm_mask_key_ranges from the mask's values: int32 [2, B]
    (ends, starts) when every batch row's visible keys (0 or True attend,
    -inf hides; causal and the window applied) are one range, the same for
    every head, with no other value anywhere; else None."""
    a = case.args
    m = case.tensors["mask"].array()
    if m.dtype == np.bool_:
        vis = m[:, :, 0, :].astype(bool)
    else:
        x = m[:, :, 0, :].astype(np.float64)
        vis = x == 0
        if not (vis | np.isneginf(x)).all():
            return None
    if not (vis == vis[:, :1]).all():
        return None
    vis, pos = vis[:, 0].copy(), np.arange(vis.shape[-1])
    if a["causal"]:
        vis &= pos <= a["q_pos"]
    if a["window"] > 0:
        vis &= a["q_pos"] - pos < a["window"]
    out = np.zeros((2, vis.shape[0]), np.int32)
    for b, row in enumerate(vis):
        idx = np.flatnonzero(row)
        if idx.size and idx[-1] - idx[0] + 1 != idx.size:
            return None
        if idx.size:
            out[:, b] = [idx[-1] + 1, idx[0]]
    return out


def _check_encode(case: Case, ctx: str) -> None:
    """An accepted kv_encode: codes equal the reference encoding except
    within 1e-5 of a boundary, norms to 1e-5 relative, nothing written past
    either (non-finite rows: only the safety contract)."""
    t, c = case.tensors, case.args["codec"]
    x = t["x"].array().astype(np.float64)
    for name in ("codes", "norms"):
        nb = int(np.prod(t[name].shape)) * SIZE[t[name].dtype]
        assert np.array_equal(t[name].buf.raw[G + nb:], t[name].buf.snap[G + nb:]), f"wrote past {name}: {ctx}"
    if not np.isfinite(x).all() or np.abs(x).max(initial=0.0) > 1e18:
        return  # rows relabelled to another dtype: only the safety contract
    want, norms, u = quant_reference.encode(x, c["bits"], c["seed"])
    got = quant_reference.unpack(t["codes"].array(), c["bits"], c["head_dim"])
    _, bounds, _ = quant_reference.design(c["bits"])
    near = np.min(np.abs(u[..., None] - bounds), axis=-1) < 1e-5
    assert np.array_equal(got[~near], want[~near]), f"codes differ from the reference encoding: {ctx}"
    ok, ratio = reference.close(t["norms"].array(), norms, 1e-30, 1e-5)
    assert ok, f"norms off by {ratio:.3g}x: {ctx}"
    case.notes.append("kv_encode compared")


def _codes_attn_expected(case: Case) -> np.ndarray:
    """float64 attention over the caches' rows as the call left them (the
    appended rows checked on their own), lengths grown by the new rows."""
    t, o = case.tensors, case.opts
    i32 = lambda x: (x + 2**31) % 2**32 - 2**31  # noqa: E731 - the library saw the wrapped int32
    k, v = _codes_sides(case)
    if not (np.isfinite(k).all() and np.isfinite(v).all()):
        case.finite = False  # a dense side's bytes read as another dtype: only the safety contract is checked
    kw = dict(scale=o["scale"], causal=bool(o["causal"]), softcap=o["softcap"],
              window_size=(i32(o["window_left"]), i32(o["window_right"])), attention_chunk=i32(o["attention_chunk"]),
              sinks=t["sinks"].array() if _seq_present(case, "sinks") else None,
              alibi_slopes=t["alibi_slopes"].array() if _seq_present(case, "alibi_slopes") else None)
    if _seq_present(case, "cu_seqlens_k"):
        paged_k = _seq_present(case, "block_table")
        out, lse = reference.flash_attn_varlen(
            t["q"].array(), k if paged_k else k[0], v if paged_k else v[0], t["cu_seqlens_q"].array(),
            t["cu_seqlens_k"].array(), block_table=t["block_table"].array() if paged_k else None,
            seqused_q=t["seqused_q"].array() if _seq_present(case, "seqused_q") else None,
            seqused_k=t["seqlens_k"].array() if _seq_present(case, "seqlens_k") else None, **kw)
        case.args["lse"] = lse
        return out
    lens, starts = _lens_and_starts(case)
    if _seq_present(case, "k_new"):
        lens = lens + _codes_new_counts(case)
    table = _pages_read(case)
    if _seq_present(case, "cu_seqlens_q"):  # packed queries over the cache lengths, sequence by sequence
        q, cq = t["q"].array(), t["cu_seqlens_q"].array()
        if lens is None:  # every sequence holds its whole cache
            lens = np.full(cq.shape[0] - 1, k.shape[1] * (1 if table is None else table.shape[1]))
        out, lse = np.zeros(q.shape), np.full((q.shape[1], q.shape[0]), -np.inf)
        slopes = kw.pop("alibi_slopes")
        for b in range(cq.shape[0] - 1):
            s, e = int(cq[b]), int(cq[b + 1])
            one = slice(b, b + 1)
            caches = (k, v) if table is not None else (k[one], v[one])
            ob, lb = reference.flash_attn_kvcache(
                q[None, s:e], *caches, cache_seqlens=lens[one], block_table=None if table is None else table[one],
                cache_leftpad=None if starts is None else starts[one],
                alibi_slopes=None if slopes is None else slopes[one], **kw)
            out[s:e], lse[:, s:e] = ob[0], lb[0]
        case.args["lse"] = lse
        return out
    out, lse = reference.flash_attn_kvcache(t["q"].array(), k, v, cache_seqlens=lens, block_table=table,
                                            cache_leftpad=starts, **kw)
    case.args["lse"] = lse
    return out


def _attn_expected(case: Case) -> np.ndarray:
    out, lse = _attn_reference(case)
    case.args["lse"] = lse
    return out


def check(case: Case, status: int, msg: str, extra: Any) -> None:
    """Asserts the contract for one completed call."""
    ctx = f"{case.backend} {case.op} mutations={case.mutations} status={status} msg={msg!r}"
    assert status in (0, 1, 2) or (status == 3 and case.backend != "cpu" and "no kernel named" in msg), ctx
    bufs = {n: t.buf for n, t in case.tensors.items()}
    if status == 3:  # an op the simulator does not have yet: nothing may have been written
        for n, b in bufs.items():
            assert b.unchanged(), f"{n} modified by a failed call: {ctx}"
        return
    if status != 0:
        ops = OPS[case.op] + ("create_registry",)
        head = msg.split(":", 1)[0]
        assert head in ops and len(msg) > len(head) + 2, f"message does not name the op: {ctx}"
        for n, b in bufs.items():
            assert b.unchanged(), f"{n} modified by a failed call: {ctx}"
        if "q_rows" in case.args:
            _check_rows_refusal(case, status, msg, extra, ctx)
        return
    assert status == 0
    # (Another mutation may leave nothing to write, e.g. an empty out.)
    assert not (case.mutations and all(m.startswith("alias:") for m in case.mutations)), \
        f"an output sharing memory was accepted: {ctx}"
    if case.op == "vec_seq":
        q = case.tensors["q"]
        assert len(q.shape) != 4 or 1 <= q.shape[1] <= max_query_rows(), f"q of {q.shape[1]} rows accepted: {ctx}"
    if case.op == "blk_byte_len":
        ql, kl, d = case.args["q_len"], case.args["k_len"], case.args["head_dim"]
        assert 0 < ql < 2**31 and 0 < kl < 2**31 and (0 < d <= 512 or d in prefill_dims()), ctx
        assert extra == _blk_expect(ql, kl, d)[1], ctx
        return
    if case.op == "alloc_blk":
        ql, kl, d = case.args["q_len"], case.args["k_len"], case.args["head_dim"]
        n, nb, nq, nk = _blk_expect(ql, kl, d)
        assert extra == (nb, nq, nk, True), ctx
        return
    for n, ts in case.tensors.items():
        b = ts.buf
        # An input the library got no pointer to (descriptor or data NULL) is
        # not checked: an alias may have put its bytes inside a passed
        # output's buffer, which the library may write. A passed input is.
        if ts.role == "in":
            assert b.unchanged() or not ts.passed, f"input {n} modified: {ctx}"
        else:
            assert b.guards_ok(), f"write outside {n}: {ctx}"
    e, outname, tol = expected(case, extra)
    out = case.tensors[outname]
    if tol == -3:  # kv_append: both caches exactly the appended bytes
        for name, want in zip(("k_cache", "v_cache"), e):
            got = case.tensors[name].array()
            assert got.tobytes() == np.ascontiguousarray(want).tobytes(), f"{name} differs from the append: {ctx}"
        return
    if tol == -6:  # mask_key_ranges: found as the rule says, out its ranges (untouched when not found)
        assert extra == (e is not None), f"found={extra}, the rule: {e is not None}: {ctx}"
        if e is None:
            assert out.buf.unchanged(), f"out written though no ranges were found: {ctx}"
        else:
            assert np.array_equal(out.array(), e), f"ranges {out.array().tolist()} != {e.tolist()}: {ctx}"
        case.notes.append(f"mask_key_ranges {'found' if e is not None else 'none'} compared")
        return
    if tol == -4:  # kv_encode: the reference codec's codes and norms
        _check_encode(case, ctx)
        return
    if tol == -5:  # kv_codes_append: the appended rows encoded, every other row as it was
        rows = [case.tensors[n].array().astype(np.float64) for n in ("k_new", "v_new")]
        if all(np.isfinite(x).all() and np.abs(x).max(initial=0.0) <= 1e18 for x in rows):
            _check_codes_append(case, ctx)
            case.notes.append("kv_codes_append compared")
        return
    if tol == -2:  # blk: the classes, nothing past NQ*NK written
        got = out.buf.mid()[: e.size]
        assert np.array_equal(got, e), f"blk classes differ: {ctx}"
        assert np.array_equal(out.buf.raw[G + e.size:], out.buf.snap[G + e.size:]), f"blk wrote past NQ*NK: {ctx}"
        return
    nbytes_shape = int(np.prod(out.shape)) * SIZE[out.dtype]
    assert np.array_equal(out.buf.raw[G + nbytes_shape:], out.buf.snap[G + nbytes_shape:]), \
        f"wrote past the out shape: {ctx}"
    got = out.array()
    if tol == -1:
        assert np.array_equal(got.astype(np.float64), e), f"mask differs: {ctx}"
        return
    if not case.finite:
        if case.op == "vec_seq" and len(case.tensors["q"].shape) == 4:
            case.notes.append("vec_seq q[B,L,H,D] accepted, not finite")
        return
    atol, rtol = TOL[tol]
    ok, ratio = reference.close(got, e, atol, rtol)
    assert ok, f"output off by {ratio:.3g}x tolerance: {ctx}"
    if case.op in ("kv_dequantize", "kv_codes_decode"):
        case.notes.append(f"{case.op} compared")
    if case.op == "kv_codes_attn":
        _check_codes_append(case, ctx)
        how = " with k_new/v_new" if _seq_present(case, "k_new") else ""
        how += " and packed q" if _seq_present(case, "cu_seqlens_q") else ""
        how += " over packed keys" if _seq_present(case, "cu_seqlens_k") and not _seq_present(case, "block_table") else ""
        case.notes.append("kv_codes_attn compared" + how)
    if case.op in ("attn", "vec_seq", "kv_codes_attn") and _seq_present(case, "lse"):
        lse = case.tensors["lse"]
        ok, ratio = reference.close(lse.array(), case.args["lse"].reshape(lse.shape), 2e-4, 2e-4)
        assert ok, f"lse off by {ratio:.3g}x tolerance: {ctx}"
    if case.op == "vec_seq" and len(case.tensors["q"].shape) == 4:
        case.notes.append("vec_seq q[B,L,H,D] compared" + (" with lse" if _seq_present(case, "lse") else ""))
    if case.op == "vec_seq" and case.opts.get("head_major") == 1:
        case.notes.append("vec_seq head-major compared" + (" (paged)" if _seq_present(case, "block_table") else ""))
    if case.op in ("vec_seq", "attn") and _seq_present(case, "k_new"):
        want = _appended(case)[:2]
        for name, w in zip(("k", "v"), want):
            got = case.tensors[name].array()
            assert got.tobytes() == np.ascontiguousarray(w).tobytes(), f"{name} differs from the append: {ctx}"
        ragged = " ragged" if _seq_present(case, "cu_seqlens_k_new") else ""
        case.notes.append(f"{case.op} with{ragged} k_new/v_new appended and compared")


def _check_rows_refusal(case: Case, status: int, msg: str, argument: str, ctx: str) -> None:
    """A refused short-query vec_seq call. One whose only fault is q's rows
    past FM_SHORT_QUERY_ROWS must be a value error naming the op, q, its rows
    and the limit."""
    rows = case.args["q_rows"]
    if case.mutations != [f"q.rows={rows}"]:  # another fault may be the one reported
        case.notes.append("vec_seq q[B,L,H,D] refused" + (" (L too many, and more)" if rows > max_query_rows() else ""))
        return
    case.notes.append("vec_seq q[B,L,H,D] refused (L too many, named)")
    assert status == 1 and argument == "q", f"q of {rows} rows not refused as a bad q: {ctx} argument={argument!r}"
    body = msg.split(":", 1)[1]
    assert msg.startswith("flash_attn_vec_seq:") and re.search(rf"\b{rows}\b", body) \
        and re.search(rf"\b{max_query_rows()}\b", body), f"rows refusal names not the rows and the limit: {ctx}"


BEFORE_CALL = None  # hook(case, seed): run_fuzz.py records the case before the call


def run_case(seed: int, backend: str, regs: Registries, op: str | None = None, nmut: int | None = None) -> Case:
    rng = np.random.default_rng([seed, 0 if backend == "cpu" else 1])
    if op is None:
        weights = np.array([22, 14, 10, 7, 7, 5, 5, 16, 8, 6, 5, 8, 3, 3, 5, 4, 2], float)  # in GENERATORS' order
        op = str(rng.choice(list(GENERATORS), p=weights / weights.sum()))
    case = GENERATORS[op](rng, backend)
    if nmut is None:
        nmut = int(rng.choice([0, 1, 1, 1, 2, 3]))
    for _ in range(nmut):
        mutate(case, rng)
    if BEFORE_CALL is not None:
        BEFORE_CALL(case, seed)
    if case.opts and abs(case.opts.get("scale", 0.0)) > 1e4:
        case.finite = False  # scores overflow float32: only the safety contract is checked
    status, msg, extra = call(case, regs)
    case.status = status
    if not case.mutations and case.op not in ("blk_byte_len", "alloc_blk"):
        assert status == 0 or (status == 3 and "no kernel named" in msg), \
            f"a valid call failed: {case.backend} {case.op} {msg!r}"
    check(case, status, msg, extra)
    return case
