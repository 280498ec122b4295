"""The prefill tile loaders' load widths. The host picks 16- or 8-byte runs
(one vector load per thread and run) when q, k and v start on such a
boundary and every stride and the head dim are whole runs, else column pairs
(4 bytes). Each case places the same inputs at several byte offsets from a
64-byte boundary, so one call takes each width: the output must equal the
float64 reference within the dtype's tolerance and be bit-identical across
offsets (the loaders move values unchanged, whichever width). On the sim,
the counted kernel's mean device load of q, k and v shows which width ran,
so a host that stopped choosing runs (or chose them where they do not fit)
fails here too. Odd head dims (59) and head dims that are whole 8-byte but
not 16-byte runs (36 in bf16, 34 in float32) keep their fallbacks; D=512's
chunked tiles and paged K/V (pages that split a key tile and pages that do
not) take the same loaders."""
from __future__ import annotations


import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, randn
from serving_cases import cu, paged
from sim_counting import run_counted


def at_offset(a: np.ndarray, offset: int) -> np.ndarray:
    """A copy of `a` whose first byte lies `offset` bytes past a 64-byte boundary."""
    buf = np.zeros(a.nbytes + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == offset
    return out


def load_width(dtype: np.dtype, d: int, offset: int) -> int:
    """The width the loaders should take for contiguous tensors of head dim d at `offset`."""
    for width in (16, 8):
        if offset % width == 0 and d % (width // dtype.itemsize) == 0:
            return width
    return 4


def counted(tmp_path, fn):
    """fn() on the sim with counting on: its result and the prefill dispatch's record."""
    out, recs = run_counted(tmp_path / "counts.jsonl", fn)
    pre = [r for r in recs if r["kernel"].startswith("flash_attn_prefill_") and "blk" not in r["kernel"]]
    assert len(pre) == 1, [r["kernel"] for r in recs]
    return out, pre[0]


def assert_width(rec, width: int, dtype: np.dtype, d: int, what: str) -> None:
    """q, k and v (bindings 0-2) were read in `width`-byte loads (two-byte
    column pairs: 4 bytes each, or 2 for the last column of an odd-width row;
    float32 ones: 4 bytes per element)."""
    for binding in "012":
        b = rec["binding"][binding]
        mean = b["bytes_read"] / b["load_events"]
        if width == 4 and d == 512 and binding in "12":
            # D=512 reads K and V straight into fragments: by runs when they
            # fit, else element by element.
            assert 2 <= mean <= 4, f"{what}: binding {binding} read {mean} bytes per load, want 2 to 4"
        elif width > 4 or d % 2 == 0 or dtype.itemsize == 4:
            assert mean == width, f"{what}: binding {binding} read {mean} bytes per load, want {width}"
        else:
            assert 2 < mean < 4, f"{what}: binding {binding} read {mean} bytes per load, want column pairs"


def check_offsets(registry, tmp_path, call, runs, expected, dtype: np.dtype, d: int, name: str) -> None:
    """`call(*args)` for each `(label, args, width)` of `runs`: on the sim
    counted, q, k and v read in `width`-byte loads; on every backend within
    the dtype's tolerance of `expected` and bit-identical to the first run."""
    first = None
    for label, args, width in runs:
        what = f"{registry.backend} {name} {label}"
        if registry.backend == "sim":
            out, rec = counted(tmp_path, lambda: call(*args))
            assert_width(rec, width, dtype, d, what)
        else:
            out = call(*args)
        assert_close(out, expected, dtype, what)
        if first is None:
            first = out
        else:
            assert_bits_equal(out, first, f"{what} vs {runs[0][0]}")


CASES = [(BF16, 64), (F16, 80), (BF16, 36), (BF16, 59), (F16, 512), (F32, 64), (F32, 34), (F32, 59), (F32, 256),
         (F32, 250), (F32, 512)]


@pytest.mark.parametrize("dtype,d", CASES, ids=[f"{np.dtype(t).name}-D{d}" for t, d in CASES])
def test_prefill_every_width(registry, rng, tmp_path, dtype, d):
    """flash_attn_prefill, causal with GQA and partial query and key tiles,
    q, k and v at offsets 0, 8, 4 and 2 bytes (2: two-byte types only)."""
    dtype = np.dtype(dtype)
    b, h, hkv, ql, kl = 1, 2, 1, 11, 21
    q, k, v = randn(rng, (b, h, ql, d), dtype), randn(rng, (b, hkv, kl, d), dtype), randn(rng, (b, hkv, kl, d), dtype)
    expected = reference.attention(q, k, v, causal=True, q_offset=kl - ql)
    offsets = [0, 8, 4] + ([2] if dtype.itemsize == 2 else [])
    runs = [(f"offset {off}", [at_offset(x, off) for x in (q, k, v)], load_width(dtype, d, off)) for off in offsets]
    check_offsets(registry, tmp_path,
                  lambda *a: fm.flash_attn_prefill(*a, causal=True, q_offset=kl - ql, registry=registry),
                  runs, expected, dtype, d, f"{dtype.name} D={d}")


def test_one_unaligned_tensor_takes_pairs(registry, rng, tmp_path):
    """k alone 8 bytes off a 16-byte boundary: 8-byte runs for all three
    (the width holds for every tensor or none); k alone 2 bytes off: pairs."""
    d = 64
    q, k, v = (randn(rng, (1, 2, 19, d), BF16) for _ in range(3))
    expected = reference.attention(q, k, v)
    runs = [(f"k at offset {k_off}", (at_offset(q, 0), at_offset(k, k_off), at_offset(v, 0)), width)
            for k_off, width in [(0, 16), (8, 8), (2, 4)]]
    check_offsets(registry, tmp_path, lambda *a: fm.flash_attn_prefill(*a, registry=registry),
                  runs, expected, BF16, d, "bfloat16 D=64")


@pytest.mark.parametrize("page_size", [3, 16])
@pytest.mark.parametrize("dtype,d", [(BF16, 64), (F32, 64), (F32, 256)], ids=["bf16-D64", "float32-D64", "float32-D256"])
def test_paged_every_width(registry, rng, tmp_path, page_size, dtype, d):
    """flash_attn_varlen_func over paged K/V, pages that split a 16-key tile
    (3: each key looked up on its own) and pages that hold whole tiles (16),
    the caches at offsets 0, 8 and 4 bytes."""
    dtype = np.dtype(dtype)
    q_lens, k_lens = [5, 9], [23, 14]
    h, hkv = 2, 1
    cq, ck = cu(q_lens), cu(k_lens)
    q = randn(rng, (int(cq[-1]), h, d), dtype)
    rows = [[randn(rng, (n, hkv, d), dtype) for n in k_lens] for _ in range(2)]
    (kc, vc), table = paged(rng, rows, page_size)
    expected, _ = reference.flash_attn_varlen(q, kc, vc, cq, ck, block_table=table, causal=True)
    runs = [(f"offset {off}", (at_offset(q, off), at_offset(kc, off), at_offset(vc, off)), load_width(dtype, d, off))
            for off in (0, 8, 4)]
    check_offsets(registry, tmp_path,
                  lambda *a: fm.flash_attn_varlen_func(*a, cq, ck, max(q_lens), max(k_lens), causal=True,
                                                       block_table=table, registry=registry),
                  runs, expected, dtype, d, f"{dtype.name} paged ps={page_size}")
