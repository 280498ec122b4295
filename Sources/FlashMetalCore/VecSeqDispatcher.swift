import CFlashMetal

/// The options of one serving decode call (FMAttnOptions, read once; the
/// varlen fields do not apply to decode and are ignored).
public struct VecSeqOptions: Sendable {
    /// Score scale, finite.
    public var scale: Float
    /// Logit softcap c > 0; 0 disables it.
    public var softcap: Float = 0
    /// Each query row sees keys up to its own position (kv_len_b - 1 for
    /// one row: every key). Off unless asked, as every op.
    public var causal: Bool = false
    /// flash-attn's window_size left: keys p >= t - left; -1 = unbounded.
    public var windowLeft: Int = -1
    /// flash-attn's window_size right: keys p <= t + right; for one query
    /// row (the newest token) no key lies right of it. -1 = unbounded.
    public var windowRight: Int = -1
    /// Chunked local attention c > 0: the query at t sees keys from floor(t / c) * c; 0 = off.
    public var attentionChunk: Int = 0
    /// torch's head-major layouts (q/out [B, H, L, D], lse [B, H, L], caches
    /// [B, Hkv, cap, D] or pages [num_pages, Hkv, page_size, D]) instead of flash-attn's.
    public var headMajor = false

    /// Options with every default but the scale.
    public init(scale: Float) { self.scale = scale }

    /// Reads the C options, rejecting out-of-range flags.
    public init(_ o: FMAttnOptions) throws {
        let op = VecSeqDispatcher.op
        guard o.causal == 0 || o.causal == 1 else {
            throw FlashMetalError.value(op, "causal must be 0 or 1, got \(o.causal)", arg: "causal")
        }
        try AttnOptions.requireWindow(left: Int(o.window_left), right: Int(o.window_right), op: op)
        self.scale = o.scale
        self.softcap = o.softcap
        self.causal = o.causal == 1
        self.windowLeft = Int(o.window_left)
        self.windowRight = Int(o.window_right)
        if o.attention_chunk < 0 {
            throw FlashMetalError.value(op, "attention_chunk must be >= 0 (0 = off), got \(o.attention_chunk)")
        }
        self.attentionChunk = Int(o.attention_chunk)
        guard o.head_major == 0 || o.head_major == 1 else {
            throw FlashMetalError.value(op, "head_major must be 0 or 1, got \(o.head_major)", arg: "head_major")
        }
        self.headMajor = o.head_major == 1
    }

    /// The decode mask: flash-attn's window_size left w is the sliding window
    /// w + 1 of FlashAttnVecParams (t - p < w + 1 for the row at position t). A left
    /// bound at or past Int32.max - 1 is held there: no key of an int32-long
    /// cache lies that far from the query, so it hides none either way.
    var mask: (type: VecMaskType, window: Int) {
        if windowLeft >= 0 { return (.window, min(windowLeft, Int(Int32.max) - 1) + 1) }
        return (causal ? .causal : .none, 0)
    }

    /// FlashAttnVecSeqParams.window_right: the right bound, 0 when causal, -1 = none.
    var rightBound: Int32 {
        if causal { return 0 }
        return Int32(windowRight)
    }
}

/// The tensors of one serving decode call.
public struct VecSeqTensors {
    /// q/out (each float32 or the caches' dtype) [B, H, D], or [B, L, H, D] for L query rows per
    /// sequence (short queries, bottom-right: row i sits at kv_len_b - L + i);
    /// k/v [B, cap, Hkv, D] or paged
    /// [num_pages, page_size, Hkv, D]; tmp float32 scratch (VecDispatcher.tmpByteCount).
    public var q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef, tmp: TensorRef
    /// int32 [B] valid keys per sequence, or [2, B]: those, then each
    /// sequence's first key (cache_leftpad); nil = every sequence holds its capacity.
    public var seqlensK: TensorRef? = nil
    /// int32 [B, max_pages]: k/v are paged.
    public var blockTable: TensorRef? = nil
    /// float32 [H] sink logits.
    public var sinks: TensorRef? = nil
    /// float32 [B, H] output ([B, L, H] for short queries): natural-log softmax denominators.
    public var lse: TensorRef? = nil
    /// float32 [B, H] ALiBi slopes.
    public var alibiSlopes: TensorRef? = nil
    /// The caller's names of k, v and lse in errors (flash_attn_with_kvcache
    /// calls them k_cache, v_cache and softmax_lse).
    public var kName = "k", vName = "v", lseName = "lse"

