"""Which cells of flash-attn's own forward test grids flashmetal runs.

flash-attn's suite (tests/test_flash_attn.py for flash-attn 2 and
hopper/test_flash_attn.py for flash-attn 3, Dao-AILab/flash-attention at the
commit in UPSTREAM) parametrises each test function with pytest; a grid cell is
one combination of its parameters, times the head-dim-of-v and attention-chunk
variants the flash-attn 3 tests loop over inside one case. This script holds
those grids as data (GRIDS), expands every cell, drops the cells upstream
skips itself, sets aside what is out of scope (dropout, fp8, qv, backward-only
tests), groups the rest into classes by the parameters that can decide
support, and for one tiny representative call per class calls flashmetal's
real API (cpu backend) and records whether it runs or refuses (the exception
and its message). Nothing about support is written down here: the call decides.

    python bench/flash_attn_grid.py [--out bench/FLASH_ATTN_GRID.md]

What the expansion assumes of upstream's environment: a GPU that is not sm75
and has more than 16 GiB (no dtype cut, no "reference OOM" skip), every
FLASH_ATTENTION_DISABLE_* unset (flash-attn 3's full grid, fp8 included).
Scheduling knobs with no effect on the result (num_splits, pack_gqa,
scheduler metadata, rotary_seqlens equal to cache_seqlens) are not passed,
nor seqused_q/seqused_k where they equal the cu_seqlens lengths (flash-attn
3's varlen test passes them always; they differ only with add_unused_qkv).
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import flashmetal as fm

HERE = Path(__file__).resolve().parent
UPSTREAM = "Dao-AILab/flash-attention @ 0251105a2fb19d2957484b7f023cd8c115286ced (2026-08-15)"
FA2 = "tests/test_flash_attn.py"
FA3 = "hopper/test_flash_attn.py"

F16, BF16, F32, FP8 = "float16", "bfloat16", "float32", "float8_e4m3fn"
MHA = ["mha", "mqa", "gqa"]
D12 = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
CAUSAL_PAIRS = [(1, 239), (3, 799), (127, 512), (127, 513), (113, 203), (128, 217), (113, 211), (108, 256),
                (256, 512), (1023, 1024)]
RACE_PAIRS = [(1, 239), (239, 1), (3, 799), (799, 3), (1024, 128), (97, 97), (128, 128), (200, 200), (256, 256),
              (257, 257), (384, 384), (512, 512), (768, 768), (1024, 1024)]
KVCACHE_PAIRS_FA2 = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
                     (1, 128 * 1024), (16, 128 * 1024), (128, 128)]
KVCACHE_PAIRS_FA3 = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000),
                     (128, 128), (256, 512), (2048, 3577)]
COMPILED_HDIMS = [64, 96, 128, 192, 256]


@dataclass(frozen=True)
class Grid:
    """One upstream test function: its parametrize lists (a comma-joined name
    is one parametrize of tuples), the constants its body fixes, the cells it
    skips itself, and the variants it loops over inside one case."""
    file: str
    name: str
    entry: str
    params: dict[str, list[Any]]
    fixed: dict[str, Any] = field(default_factory=dict)
    skip: Callable[[dict[str, Any]], bool] = lambda c: False
    inner: Callable[[dict[str, Any]], list[dict[str, Any]]] = lambda c: [{}]
    backward_only: bool = False


def fa3_dv(c: dict[str, Any]) -> list[int]:
    """hopper's dv_vals: MLA-style value head dims beside q's."""
    d = c["d"]
    if c.get("has_qv"):
        return [256, 512]
    if c["dtype"] == FP8:
        return [d]
    return [128, d] if 128 < d <= 192 else ([256, 512, d] if d <= 64 else [d])


def fa3_inner(chunk_when: Callable[[dict[str, Any]], bool]) -> Callable[[dict[str, Any]], list[dict[str, Any]]]:
    """hopper's `for dv, attention_chunk in product(dv_vals, attention_chunk_vals)`:
    a random chunk in [1, 2*seqlen_k) and 0 when `chunk_when`, else 0 only."""
    def inner(c: dict[str, Any]) -> list[dict[str, Any]]:
        chunks = [True, False] if chunk_when(c) else [False]
        return [{"dv": dv, "chunk": ch} for dv, ch in itertools.product(fa3_dv(c), chunks)]
    return inner


def fa3_kvcache_skip(c: dict[str, Any]) -> bool:
    return ((c["page_size"] is not None and c["seqlen_k"] % c["page_size"] != 0)
            or (c["seqlen_q"] > c["seqlen_k"] and c["new_kv"])
            or (not c["new_kv"] and c["rotary_fraction"] > 0.0)
            or (c["rotary_fraction"] == 0.0 and c["has_rotary_seqlens"]))


def fa2_kvcache_skip(c: dict[str, Any]) -> bool:
    return ((c["seqlen_q"] > c["seqlen_k"] and c["new_kv"])
            or (not c["new_kv"] and c["rotary_fraction"] > 0.0)
            or (c["has_batch_idx"] and c["page_size"] is not None)
            or (c["has_leftpad"] and c["page_size"] is not None))


# Every forward test's @pytest.mark.parametrize lists, transcribed (the
# decorators' values with upstream's defaults; commented-out ones left out).
GRIDS: list[Grid] = [
    Grid(FA2, "test_flash_attn_qkvpacked", "qkvpacked", {
        "dtype": [F16, BF16], "deterministic": [False, True], "alibi": [False, True], "local": [False, True],
        "causal": [False, True], "d": D12, "seqlen": [97, 128, 200, 384, 768, 1024, 1025, 2048],
        "dropout_p": [0.0, 0.17]}),
    Grid(FA2, "test_flash_attn_varlen_qkvpacked", "varlen_qkvpacked", {
        "dtype": [F16, BF16], "deterministic": [False, True], "alibi": [False, True], "local": [False, True],
        "causal": [False, True], "d": [32, 59, 64, 80, 96, 128, 160, 192, 224, 256],
        "seqlen": [97, 128, 200, 257, 384, 512, 768, 1025, 2048], "dropout_p": [0.0, 0.17]}),
    Grid(FA2, "test_flash_attn_output", "func", {
        "kvpacked": [True, False], "dtype": [F16, BF16], "mha_type": MHA, "deterministic": [False, True],
        "alibi": [False, True], "local": [False, True], "causal": [False, True],
        "d": [32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256],
        "seqlen_q,seqlen_k": [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024),
                              (1023, 1024), (1024, 1023), (2048, 2048)],
        "dropout_p": [0.0, 0.17], "softcap": [0.0, 50.0]},
        skip=lambda c: c["softcap"] > 0 and c["dropout_p"] > 0),
    Grid(FA2, "test_flash_attn_varlen_output", "varlen", {
        "kvpacked": [True, False], "dtype": [F16, BF16], "mha_type": MHA, "deterministic": [False, True],
        "alibi": [False, True], "local": [False, True], "causal": [False, True],
        "d": [32, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256],
        "seqlen_q,seqlen_k": [(1, 147), (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
                              (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)],
        "dropout_p": [0.0, 0.17], "softcap": [0.0, 50.0]},
        skip=lambda c: c["softcap"] > 0 and c["dropout_p"] > 0),
    Grid(FA2, "test_flash_attn_causal", "func", {
        "dtype": [F16, BF16], "local": [False, True], "d": D12, "swap_sq_sk": [False, True],
        "seqlen_q,seqlen_k": CAUSAL_PAIRS}, fixed={"causal": True}),
    Grid(FA2, "test_flash_attn_varlen_causal", "varlen", {
        "dtype": [F16, BF16], "local": [False, True], "d": D12, "swap_sq_sk": [False, True],
        "seqlen_q,seqlen_k": CAUSAL_PAIRS, "page_size": [None, 256, 512]}, fixed={"causal": True}),
    Grid(FA2, "test_flash_attn_splitkv", "func", {
        "dtype": [F16, BF16], "deterministic": [False, True], "alibi": [False, True], "local": [False, True],
        "causal": [False, True], "d": D12, "swap_sq_sk": [False, True],
        "seqlen_q,seqlen_k": [(3, 1024), (1, 339), (64, 800), (3, 799), (64, 2048), (16, 20000), (16, 100000),
                              (128, 128), (256, 256)]}),
    Grid(FA2, "test_flash_attn_kvcache", "kvcache", {
        "dtype": [F16], "num_splits": [1, 0], "mha_type": MHA, "new_kv": [False, True], "alibi": [False, True],
        "local": [False, True], "causal": [False, True], "seqlen_new_eq_seqlen_q": [True, False],
        "rotary_interleaved": [False, True], "rotary_fraction": [0.0, 0.5, 1.0], "page_size": [None, 256],
        "has_leftpad": [False, True], "has_batch_idx": [False], "d": [32, 59, 64, 80, 128, 256],
        "seqlen_q,seqlen_k": KVCACHE_PAIRS_FA2}, skip=fa2_kvcache_skip),
    Grid(FA2, "test_flash_attn_race_condition", "func", {
        "dtype": [F16], "causal": [False, True], "d": D12, "seqlen_q,seqlen_k": RACE_PAIRS,
        "dropout_p": [0.0, 0.17]}),
    Grid(FA2, "test_flash_attn_bwd_overflow", "func", {
        "dtype": [F16], "causal": [False, True], "d": [16, 32, 64], "seqlen": [1, 2, 5, 17, 128]},
        backward_only=True),
    Grid(FA2, "test_flash_attn_bwd_transpose", "func", {
        "dtype": [F16, BF16], "causal": [False, True], "d": [64, 128], "seqlen": [97, 128, 200, 256]},
        backward_only=True),
    Grid(FA2, "test_flash_attn_bwd_varlen_overflow", "varlen", {
        "dtype": [F16], "causal": [False, True], "d": [16, 32, 64]}, backward_only=True),
    Grid(FA2, "test_flash_attn_deterministic", "func", {
        "dtype": [F16, BF16], "local": [False, True], "causal": [False, True], "d": D12,
        "swap_sq_sk": [False, True], "seqlen_q,seqlen_k": CAUSAL_PAIRS}, backward_only=True),
    Grid(FA2, "test_flash_attn_varlen_deterministic", "varlen", {
        "dtype": [F16, BF16], "local": [False, True], "causal": [False, True], "d": D12,
        "swap_sq_sk": [False, True], "seqlen_q,seqlen_k": CAUSAL_PAIRS}, backward_only=True),
    # _flash_attn_varlen_forward over a paged cache with seqused_k (B=3, H=Hkv=4, D=128, pages of 256).
    Grid(FA2, "test_flash_attn_varlen_paged_kv_num_splits", "varlen", {"dtype": [F16, BF16]},
         fixed={"d": 128, "seqlen_q": 1, "seqlen_k": 300, "page_size": 256, "seqused": True}),
    # A block table too short for cache_seqlens must raise, not read past it.
    Grid(FA2, "test_flash_attn_kvcache_paged_block_table_bounds", "block_table_bounds", {
        "dtype": [F16], "append_knew": [False, True], "page_size": [256]}, fixed={"d": 128}),
    Grid(FA3, "test_flash_attn_output", "func", {
        "dtype": [BF16, F16, FP8], "mha_type": MHA, "has_qv": [False, True], "deterministic": [False],
        "softcap": [0.0, 15.0], "local": [False, True], "causal": [False, True], "V_colmajor": [False],
        "d": COMPILED_HDIMS,
        "seqlen_q,seqlen_k": [(1, 1), (64, 128), (128, 192), (256, 256), (239, 1), (799, 3), (113, 203), (113, 128),
                              (128, 217), (113, 211), (108, 256), (256, 512), (384, 256), (640, 128), (512, 256),
                              (1024, 1024), (1023, 1024), (1024, 1023), (4096, 4096), (4224, 4224)]},
        skip=lambda c: c["has_qv"] and (c["d"] != 64 or c["dtype"] == FP8),
        inner=fa3_inner(lambda c: True)),
    Grid(FA3, "test_flash_attn_varlen_output", "varlen", {
        "dtype": [BF16, F16, FP8], "mha_type": MHA, "has_qv": [False, True], "deterministic": [False],
        "softcap": [0.0, 15.0], "local": [False, True], "causal": [False, True], "add_unused_qkv": [False, True],
        "d": COMPILED_HDIMS,
        "seqlen_q,seqlen_k": [(1, 1), (1, 3), (2, 1), (511, 1), (3, 513), (64, 128), (128, 128), (256, 256),
                              (113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (307, 256), (640, 128),
                              (512, 256), (1024, 1024), (1023, 1024), (1024, 1023), (1024, 1024), (2048, 2048),
                              (4096, 4096)]},
        skip=lambda c: c["has_qv"] and (c["d"] != 64 or c["dtype"] == FP8),
        inner=fa3_inner(lambda c: c["seqlen_q"] <= c["seqlen_k"])),
    Grid(FA3, "test_flash_attn_kvcache", "kvcache", {
        "dtype": [BF16, FP8], "mha_type": MHA, "new_kv": [False, True],
        "causal,local": [(False, False), (True, False), (False, True)], "seqlen_new_eq_seqlen_q": [True, False],
        "has_rotary_seqlens": [False], "rotary_interleaved": [False, True], "rotary_fraction": [0.0, 0.5, 1.0],
        "page_size": [None, 1, 4, 128], "has_leftpad": [False, True], "has_batch_idx": [False, True],
        "varlen_q": [False, True], "d": [128], "seqlen_q,seqlen_k": KVCACHE_PAIRS_FA3},
        skip=fa3_kvcache_skip, inner=fa3_inner(lambda c: c["causal"] or c["local"])),
    Grid(FA3, "test_flash_attn_cluster", "func", {
        "dtype": [BF16], "causal": [False, True], "d": [128], "seqlen_q,seqlen_k": [(64, 8192)]}),
    Grid(FA3, "test_flash_attn_race_condition", "func", {
        "dtype": [BF16], "causal": [False, True], "d": D12, "seqlen_q,seqlen_k": RACE_PAIRS + [(2048, 2048)]}),
    Grid(FA3, "test_flash_attn_combine", "combine", {
        "dtype": [F32, F16, BF16], "d": [64, 96, 128, 192, 256, 512],
        "seqlen": [1, 2, 3, 32, 64, 256, 113, 108, 640, 1024], "num_splits": [1, 2, 3, 5, 17, 32, 55, 97, 133]}),
    Grid(FA3, "test_flash_attn_varlen_combine_linearize", "combine", {"dtype": [BF16]}, fixed={"d": 128}),
]


def cells(grid: Grid) -> Iterator[dict[str, Any]]:
    """Every cell of one grid (upstream's own skips included), as flat dicts."""
    for case in cases(grid):
        for variant in grid.inner(case):
            yield {**case, **variant}


def cases(grid: Grid) -> Iterator[dict[str, Any]]:
    """Every pytest case of one grid (one combination of its parametrize
    values), before the variants its body loops over."""
    names = list(grid.params)
    for values in itertools.product(*(grid.params[n] for n in names)):
        c: dict[str, Any] = dict(grid.fixed)
        for name, value in zip(names, values):
            if "," in name:
                c.update(zip(name.split(","), value))
            else:
                c[name] = value
        if "seqlen" in c:
            c.setdefault("seqlen_q", c["seqlen"])
            c.setdefault("seqlen_k", c["seqlen"])
        if c.get("swap_sq_sk"):
            c["seqlen_q"], c["seqlen_k"] = c["seqlen_k"], c["seqlen_q"]
        yield c


def out_of_scope(grid: Grid, c: dict[str, Any]) -> str | None:
    """Why a cell is outside flashmetal's scope (inference, no fp8), or None."""
    if grid.backward_only:
        return "backward"
    if c.get("dropout_p", 0.0) > 0:
        return "dropout"
    if c["dtype"] == FP8:
        return "fp8"
    if c.get("has_qv"):
        return "qv"
    return None


def tiny_lens(sq: int, sk: int) -> tuple[int, int]:
    """Small query/key lengths that keep the relation that matters to routing
    and masking: one query row, one key, fewer, as many or more queries."""
    if sq == 1:
        return (1, 1) if sk == 1 else (1, 6)
    if sk == 1:
        return 4, 1
    return (3, 6) if sq < sk else ((5, 5) if sq == sk else (6, 4))


def class_key(grid: Grid, c: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The parameters of a cell that can decide whether flashmetal runs it;
    cells with one key share one representative call."""
    entry = grid.entry
    if entry == "func" and c.get("kvpacked"):
        entry = "kvpacked"
    if entry == "varlen" and c.get("kvpacked"):
        entry = "varlen_kvpacked"
    k: dict[str, Any] = {"entry": entry, "dtype": c["dtype"], "d": c["d"], "dv": c.get("dv", c["d"])}
    if entry == "combine":
        return tuple(k.items())
    if entry == "block_table_bounds":
        k["append"] = c["append_knew"]
        k["page_size"] = c["page_size"]
        return tuple(k.items())
    k["lens"] = tiny_lens(c["seqlen_q"], c["seqlen_k"])
    for name in ("causal", "local", "alibi", "deterministic", "chunk"):
        k[name] = bool(c.get(name, False))
    k["softcap"] = c.get("softcap", 0.0) > 0
    k["heads"] = c.get("mha_type", "mha")
    if entry.startswith("varlen"):
        k["page_size"] = c.get("page_size")
        k["seqused"] = bool(c.get("add_unused_qkv") or c.get("seqused"))
    if entry == "kvcache":
        k["page_size"] = c["page_size"]
        frac = c["rotary_fraction"]
        k["rotary"] = "none" if frac == 0 else ("partial" if frac < 1 else "full")
        k["interleaved"] = frac > 0 and c["rotary_interleaved"]
        k["leftpad"] = c["has_leftpad"]
        k["batch_idx"] = c["has_batch_idx"]
        k["new_kv"] = c["new_kv"]
        k["new_shorter"] = c["new_kv"] and not c["seqlen_new_eq_seqlen_q"] and c["seqlen_q"] > 1
        k["varlen_q"] = c.get("varlen_q", False)
    return tuple(k.items())


# ---------------------------------------------------------------------------
# One representative call per class, on the cpu backend.

NP_DTYPES = {F16: np.dtype(np.float16), BF16: np.dtype(ml_dtypes.bfloat16), F32: np.dtype(np.float32)}
HEADS = {"mha": (2, 2), "mqa": (2, 1), "gqa": (4, 2)}


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def _common(k: dict[str, Any], batch: int, h: int) -> dict[str, Any]:
    """Keyword arguments every flash-attn entry point shares."""
    kw: dict[str, Any] = {"causal": k["causal"], "registry": "cpu"}
    if k["local"]:
        kw["window_size"] = (2, 1)
    if k.get("softcap"):
        kw["softcap"] = 15.0
    if k["alibi"]:
        kw["alibi_slopes"] = (np.random.default_rng(1).random((batch, h)) * 0.3).astype(np.float32)
    if k.get("deterministic"):
        kw["deterministic"] = True
    if k["chunk"]:
        kw["attention_chunk"] = 3
    return kw


def _cu(counts: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


def _paged(rng: np.random.Generator, rows: int, cap: int, page: int, hkv: int, d: int, dv: int,
           dt: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`rows` sequences of `cap` slots in pages of `page` rows, in shuffled pages."""
    per = -(-cap // page)
    order = rng.permutation(rows * per).astype(np.int32)
    table = order.reshape(rows, per)
    return (_rand(rng, (rows * per, page, hkv, d), dt), _rand(rng, (rows * per, page, hkv, dv), dt), table)


def call_class(key: tuple[tuple[str, Any], ...]) -> Any:
    """Run the representative call of one class; returns what flashmetal returned."""
    k = dict(key)
    rng = np.random.default_rng(0)
    entry, d, dv = k["entry"], k["d"], k["dv"]
    dt = NP_DTYPES[k["dtype"]]
    if entry == "combine":
        # flash-attn 3's split merge: out_partial [splits, B, L, H, D] float32, lse_partial [splits, B, L, H].
        return fm.flash_attn_combine(_rand(rng, (3, 2, 4, 2, d), np.dtype(np.float32)),
                                     _rand(rng, (3, 2, 4, 2), np.dtype(np.float32)), out_dtype=dt)
    if entry == "block_table_bounds":
        return _block_table_bounds(k, rng, dt)
    b = 2
    h, hkv = HEADS[k["heads"]]
    sq, sk = k["lens"]
    kw = _common(k, b, h)
    if entry == "qkvpacked":
        return fm.flash_attn_qkvpacked_func(_rand(rng, (b, sq, 3, h, d), dt), **kw)
    if entry == "varlen_qkvpacked":
        cu = _cu([sq, max(1, sq - 1)])
        return fm.flash_attn_varlen_qkvpacked_func(_rand(rng, (int(cu[-1]), 3, h, d), dt), cu, sq, **kw)
    if entry == "func":
        return fm.flash_attn_func(_rand(rng, (b, sq, h, d), dt), _rand(rng, (b, sk, hkv, d), dt),
                                  _rand(rng, (b, sk, hkv, dv), dt), **kw)
    if entry == "kvpacked":
        return fm.flash_attn_kvpacked_func(_rand(rng, (b, sq, h, d), dt), _rand(rng, (b, sk, 2, hkv, d), dt), **kw)
    if entry in ("varlen", "varlen_kvpacked"):
        cu_q, cu_k = _cu([sq, max(1, sq - 1)]), _cu([sk, max(1, sk - 1)])
        q = _rand(rng, (int(cu_q[-1]), h, d), dt)
        if k["seqused"]:
            kw["seqused_q"] = (np.diff(cu_q) - (np.diff(cu_q) > 1)).astype(np.int32)
            kw["seqused_k"] = (np.diff(cu_k) - (np.diff(cu_k) > 1)).astype(np.int32)
        if entry == "varlen_kvpacked":
            kv = _rand(rng, (int(cu_k[-1]), 2, hkv, d), dt)
            return fm.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, sq, sk, **kw)
        if k["page_size"] is not None:
            kc, vc, table = _paged(rng, b, sk, k["page_size"], hkv, d, dv, dt)
            return fm.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, sq, sk, block_table=table, **kw)
        return fm.flash_attn_varlen_func(q, _rand(rng, (int(cu_k[-1]), hkv, d), dt),
                                         _rand(rng, (int(cu_k[-1]), hkv, dv), dt), cu_q, cu_k, sq, sk, **kw)
    assert entry == "kvcache", entry
    return _kvcache(k, rng, dt, b, h, hkv, kw)


def _kvcache(k: dict[str, Any], rng: np.random.Generator, dt: np.dtype, b: int, h: int, hkv: int,
             kw: dict[str, Any]) -> Any:
    """flash_attn_with_kvcache as flash-attn's test calls it, at tiny sizes."""
    d, dv = k["d"], k["dv"]
    sq, sk = k["lens"]
    cap = sk + sq + 2
    rows = 2 * b if k["batch_idx"] else b
    n_new = max(1, sq - 1) if k["new_shorter"] else sq
    lens = np.array([sk, max(1, sk - 1)], np.int32)
    if k["page_size"] is None:
        kc, vc = _rand(rng, (rows, cap, hkv, d), dt), _rand(rng, (rows, cap, hkv, dv), dt)
        kw["block_table"], ro_len = None, cap
    else:
        kc, vc, kw["block_table"] = _paged(rng, rows, cap, k["page_size"], hkv, d, dv, dt)
        ro_len = kw["block_table"].shape[1] * k["page_size"]
    if k["batch_idx"]:
        kw["cache_batch_idx"] = np.array([3, 0], np.int32)
    if k["leftpad"]:
        kw["cache_leftpad"] = np.minimum(lens - 1, 1).astype(np.int32)
    kw["cache_seqlens"] = lens
    if k["varlen_q"]:
        q_counts = [sq, max(1, sq - 1)]
        kw["cu_seqlens_q"], kw["max_seqlen_q"] = _cu(q_counts), sq
        q = _rand(rng, (sum(q_counts), h, d), dt)
    else:
        q = _rand(rng, (b, sq, h, d), dt)
    if k["new_kv"]:
        if k["varlen_q"]:
            k_counts = [n_new, max(1, n_new - 1)]
            kw["cu_seqlens_k_new"] = _cu(k_counts)
            kw["k"], kw["v"] = _rand(rng, (sum(k_counts), hkv, d), dt), _rand(rng, (sum(k_counts), hkv, dv), dt)
        else:
            kw["k"], kw["v"] = _rand(rng, (b, n_new, hkv, d), dt), _rand(rng, (b, n_new, hkv, dv), dt)
    if k["rotary"] != "none":
        rot = math.floor(int((0.5 if k["rotary"] == "partial" else 1.0) * d) / 16) * 16
        angle = rng.random((ro_len, rot // 2)) * 2 * math.pi
        kw["rotary_cos"], kw["rotary_sin"] = np.cos(angle).astype(dt), np.sin(angle).astype(dt)
        kw["rotary_interleaved"] = k["interleaved"]
    return fm.flash_attn_with_kvcache(q, kc, vc, **kw)


def _block_table_bounds(k: dict[str, Any], rng: np.random.Generator, dt: np.dtype) -> str:
    """Upstream's bounds test: one page per sequence, cache_seqlens past it must
    raise before any kernel reads the table out of bounds."""
    page = k["page_size"]
    kc, vc = _rand(rng, (2, page, 1, k["d"]), dt), _rand(rng, (2, page, 1, k["d"]), dt)
    q = _rand(rng, (2, 1, 1, k["d"]), dt)
    table = np.array([[0], [1]], np.int32)
    new = {"k": _rand(rng, (2, 1, 1, k["d"]), dt), "v": _rand(rng, (2, 1, 1, k["d"]), dt)} if k["append"] else {}
    try:
        fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=np.array([page + 1, 1], np.int32), block_table=table,
                                   registry="cpu", **new)
    except ValueError:
        return "raised ValueError as upstream expects"
    raise AssertionError("cache_seqlens past the block table was accepted")


@dataclass(frozen=True)
class Outcome:
    status: str  # "run", "refused" or "failed"
    message: str = ""


REFUSALS = (fm.UnsupportedFeatureError, fm.InvalidValueError, fm.InvalidTypeError, ValueError, TypeError,
            NotImplementedError, AttributeError)


def probe(key: tuple[tuple[str, Any], ...]) -> Outcome:
    """Call the class's representative; a refusal is an exception of the kinds
    flashmetal raises for what it does not take (or Python raises for an
    argument or function it does not have), anything else a failure."""
    try:
        result = call_class(key)
    except REFUSALS as e:
        return Outcome("refused", f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 (a crash of any kind is the finding)
        return Outcome("failed", f"{type(e).__name__}: {e}")
    out = result[0] if isinstance(result, tuple) else result
    if isinstance(out, np.ndarray) and out.dtype.kind == "f" and not np.isfinite(out.astype(np.float32)).all():
        return Outcome("failed", "non-finite output")
    return Outcome("run")


# ---------------------------------------------------------------------------
# Counting and the report.

@dataclass
class Tally:
    total: int = 0
    upstream_skip: int = 0
    out_of_scope: Counter[str] = field(default_factory=Counter)
    classes: Counter[tuple[tuple[str, Any], ...]] = field(default_factory=Counter)
    per_test: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))


def tally(grids: list[Grid]) -> Tally:
    t = Tally()
    for grid in grids:
        label = f"{grid.file}::{grid.name}"
        counts = t.per_test[label]
        for case in cases(grid):
            if grid.skip(case):
                # Upstream skips before its inner loop: one cell per case.
                t.total += 1
                t.upstream_skip += 1
                counts["cells"] += 1
                counts["upstream skip"] += 1
                continue
            for variant in grid.inner(case):
                c = {**case, **variant}
                t.total += 1
                counts["cells"] += 1
                reason = out_of_scope(grid, c)
                if reason:
                    t.out_of_scope[reason] += 1
                    counts["out of scope"] += 1
                else:
                    t.classes[class_key(grid, c)] += 1
    return t


def common_params(keys: list[tuple[tuple[str, Any], ...]]) -> str:
    """The parameters every class of a refusal shares, leaving out features
    shared only by being off: what the refusal is about."""
    dicts = [dict(k) for k in keys]
    shared = []
    for name, value in dicts[0].items():
        same = all(name in x and repr(x[name]) == repr(value) for x in dicts)
        if same and not (value is None or value is False or value == "none"):
            shared.append(f"{name}={value}")
    return ", ".join(shared) or "(no single parameter)"


def measure(grids: list[Grid]) -> tuple[Tally, dict[tuple[tuple[str, Any], ...], Outcome]]:
    t = tally(grids)
    outcomes = {key: probe(key) for key in t.classes}
    return t, outcomes


def report(t: Tally, outcomes: dict[tuple[tuple[str, Any], ...], Outcome], seconds: float) -> str:
    by_msg: dict[tuple[str, str], list[tuple[tuple[str, Any], ...]]] = defaultdict(list)
    for key, o in outcomes.items():
        if o.status != "run":
            by_msg[(o.status, o.message)].append(key)
    run = sum(n for key, n in t.classes.items() if outcomes[key].status == "run")
    refused = sum(n for key, n in t.classes.items() if outcomes[key].status == "refused")
    failed = sum(n for key, n in t.classes.items() if outcomes[key].status == "failed")
    in_scope = sum(t.classes.values())
    lines = [
        "# flash-attn's forward test grid on flashmetal",
        "",
        f"Generated by `make flash-attn-grid` (`bench/flash_attn_grid.py`) from the grids of `{FA2}` and `{FA3}` of",
        f"{UPSTREAM}. {len(outcomes)} classes, one tiny call each on the cpu backend, {seconds:.1f} s.",
        "What the count assumes of upstream's environment, and the scheduling knobs it does not pass: the "
        "script's docstring. A class's call uses 1 to 7 query and key rows: lengths are assumed to decide "
        "support only through the relations kept (one query row, one key, fewer, as many or more queries).",
        "",
        "| cells | count |",
        "|---|---|",
        f"| grid cells (pytest cases; a flash-attn 3 case run counts its dv x attention_chunk variants) "
        f"| {t.total:,} |",
        f"| skipped by upstream's own conditions | {t.upstream_skip:,} |",
        f"| out of scope ({', '.join(f'{r} {n:,}' for r, n in sorted(t.out_of_scope.items()))}) "
        f"| {sum(t.out_of_scope.values()):,} |",
        f"| in scope | {in_scope:,} |",
        f"| run | {run:,} |",
        f"| refused | {refused:,} |",
        f"| failed (an error that is not a refusal) | {failed:,} |",
        "",
        "Refused or failed, by the exception flashmetal raised (the parameters every such class shares name the "
        "feature):",
        "",
        "| feature (the parameters its classes share) | cells | classes | exception and message |",
        "|---|---|---|---|",
    ]
    rows = sorted(by_msg.items(), key=lambda kv: -sum(t.classes[k] for k in kv[1]))
    for (status, msg), keys in rows:
        cells_n = sum(t.classes[k] for k in keys)
        text = msg.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {common_params(keys)} | {cells_n:,} | {len(keys)} | {status}: `{text}` |")
    if not rows:
        lines.append("| (none) | 0 | 0 | |")
    lines += ["", "Per test function:", "", "| test | cells | upstream skip | out of scope | in scope |",
              "|---|---|---|---|---|"]
    for label, c in t.per_test.items():
        ins = c["cells"] - c["upstream skip"] - c["out of scope"]
        lines.append(f"| `{label}` | {c['cells']:,} | {c['upstream skip']:,} | {c['out of scope']:,} | {ins:,} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "FLASH_ATTN_GRID.md")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    t, outcomes = measure(GRIDS)
    text = report(t, outcomes, time.perf_counter() - start)
    print(text, end="")
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
