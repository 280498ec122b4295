"""flash-attn's serving API: ``flash_attn_func``,
``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``, with flash-attn's
argument names, order, defaults, shapes (token-major ``[B, L, H, D]``) and
return values, on every backend.

Semantics (flash-attn's): row i of a sequence with qL queries and kL keys sits
at ``t = kL - qL + i`` (bottom-right); ``causal`` keeps keys ``p <= t``;
``window_size=(left, right)`` keeps ``t - left <= p <= t + right`` (-1 =
unbounded); ``softcap`` c > 0 applies ``c*tanh(s/c)`` to the scaled score;
``sinks`` (as gpt-oss and MLX have them): a float32 ``[H]`` logit per head that joins
every row's softmax denominator without a value. The softmax LSE is the
natural log of that denominator, float32; a row that sees no key (and has no
sink) outputs zeros and has LSE ``-inf`` (flash-attn's CUDA kernel writes
``+inf`` there; ``-inf`` is the log of an empty sum and merges correctly).

Routes: one query row per sequence (``seqlen_q == 1``) goes to the split-KV
decode kernel (``fm_dispatch_vec_seq``, which reads q and writes the output
in their own dtypes, computing in float32), everything else to the serving prefill kernel
(``fm_dispatch_attn``). Appended k/v ride in the attention's own call
(``FMSeqTensors.k_new``/``v_new``): the library appends them, then attends
with the grown lengths, validating both before either runs.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike

from . import _kvcache_ragged as _ragged, _native
from ._arrays import BF16, F16, F32, I32, as_index, as_input, check_out, out_shape, tensor
from ._errors import InvalidTypeError, InvalidValueError
from ._hints import layout_hint
from ._interop import refuse_grad_write, to_numpy, wrapper_like
from ._rotary import per_row_positions, rotary_tables, rotate
from ._route import short_query_runs
from ._serving_args import (alibi_arg, attn_options, flag, seq_tensors, sinks_arg, training_arguments, window)
from .kv_codec import QuantizedKV
from .kv_codec_kvcache import attend_codes, kvcache_over_codes, ragged_over_codes, varlen_over_codes
from .registry import Registry, RegistryLike, resolve

_FUNC = "flash_attn_func"
_VARLEN = "flash_attn_varlen_func"
_KVCACHE = "flash_attn_with_kvcache"


@layout_hint(_FUNC, q="q", k="k", v="v", expected="blhd")
def flash_attn_func(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: ArrayLike | None = None,
    attention_chunk: int = 0,
    registry: RegistryLike = None,
) -> Any:
    """Attention over a batch of equal-length sequences.

    Args:
        q: ``[B, seqlen_q, H, D]`` bfloat16, float16 or float32, any D up
            to 512 (``supported_head_dims`` lists the tiled ones).
        k, v: ``[B, seqlen_k, Hkv, D]``, q's dtype; H a multiple of Hkv (GQA:
            query head h reads kv head ``h // (H // Hkv)``). Or a QuantizedKV
            of leading shape ``[B, seqlen_k, Hkv]`` for either or both (the
            other side a dense cache of float32/float16/bfloat16): attention
            reads the codes (q of any float dtype; no ALiBi). v may have a
            head dim Dv of its own (flash-attn's head_dim_v; out then has
            Dv): unequal dims both in 1...512, or q/k 576 over v 512 (MLA's
            latent cache) in bfloat16/float16, and for one query row any
            pair the decode runs (576 over 512 in float32 too).
        dropout_p: must be 0.0 (inference only).
        softmax_scale: score scale; default ``1/sqrt(D)``.
        causal: bottom-right causal mask.
        window_size: ``(left, right)`` sliding window, -1 = unbounded.
        softcap: ``c*tanh(s/c)`` on the scaled scores when > 0.
        alibi_slopes: float32 ``[H]`` or ``[B, H]`` ALiBi slopes, or None: key
            j of query row i scores ``-slope * |i + seqlen_k - seqlen_q - j|``
            more (after the softcap), flash-attn's bias; computed in the
            kernel.
        deterministic: accepted; the forward pass is always deterministic.
        return_attn_probs: also return the softmax LSE and flash-attn's
            ``S_dmask``, which (as flash-attn's with dropout_p == 0) is empty.
        sinks: float32 ``[H]`` sink logits, or None.
        attention_chunk: chunked local attention (flash-attn 3's argument,
            Llama 4's): with c > 0 the row at position t sees only keys p in
            its own chunk, ``p // c == t // c``, on top of causal and the
            window; 0 = off.
        registry: a Registry or a backend name; default ``Registry("auto")``.

    Returns:
        out ``[B, seqlen_q, H, Dv]`` like q, or ``(out, softmax_lse [B, H,
        seqlen_q] float32, S_dmask)`` with return_attn_probs; the caller's
        array type (torch in, torch out).
    """
    op = _native.public_op(_FUNC)  # a packed function running this one names itself
    reg = resolve(registry, op)
    want_lse = training_arguments(op, dropout_p, deterministic, return_attn_probs)
    if isinstance(k, QuantizedKV) or isinstance(v, QuantizedKV):
        qa = as_input(q, op, "q")
        opts = attn_options(op, head_dim=_head_dim(qa), softmax_scale=softmax_scale, softcap=softcap,
                            causal=causal, window_size=window_size, attention_chunk=attention_chunk)
        qout, qlse = attend_codes(reg, op, qa, k, v, None, opts, sinks_arg(op, sinks), want_lse,
                                  alibi=alibi_arg(op, alibi_slopes, *_batch_heads(qa)))
        return _with_probs(q, qout, qlse)
    qa, ka, va = as_input(q, op, "q"), as_input(k, op, "k"), as_input(v, op, "v")
    opts = attn_options(op, head_dim=_head_dim(qa), softmax_scale=softmax_scale, softcap=softcap,
                        causal=causal, window_size=window_size, attention_chunk=attention_chunk)
    slopes = alibi_arg(op, alibi_slopes, *_batch_heads(qa))
    out, lse = _attend(reg, op, qa, ka, va, opts, sinks=sinks_arg(op, sinks), want_lse=want_lse, alibi=slopes,
                       short=_short_query(qa, ka, va))()
    return _with_probs(q, out, lse if want_lse else None)


def flash_attn_varlen_func(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: ArrayLike | None = None,
    *,
    seqused_q: ArrayLike | None = None,
    seqused_k: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    attention_chunk: int = 0,
    registry: RegistryLike = None,
) -> Any:
    """Attention over packed sequences of different lengths (no padding).

    Args:
        q: ``[total_q, H, D]`` bfloat16, float16 or float32 (D up to 512): the B sequences' queries
            back to back; sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
        k, v: ``[total_k, Hkv, D]`` likewise with cu_seqlens_k, or, with
            block_table, paged caches ``[num_pages, page_size, Hkv, D]`` where
            sequence b has ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` keys. Or
            QuantizedKV: packed ``[total_k, Hkv]``, or with block_table page
            pools ``[num_pages, page_size, Hkv]`` (one side may stay dense),
            read as codes.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B+1]`` cumulative lengths
            (integer arrays are converted once), starting at 0, non-decreasing.
        max_seqlen_q, max_seqlen_k: at least every sequence's length.
        block_table: int32 ``[B, max_pages]`` page indices, or None.
        seqused_q, seqused_k: int32 ``[B]`` or None (flash-attn 3's): only
            the first ``seqused_q[b]`` query rows and ``seqused_k[b]`` keys
            of sequence b (each at most its cu_seqlens length) take part;
            causal, windows and chunks align those used lengths
            bottom-right. Its other query rows read 0 (LSE -inf; with sinks
            the sink logit). QuantizedKV page pools too.
        The other arguments as ``flash_attn_func``; causal and windows are
        bottom-right per sequence.

    Returns:
        out ``[total_q, H, D]``, or ``(out, softmax_lse [H, total_q] float32,
        S_dmask)`` with return_attn_probs (S_dmask empty, as flash-attn's
        without dropout).
    """
    op = _native.public_op(_VARLEN)  # a packed function running this one names itself
    reg = resolve(registry, op)
    want_lse = training_arguments(op, dropout_p, deterministic, return_attn_probs)
    quantized = isinstance(k, QuantizedKV) or isinstance(v, QuantizedKV)
    qa = as_input(q, op, "q")
    cq, ck = as_index(cu_seqlens_q, op, "cu_seqlens_q"), as_index(cu_seqlens_k, op, "cu_seqlens_k")
    bt = None if block_table is None else as_index(block_table, op, "block_table")
    opts = attn_options(op, head_dim=_head_dim(qa), softmax_scale=softmax_scale, softcap=softcap,
                        causal=causal, window_size=window_size, attention_chunk=attention_chunk,
                        max_seqlen_q=_native.index_arg(op, "max_seqlen_q", max_seqlen_q, 0),
                        max_seqlen_k=_native.index_arg(op, "max_seqlen_k", max_seqlen_k, 0))
    slopes = alibi_arg(op, alibi_slopes, max(cq.shape[0] - 1, 0) if cq.ndim == 1 else 0,
                       qa.shape[-2] if qa.ndim >= 2 else 0)
    used_q = None if seqused_q is None else as_index(seqused_q, op, "seqused_q")
    used_k = None if seqused_k is None else as_index(seqused_k, op, "seqused_k")
    if quantized:
        qout, qlse = varlen_over_codes(reg, qa, k, v, cq, ck, bt, opts, sinks_arg(op, sinks), want_lse,
                                       alibi=slopes, seqused_q=used_q, seqused_k=used_k)
        return _with_probs(q, qout, qlse)
    ka, va = as_input(k, op, "k"), as_input(v, op, "v")
    lse = np.empty((qa.shape[1], qa.shape[0]), dtype=F32) if want_lse and qa.ndim == 3 else None
    out = np.empty(out_shape(qa, va), dtype=qa.dtype)
    ffi = _native.ffi()
    seq, keep = seq_tensors(ffi, cu_seqlens_q=cq, cu_seqlens_k=ck, seqlens_k=used_k, seqused_q=used_q,
                            block_table=bt, sinks=sinks_arg(op, sinks), lse=lse, alibi_slopes=slopes)
    _native.call(reg, "fm_dispatch_attn", tensor(ffi, qa), tensor(ffi, ka), tensor(ffi, va), seq,
                 tensor(ffi, out), opts, op=op, keep=(qa, ka, va, cq, ck, used_k, used_q, bt, lse, slopes, out, keep))
    return _with_probs(q, out, lse if want_lse else None)


@layout_hint(_KVCACHE, q="q", k="k_cache", v="v_cache", expected="blhd")
def flash_attn_with_kvcache(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    k: ArrayLike | None = None,
    v: ArrayLike | None = None,
    rotary_cos: ArrayLike | None = None,
    rotary_sin: ArrayLike | None = None,
    cache_seqlens: ArrayLike | int | None = None,
    cache_batch_idx: ArrayLike | None = None,
    cache_leftpad: ArrayLike | None = None,
    block_table: ArrayLike | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: ArrayLike | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    sinks: ArrayLike | None = None,
    attention_chunk: int = 0,
    cu_seqlens_q: ArrayLike | None = None,
    cu_seqlens_k_new: ArrayLike | None = None,
    max_seqlen_q: int | None = None,
    out: Any = None,
    registry: RegistryLike = None,
) -> Any:
    """Attention of new queries over a KV cache, optionally appending new keys
    and values to it first (incremental decoding and chunked prefill).

    Args:
        q: ``[B, seqlen_q, H, D]``. seqlen_q == 1 runs the decode kernel (q
            float32 or of the caches' dtype, read and written as they are),
            and so do 2...8 rows of q's dtype equal to the caches' (each
            row with its own causal/window keys); longer
            blocks the prefill kernel (bfloat16, float16, float32 up to D
            256).
        k_cache, v_cache: ``[B, cap, Hkv, D]``, or ``[num_pages, page_size,
            Hkv, D]`` with block_table; v_cache (and v) may have a head dim
            Dv of its own, as in flash_attn_func (out then has Dv). Or both QuantizedKV (KVCodec.empty of
            leading shape ``[B, cap, Hkv]`` or ``[num_pages, page_size, Hkv]``;
            K and V widths and seeds may differ): k/v are then encoded into
            the codes and the attention reads the codes (q converted to
            float32, the output back to q's dtype). Updated in place when k/v are given:
            they must then be C-contiguous and writeable (numpy arrays or
            torch CPU tensors).
        k, v: ``[B, seqlen_new, Hkv, D]`` in the caches' dtype, written at rows
            ``cache_seqlens[b] ...`` of each sequence before attending.
        cache_seqlens: an int or int32 ``[B]`` (integer arrays converted once):
            each sequence's valid keys before the append. None: every slot
            of the cache (all ``max_pages * page_size`` when paged); needed
            with k/v. Not modified.
        block_table: int32 ``[B, max_pages]`` page indices, or None.
        cache_batch_idx: int32 ``[B]`` or None: sequence b uses cache row
            ``cache_batch_idx[b]`` of caches ``[batch_cache, cap, Hkv, D]``
            (read, and appended to, in place); each index in
            ``[0, batch_cache)``, distinct when appending. With
            block_table (flash-attn 3's page_table) of ``[batch_cache,
            max_pages]``: sequence b reads and appends through its row
            ``cache_batch_idx[b]``. QuantizedKV caches too.
        cache_leftpad: int32 ``[B]`` or None: sequence b's keys start at
            cache row ``cache_leftpad[b]`` (left padding): it sees rows
            ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)``, its
            positions (causal, window, attention_chunk) counted from there;
            k/v are appended at ``cache_seqlens[b]``. Paged caches and
            QuantizedKV caches too.
        num_splits: accepted (>= 0) and ignored: decode splits every row's
            keys over 32 workgroups and reduces them.
        rotary_cos, rotary_sin: ``[seqlen_ro, rotary_dim / 2]`` (float32,
            float16 or bfloat16, one dtype), or None: rotary embedding of
            the appended k and of q (flash-attn's apply_rotary_emb on the
            first rotary_dim <= D dims, the rest unchanged), in float32,
            rounded once to the input's dtype; needs k/v. k's row i of
            sequence b sits at position ``cache_seqlens[b] + i`` (its cache
            row, whatever cache_leftpad says), q's rows likewise when causal,
            a window or attention_chunk is set, else all at
            ``cache_seqlens[b]``; each position must be < seqlen_ro. The
            caller's q and k are not modified (rotated copies are attended
            and appended, or encoded into QuantizedKV caches).
        rotary_interleaved: rotate dims (2j, 2j+1) (GPT-J) if True, else
            (j, j + rotary_dim/2) (GPT-NeoX).
        alibi_slopes: float32 ``[H]`` or ``[B, H]`` ALiBi slopes, or None (as
            in flash_attn_func, per sequence; QuantizedKV caches too).
        sinks: float32 ``[H]`` sink logits, or None.
        cu_seqlens_q, max_seqlen_q: ragged queries (flash-attn 3's): q is
            ``[total_q, H, D]``, sequence b its rows ``cu_seqlens_q[b] :
            cu_seqlens_q[b+1]`` (int32 ``[B+1]``, from 0, non-decreasing,
            ending at most at total_q; later rows of out read 0);
            max_seqlen_q (required with it) at least every count. The
            output is ``[total_q, H, D]``, the LSE ``[H, total_q]``.
        cu_seqlens_k_new: int32 ``[B+1]``, ragged new keys: k/v are
            ``[total_k_new, Hkv, D]`` (ending exactly at total_k_new) and
            sequence b appends its rows ``cu_seqlens_k_new[b] : ...[b+1]``
            at its cache rows ``cache_seqlens[b] ...``. Without it (and with
            cu_seqlens_q) k/v stay ``[B, seqlen_new, Hkv, D]``. With any of
            these three every sequence's queries attend to its cache prefix
            plus its own new keys, bottom-right aligned per sequence, by the
            prefill kernel (q bfloat16 or float16); every feature above
            applies per sequence (QuantizedKV caches too).
        out: optional C-contiguous output shaped like q, of q's dtype
            (a numpy array or a torch CPU tensor), filled in place and returned.
        The other arguments as ``flash_attn_func``.

    Returns:
        out ``[B, seqlen_q, H, D]`` (``[total_q, H, D]`` with cu_seqlens_q),
        or ``(out, softmax_lse [B, H, seqlen_q] float32)`` (``[H, total_q]``
        with cu_seqlens_q) with return_softmax_lse.
    """
    reg = resolve(registry, _KVCACHE)
    interleaved = flag(_KVCACHE, "rotary_interleaved", rotary_interleaved)
    _native.index_arg(_KVCACHE, "num_splits", num_splits, 0)
    want_lse = flag(_KVCACHE, "return_softmax_lse", return_softmax_lse)
    if (k is None) != (v is None):
        raise InvalidValueError(_KVCACHE, "k and v must be given together (or both None)")
    appending = k is not None
    tables = rotary_tables(_KVCACHE, rotary_cos, rotary_sin, appending=appending)
    qa = as_input(q, _KVCACHE, "q")
    ragged_args = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k_new": cu_seqlens_k_new, "max_seqlen_q": max_seqlen_q}
    ragged = any(a is not None for a in ragged_args.values())
    slopes = None if ragged else alibi_arg(_KVCACHE, alibi_slopes, *_batch_heads(qa))
    if isinstance(k_cache, QuantizedKV) or isinstance(v_cache, QuantizedKV):
        ka = None if k is None else as_input(k, _KVCACHE, "k")
        va = None if v is None else as_input(v, _KVCACHE, "v")
        bt = None if block_table is None else as_index(block_table, _KVCACHE, "block_table")
        codes = k_cache.codes if isinstance(k_cache, QuantizedKV) else v_cache.codes
        rag = None
        if ragged:
            rag = _ragged.layout(qa, ka, va, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q)
            slopes = alibi_arg(_KVCACHE, alibi_slopes, rag.batch, rag.q.shape[1])
        batch = rag.batch if rag is not None else qa.shape[0] if qa.ndim else 0
        idx = _batch_idx(cache_batch_idx)
        lens = _cache_seqlens(cache_seqlens, batch, codes, _pages(bt, idx), required=appending)
        first_keys = None if cache_leftpad is None else _cache_leftpad(cache_leftpad, batch, codes, bt, lens)
        if rag is not None:
            opts = attn_options(_KVCACHE, head_dim=_head_dim(qa), softmax_scale=softmax_scale, softcap=softcap,
                                causal=causal, window_size=window_size, attention_chunk=attention_chunk,
                                max_seqlen_q=rag.max_seqlen_q)
            per_row = per_row_positions(flag(_KVCACHE, "causal", causal), window(_KVCACHE, window_size),
                                        int(attention_chunk))
            kernel_lens = lens if first_keys is None else first_keys
            codes_call = ragged_over_codes(reg, rag, qa.dtype, k_cache, v_cache, kernel_lens, bt, idx, opts,
                                           sinks=sinks_arg(_KVCACHE, sinks), alibi=slopes, want_lse=want_lse,
                                           out=out, in_place=_in_place)
            result, lse = _ragged_kvcache(reg, rag, lens, tables, interleaved, per_row,
                                          ragged_k=cu_seqlens_k_new is not None, call=codes_call)
            return _returned(q, out, result, lse if want_lse else None)
        opts = attn_options(_KVCACHE, head_dim=_head_dim(qa), softmax_scale=softmax_scale, softcap=softcap,
                            causal=causal, window_size=window_size, attention_chunk=attention_chunk)
        if tables is not None:  # rotated copies of q and k are attended and encoded, as over dense caches
            assert lens is not None and ka is not None  # rotary needs k/v, and k/v need cache_seqlens
            per_row = per_row_positions(flag(_KVCACHE, "causal", causal), window(_KVCACHE, window_size),
                                        int(attention_chunk))
            qa = rotate(reg, _KVCACHE, qa, tables, lens, interleaved=interleaved, per_row=per_row, name="q")
            ka = rotate(reg, _KVCACHE, ka, tables, lens, interleaved=interleaved, per_row=True, name="k")
        return kvcache_over_codes(reg, q, qa, k_cache, v_cache, ka, va, lens, bt, opts, sinks_arg(_KVCACHE, sinks),
                                  want_lse, out, _in_place, first_keys, alibi=slopes, cache_batch_idx=idx)
    if appending:
        # The library refuses caches that overlap each other, k, v or a table;
        # a strided k/v is copied here first, so the append reads the copy.
        kc, vc = _in_place(k_cache, "k_cache"), _in_place(v_cache, "v_cache")
        ka, va = as_input(k, _KVCACHE, "k"), as_input(v, _KVCACHE, "v")
    else:
        kc, vc = as_input(k_cache, _KVCACHE, "k_cache"), as_input(v_cache, _KVCACHE, "v_cache")
    bt = None if block_table is None else as_index(block_table, _KVCACHE, "block_table")
    rag = None
    if ragged:
        rag = _ragged.layout(qa, ka if appending else None, va if appending else None, cu_seqlens_q,
                             cu_seqlens_k_new, max_seqlen_q)
        slopes = alibi_arg(_KVCACHE, alibi_slopes, rag.batch, rag.q.shape[1])
    batch = rag.batch if rag is not None else qa.shape[0] if qa.ndim else 0
    idx = _batch_idx(cache_batch_idx)
    lens = given_lens = _cache_seqlens(cache_seqlens, batch, kc, _pages(bt, idx), required=appending)
    if cache_leftpad is not None:
        given_lens, lens = lens, _cache_leftpad(cache_leftpad, batch, kc, bt, lens)
    opts = attn_options(_KVCACHE, head_dim=_head_dim(qa), softmax_scale=softmax_scale, softcap=softcap,
                        causal=causal, window_size=window_size, attention_chunk=attention_chunk,
                        max_seqlen_q=0 if rag is None else rag.max_seqlen_q)
    sk = sinks_arg(_KVCACHE, sinks)
    out_arr = None if out is None else check_out(out, _KVCACHE, out_shape(qa, vc), qa.dtype,
                                                 [qa, kc, vc, bt, idx, sk, lens, given_lens])
    if rag is not None:
        per_row = per_row_positions(flag(_KVCACHE, "causal", causal), window(_KVCACHE, window_size),
                                    int(attention_chunk))
        out_flat = None if out_arr is None else out_arr.reshape(out_shape(rag.q, vc))

        def dense_call(q_rows: np.ndarray, new: _ragged.NewRows | None) -> tuple[np.ndarray, np.ndarray | None]:
            return _ragged.attend(reg, rag, q_rows, kc, vc, lens, bt, opts, sinks=sk, alibi=slopes, want_lse=want_lse,
                                  out=out_flat, new=new, cache_batch_idx=idx)
        result, lse = _ragged_kvcache(reg, rag, given_lens, tables, interleaved, per_row,
                                      ragged_k=cu_seqlens_k_new is not None, call=dense_call)
        return _returned(q, out, result, lse if want_lse else None)
    short = _short_query(qa, kc, vc)
    if tables is None:  # k/v (when given) ride in the attention's own call
        finish = _attend(reg, _KVCACHE, qa, kc, vc, opts, sinks=sk, want_lse=want_lse, seqlens_k=lens,
                         block_table=bt, cache_batch_idx=idx, out=out_arr, alibi=slopes, short=short,
                         appended=(ka, va) if appending else None)
    else:
        assert lens is not None and given_lens is not None  # required when appending
        per_row = per_row_positions(flag(_KVCACHE, "causal", causal), window(_KVCACHE, window_size),
                                    int(attention_chunk))
        decode = qa.ndim == 4 and qa.shape[1] == 1
        if decode:
            _decode_dtypes(_KVCACHE, qa, kc)
        # The decode kernel computes in float32: q is rotated in float32 for
        # it, so the rotated query is never rounded to q's dtype.
        q_in = np.ascontiguousarray(qa, dtype=F32) if decode or short else qa
        with reg.batch():  # the rotations run before the call that reads them
            q_rot = rotate(reg, _KVCACHE, q_in, tables, given_lens, interleaved=interleaved, per_row=per_row,
                           name="q")
            k_rot = rotate(reg, _KVCACHE, ka, tables, given_lens, interleaved=interleaved, per_row=True, name="k")
            finish = _attend(reg, _KVCACHE, q_rot, kc, vc, opts, sinks=sk, want_lse=want_lse, seqlens_k=lens,
                             block_table=bt, cache_batch_idx=idx, out=out_arr, out_dtype=qa.dtype, alibi=slopes,
                             short=short, appended=(k_rot, va))
    result, lse = finish()
    return _returned(q, out, result, lse if want_lse else None)


def _returned(q: Any, out: Any, result: np.ndarray, lse: np.ndarray | None) -> Any:
    """flash_attn_with_kvcache's return in the caller's array type: the
    caller's own `out` when given, and the LSE when asked for."""
    wrap = wrapper_like(q)
    res = wrap(result) if out is None else out
    return res if lse is None else (res, wrap(lse))


def _ragged_kvcache(reg: Registry, rag: _ragged.Ragged, given_lens: np.ndarray | None,
                    tables: tuple[np.ndarray, np.ndarray] | None, interleaved: bool, per_row: bool, *, ragged_k: bool,
                    call: Callable[[np.ndarray, _ragged.NewRows | None], tuple[np.ndarray, np.ndarray | None]]
                    ) -> tuple[np.ndarray, np.ndarray | None]:
    """flash_attn_with_kvcache with cu_seqlens_q / cu_seqlens_k_new (the
    ragged arguments checked in _kvcache_ragged): `call(q, new)` is the one
    library call that appends the new keys per sequence (ragged_k: split by
    cu_seqlens_k_new, else the same count for every sequence) and runs the
    varlen prefill over the cache (dense or quantized), validating both
    before either runs; here the rows are rotated first (rotary) and the
    result takes the caller's shapes."""
    def attend(q: np.ndarray, new: _ragged.NewRows | None) -> tuple[np.ndarray, np.ndarray | None]:
        res, lse = call(q, new)
        return _ragged.unpack(rag, res, lse)

    if rag.k is None or rag.v is None:
        return attend(rag.q, None)
    assert given_lens is not None and rag.cu_k is not None  # required when appending

    def new_rows(k: np.ndarray) -> _ragged.NewRows:
        assert rag.v is not None and rag.cu_k is not None
        if ragged_k:
            return k, rag.v, rag.cu_k
        return k.reshape(rag.batch, -1, *k.shape[1:]), rag.v.reshape(rag.batch, -1, *rag.v.shape[1:]), None

    if tables is None:
        return attend(rag.q, new_rows(rag.k))
    if tables[0].ndim == 2:
        _ragged.check_rotary(rag, given_lens, tables[0].shape[0], per_row)
    with reg.batch():  # the rotations run before the call that reads them
        q = _ragged.rotate_rows(reg, rag.q, tables, _ragged.positions(
            rag, given_lens, rows=rag.q_lens, cu=rag.cu_q, per_row=per_row), interleaved, "q")
        k = _ragged.rotate_rows(reg, rag.k, tables, _ragged.positions(
            rag, given_lens, rows=rag.new_lens, cu=rag.cu_k, per_row=True), interleaved, "k")
        return attend(q, new_rows(k))


def _batch_heads(qa: np.ndarray) -> tuple[int, int]:
    """(B, H) of q [B, qL, H, D] (zeros for a misshapen q: the library names it)."""
    return (qa.shape[0], qa.shape[2]) if qa.ndim == 4 else (0, 0)


def _with_probs(q: Any, out: np.ndarray, lse: np.ndarray | None) -> Any:
    """flash-attn's return: out, or (out, softmax_lse, S_dmask) when the LSE
    was asked for; S_dmask is empty, as flash-attn's is without dropout. In
    the caller's array type."""
    wrap = wrapper_like(q)
    if lse is None:
        return wrap(out)
    return wrap(out), wrap(lse), wrap(np.empty((0,), dtype=out.dtype))


def _head_dim(qa: np.ndarray) -> int:
    return int(qa.shape[-1]) if qa.ndim else 0


def _in_place(cache: Any, name: str) -> np.ndarray:
    """A cache the append writes: the caller's own memory, never a copy."""
    refuse_grad_write(cache, _KVCACHE, name)
    a = to_numpy(cache, _KVCACHE, name)
    if not a.flags.c_contiguous:
        raise InvalidValueError(_KVCACHE, f"{name} must be C-contiguous to append k/v into it in place")
    if not a.flags.writeable:
        raise InvalidValueError(_KVCACHE, f"{name} is read-only; appending k/v writes into it")
    return as_input(a, _KVCACHE, name)


def _cache_seqlens(cache_seqlens: Any, batch: int, cache: np.ndarray, pages: int | None,
                   *, required: bool) -> np.ndarray | None:
    """cache_seqlens as int32 [B] (an int is broadcast). None reads every slot:
    no table for a contiguous cache; through pages (`pages` of them per
    sequence: a block table's dim 1, or 1 when cache_batch_idx reads each
    cache row as one page) all pages * page_size keys of each sequence (the
    kernel needs lengths to bound its table reads)."""
    if cache_seqlens is None:
        if required:
            raise InvalidValueError(_KVCACHE, "cache_seqlens is required when appending k/v")
        if pages is None or cache.ndim < 2:
            return None
        return np.full(batch, min(pages * cache.shape[1], 2**31 - 1), dtype=I32)
    lens = as_index(cache_seqlens, _KVCACHE, "cache_seqlens")
    return np.full(batch, int(lens), dtype=I32) if lens.ndim == 0 else lens


def _batch_idx(cache_batch_idx: Any) -> np.ndarray | None:
    """cache_batch_idx as int32 (the library checks it and makes the block
    table the kernels read from it)."""
    return None if cache_batch_idx is None else as_index(cache_batch_idx, _KVCACHE, "cache_batch_idx")


def _pages(block_table: np.ndarray | None, cache_batch_idx: np.ndarray | None) -> int | None:
    """Pages per sequence: the block table's dim 1; 1 when cache_batch_idx
    reads a row of the cache as one page; None for a contiguous cache."""
    if block_table is not None:
        return block_table.shape[1] if block_table.ndim == 2 else None
    return None if cache_batch_idx is None else 1


def _table(x: Any, batch: int, name: str) -> np.ndarray:
    """A per-sequence int32 [B] table as a private copy, so the values checked
    are the values the kernels read."""
    a = np.array(as_index(x, _KVCACHE, name), dtype=I32, copy=True)
    if a.shape != (batch,):
        raise InvalidValueError(_KVCACHE, f"{name} must have shape [{batch}] (q's batch), got {list(a.shape)}",
                                argument=name)
    return a


def _cache_leftpad(cache_leftpad: Any, batch: int, cache: np.ndarray, block_table: np.ndarray | None,
                   lens: np.ndarray | None) -> np.ndarray:
    """The [2, B] seqlens table the kernels read with flash-attn's
    cache_leftpad: row 0 each sequence's end (cache_seqlens; every slot when
    None), row 1 its first key. Sequence b is the cache rows [leftpad[b],
    end[b]), its positions counted from leftpad[b]; k/v are still appended at
    cache_seqlens[b]. The library checks every entry against the capacity."""
    lp = _table(cache_leftpad, batch, "cache_leftpad")
    if cache.ndim != 4:
        raise InvalidValueError(_KVCACHE, f"k_cache must have rank 4 ([B, cap, Hkv, D] or [num_pages, page_size, "
                                f"Hkv, D]), got shape {list(cache.shape)}", argument="k_cache")
    capacity = cache.shape[1] * (1 if block_table is None or block_table.ndim != 2 else block_table.shape[1])
    capacity = min(capacity, 2**31 - 1)
    ends = np.full(batch, capacity, dtype=I32) if lens is None else lens
    if ends.shape != (batch,):
        raise InvalidValueError(_KVCACHE, f"cache_seqlens must have shape [{batch}] (q's batch), got "
                                f"{list(ends.shape)}", argument="cache_seqlens")
    return np.ascontiguousarray(np.stack([ends, lp]))


def _decode_dtypes(op: str, qa: np.ndarray, ka: np.ndarray) -> bool:
    """The decode route's dtype rule (q float32, or q's dtype equal to the
    cache's), worded as the prefill route says it for the same call; True
    when it holds."""
    if qa.dtype != F32 and ka.dtype != qa.dtype:
        name = "k_cache" if op == _KVCACHE else "k"
        raise InvalidTypeError(op, f"{name} dtype {ka.dtype} does not match q dtype {qa.dtype}")
    return True


def _attend(reg: Registry, op: str, qa: np.ndarray, ka: np.ndarray, va: np.ndarray, opts: Any, *,
            sinks: np.ndarray | None, want_lse: bool, seqlens_k: np.ndarray | None = None,
            block_table: np.ndarray | None = None, cache_batch_idx: np.ndarray | None = None,
            out: np.ndarray | None = None, out_dtype: np.dtype | None = None, alibi: np.ndarray | None = None,
            short: bool = False, appended: tuple[np.ndarray, np.ndarray] | None = None,
            ) -> Callable[[], tuple[np.ndarray, np.ndarray | None]]:
    """Dispatches q [B, qL, H, D] over k/v (ALiBi slopes float32 [B, H] or
    None; pages through block_table, cache rows cache_batch_idx, when
    given): the decode kernel for qL == 1 (q and the output in their own
    dtypes, float32 or the caches'), the same kernel over all qL rows with
    `short` (_short_query), else prefill. `appended`: new rows (k, v) the
    call appends into k/v (the caches) at seqlens_k before it attends over
    them. Returns a function to
    call once the work ran (after the batch scope the call is in) that gives
    (out [B, qL, H, D] in out_dtype, default q's, lse [B, H, qL] float32 or
    None)."""
    ffi = _native.ffi()
    k_new, v_new = appended or (None, None)
    if short:
        return _attend_short(reg, op, qa, ka, va, opts, sinks=sinks, want_lse=want_lse, seqlens_k=seqlens_k,
                             block_table=block_table, cache_batch_idx=cache_batch_idx, out=out,
                             out_dtype=out_dtype, alibi=alibi, appended=appended)
    target = np.dtype(out_dtype or qa.dtype)
    if qa.ndim == 4 and qa.shape[1] == 1 and _decode_dtypes(op, qa, ka):
        b, _, h, d = qa.shape
        dv = out_shape(qa, va)[-1]
        # The kernel writes float32 or the caches' dtype itself (in place
        # into `out`); any other output dtype is converted once it ran.
        direct = target == F32 or target == ka.dtype
        o = (out.reshape(b, h, dv) if out is not None and direct
             else np.empty((b, h, dv), dtype=target if direct else F32))
        lse = np.empty((b, h), dtype=F32) if want_lse else None
        seq, keep = seq_tensors(ffi, seqlens_k=seqlens_k, block_table=block_table, sinks=sinks, lse=lse,
                                alibi_slopes=alibi, k_new=k_new, v_new=v_new, cache_batch_idx=cache_batch_idx)
        qd = qa.reshape(b, h, d)
        _native.call(reg, "fm_dispatch_vec_seq", tensor(ffi, qd), tensor(ffi, ka), tensor(ffi, va), seq,
                     ffi.NULL, tensor(ffi, o), opts, op=op, keep=(qd, ka, va, seqlens_k, block_table, cache_batch_idx,
                                                                 sinks, lse, alibi, o, k_new, v_new, keep))

        def finish_decode() -> tuple[np.ndarray, np.ndarray | None]:
            result = o.reshape(b, 1, h, dv) if direct else o.reshape(b, 1, h, dv).astype(target)
            if out is not None and not direct:
                out[...] = result
            return (result if out is None else out), (None if lse is None else lse.reshape(b, h, 1))
        return finish_decode
    result = np.empty(out_shape(qa, va), dtype=qa.dtype) if out is None else out
    rows_lse: np.ndarray | None = None
    if want_lse and qa.ndim == 4:
        rows_lse = np.empty((qa.shape[0], qa.shape[2], qa.shape[1]), dtype=F32)
    seq, keep = seq_tensors(ffi, seqlens_k=seqlens_k, block_table=block_table, sinks=sinks, lse=rows_lse,
                            alibi_slopes=alibi, k_new=k_new, v_new=v_new, cache_batch_idx=cache_batch_idx)
    _native.call(reg, "fm_dispatch_attn", tensor(ffi, qa), tensor(ffi, ka), tensor(ffi, va), seq,
                 tensor(ffi, result), opts, op=op, keep=(qa, ka, va, seqlens_k, block_table, cache_batch_idx, sinks,
                                                         rows_lse, alibi, result, k_new, v_new, keep))
    return lambda: (result, rows_lse)


def _short_query(qa: np.ndarray, ka: np.ndarray, va: np.ndarray) -> bool:
    """Whether q [B, qL, H, D] with qL > 1 rows runs the split-KV decode
    kernel (each query row with its own causal/window keys, the rows of a kv
    head reading its K/V once) instead of the prefill's 32-row tile: q and
    the caches of one dtype (the kernel then reads q and writes the output
    in it), and rows and head dims the library's router sends there."""
    if qa.ndim != 4 or qa.shape[1] < 2 or ka.ndim != 4 or va.ndim != 4:
        return False
    if qa.dtype != ka.dtype or ka.dtype != va.dtype or qa.dtype not in (F32, F16, BF16):
        return False
    return short_query_runs(qa.dtype, int(qa.shape[1]), int(qa.shape[-1]), int(va.shape[-1]))


def _attend_short(reg: Registry, op: str, qa: np.ndarray, ka: np.ndarray, va: np.ndarray, opts: Any, *,
                  sinks: np.ndarray | None, want_lse: bool, seqlens_k: np.ndarray | None,
                  block_table: np.ndarray | None, cache_batch_idx: np.ndarray | None, out: np.ndarray | None,
                  out_dtype: np.dtype | None, alibi: np.ndarray | None,
                  appended: tuple[np.ndarray, np.ndarray] | None,
                  ) -> Callable[[], tuple[np.ndarray, np.ndarray | None]]:
    """_attend's short-query route (see _short_query): q [B, qL, H, D]
    (float32 when rotated, else the caches' dtype) through
    fm_dispatch_vec_seq, which writes the output [B, qL, H, Dv] in the
    caches' dtype (q's, which _short_query requires) in place, into `out`
    when given. The kernel's LSE [B, qL, H] is returned as [B, H, qL]: a
    copy once the work ran, a transposed view of it inside a caller's batch
    scope on a deferring backend (the work runs when that scope ends)."""
    ffi = _native.ffi()
    b, ql, h, _ = qa.shape
    dv = out_shape(qa, va)[-1]
    assert np.dtype(out_dtype or qa.dtype) == ka.dtype  # _short_query: q, k and v of one dtype
    o = np.empty((b, ql, h, dv), dtype=ka.dtype) if out is None else out
    lse = np.empty((b, ql, h), dtype=F32) if want_lse else None
    k_new, v_new = appended or (None, None)
    seq, keep = seq_tensors(ffi, seqlens_k=seqlens_k, block_table=block_table, sinks=sinks, lse=lse,
                            alibi_slopes=alibi, k_new=k_new, v_new=v_new, cache_batch_idx=cache_batch_idx)
    _native.call(reg, "fm_dispatch_vec_seq", tensor(ffi, qa), tensor(ffi, ka), tensor(ffi, va), seq, ffi.NULL,
                 tensor(ffi, o), opts, op=op, keep=(qa, ka, va, seqlens_k, block_table, cache_batch_idx, sinks, lse,
                                                    alibi, o, k_new, v_new, keep))

    def finish() -> tuple[np.ndarray, np.ndarray | None]:
        if lse is None:
            return o, None
        by_head = lse.transpose(0, 2, 1)
        return o, (by_head if reg._work_deferred else np.ascontiguousarray(by_head))
    return finish