    /// The tensors of a call; the serving ones are optional.
    public init(q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef, tmp: TensorRef,
                seqlensK: TensorRef? = nil, blockTable: TensorRef? = nil, sinks: TensorRef? = nil,
                lse: TensorRef? = nil) {
        self.q = q; self.k = k; self.v = v; self.out = out; self.tmp = tmp
        self.seqlensK = seqlensK; self.blockTable = blockTable; self.sinks = sinks; self.lse = lse
    }
}

/// Serving decode (fm_dispatch_vec_seq): the split-KV decode of
/// VecDispatcher with each sequence's own kv length, K/V in flash-attn's
/// [B, cap, Hkv, D] layout or paged through a block table, a sliding window
/// per sequence, then the plain reduce with sinks and the LSE output.
///
/// Main dispatch: constants vecSeq = true, vecKVLens, vecPaged; buffers
/// VecBuffer plus FlashAttnVecSeqParams at VecBuffer.seqParams, seqlens_k at
/// VecBuffer.seqlensK, block_table at VecBuffer.blockTable. FlashAttnVecParams
/// holds per-sequence heads (H, Hkv) and rows = B * H run on the grid's y.
/// Reduce: constants vecSinks/vecLSE; FlashAttnVecReduceExtParams at
/// VecReduceBuffer.ext, sinks and lse at their indices.
public enum VecSeqDispatcher {
    /// The op name errors carry.
    public static let op = "flash_attn_vec_seq"

    /// Shape facts of a call, validated before any table is read.
    public struct Shapes {
        /// Sequences, query heads, kv heads, head dim (q's and k's), v's head dim.
        public let batch: Int, heads: Int, kvHeads: Int, headDim: Int, headDimV: Int
        /// Query rows per sequence (1: decode; rank-4 q's dim 1).
        public var queryRows = 1
        /// Keys one sequence can hold: cap, or max_pages * page_size.
        public let capacity: Int
        /// Pages and keys per page (paged only; else 0).
        public let numPages: Int, pageSize: Int, maxPages: Int
        /// B * L * H.
        public var rows: Int { batch * queryRows * heads }
    }

    /// The most query rows per sequence a short-query call takes (rank-4 q): FM_SHORT_QUERY_ROWS of flashmetal.h.
    public static let maxQueryRows = Int(FM_SHORT_QUERY_ROWS)

