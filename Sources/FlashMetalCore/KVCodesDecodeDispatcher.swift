import CFlashMetal

/// Buffer indices of kv_codes_decode.
public enum KVCodesDecodeBuffer {
    /// KVCodesDecodeParams.
    public static let params = Int(FM_KVQD_BUF_PARAMS.rawValue)
    /// [B, H, D]: float32, float16 or bfloat16.
    public static let q = Int(FM_KVQD_BUF_Q.rawValue)
    /// uint8 codes of the K cache.
    public static let kCodes = Int(FM_KVQD_BUF_K_CODES.rawValue)
    /// float32 norms of the K cache.
    public static let kNorms = Int(FM_KVQD_BUF_K_NORMS.rawValue)
    /// uint8 codes of the V cache.
    public static let vCodes = Int(FM_KVQD_BUF_V_CODES.rawValue)
    /// float32 norms of the V cache.
    public static let vNorms = Int(FM_KVQD_BUF_V_NORMS.rawValue)
    /// [B, H, D] out, of q's dtype.
    public static let out = Int(FM_KVQD_BUF_OUT.rawValue)
    /// int32 [B] keys per sequence (FunctionConstantIndex.kvqLens).
    public static let seqlens = Int(FM_KVQD_BUF_SEQLENS.rawValue)
    /// int32 [B, max_pages] (FunctionConstantIndex.kvqPaged).
    public static let blockTable = Int(FM_KVQD_BUF_BLOCK_TABLE.rawValue)
    /// float32 [H] (FunctionConstantIndex.kvqSinks).
    public static let sinks = Int(FM_KVQD_BUF_SINKS.rawValue)
    /// float32 [B, H, qL] out (FunctionConstantIndex.kvqLSE).
    public static let lse = Int(FM_KVQD_BUF_LSE.rawValue)
    /// A dense K cache (FunctionConstantIndex.kvqKDense; codes unbound).
    public static let kDense = Int(FM_KVQD_BUF_K_DENSE.rawValue)
    /// A dense V cache (FunctionConstantIndex.kvqVDense; codes unbound).
    public static let vDense = Int(FM_KVQD_BUF_V_DENSE.rawValue)
    /// int32 [B+1] (FunctionConstantIndex.kvqVarlenQ).
    public static let cuSeqlensQ = Int(FM_KVQD_BUF_CU_SEQLENS_Q.rawValue)
    /// int32 [B+1] (FunctionConstantIndex.kvqVarlenK).
    public static let cuSeqlensK = Int(FM_KVQD_BUF_CU_SEQLENS_K.rawValue)
    /// float32 partials of a split decode (FunctionConstantIndex.kvqSplit; kv_codes_reduce).
    public static let tmp = Int(FM_KVQD_BUF_TMP.rawValue)
    /// float32 [B, H] ALiBi slopes (FunctionConstantIndex.kvqAlibi).
    public static let alibi = Int(FM_KVQD_BUF_ALIBI.rawValue)
}

/// Buffer indices of kv_codes_reduce.
public enum KVCodesReduceBuffer {
    /// KVCodesDecodeParams.
    public static let params = Int(FM_KVQR_BUF_PARAMS.rawValue)
    /// float32 partials of the split decode.
    public static let tmp = Int(FM_KVQR_BUF_TMP.rawValue)
    /// float32 out.
    public static let out = Int(FM_KVQR_BUF_OUT.rawValue)
    /// float32 [H] (FunctionConstantIndex.kvqSinks).
    public static let sinks = Int(FM_KVQR_BUF_SINKS.rawValue)
    /// float32 out (FunctionConstantIndex.kvqLSE).
    public static let lse = Int(FM_KVQR_BUF_LSE.rawValue)
    /// int32 [B+1] (FunctionConstantIndex.kvqVarlenQ).
    public static let cuSeqlensQ = Int(FM_KVQR_BUF_CU_SEQLENS_Q.rawValue)
}

