import CFlashMetal

/// The tensors of one attention over quantized caches
/// (flash_attn_with_kvcache's layout).
public struct KVCodesAttnTensors {
    /// [B, qL, H, D]: float32, or float16 / bfloat16 (any dense side of that dtype).
    public var q: TensorRef
    /// Leading shape [B, cap, Hkv], or paged [num_pages, page_size, Hkv]; at
    /// most one side dense.
    public var k: KVSide, v: KVSide
    /// [B, qL, H, D] out, of q's dtype.
    public var out: TensorRef
    /// int32 [B] keys per sequence; nil: the whole capacity. With
    /// cuSeqlensK, flash-attn 3's seqused_k: each within its cu_seqlens_k count.
    public var seqlens: TensorRef? = nil
    /// int32 [B, max_pages]: the caches are paged.
    public var blockTable: TensorRef? = nil
    /// float32 [H] sink logits.
    public var sinks: TensorRef? = nil
    /// float32 [B, H, qL] out ([H, total_q] varlen).
    public var lse: TensorRef? = nil
    /// int32 [B+1]: q and out packed [total_q, H, D] (varlen); the keys of
    /// sequence b as seqlens (or the capacity) say, or cuSeqlensK's counts.
    public var cuSeqlensQ: TensorRef? = nil
    /// int32 [B+1], with cuSeqlensQ: sequence b has cu[b+1] - cu[b] keys,
    /// in the paged caches (with a block table) or at rows cu[b] ..< cu[b+1]
    /// of packed storage [1, total_k, Hkv].
    public var cuSeqlensK: TensorRef? = nil
    /// int32 [B], with cuSeqlensQ (flash-attn 3's seqused_q): only sequence
    /// b's first seqused_q[b] rows attend (bottom-right among themselves);
    /// its other rows see no key. Run through usedRowsSplit.
    public var sequsedQ: TensorRef? = nil
    /// float32 [B, H] ALiBi slopes: key t's score at row position r gains
    /// -slopes[b, h] * |r - t| after the softcap.
    public var alibi: TensorRef? = nil
    /// The caller's name of lse in errors.
    public var lseName = "lse"

    public init(q: TensorRef, k: KVSide, v: KVSide, out: TensorRef) {
        self.q = q; self.k = k; self.v = v; self.out = out
    }
}

/// Attention over flash_attn_with_kvcache's quantized caches: every query
/// row of every sequence (bottom-right causal, window, chunk, softcap, ALiBi,
/// sinks, LSE, GQA), keys read through the block table when paged; kv_codes_decode
/// (split over keys, then kv_codes_reduce) for one query row per sequence,
/// kv_codes_prefill (each key tile decoded once for many rows) for more. Every length and every table
/// entry the kernel reads is checked first.
public enum KVCodesAttnDispatcher {
    /// The op name errors carry.
    public static let op = "kv_codes_attn"

    /// A call's shapes, validated: q's batch (sequences), rows, heads and
    /// head dim, the caches' leading shape and a quantized side's codec.
    public static func shape(_ t: KVCodesAttnTensors) throws -> (batch: Int, qLen: Int, heads: Int, headDim: Int,
                                                                  lead: [Int], codec: KVCodec) {
        let q = t.q
        let varlen = t.cuSeqlensQ != nil
        try q.requireDType(KVSide.ioTypes([t.k, t.v]), op: op, name: "q")
        try q.requireRank([varlen ? 3 : 4], op: op, name: "q")
        try q.requireBytes(op: op, name: "q")
        if t.cuSeqlensK != nil && !varlen {
            throw FlashMetalError.value(op, "cu_seqlens_k (varlen keys) over quantized caches needs cu_seqlens_q", arg: "cu_seqlens_k")
        }
        if t.sequsedQ != nil && !varlen {
            throw FlashMetalError.value(op, "seqused_q needs cu_seqlens_q (packed query rows)", arg: "seqused_q")
        }
        // Varlen: q [total_q, H, D] as one "sequence" of total_q rows for the shapes below.
        let batch = SequenceTables.sequences(q: q, cuSeqlensQ: t.cuSeqlensQ)
        let (qLen, heads, d) = varlen ? (q.shape[0], q.shape[1], q.shape[2]) : (q.shape[1], q.shape[2], q.shape[3])
        let (lead, codec) = try KVCodesAppendDispatcher.requireSides(t.k, t.v, headDim: d, headDimOf: "q", op: op)
        return (batch, qLen, heads, d, lead, codec)
    }

