import CFlashMetal

/// Buffer indices of kv_codes_decode.
public enum KVCodesDecodeBuffer {
    /// KVCodesDecodeParams.
    public static let params = Int(FM_KVQD_BUF_PARAMS.rawValue)
    /// float32 [B, H, D].
    public static let q = Int(FM_KVQD_BUF_Q.rawValue)
    /// uint8 codes of the K cache.
    public static let kCodes = Int(FM_KVQD_BUF_K_CODES.rawValue)
    /// float32 norms of the K cache.
    public static let kNorms = Int(FM_KVQD_BUF_K_NORMS.rawValue)
    /// uint8 codes of the V cache.
    public static let vCodes = Int(FM_KVQD_BUF_V_CODES.rawValue)
    /// float32 norms of the V cache.
    public static let vNorms = Int(FM_KVQD_BUF_V_NORMS.rawValue)
    /// float32 [B, H, D] out.
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
}

/// One side (K or V) of an attention over quantized caches: codes, or a
/// dense cache of the same rows beside a quantized other side.
public enum KVSide {
    case codes(QuantizedCache)
    /// [lead..., D] float32, float16 or bfloat16.
    case dense(TensorRef)

    /// The codes, or nil for a dense side.
    public var quantized: QuantizedCache? {
        if case let .codes(c) = self { return c }
        return nil
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
/// [(B,) Hkv, cap] of rows), one query row per head, float32 q and out. The
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

    /// Validates a call and builds its dispatch.
    public static func makeDispatch(q: TensorRef, k: QuantizedCache, v: QuantizedCache, out: TensorRef,
                                    options o: FMKVCodesDecodeOptions) throws -> Dispatch {
        try q.requireDType([.f32], op: op, name: "q")
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
        try out.requireDType([.f32], op: op, name: "out")
        try out.requireBytes(op: op, name: "out")
        try Checks.sameShape(out, "out", as: q, "q", op: op)
        let rows = try KVCodecDispatcher.rows([batch, heads], op: op)
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
            page_size: Int32(capacity), max_pages: 0, batch: Int32(batch), _pad: 0)
        return dispatch(params, rows: rows, q: q, k: .codes(k), v: .codes(v), out: out)
    }

    /// The kv_codes_decode launch of validated arguments: one threadgroup per
    /// query row, each optional table bound with its function constant set;
    /// with `prefill`, kv_codes_prefill over that grid instead.
    static func dispatch(_ params: KVCodesDecodeParams, rows: Int, prefill: Size3? = nil, q: TensorRef, k: KVSide,
                         v: KVSide, out: TensorRef, seqlens: TensorRef? = nil, blockTable: TensorRef? = nil,
                         sinks: TensorRef? = nil, lse: TensorRef? = nil, cuSeqlensQ: TensorRef? = nil,
                         cuSeqlensK: TensorRef? = nil) -> Dispatch {
        var bindings: [Int: Binding] = [
            KVCodesDecodeBuffer.params: .bytes(bytesOf(params)), KVCodesDecodeBuffer.q: .buffer(q),
            KVCodesDecodeBuffer.out: .buffer(out),
        ]
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
        var writes: Set<Int> = [KVCodesDecodeBuffer.out]
        let optional: [(TensorRef?, Int)] = [(seqlens, KVCodesDecodeBuffer.seqlens),
                                             (blockTable, KVCodesDecodeBuffer.blockTable),
                                             (sinks, KVCodesDecodeBuffer.sinks), (lse, KVCodesDecodeBuffer.lse),
                                             (cuSeqlensQ, KVCodesDecodeBuffer.cuSeqlensQ),
                                             (cuSeqlensK, KVCodesDecodeBuffer.cuSeqlensK)]
        for (t, i) in optional { if let t = t { bindings[i] = .buffer(t) } }
        if lse != nil { writes.insert(KVCodesDecodeBuffer.lse) }
        let constants = FunctionConstants([
            (FunctionConstantIndex.kvqLens, .bool(seqlens != nil)), (FunctionConstantIndex.kvqPaged, .bool(blockTable != nil)),
            (FunctionConstantIndex.kvqSinks, .bool(sinks != nil)), (FunctionConstantIndex.kvqLSE, .bool(lse != nil)),
            (FunctionConstantIndex.kvqKDense, .bool(k.quantized == nil)),
            (FunctionConstantIndex.kvqVDense, .bool(v.quantized == nil)),
            (FunctionConstantIndex.kvqVarlenQ, .bool(cuSeqlensQ != nil)),
            (FunctionConstantIndex.kvqVarlenK, .bool(cuSeqlensK != nil)),
        ])
        if let grid = prefill {
            return Dispatch(kernel: .kvCodesPrefill(dense: dense), constants: constants, grid: grid,
                            threadgroup: Size3(Int(FM_KVQ_PREFILL_ROWS) * Int(FM_KVQ_DECODE_THREADS), 1, 1),
                            bindings: bindings, writes: writes)
        }
        return Dispatch(kernel: .kvCodesDecode(dense: dense), constants: constants, grid: Size3(rows, 1, 1),
                        threadgroup: Size3(Int(FM_KVQ_DECODE_THREADS), 1, 1), bindings: bindings, writes: writes)
    }
}