/// The work of one attention over quantized caches: its dispatches, built
/// once the scratch for a split decode's partials (tmpBytes, 0 when there
/// are none) exists.
public struct KVCodesPlan {
    /// Bytes of float32 scratch the dispatches need (bound as tmp).
    public let tmpBytes: Int
    let build: (TensorRef?) -> [Dispatch]
    /// The packed rows no sequence owns (varlen), cleared once the call is accepted.
    public var unowned = UnownedRows()
    /// The call's arguments when no dispatch binds them (no query row): what
    /// an append before it writes must still not overlap them.
    public var unbound: [TensorRef] = []

    /// The dispatches, with `tmp` (of tmpBytes, or nil when 0) for the partials.
    public func dispatches(tmp: TensorRef?) -> [Dispatch] { build(tmp) }
}

/// One side (K or V) of an attention over quantized caches: codes, or a
/// dense cache of the same rows beside a quantized other side.
public enum KVSide {
    case codes(QuantizedCache)
    /// [lead..., D] float32, float16 or bfloat16.
    case dense(TensorRef)

    /// The tensors the side's storage is: codes and norms, or the dense cache.
    public var tensors: [TensorRef] {
        switch self {
        case let .codes(c): return [c.codes, c.norms]
        case let .dense(t): return [t]
        }
    }

    /// The codes, or nil for a dense side.
    public var quantized: QuantizedCache? {
        if case let .codes(c) = self { return c }
        return nil
    }

    /// The dtypes q (and the output, of q's dtype) may have over these sides:
    /// float32, or a 16-bit dtype that every dense side also has.
    static func ioTypes(_ sides: [KVSide]) -> [DType] {
        let dense = sides.compactMap { side -> DType? in
            if case let .dense(t) = side { return t.dtype }
            return nil
        }
        return [.f32] + [DType.f16, .bf16].filter { io in dense.allSatisfy { $0 == io } }
    }
}

/// One quantized cache of a kv_codes_decode call: its codec and storage.
public struct QuantizedCache {
    public var codec: KVCodec
    public var codes: TensorRef
    public var norms: TensorRef

    public init(codec: KVCodec, codes: TensorRef, norms: TensorRef) {
        self.codec = codec; self.codes = codes; self.norms = norms
    }
}

/// kv_codes_decode: flash_attn_decode over quantized K and V caches (layout
/// [(B,) Hkv, cap] of rows), one query row per head, q and out of one dtype (float32, float16 or bfloat16). The
/// query is rotated with K's signs and Hadamard blocks, scores are taken
/// against the codes, and the output is rotated back with V's; no cache row
/// is ever dequantized to memory.
public enum KVCodesDecodeDispatcher {
    /// The op name errors carry.
    public static let op = "kv_codes_decode"

    /// `cache` is codes [lead..., row_bytes] and norms [lead..., num_blocks] of its codec.
    static func requireStorage(_ c: QuantizedCache, _ name: String, lead: [Int], op: String = op) throws {
        try KVCodecDispatcher.require(c.codes, "\(name) codes", dtype: .u8, lead: lead, last: c.codec.rowBytes, op: op)
        try KVCodecDispatcher.require(c.norms, "\(name) norms", dtype: .f32, lead: lead, last: c.codec.numBlocks, op: op)
    }