    /// Validates a call and plans its work; `splitKeys` as Backend.splitsKeysInGrid.
    public static func makePlan(_ t: KVCodesAttnTensors, _ o: FMAttnOptions, splitKeys: Bool = true) throws -> KVCodesPlan {
        guard t.sequsedQ == nil else {
            throw FlashMetalError.internalError("seqused_q needs library tables: run the call through usedRowsSplit")
        }
        let q = t.q
        let varlen = t.cuSeqlensQ != nil
        let (batch, qLen, heads, d, lead, codec) = try shape(t)
        let (first, rows, kvHeads) = (lead[0], lead[1], lead[2])
        try Checks.positive("batch", batch, op: op, arg: "q")
        if !varlen { try Checks.positive("seqlen_q", qLen, op: op, arg: "q") }  // packed: total_q may be 0
        try Checks.heads(heads, kvHeads: kvHeads, of: "k_cache", op: op, kvHeadsArg: "q")
        // Packed varlen keys (cu_seqlens_k without pages): storage [1, total_k, Hkv], sequence b's keys
        // its rows cu_seqlens_k[b] ..< [b+1].
        let packed = t.cuSeqlensK != nil && t.blockTable == nil
        if packed && first != 1 {
            throw FlashMetalError.value(op, "packed varlen k/v over quantized caches (cu_seqlens_k without block_table) must have leading shape [1, total_k, Hkv], got \(lead)", arg: "k_cache")
        }
        let cache: CacheCapacity? = try packed ? nil : CacheCapacity(op: op, cacheShape: lead, blockTable: t.blockTable,
                                                                     batch: batch, batchName: "q")
        let (capacity, maxPages) = (cache?.rows ?? rows, cache?.maxPages ?? 0)
        try out(t, shape: q.shape)
        try Checks.scaleAndSoftcap(o.scale, o.softcap, op: op)
        try AttnOptions.requireFlashAttnLayout(o, op: op)
        guard o.causal == 0 || o.causal == 1 else {
            throw FlashMetalError.value(op, "causal must be 0 or 1, got \(o.causal)", arg: "causal")
        }
        try AttnOptions.requireWindow(left: Int(o.window_left), right: Int(o.window_right), op: op)
        if o.attention_chunk < 0 {
            throw FlashMetalError.value(op, "attention_chunk must be >= 0 (0 = off), got \(o.attention_chunk)", arg: "attention_chunk")
        }
        if let sinks = t.sinks {
            try sinks.requireDType([.f32], op: op, name: "sinks")
            try sinks.requireBytes(op: op, name: "sinks")
            if sinks.shape != [heads] {
                throw FlashMetalError.value(op, "sinks must have shape [\(heads)] (num_heads), got \(sinks.shape)", arg: "sinks")
            }
        }
        if let a = t.alibi {
            try a.requireDType([.f32], op: op, name: "alibi_slopes")
            try a.requireBytes(op: op, name: "alibi_slopes")
            if a.shape != [batch, heads] {
                throw FlashMetalError.value(op, "alibi_slopes shape \(a.shape) must be [\(batch), \(heads)]", arg: "alibi_slopes")
            }
        }
        if let lse = t.lse {
            try lse.requireDType([.f32], op: op, name: t.lseName)
            try lse.requireBytes(op: op, name: t.lseName)
            let want = varlen ? [heads, qLen] : [batch, heads, qLen]
            if lse.shape != want {
                throw FlashMetalError.value(op, "\(t.lseName) must have shape \(want) (\(varlen ? "[H, total_q]" : "[B, H, seqlen_q]")), got \(lse.shape)", arg: t.lseName)
            }
        }
        let limit = Int(Int32.max)
        if [qLen, heads, kvHeads, rows, maxPages].contains(where: { $0 > limit }) {
            throw FlashMetalError.value(op, "seqlen_q, num_heads, num_kv_heads, the cache's dim 1 and max_pages must fit int32", arg: "q")
        }
        _ = try KVCodecDispatcher.rows([batch, qLen, heads], op: op)

        // Tables last: their contents are read only once every shape is known good.
        let capacityName = t.blockTable == nil ? "the cache capacity, k_cache's dim 1"
            : SequenceTables.pagedCapacity(pages: maxPages, pageSize: rows, table: "block_table", cache: "k_cache")
        var lengths = Array(repeating: capacity, count: batch)
        var rowsPerSequence = qLen
        var unowned = UnownedRows()
        if let cq = t.cuSeqlensQ {
            let rowCounts = try SequenceTables.cuSeqlens(cq, op: op, name: "cu_seqlens_q", tokens: qLen, tokensName: "q",
                                                         maxSeqlen: Int(o.max_seqlen_q), maxSeqlenName: "max_seqlen_q")
            rowsPerSequence = rowCounts.max() ?? 0
            unowned = UnownedRows(rows: min(rowCounts.reduce(0, +), qLen)..<qLen, out: t.out, lse: t.lse)
        }
        if let ck = t.cuSeqlensK {
            lengths = try SequenceTables.cuSeqlens(ck, op: op, name: "cu_seqlens_k", batch: batch,
                                                   tokens: packed ? rows : limit,
                                                   tokensName: packed ? "the packed keys" : "the paged caches",
                                                   maxSeqlen: Int(o.max_seqlen_k), maxSeqlenName: "max_seqlen_k")
            if let s = t.seqlens {
                lengths = try SequenceTables.used(s, op: op, name: "seqused_k", lengths: lengths,
                                                  lengthsName: "cu_seqlens_k")
            }
        } else if let s = t.seqlens {
            lengths = try SequenceTables.seqlens(s, op: op, name: "cache_seqlens", batch: batch, capacity: capacity,
                                                 capacityName: capacityName)
        }
        if t.seqlens == nil && t.cuSeqlensK == nil && capacity > limit {
            throw FlashMetalError.value(op, "without cache_seqlens every sequence has \(capacityName) = \(capacity) keys, more than int32 holds", arg: "cache_seqlens")
        }
        if let bt = t.blockTable {
            try SequenceTables.blockTable(bt, op: op, name: "block_table", lengths: lengths, numPages: first,
                                          pageSize: rows, cacheName: "k_cache")
        }

        if qLen == 0 {  // no packed query row: nothing to run
            var plan = KVCodesPlan(tmpBytes: 0) { _ in [] }
            plan.unbound = [t.q, t.out]
                + [t.seqlens, t.blockTable, t.sinks, t.lse, t.alibi, t.cuSeqlensQ, t.cuSeqlensK].compactMap { $0 }
            return plan
        }
        let (hk, cap) = (Int64(kvHeads), Int64(rows))
        let (k, v) = (t.k.quantized?.codec ?? codec, t.v.quantized?.codec ?? codec)
        let params = KVCodesDecodeParams(
            k_seed: k.seed, v_seed: v.seed, kv_strides: (packed ? 0 : cap * hk, 1, hk),
            n_heads: Int32(heads), n_kv_heads: Int32(kvHeads), head_dim: Int32(d), block: Int32(k.block),
            k_bits: Int32(k.bits), v_bits: Int32(v.bits), k_row_bytes: Int32(k.rowBytes), v_row_bytes: Int32(v.rowBytes),
            kv_len: Int32(t.seqlens == nil && t.cuSeqlensK == nil ? capacity : 0), q_len: Int32(qLen), scale: o.scale, softcap: o.softcap,
            causal: o.causal, window_left: o.window_left, window_right: o.window_right,
            attention_chunk: o.attention_chunk, page_size: Int32(rows), max_pages: Int32(maxPages), batch: Int32(batch),
            nwg: 1, heads_per_group: 1, _pad: 0)
        if rowsPerSequence > 1 {
            // Many query rows per sequence take the tiled prefill: threadgroups of
            // FM_KVQ_PREFILL_ROWS (query row, head of the group) items of one kv head.
            let grid = Size3((rowsPerSequence * (heads / kvHeads) + Int(FM_KVQ_PREFILL_ROWS) - 1) / Int(FM_KVQ_PREFILL_ROWS),
                             kvHeads, batch)
            let d = KVCodesDecodeDispatcher.dispatch(params, grid: grid, prefill: true, q: q, k: t.k, v: t.v, out: t.out,
                                                     seqlens: t.seqlens, blockTable: t.blockTable, sinks: t.sinks,
                                                     lse: t.lse, cuSeqlensQ: t.cuSeqlensQ, cuSeqlensK: t.cuSeqlensK,
                                                     alibi: t.alibi)
            var plan = KVCodesPlan(tmpBytes: 0) { _ in [d] }
            plan.unowned = unowned
            return plan
        }
        var plan = KVCodesDecodeDispatcher.plan(params, tokens: (varlen ? 1 : batch) * qLen, keys: lengths.max() ?? 0,
                                                splitKeys: splitKeys, q: q, k: t.k, v: t.v, out: t.out,
                                                seqlens: t.seqlens, blockTable: t.blockTable, sinks: t.sinks,
                                                lse: t.lse, cuSeqlensQ: t.cuSeqlensQ, cuSeqlensK: t.cuSeqlensK,
                                                alibi: t.alibi)
        plan.unowned = unowned
        return plan
    }

