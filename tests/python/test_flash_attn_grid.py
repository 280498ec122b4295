"""bench/flash_attn_grid.py's expansion and classing of flash-attn's test
grid cells, on a handful of cells: the count of a grid, upstream's own skips,
what is out of scope, that each class's representative call passes the
feature its class names, and that a refusal is counted refused by calling
the library (cpu only, a few tiny calls)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import flashmetal as fm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import flash_attn_grid as g  # noqa: E402


def grid(name: str, file: str = g.FA3) -> g.Grid:
    return next(x for x in g.GRIDS if x.name == name and x.file == file)


def test_cells_expand_every_parametrize_and_the_inner_variants():
    small = g.Grid(g.FA3, "t", "func", {"dtype": [g.BF16], "d": [64, 128], "seqlen_q,seqlen_k": [(3, 7)],
                                        "swap_sq_sk": [False, True]}, inner=g.fa3_inner(lambda c: True))
    cells = list(g.cells(small))
    # d=64: dv 256, 512, 64; d=128: dv 128; each with a chunk and without; two swaps.
    assert len(cells) == (3 + 1) * 2 * 2
    assert {(c["seqlen_q"], c["seqlen_k"]) for c in cells} == {(3, 7), (7, 3)}
    assert sorted({c["dv"] for c in cells if c["d"] == 64}) == [64, 256, 512]
    assert g.fa3_dv({"d": 160, "dtype": g.BF16}) == [128, 160]
    assert g.fa3_dv({"d": 64, "dtype": g.FP8}) == [64]


def test_a_case_upstream_skips_is_one_cell():
    """Upstream skips before its inner loop, so a skipped case counts once;
    a case that runs counts each of its variants."""
    small = g.Grid(g.FA3, "t", "func", {"dtype": [g.BF16], "d": [64, 128], "seqlen_q,seqlen_k": [(3, 7)]},
                   skip=lambda c: c["d"] == 64, inner=g.fa3_inner(lambda c: True))
    t = g.tally([small])
    assert (t.total, t.upstream_skip, sum(t.classes.values()), len(t.classes)) == (3, 1, 2, 2)


def test_upstream_skips_and_out_of_scope():
    kv = grid("test_flash_attn_kvcache")
    base = {"page_size": 4, "seqlen_k": 339, "seqlen_q": 1, "new_kv": True, "rotary_fraction": 0.0,
            "has_rotary_seqlens": False}
    assert kv.skip(base)  # 339 keys are not whole pages of 4
    assert not kv.skip({**base, "page_size": 1})
    assert kv.skip({**base, "page_size": None, "new_kv": False, "rotary_fraction": 0.5})
    out = grid("test_flash_attn_output")
    assert g.out_of_scope(out, {"dtype": g.FP8}) == "fp8"
    assert g.out_of_scope(out, {"dtype": g.BF16, "has_qv": True}) == "qv"
    assert g.out_of_scope(out, {"dtype": g.BF16, "has_qv": False}) is None
    assert g.out_of_scope(grid("test_flash_attn_output", g.FA2), {"dtype": g.F16, "dropout_p": 0.17}) == "dropout"
    assert g.out_of_scope(grid("test_flash_attn_bwd_transpose", g.FA2), {"dtype": g.F16}) == "backward"


def test_class_key_keeps_what_decides_support():
    kv = grid("test_flash_attn_kvcache")
    cell = {"dtype": g.BF16, "d": 128, "dv": 128, "chunk": True, "seqlen_q": 64, "seqlen_k": 800,
            "causal": True, "local": False, "mha_type": "gqa", "page_size": 1, "rotary_fraction": 0.5,
            "rotary_interleaved": True, "has_leftpad": True, "has_batch_idx": True, "new_kv": True,
            "seqlen_new_eq_seqlen_q": False, "varlen_q": True}
    k = dict(g.class_key(kv, cell))
    assert k["lens"] == (3, 6) and k["page_size"] == 1 and k["rotary"] == "partial" and k["interleaved"]
    assert k["leftpad"] and k["batch_idx"] and k["new_shorter"] and k["varlen_q"] and k["chunk"]
    # Cells that differ only in sizes that do not change the route share a class.
    assert g.class_key(kv, {**cell, "seqlen_q": 16, "seqlen_k": 20000}) == g.class_key(kv, cell)
    assert g.class_key(kv, {**cell, "seqlen_q": 1}) != g.class_key(kv, cell)


def test_representative_call_passes_the_class_features(monkeypatch):
    """The kvcache representative hands flash_attn_with_kvcache every
    argument its class names (a recording stand-in replaces the library)."""
    seen = {}
    monkeypatch.setattr(fm, "flash_attn_with_kvcache", lambda *a, **kw: seen.update(kw) or np.zeros(1))
    key = (("entry", "kvcache"), ("dtype", g.BF16), ("d", 64), ("dv", 64), ("lens", (3, 6)), ("causal", True),
           ("local", True), ("alibi", True), ("deterministic", False), ("chunk", True), ("softcap", False),
           ("heads", "gqa"), ("page_size", 4), ("rotary", "full"), ("interleaved", False), ("leftpad", True),
           ("batch_idx", True), ("new_kv", True), ("new_shorter", False), ("varlen_q", True))
    assert g.probe(key) == g.Outcome("run")
    assert seen["rotary_cos"].shape[1] == 32 and seen["rotary_interleaved"] is False
    for name in ("cache_leftpad", "cache_batch_idx", "block_table", "cu_seqlens_q", "cu_seqlens_k_new",
                 "alibi_slopes", "k", "v"):
        assert seen[name] is not None, name
    assert seen["window_size"] == (2, 1) and seen["attention_chunk"] == 3 and seen["causal"]


def test_a_refusal_is_counted_refused_by_calling(monkeypatch):
    """Tallying a grid calls the library once per class; the class a library
    refusal answers is counted refused with its message, the rest run."""
    small = g.Grid(g.FA3, "t", "func", {"dtype": [g.BF16], "d": [64], "seqlen_q,seqlen_k": [(3, 7), (5, 9)]},
                   inner=g.fa3_inner(lambda c: False))
    real = fm.flash_attn_func

    def refuse_dv_512(q, k, v, **kw):
        if v.shape[-1] == 512:
            raise fm.UnsupportedFeatureError("flash_attn_func", "no 512 here", argument="v")
        return real(q, k, v, **kw)
    monkeypatch.setattr(fm, "flash_attn_func", refuse_dv_512)
    t, outcomes = g.measure([small])
    assert t.total == 6 and len(outcomes) == 3  # dv 256, 512, 64; both lengths share a class
    md = g.report(t, outcomes, 0.0)
    assert "| run | 4 |" in md and "| refused | 2 |" in md
    assert "dv=512" in md and "no 512 here" in md


def test_probe_agrees_with_a_direct_call():
    """A real refusal (or, once supported, a real run): the probe of the MLA
    class q/k 64, v 512 over a query block says what calling says."""
    key = (("entry", "func"), ("dtype", g.BF16), ("d", 64), ("dv", 512), ("lens", (3, 6)), ("causal", False),
           ("local", False), ("alibi", False), ("deterministic", False), ("chunk", False), ("softcap", False),
           ("heads", "mha"))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(g.NP_DTYPES[g.BF16]) for s in ((1, 3, 2, 64), (1, 6, 2, 64),
                                                                              (1, 6, 2, 512)))
    try:
        fm.flash_attn_func(q, k, v, registry="cpu")
        expected = "run"
    except fm.Error:
        expected = "refused"
    outcome = g.probe(key)
    assert outcome.status == expected
    if expected == "refused":
        assert outcome.message.startswith("InvalidValueError: flash_attn_func:")


SEQUSED_KEY = (("entry", "varlen"), ("dtype", g.F16), ("d", 64), ("dv", 64), ("lens", (3, 6)), ("causal", True),
               ("local", False), ("alibi", False), ("deterministic", False), ("chunk", False), ("softcap", False),
               ("heads", "mha"), ("page_size", None), ("seqused", True))


def test_seqused_reaches_the_call():
    """flash-attn 3's seqused_q/seqused_k are passed, and run."""
    assert g.probe(SEQUSED_KEY) == g.Outcome("run")


def test_an_argument_flashmetal_lacks_is_a_refusal(monkeypatch):
    """A Python TypeError for an unknown keyword (here a varlen function
    without seqused_q) counts as refused, not as a failure."""
    real = fm.flash_attn_varlen_func

    def without_seqused(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                        registry=None):
        return real(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, registry=registry)
    monkeypatch.setattr(fm, "flash_attn_varlen_func", without_seqused)
    outcome = g.probe(SEQUSED_KEY)
    assert outcome.status == "refused" and "seqused_q" in outcome.message, outcome


@pytest.mark.parametrize("page_size", [1, 4, 128])
def test_page_sizes_run_through_the_probe(page_size):
    key = (("entry", "kvcache"), ("dtype", g.BF16), ("d", 128), ("dv", 128), ("lens", (1, 6)), ("causal", True),
           ("local", False), ("alibi", False), ("deterministic", False), ("chunk", False), ("softcap", False),
           ("heads", "mqa"), ("page_size", page_size), ("rotary", "none"), ("interleaved", False),
           ("leftpad", True), ("batch_idx", False), ("new_kv", True), ("new_shorter", False), ("varlen_q", False))
    assert g.probe(key) == g.Outcome("run")