    /// Validates a call and plans its work; `splitKeys` as Backend.splitsKeysInGrid.
    public static func makePlan(q: TensorRef, k: QuantizedCache, v: QuantizedCache, out: TensorRef,
                                options o: FMKVCodesDecodeOptions, splitKeys: Bool = true) throws -> KVCodesPlan {
        try q.requireDType(KVSide.ioTypes([]), op: op, name: "q")
        try q.requireRank([2, 3], op: op, name: "q")
        try q.requireBytes(op: op, name: "q")
        let batched = q.rank == 3
        let (batch, heads, d) = (batched ? q.shape[0] : 1, q.shape[q.rank - 2], q.shape[q.rank - 1])
        for (c, name) in [(k.codec, "k_cache"), (v.codec, "v_cache")] where c.headDim != d {
            throw FlashMetalError.value(op, "\(name)'s codec head_dim \(c.headDim) must equal q's head dim \(d)")
        }
        try k.codes.requireDType([.u8], op: op, name: "k_cache codes")
        guard k.codes.rank == q.rank + 1 else {
            throw FlashMetalError.value(op, "k_cache must have leading shape \(batched ? "[B, Hkv, cap]" : "[Hkv, cap]") for q of rank \(q.rank), got codes shape \(k.codes.shape)")
        }
        let lead = Array(k.codes.shape.dropLast())
        try requireStorage(k, "k_cache", lead: lead)
        try requireStorage(v, "v_cache", lead: lead)
        let (kvHeads, capacity) = (lead[lead.count - 2], lead[lead.count - 1])
        if batched { try Checks.sameDim("batch", lead[0], of: "k_cache", as: batch, of: "q", op: op) }
        try Checks.positive("batch", batch, op: op, arg: "q")
        try Checks.heads(heads, kvHeads: kvHeads, of: "k_cache", op: op, kvHeadsArg: "k_cache")
        try Checks.kvLen(Int(o.kv_len), capacity: capacity, op: op)
        if o.window < 0 { throw FlashMetalError.value(op, "window must be >= 0, got \(o.window)", arg: "window") }
        try Checks.scaleAndSoftcap(o.scale, o.softcap, op: op)
        try out.requireDType([q.dtype], op: op, name: "out")
        try out.requireBytes(op: op, name: "out")
        try Checks.sameShape(out, "out", as: q, "q", op: op)
        _ = try KVCodecDispatcher.rows([batch, heads], op: op)
        if capacity > Int(Int32.max) || kvHeads > Int(Int32.max) {
            throw FlashMetalError.value(op, "num_kv_heads and the cache capacity must fit int32")
        }

        let (hk, cap) = (Int64(kvHeads), Int64(capacity))
        let params = KVCodesDecodeParams(
            k_seed: k.codec.seed, v_seed: v.codec.seed, kv_strides: (hk * cap, cap, 1),
            n_heads: Int32(heads), n_kv_heads: Int32(kvHeads), head_dim: Int32(d), block: Int32(k.codec.block),
            k_bits: Int32(k.codec.bits), v_bits: Int32(v.codec.bits), k_row_bytes: Int32(k.codec.rowBytes),
            v_row_bytes: Int32(v.codec.rowBytes), kv_len: o.kv_len, q_len: 1, scale: o.scale, softcap: o.softcap,
            causal: 0, window_left: o.window > 0 ? o.window - 1 : -1, window_right: -1, attention_chunk: 0,
            page_size: Int32(capacity), max_pages: 0, batch: Int32(batch), nwg: 1, heads_per_group: 1, _pad: 0)
        return plan(params, tokens: batch, keys: Int(o.kv_len), splitKeys: splitKeys, q: q, k: .codes(k), v: .codes(v),
                    out: out)
    }

    /// Query heads one kv_codes_decode SIMD group serves, sharing each code
    /// row it reads: the largest power of two dividing the GQA group size
    /// `gqa` (H / Hkv) whose query and accumulator coordinates fit a lane
    /// (heads * ceil(D / 32) <= FM_KVQ_DECODE_LANE_FLOATS).
    public static func headsPerGroup(gqa: Int, headDim: Int) -> Int {
        let per = (headDim + 31) / 32
        var hg = 1
        while gqa % (2 * hg) == 0 && 2 * hg * per <= Int(FM_KVQ_DECODE_LANE_FLOATS) { hg *= 2 }
        return hg
    }

    /// Threadgroups (one SIMD group each) a split decode aims for: enough
    /// to keep every core of a large Apple GPU issuing (40 cores x 24).
    public static let targetThreadgroups = 960
    /// The fewest keys a split takes: each split writes D + 2 floats per
    /// head that the reduce reads back, small beside 128 keys' codes.
    public static let minKeysPerSplit = 128

    /// Key splits (NWG) of a decode over `keys` keys (the most any
    /// sequence has) whose grid has `threadgroups` threadgroups per split:
    /// enough splits to reach targetThreadgroups, none shorter than
    /// minKeysPerSplit, at most FM_KVQ_MAX_SPLITS.
    public static func splits(keys: Int, threadgroups: Int) -> Int {
        let byGrid = (targetThreadgroups + max(threadgroups, 1) - 1) / max(threadgroups, 1)
        return max(1, min(byGrid, keys / minKeysPerSplit, Int(FM_KVQ_MAX_SPLITS)))
    }