    /// seqused_q's split of a varlen call (UsedRowsSplit), validated: every
    /// other argument as makePlan checks it, then seqused_q within each
    /// sequence's cu_seqlens_q rows; nil without seqused_q.
    public static func usedRowsSplit(_ t: KVCodesAttnTensors, _ o: FMAttnOptions) throws -> UsedRowsSplit? {
        guard let u = t.sequsedQ else { return nil }
        guard let cq = t.cuSeqlensQ else {
            throw FlashMetalError.value(op, "seqused_q needs cu_seqlens_q (packed query rows)", arg: "seqused_q")
        }
        guard t.cuSeqlensK != nil else {
            throw FlashMetalError.value(op, "seqused_q needs cu_seqlens_k (packed keys)", arg: "seqused_q")
        }
        var plain = t
        plain.sequsedQ = nil
        _ = try makePlan(plain, o)
        let qLens = try SequenceTables.cuSeqlens(cq, op: op, name: "cu_seqlens_q", tokens: t.q.shape[0], tokensName: "q",
                                                 maxSeqlen: Int(o.max_seqlen_q), maxSeqlenName: "max_seqlen_q")
        let used = try SequenceTables.used(u, op: op, name: "seqused_q", lengths: qLens, lengthsName: "cu_seqlens_q")
        return UsedRowsSplit(cuSeqlensQ: cq, used: used, lengths: qLens)
    }

