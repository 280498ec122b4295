"""Shared pieces of the serving tests (test_serving*.py): registries per
backend, random packed/paged inputs, and the comparison of (out, lse)."""
from __future__ import annotations

import functools

import numpy as np

import flashmetal as fm
import head_dim_tables
from conftest import BACKENDS, SIMULATED
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, randn
from flashmetal import reference
from flashmetal.reference import close

# The LSE is float32 from float32 accumulation: held to a float32-class
# tolerance, looser than the output's only by the score rounding.
LSE_TOL = (2e-4, 2e-4)
HEAD_DIMS = [d for d in head_dim_tables.PADDED_TILES if d <= 256]  # the narrow body's tiles
# Key tile of the prefill kernels for D <= 256, query tile (page sizes and
# ragged lengths are chosen around them).
BK, BQ = 16, 32


@functools.cache
def registry(backend: str) -> fm.Registry:
    """One registry per backend for the whole session."""
    return fm.Registry(backend)


def assert_out_lse(out, lse, exp_out, exp_lse, dtype, what: str, *, merged: bool = False) -> None:
    """out within the dtype's tolerance; lse (float32 from a kernel, float64
    when `merged` on the host) within LSE_TOL, -inf exactly where the
    reference has -inf (rows that see nothing)."""
    assert_close(np.asarray(out), exp_out, dtype, f"{what} out")
    if lse is not None:
        lse = np.asarray(lse)
        assert lse.dtype == (np.float64 if merged else F32), (what, lse.dtype)
        assert lse.shape == exp_lse.shape, (what, lse.shape, exp_lse.shape)
        ok, ratio = close(lse, exp_lse, *LSE_TOL)
        assert ok, f"{what} lse: {ratio:.3g}x over tolerance"


def cu(lengths: list[int]) -> np.ndarray:
    """int32 cumulative offsets [B+1] of the given lengths."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def paged(rng: np.random.Generator, caches: list[list[np.ndarray]], page_size: int, *, room: int = 0,
          spare_pages: int = 2) -> tuple[list[np.ndarray], np.ndarray]:
    """Paged caches [num_pages, page_size, Hkv, D], one per entry of `caches`
    (e.g. [k_rows, v_rows], each a list of [L_b, Hkv, D] per sequence), with
    every sequence on shuffled pages with room for `room` more keys, and their
    block table. Unused slots and spare pages hold noise; padding is -1."""
    lengths = [len(r) for r in caches[0]]
    need = [-(-(n + room) // page_size) for n in lengths]
    max_pages = max(max(need), 1)
    num_pages = sum(need) + spare_pages
    order = rng.permutation(num_pages)
    table = np.full((len(lengths), max_pages), -1, dtype=np.int32)
    table_rows = np.split(order[:sum(need)], np.cumsum(need)[:-1])
    for b, pages in enumerate(table_rows):
        table[b, :len(pages)] = pages
    out = []
    for rows in caches:
        cache = randn(rng, (num_pages, page_size) + rows[0].shape[1:], rows[0].dtype)
        for b, r in enumerate(rows):
            for j in range(-(-len(r) // page_size)):
                chunk = r[j * page_size:(j + 1) * page_size]
                cache[table[b, j], :len(chunk)] = chunk
        out.append(cache)
    return out, table


def sinks_for(rng, heads: int) -> np.ndarray:
    """Sink logits around the scores' range, so they change the result."""
    return rng.uniform(-1.0, 2.0, heads).astype(np.float32)


def with_sinks(rng, features: dict, heads: int) -> dict:
    """A copy of a feature dict whose `sinks=True` became sink logits."""
    kw = dict(features)
    if kw.pop("sinks", False):
        kw["sinks"] = sinks_for(rng, heads)
    return kw


def ragged_features(window: tuple[int, int]) -> dict[str, dict]:
    """The features the ragged serving tests run each case under, by name:
    plain, causal, a window, chunks, softcap with sinks, ALiBi (the last
    three causal). `sinks=True` and `alibi=True` stand for values drawn per
    call (feature_kw)."""
    return {
        "plain": {},
        "causal": dict(causal=True),
        "window": dict(window_size=window),
        "chunk": dict(causal=True, attention_chunk=4),
        "softcap_sinks": dict(causal=True, softcap=2.0, sinks=True),
        "alibi": dict(causal=True, alibi=True),
    }


def feature_kw(rng, features: dict, batch: int, heads: int) -> dict:
    """A feature dict's call arguments: `sinks=True` as sink logits [heads],
    `alibi=True` as ALiBi slopes [batch, heads]."""
    kw = with_sinks(rng, features, heads)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (batch, heads)).astype(np.float32)
    return kw


def check_sink_limits(reg: fm.Registry, rng: np.random.Generator, q_len: int, dtype=BF16, d: int = 64) -> None:
    """Sinks [+inf, -inf, NaN, finite] on four heads, through
    flash_attn_with_kvcache (q_len 1: the decode route, else prefill), causal,
    cache lengths 0 / 5 / 40 (rows that see nothing included): a +inf sink
    takes all the mass (output exactly 0, LSE +inf: the limit, as the
    reference says); a -inf sink is no sink (bit-identical to sinks=None); a
    NaN sink makes its head NaN; the finite one matches the reference."""
    b, heads, kv_heads, cap = 3, 4, 2, 48
    q = randn(rng, (b, q_len, heads, d), dtype)
    kc, vc = randn(rng, (b, cap, kv_heads, d), dtype), randn(rng, (b, cap, kv_heads, d), dtype)
    lens = np.array([0, 5, 40], np.int32)
    sinks = np.array([np.inf, -np.inf, np.nan, 0.7], np.float32)
    kw = dict(cache_seqlens=lens, causal=True)

    def run(sk):
        out, lse = fm.flash_attn_with_kvcache(q, kc, vc, sinks=sk, return_softmax_lse=True, registry=reg, **kw)
        return np.asarray(out), np.asarray(lse)  # [B, qL, H, D], [B, H, qL]

    out, lse = run(sinks)
    base_out, base_lse = run(None)
    e_out, e_lse = reference.flash_attn_kvcache(q, kc, vc, sinks=sinks, **kw)
    what = f"{reg.backend} q_len={q_len} {np.dtype(dtype).name}"
    assert (e_out[:, :, 0] == 0).all() and np.isposinf(e_lse[:, 0]).all(), "the reference's +inf sink limit"
    assert (out[:, :, 0].astype(F32) == 0).all(), f"{what}: +inf sink head is not 0"
    assert np.isposinf(lse[:, 0]).all(), f"{what}: +inf sink LSE {lse[:, 0]}"
    assert_bits_equal(np.ascontiguousarray(out[:, :, 1]), np.ascontiguousarray(base_out[:, :, 1]), f"{what}: -inf sink")
    assert_bits_equal(np.ascontiguousarray(lse[:, 1]), np.ascontiguousarray(base_lse[:, 1]), f"{what}: -inf sink lse")
    assert np.isnan(out[:, :, 2].astype(F32)).all() and np.isnan(lse[:, 2]).all(), f"{what}: NaN sink"
    assert np.isnan(e_out[:, :, 2]).all(), "the reference's NaN sink"
    assert_out_lse(out[:, :, [1, 3]], lse[:, [1, 3]], e_out[:, :, [1, 3]], e_lse[:, [1, 3]], dtype, what)


DTYPES = [BF16, F16]
__all__ = ["BACKENDS", "SIMULATED", "BF16", "F16", "F32", "randn"]