    /// Validates shapes (q [B, H, D] or [B, L, H, D] with 1 <= L <= maxQueryRows; k [B, cap, Hkv, D] or paged
    /// [num_pages, page_size, Hkv, D] with an int32 [B, max_pages] block table; head-major: q [B, H, L, D],
    /// k [B, Hkv, cap, D] or [num_pages, Hkv, page_size, D]).
    public static func shapes(q: TensorRef, k: TensorRef, v: TensorRef? = nil, blockTable: TensorRef?,
                              kName: String = "k", vName: String = "v", headMajor: Bool = false) throws -> Shapes {
        try q.requireRank([3, 4], op: op, name: "q")
        try k.requireRank([4], op: op, name: kName)
        // The axes of the query rows and heads of q, and of the keys and kv heads of k.
        let (qRowAxis, headAxis) = headMajor ? (2, 1) : (1, q.rank - 2)
        let (keyAxis, kvHeadAxis) = headMajor ? (2, 1) : (1, 2)
        let (batch, heads, d) = (q.shape[0], q.shape[headAxis], q.shape[q.rank - 1])
        let queryRows = q.rank == 4 ? q.shape[qRowAxis] : 1
        if queryRows < 1 || queryRows > maxQueryRows {
            throw FlashMetalError.value(op, "q's query rows (dim \(qRowAxis)) must be in 1...\(maxQueryRows), got \(queryRows)", arg: "q")
        }
        let (kvHeads, kd) = (k.shape[kvHeadAxis], k.shape[3])
        try Checks.sameDim("head_dim", kd, of: kName, as: d, of: "q", op: op)
        try VecCapability.requireHeadDim(d, op: op)
        var dv = d
        if let v = v {
            if v.rank != k.rank || Array(v.shape.dropLast()) != Array(k.shape.dropLast()) {
                throw FlashMetalError.value(
                    op, "\(vName) shape \(v.shape) must equal \(kName) shape \(k.shape) but for the head dim", arg: vName)
            }
            dv = v.shape[3]
            try VecCapability.tileDim(d, dv: dv, op: op, vName: vName)
        }
        try VecDispatcher.requireHeads(batch: batch, heads: heads, kvHeads: kvHeads, op: op, kName: kName)
        var (capacity, numPages, pageSize, maxPages) = (k.shape[keyAxis], 0, 0, 0)
        if let bt = blockTable {
            try bt.requireRank([2], op: op, name: "block_table")
            (numPages, pageSize, maxPages) = (k.shape[0], k.shape[keyAxis], bt.shape[1])
            try SequenceTables.requirePageSize(pageSize, op: op, cacheName: kName)
            if numPages == 0 { throw FlashMetalError.value(op, "a paged \(kName) must hold at least one page", arg: kName) }
            let (c, o) = maxPages.multipliedReportingOverflow(by: pageSize)
            capacity = o ? Int.max : c
        } else {
            try Checks.sameDim("batch", k.shape[0], of: kName, as: batch, of: "q", op: op)
        }
        // A cache with room for no key (k's dim 1 or block_table's dim 1 is 0)
        // is attended as empty sequences: output 0, as the prefill route and
        // flash-attn (seqlen_k == 0) give.
        let (bh, o0) = batch.multipliedReportingOverflow(by: heads)
        let (rows, o1) = bh.multipliedReportingOverflow(by: queryRows)
        if o0 || o1 || rows > Int(UInt32.max) || rows > Int.max / (VecDispatcher.nwg * (max(d, dv) + 2) * 4)
            || capacity > Int(UInt32.max) || kvHeads > Int(UInt32.max) {
            throw FlashMetalError.value(op, "batch*seqlen_q*num_heads (\(batch)x\(queryRows)x\(heads)) or the keys per sequence (\(capacity)) exceed the uint32 range of FlashAttnVecParams", arg: "q")
        }
        var s = Shapes(batch: batch, heads: heads, kvHeads: kvHeads, headDim: d, headDimV: dv, capacity: capacity,
                       numPages: numPages, pageSize: pageSize, maxPages: maxPages)
        s.queryRows = queryRows
        return s
    }