    /// The decode over validated arguments (one query row per token:
    /// `tokens` of them, `keys` the most keys any sees): kv_codes_decode over
    /// a grid of (tokens x H / HG, NWG) threadgroups, then with NWG > 1
    /// kv_codes_reduce (one threadgroup per row). Without `splitKeys` (the
    /// cpu: its workers split keys inside one dispatch) NWG is 1.
    static func plan(_ params: KVCodesDecodeParams, tokens: Int, keys: Int, splitKeys: Bool, q: TensorRef, k: KVSide,
                     v: KVSide, out: TensorRef, seqlens: TensorRef? = nil, blockTable: TensorRef? = nil,
                     sinks: TensorRef? = nil, lse: TensorRef? = nil, cuSeqlensQ: TensorRef? = nil,
                     cuSeqlensK: TensorRef? = nil, alibi: TensorRef? = nil) -> KVCodesPlan {
        var p = params
        let heads = Int(p.n_heads)
        p.heads_per_group = Int32(headsPerGroup(gqa: heads / Int(p.n_kv_heads), headDim: Int(p.head_dim)))
        let units = tokens * heads / Int(p.heads_per_group)
        p.nwg = Int32(splitKeys ? splits(keys: keys, threadgroups: units) : 1)
        let rows = tokens * heads
        let tmpBytes = p.nwg > 1 ? rows * Int(p.nwg) * (Int(p.head_dim) + 2) * 4 : 0
        return KVCodesPlan(tmpBytes: tmpBytes) { tmp in
            let split = p.nwg > 1
            let main = dispatch(p, grid: Size3(units, Int(p.nwg), 1), q: q, k: k, v: v, out: out,
                                seqlens: seqlens, blockTable: blockTable, sinks: split ? nil : sinks,
                                lse: split ? nil : lse, cuSeqlensQ: cuSeqlensQ, cuSeqlensK: cuSeqlensK,
                                alibi: alibi, tmp: split ? tmp : nil)
            guard split, let tmp else { return [main] }
            return [main, reduceDispatch(p, rows: rows, v: v, out: out, sinks: sinks, lse: lse, cuSeqlensQ: cuSeqlensQ,
                                         tmp: tmp)]
        }
    }

    /// kv_codes_reduce over the partials in `tmp`: one threadgroup per row.
    static func reduceDispatch(_ p: KVCodesDecodeParams, rows: Int, v: KVSide, out: TensorRef, sinks: TensorRef?,
                               lse: TensorRef?, cuSeqlensQ: TensorRef?, tmp: TensorRef) -> Dispatch {
        var bindings: [Int: Binding] = [KVCodesReduceBuffer.params: .bytes(bytesOf(p)),
                                        KVCodesReduceBuffer.out: .buffer(out), KVCodesReduceBuffer.tmp: .buffer(tmp)]
        for (t, i) in [(sinks, KVCodesReduceBuffer.sinks), (lse, KVCodesReduceBuffer.lse),
                       (cuSeqlensQ, KVCodesReduceBuffer.cuSeqlensQ)] {
            if let t { bindings[i] = .buffer(t) }
        }
        var writes: Set<Int> = [KVCodesReduceBuffer.out]
        if lse != nil { writes.insert(KVCodesReduceBuffer.lse) }
        let constants = FunctionConstants([
            (FunctionConstantIndex.kvqSinks, .bool(sinks != nil)), (FunctionConstantIndex.kvqLSE, .bool(lse != nil)),
            (FunctionConstantIndex.kvqVDense, .bool(v.quantized == nil)),
            (FunctionConstantIndex.kvqVarlenQ, .bool(cuSeqlensQ != nil)),
        ])
        return Dispatch(kernel: .kvCodesReduce(io: out.dtype), constants: constants, grid: Size3(rows, 1, 1),
                        threadgroup: Size3(Int(FM_KVQ_DECODE_THREADS), 1, 1), bindings: bindings, writes: writes)
    }

