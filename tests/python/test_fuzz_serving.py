"""Fuzzing the serving API through hypothesis, as test_fuzz.py
does the other ops: random shapes, lengths, tables and options, some of them
wrong. Every call either succeeds -- matching the float64 serving reference,
with the caches holding exactly the appended rows -- or raises ValueError /
TypeError / NotImplementedError naming the public function, with every
array of the caller (caches, tables, lengths) unchanged; never a crash."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashmetal as fm
import test_fuzz as base
from flashmetal import reference
from numerics import BF16, F16, F32

OPS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")


MISTAKES = ["seqlens_high", "seqlens_neg", "table_entry", "table_short", "cu_start", "cu_order", "max_seqlen",
            "noncontig", "head_dim", "heads", "softcap", "window", "sinks_short", "dtype", "chunk",
            "out_over_seqlens", "shared_slot",  # these two: a crash, or last-writer-wins, before
            "leftpad_high", "leftpad_neg", "batch_idx_range", "batch_idx_paged", "batch_idx_twice",
            "rotary_short", "rotary_no_k", "alibi_shape", "alibi_nan", "seqused_high"]


@st.composite
def serving_calls(draw):
    """A valid call, or (about 40%) one with one mistake of MISTAKES."""
    hkv = draw(st.integers(1, 2))
    bad = draw(st.sampled_from(["none"] * 20 + MISTAKES))
    return dict(
        fn=draw(st.sampled_from(["func", "varlen", "kvcache", "kvcache"])),
        dt=F32 if bad == "dtype" else draw(st.sampled_from([BF16, F16])),
        d=draw(st.sampled_from([300, 0])) if bad == "head_dim" else draw(st.sampled_from([64, 64, 80, 96, 128, 192,
                                                                                           256])),
        b=draw(st.integers(1, 3)), hkv=hkv, h=hkv * draw(st.sampled_from([1, 2])) + (bad == "heads"),
        q_lens=draw(st.lists(st.integers(0, 20), min_size=3, max_size=3)),
        k_lens=draw(st.lists(st.integers(0, 40), min_size=3, max_size=3)),
        one_row=draw(st.booleans()),
        causal=draw(st.booleans()),
        window=(-2, 0) if bad == "window" else draw(st.sampled_from([(-1, -1), (-1, -1), (4, 0), (0, 3), (-1, 2)])),
        softcap=-1.0 if bad == "softcap" else draw(st.sampled_from([0.0, 0.0, 3.0])),
        chunk=-1 if bad == "chunk" else draw(st.sampled_from([0, 0, 0, 1, 5, 16])),
        sinks="short" if bad == "sinks_short" else draw(st.sampled_from(["none", "none", "ok"])),
        paged=draw(st.booleans()), page_size=draw(st.sampled_from([16, 32, 24, 1, 3, 4])),
        n_new=draw(st.sampled_from([0, 0, 1, 3])), bad=bad,
        leftpad=bad.startswith("leftpad") or draw(st.booleans()),
        batch_idx=bad.startswith("batch_idx") or draw(st.booleans()),
        rotary=draw(st.sampled_from(["neox", "gptj"])) if bad.startswith("rotary") else
        draw(st.sampled_from([None, None, "neox", "gptj"])),
        rotary_dim=draw(st.sampled_from([16, 32, 0])),  # 0: the whole head dim
        alibi=draw(st.sampled_from(["h", "bh"] if bad.startswith("alibi") else ["none", "none", "h", "bh"])),
        seqused=bad == "seqused_high" or draw(st.booleans()),
    )


def _with_alibi(c, rng, kw, batch):
    """kw with ALiBi slopes [H] or [B, H] when the call has them; a
    mistake makes them one head short or puts a NaN in."""
    if c["alibi"] == "none":
        return kw
    heads = c["h"] - (c["bad"] == "alibi_shape")
    shape = (heads,) if c["alibi"] == "h" else (batch, heads)
    slopes = rng.uniform(0.0, 0.7, shape).astype(np.float32)
    if c["bad"] == "alibi_nan" and slopes.size:
        slopes.reshape(-1)[-1] = np.nan
    return {**kw, "alibi_slopes": slopes}


def _bad_table(table, rng, num_pages, lens, page_size):
    """An entry a sequence reads set out of range (if any sequence reads one)."""
    readers = [b for b, n in enumerate(lens) if n > 0]
    if not readers:
        return table
    b = readers[int(rng.integers(0, len(readers)))]
    j = int(rng.integers(0, -(-lens[b] // page_size)))
    table[b, j] = int(rng.choice([num_pages, -1, 2**31 - 1, -2**31]))
    return table


def _varlen(c, rng):
    dt, d, h, hkv, b = c["dt"], c["d"], c["h"], c["hkv"], c["b"]
    ql, kl = c["q_lens"][:b], c["k_lens"][:b]
    q = base._values(rng, (sum(ql), h, d), dt)
    k, v = base._values(rng, (sum(kl), hkv, d), dt), base._values(rng, (sum(kl), hkv, d), dt)
    cq = np.concatenate([[0], np.cumsum(ql)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(kl)]).astype(np.int32)
    mq, mk = max(ql), max(kl)
    if c["bad"] == "cu_start":
        cq[0] = 1
    elif c["bad"] == "cu_order" and b > 1:
        ck[1] = ck[-1] + 1
    elif c["bad"] == "max_seqlen" and mq > 0:
        mq -= 1
    return q, k, v, cq, ck, mq, mk


def _seqused(c, rng, cq, ck):
    """flash-attn 3's seqused_q/seqused_k (the first rows and keys of each
    sequence that take part), or {}; seqused_high: one key more than the
    sequence holds."""
    if not c["seqused"]:
        return {}
    used_q = np.array([rng.integers(0, max(n, 0) + 1) for n in np.diff(cq)], np.int32)
    used_k = np.array([rng.integers(0, max(n, 0) + 1) for n in np.diff(ck)], np.int32)
    if c["bad"] == "seqused_high":
        used_k[-1] = ck[-1] - ck[-2] + 1
    return dict(seqused_q=used_q, seqused_k=used_k)


def _kvcache(c, rng):
    dt, d, h, hkv, b = c["dt"], c["d"], c["h"], c["hkv"], c["b"]
    ql = 1 if c["one_row"] else max(c["q_lens"][0], 1)
    lens = c["k_lens"][:b]
    n_new, ps = c["n_new"], c["page_size"]
    q = base._values(rng, (b, ql, h, d), dt)
    table = None
    if c["paged"]:
        per = max(-(-(max(lens) + n_new) // ps), 1)
        rows = 2 * b if c["batch_idx"] else b  # with cache_batch_idx sequence b uses table row idx[b]
        num_pages = rows * per + 1
        kc, vc = base._values(rng, (num_pages, ps, hkv, d), dt), base._values(rng, (num_pages, ps, hkv, d), dt)
        table = rng.permutation(num_pages)[:rows * per].astype(np.int32).reshape(rows, per)
        if c["bad"] == "table_entry":
            table = _bad_table(table, rng, num_pages, [n + n_new for n in lens], ps)
        elif c["bad"] == "table_short" and per > 1:
            table = np.ascontiguousarray(table[:, :per - 1])
        elif c["bad"] == "shared_slot" and n_new and b > 1:
            lens = [lens[0]] * b  # every sequence appends at the same rows of the same pages
            table[1:] = table[0]
        idx = None
        if c["batch_idx"]:
            idx = rng.permutation(rows)[:b].astype(np.int32)
            if c["bad"] in ("batch_idx_paged", "batch_idx_range"):  # past the block table's rows
                idx[-1] = int(rng.choice([rows, -1, 2**31 - 1]))
            elif c["bad"] == "batch_idx_twice" and b > 1 and n_new:
                idx[1] = idx[0]
    else:
        cap = max(lens) + n_new + 1
        rows = b
        idx = None
        if c["batch_idx"]:  # sequence b on cache row idx[b] of a larger cache
            rows = 2 * b
            idx = rng.permutation(rows)[:b].astype(np.int32)
            if c["bad"] == "batch_idx_range":
                idx[-1] = int(rng.choice([rows, -1, 2**31 - 1]))
            elif c["bad"] == "batch_idx_twice" and b > 1 and n_new:
                idx[1] = idx[0]
        kc, vc = base._values(rng, (rows, cap, hkv, d), dt), base._values(rng, (rows, cap, hkv, d), dt)
    seqlens = np.array(lens, np.int32)
    leftpad = None
    if c["leftpad"]:  # each sequence's first key, up to its length (or past it: it then sees nothing)
        leftpad = np.array([int(rng.integers(0, n + 2)) for n in lens], np.int32)
        if c["bad"] == "leftpad_high":
            leftpad[-1] = (table.shape[1] * ps if c["paged"] else kc.shape[1]) + 1
        elif c["bad"] == "leftpad_neg":
            leftpad[0] = -3
    if c["bad"] == "seqlens_high":
        seqlens[-1] = (table.shape[1] * ps if c["paged"] else kc.shape[1]) + 1
    elif c["bad"] == "seqlens_neg":
        seqlens[0] = -1
    new = None
    if n_new:
        new = (base._values(rng, (b, n_new, hkv, d), dt), base._values(rng, (b, n_new, hkv, d), dt))
    if c["bad"] == "noncontig" and n_new:
        kc = np.repeat(kc, 2, axis=-1)[..., ::2]
    return q, kc, vc, new, seqlens, table, leftpad, idx


@pytest.mark.slow
@base.FUZZ
@given(c=serving_calls(), seed=st.integers(0, 2**32 - 1))
def test_serving_api(cpu, c, seed):
    rng = np.random.default_rng(seed)
    kw = dict(causal=c["causal"], window_size=c["window"], softcap=c["softcap"], attention_chunk=c["chunk"])
    if c["sinks"] != "none":
        kw["sinks"] = rng.uniform(-1, 1, c["h"] - (c["sinks"] == "short")).astype(np.float32)
    if c["fn"] == "func":
        b, d, dt = c["b"], c["d"], c["dt"]
        ql = 1 if c["one_row"] else max(c["q_lens"][0], 1)
        q = base._values(rng, (b, ql, c["h"], d), dt)
        k = base._values(rng, (b, max(c["k_lens"][0], 1), c["hkv"], d), dt)
        v = base._values(rng, k.shape, dt)
        kw = _with_alibi(c, rng, kw, b)
        res = base._run(lambda: fm.flash_attn_func(q, k, v, return_attn_probs=True, registry=cpu, **kw),
                        [q, k, v], None, OPS)
        if res is not None:
            _check(res[0], res[1], reference.flash_attn(q, k, v, **kw), dt, "func")
        return
    if c["fn"] == "varlen":
        q, k, v, cq, ck, mq, mk = _varlen(c, rng)
        kw = _with_alibi(c, rng, kw, len(cq) - 1)
        kw.update(_seqused(c, rng, cq, ck))
        res = base._run(lambda: fm.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, return_attn_probs=True,
                                                          registry=cpu, **kw), [q, k, v, cq, ck], None, OPS)
        assert not (c["bad"] == "seqused_high" and res is not None), "a seqused_high call was accepted"
        if res is not None:
            _check(res[0], res[1], reference.flash_attn_varlen(q, k, v, cq, ck, **kw), c["dt"], "varlen")
        return
    q, kc, vc, new, seqlens, table, leftpad, idx = _kvcache(c, rng)
    if c["bad"] == "rotary_no_k":
        new = None
    rot, q_ro, new_ro = _rotary(c, rng, q, kc, new, seqlens, table, kw)
    kw = _with_alibi(c, rng, kw, q.shape[0])
    out = None
    refused = c["bad"] == "shared_slot" and new is not None and c["b"] > 1 and table is not None
    refused |= c["bad"] in ("leftpad_high", "leftpad_neg") or (c["bad"] == "batch_idx_paged" and table is not None) or (
        c["bad"] == "batch_idx_range" and idx is not None) or (
        c["bad"] == "batch_idx_twice" and idx is not None and new is not None and c["b"] > 1) or (
        c["bad"] == "rotary_no_k") or (c["bad"] == "rotary_short" and new is not None) or (
        c["bad"] in ("alibi_shape", "alibi_nan"))
    if c["bad"] == "out_over_seqlens":  # the lengths live in out's first bytes
        out = np.empty(q.shape, q.dtype)
        held = out.reshape(-1).view(np.uint8)[:4 * seqlens.size].view(np.int32)
        held[:] = seqlens
        seqlens, refused = held, True
    watched = [q, seqlens] + [t for t in (table, leftpad, idx) if t is not None] + ([] if new is None else list(new))
    watched += list(rot.values())
    before_k, before_v = np.array(kc, copy=True), np.array(vc, copy=True)
    args = () if new is None else new
    try:
        res = base._run(lambda: fm.flash_attn_with_kvcache(q, kc, vc, *args, cache_seqlens=seqlens,
                                                           block_table=table, cache_leftpad=leftpad,
                                                           cache_batch_idx=idx, return_softmax_lse=True, out=out,
                                                           registry=cpu, **rot, **kw), watched, None, OPS)
    except NotImplementedError:
        raise AssertionError("an UnsupportedFeatureError for a supported call") from None
    assert not (refused and res is not None), f"a {c['bad']} call was accepted"
    if res is None:
        assert kc.tobytes() == before_k.tobytes() and vc.tobytes() == before_v.tobytes(), \
            "a failed call modified the caches"
        return
    q, new = q_ro, new_ro
    exp = reference.flash_attn_kvcache(q, before_k, before_v, k=None if new is None else new[0],
                                       v=None if new is None else new[1], cache_seqlens=seqlens,
                                       block_table=table, cache_leftpad=leftpad, cache_batch_idx=idx, **kw)
    if new is not None:
        ek, ev = np.array(before_k), np.array(before_v)
        if table is not None:
            ek, ev = reference.kv_append(before_k, before_v, *new, seqlens, table if idx is None else table[idx])
        else:
            rows = slice(None) if idx is None else idx.astype(np.int64)
            ek[rows], ev[rows] = reference.kv_append(before_k[rows], before_v[rows], *new, seqlens, table)
        if rot:  # the rotated keys: float32 arithmetic rounded once, vs float64 rounded once
            assert np.allclose(kc.astype(np.float64), ek.astype(np.float64), rtol=2**-7, atol=1e-6, equal_nan=True), \
                "the caches differ from the rotated append"
            assert vc.tobytes() == ev.tobytes(), "the caches differ from the append"
        else:
            assert kc.tobytes() == ek.tobytes() and vc.tobytes() == ev.tobytes(), "the caches differ from the append"
    _check(res[0], res[1], exp, c["dt"], "kvcache")


def _rotary(c, rng, q, kc, new, seqlens, table, kw):
    """The rotary arguments of a kvcache call ({} without rotary) and the
    q and (k, v) the reference then attends and appends: flash-attn's
    rotation in float64, rounded once to the rows' dtype (q to float32 on
    the decode route). rotary_short: tables one position short."""
    if c["rotary"] is None or c["d"] < 2:
        return {}, q, new
    rd = min(c["rotary_dim"] or c["d"], c["d"]) // 2 * 2
    # Every cache position, and q's rows past the last key (causal q rows sit at cache_seqlens[b] + i).
    ro = (table.shape[1] * kc.shape[1] if table is not None else kc.shape[1]) + q.shape[1]
    if c["bad"] == "rotary_short" and new is not None:
        ro = int(np.max(seqlens)) + new[0].shape[1] - 1
    angle = rng.random((max(ro, 0), rd // 2)) * 2 * np.pi
    cos, sin = np.cos(angle).astype(c["dt"]), np.sin(angle).astype(c["dt"])
    inter = c["rotary"] == "gptj"
    rot = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=inter)
    if new is None or np.any(seqlens < 0):
        return rot, q, new
    per_row = kw["causal"] or kw["window_size"] != (-1, -1) or kw["attention_chunk"] > 0
    if np.any(seqlens.astype(np.int64) + (q.shape[1] if per_row else 1) > ro) or np.any(
            seqlens.astype(np.int64) + new[0].shape[1] > ro):
        return rot, q, new  # refused: a position past the tables
    if per_row:
        q_ro = reference.apply_rotary_emb(q, cos, sin, seqlens, interleaved=inter)
    else:
        b, s, h, d = q.shape
        q_ro = reference.apply_rotary_emb(q.reshape(b, 1, s * h, d), cos, sin, seqlens,
                                          interleaved=inter).reshape(q.shape)
    k_ro = reference.apply_rotary_emb(new[0], cos, sin, seqlens, interleaved=inter).astype(new[0].dtype)
    return rot, q_ro.astype(F32 if q.shape[1] == 1 else q.dtype), (k_ro, new[1])


def _check(out, lse, exp, dt, what):
    base._close(out, exp[0], dt, what)
    ok, ratio = reference.close(lse, exp[1], 2e-4, 2e-4)
    assert ok, f"{what} lse: {ratio:.3g}x over tolerance"