    /// Validates a call (shapes, dtypes, options, and every table entry a
    /// kernel will read) and builds its two dispatches (decode, then reduce).
    public static func makeDispatches(_ t: VecSeqTensors, _ o: VecSeqOptions) throws -> [Dispatch] {
        try VecDispatcher.requireTypes(q: t.q, k: t.k, v: t.v, out: t.out, tmp: t.tmp, op: op,
                                       kName: t.kName, vName: t.vName)
        let s = try shapes(q: t.q, k: t.k, v: t.v, blockTable: t.blockTable, kName: t.kName, vName: t.vName,
                           headMajor: o.headMajor)
        _ = try Checks.valueShapes(v: t.v, t.vName, k: t.k, t.kName, out: t.out, q: t.q, op: op)
        try Checks.scaleAndSoftcap(o.scale, o.softcap, op: op)
        try AttnOptions.requireWindow(left: o.windowLeft, right: o.windowRight, op: op)
        try VecDispatcher.requireTmp(t.tmp, rows: s.rows, headDim: s.headDimV, op: op)
        if let sinks = t.sinks {
            try sinks.requireDType([.f32], op: op, name: "sinks")
            if sinks.shape != [s.heads] {
                throw FlashMetalError.value(op, "sinks must have shape [\(s.heads)] (num_heads), got \(sinks.shape)", arg: "sinks")
            }
        }
        if let a = t.alibiSlopes {
            try a.requireDType([.f32], op: op, name: "alibi_slopes")
            if a.shape != [s.batch, s.heads] {
                throw FlashMetalError.value(op, "alibi_slopes shape \(a.shape) must be [\(s.batch), \(s.heads)]", arg: "alibi_slopes")
            }
            try a.requireBytes(op: op, name: "alibi_slopes")
        }
        if let lse = t.lse {
            try lse.requireDType([.f32], op: op, name: t.lseName)
            let (want, axes) = t.q.rank == 3 ? ([s.batch, s.heads], "[B, H]")
                : o.headMajor ? ([s.batch, s.heads, s.queryRows], "[B, H, L]") : ([s.batch, s.queryRows, s.heads], "[B, L, H]")
            if lse.shape != want {
                throw FlashMetalError.value(op, "\(t.lseName) must have shape \(want) (\(axes)), got \(lse.shape)", arg: t.lseName)
            }
        }
        for (x, n) in [(t.sinks, "sinks"), (t.lse, t.lseName)] { try x?.requireBytes(op: op, name: n) }

        // Tables last: their contents are read only once every shape is known good.
        let capacityName = t.blockTable == nil ? "the cache capacity, \(t.kName)'s dim 1"
            : SequenceTables.pagedCapacity(pages: s.maxPages, pageSize: s.pageSize, table: "block_table", cache: t.kName)
        let checked = try t.seqlensK.map {
            try SequenceTables.seqlensAndStarts($0, op: op, name: "cache_seqlens", startsName: "cache_leftpad",
                                                batch: s.batch, capacity: s.capacity, capacityName: capacityName)
        }
        let lengths = checked?.lengths ?? Array(repeating: s.capacity, count: s.batch)
        if let bt = t.blockTable {
            try SequenceTables.blockTable(bt, op: op, name: "block_table", lengths: lengths,
                                                 numPages: s.numPages, pageSize: s.pageSize,
                                                 cacheName: t.kName)
        }

        let mask = o.mask
        let params = FlashAttnVecParams(
            n_heads: UInt32(s.heads), n_kv_heads: UInt32(s.kvHeads), head_dim: UInt32(s.headDim),
            kv_seq_len: UInt32(s.capacity), kv_capacity: UInt32(s.capacity), scale: o.scale,
            mask_type: UInt32(mask.type.rawValue), sliding_window: UInt32(mask.window),
            softcap: o.softcap, nwg: UInt32(VecDispatcher.nwg), head_dim_v: UInt32(s.headDimV), _pad: 0)
        let seq = VecDispatcher.SeqBindings(
            params: FlashAttnVecSeqParams(K_strides: rowStrides(t.k, headMajor: o.headMajor),
                                          V_strides: rowStrides(t.v, headMajor: o.headMajor),
                                          page_size: UInt32(s.pageSize), max_pages: UInt32(s.maxPages),
                                          attention_chunk: UInt32(o.attentionChunk),
                                          key_starts_at: checked?.starts == true ? UInt32(s.batch) : 0,
                                          q_rows: UInt32(s.queryRows), window_right: o.rightBound,
                                          head_major: o.headMajor ? 1 : 0, _pad: 0),
            seqlensK: t.seqlensK, blockTable: t.blockTable, alibi: t.alibiSlopes)
        let main = VecDispatcher.mainDispatch(params, rows: s.rows, q: t.q, k: t.k, v: t.v, tmp: t.tmp, seq: seq)
        let ext = t.sinks == nil && t.lse == nil ? nil
            : VecDispatcher.ReduceExt(heads: s.heads, headRows: o.headMajor ? s.queryRows : 1, sinks: t.sinks, lse: t.lse)
        let reduce = try VecDispatcher.reduceDispatch(tmp: t.tmp, out: t.out, rows: s.rows, headDim: s.headDimV,
                                                      nwg: VecDispatcher.nwg, fwht: false, signs: nil, ext: ext)
        return [main, reduce]
    }

    /// (batch or page, kv head, row) element strides of a C-contiguous
    /// [*, rows, Hkv, D] cache, or head-major [*, Hkv, rows, D].
    static func rowStrides(_ t: TensorRef, headMajor: Bool) -> (Int64, Int64, Int64) {
        let d = Int64(t.shape[3])
        if headMajor {
            let (kvHeads, rows) = (Int64(t.shape[1]), Int64(t.shape[2]))
            return (kvHeads * rows * d, rows * d, d)
        }
        let (rows, kvHeads) = (Int64(t.shape[1]), Int64(t.shape[2]))
        return (rows * kvHeads * d, d, kvHeads * d)
    }
}