    /// `t`'s per-sequence tables.
    public static func tables(_ t: KVCodesAttnTensors) -> UsedRowsSplit.Tables {
        UsedRowsSplit.Tables(cuSeqlensQ: t.cuSeqlensQ, cuSeqlensK: t.cuSeqlensK, seqlensK: t.seqlens,
                             blockTable: t.blockTable, alibi: t.alibi)
    }

    /// `t` over a split's rewritten tables, written to `memory`.
    public static func view(_ t: KVCodesAttnTensors, split: UsedRowsSplit, memory: UnsafeMutableRawPointer)
        -> KVCodesAttnTensors {
        let w = split.write(tables(t), to: memory)
        var s = t
        s.sequsedQ = nil
        (s.cuSeqlensQ, s.cuSeqlensK, s.seqlens, s.blockTable, s.alibi) =
            (w.cuSeqlensQ, w.cuSeqlensK, w.seqlensK, w.blockTable, w.alibi)
        return s
    }

    static func out(_ t: KVCodesAttnTensors, shape: [Int]) throws {
        try t.out.requireDType([t.q.dtype], op: op, name: "out")
        try t.out.requireBytes(op: op, name: "out")
        if t.out.shape != shape { throw FlashMetalError.value(op, "out shape \(t.out.shape) must be \(shape)", arg: "out") }
    }
}