    /// The kv_codes_decode launch of validated arguments over `grid`, each
    /// optional table bound with its function constant set; with `tmp` the
    /// partials go there (kvqSplit) instead of out; with `prefill`,
    /// kv_codes_prefill over `grid` instead.
    static func dispatch(_ params: KVCodesDecodeParams, grid: Size3, prefill: Bool = false, q: TensorRef,
                         k: KVSide, v: KVSide, out: TensorRef, seqlens: TensorRef? = nil, blockTable: TensorRef? = nil,
                         sinks: TensorRef? = nil, lse: TensorRef? = nil, cuSeqlensQ: TensorRef? = nil,
                         cuSeqlensK: TensorRef? = nil, alibi: TensorRef? = nil, tmp: TensorRef? = nil) -> Dispatch {
        var bindings: [Int: Binding] = [KVCodesDecodeBuffer.params: .bytes(bytesOf(params)), KVCodesDecodeBuffer.q: .buffer(q)]
        bindings[tmp == nil ? KVCodesDecodeBuffer.out : KVCodesDecodeBuffer.tmp] = .buffer(tmp ?? out)
        var dense = DType.f32
        for (side, codes, norms, denseIndex) in [(k, KVCodesDecodeBuffer.kCodes, KVCodesDecodeBuffer.kNorms, KVCodesDecodeBuffer.kDense),
                                                 (v, KVCodesDecodeBuffer.vCodes, KVCodesDecodeBuffer.vNorms, KVCodesDecodeBuffer.vDense)] {
            switch side {
            case let .codes(c):
                bindings[codes] = .buffer(c.codes)
                bindings[norms] = .buffer(c.norms)
            case let .dense(t):
                bindings[denseIndex] = .buffer(t)
                dense = t.dtype
            }
        }
        var writes: Set<Int> = [tmp == nil ? KVCodesDecodeBuffer.out : KVCodesDecodeBuffer.tmp]
        let optional: [(TensorRef?, Int)] = [(seqlens, KVCodesDecodeBuffer.seqlens),
                                             (blockTable, KVCodesDecodeBuffer.blockTable),
                                             (sinks, KVCodesDecodeBuffer.sinks), (lse, KVCodesDecodeBuffer.lse),
                                             (cuSeqlensQ, KVCodesDecodeBuffer.cuSeqlensQ),
                                             (cuSeqlensK, KVCodesDecodeBuffer.cuSeqlensK),
                                             (alibi, KVCodesDecodeBuffer.alibi)]
        for (t, i) in optional { if let t = t { bindings[i] = .buffer(t) } }
        if lse != nil { writes.insert(KVCodesDecodeBuffer.lse) }
        let constants = FunctionConstants([
            (FunctionConstantIndex.kvqLens, .bool(seqlens != nil)), (FunctionConstantIndex.kvqPaged, .bool(blockTable != nil)),
            (FunctionConstantIndex.kvqSinks, .bool(sinks != nil)), (FunctionConstantIndex.kvqLSE, .bool(lse != nil)),
            (FunctionConstantIndex.kvqKDense, .bool(k.quantized == nil)),
            (FunctionConstantIndex.kvqVDense, .bool(v.quantized == nil)),
            (FunctionConstantIndex.kvqVarlenQ, .bool(cuSeqlensQ != nil)),
            (FunctionConstantIndex.kvqVarlenK, .bool(cuSeqlensK != nil)),
            (FunctionConstantIndex.kvqSplit, .bool(tmp != nil)),
            (FunctionConstantIndex.kvqAlibi, .bool(alibi != nil)),
        ])
        // q/out of a 16-bit dtype: the dense side, if any, is of it (validated).
        let io = q.dtype
        if io != .f32 { dense = io }
        if prefill {
            return Dispatch(kernel: .kvCodesPrefill(io: io, dense: dense), constants: constants, grid: grid,
                            threadgroup: Size3(Int(FM_KVQ_PREFILL_ROWS) * Int(FM_KVQ_DECODE_THREADS), 1, 1),
                            bindings: bindings, writes: writes)
        }
        return Dispatch(kernel: .kvCodesDecode(io: io, dense: dense), constants: constants, grid: grid,
                        threadgroup: Size3(Int(FM_KVQ_DECODE_THREADS), 1, 1), bindings: bindings, writes: writes)
    }
}
