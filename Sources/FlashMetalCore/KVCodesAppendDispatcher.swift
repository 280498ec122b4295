import CFlashMetal

/// Buffer indices of kv_codes_append.
public enum KVCodesAppendBuffer {
    /// KVCodesAppendParams.
    public static let params = Int(FM_KVQA_BUF_PARAMS.rawValue)
    /// [B, n_new, Hkv, D] new rows.
    public static let kNew = Int(FM_KVQA_BUF_K_NEW.rawValue), vNew = Int(FM_KVQA_BUF_V_NEW.rawValue)
    /// The K cache's codes and norms.
    public static let kCodes = Int(FM_KVQA_BUF_K_CODES.rawValue), kNorms = Int(FM_KVQA_BUF_K_NORMS.rawValue)
    /// The V cache's codes and norms.
    public static let vCodes = Int(FM_KVQA_BUF_V_CODES.rawValue), vNorms = Int(FM_KVQA_BUF_V_NORMS.rawValue)
    /// int32 [B].
    public static let seqlens = Int(FM_KVQA_BUF_SEQLENS.rawValue)
    /// int32 [B, max_pages] (FunctionConstantIndex.kvqAppendPaged).
    public static let blockTable = Int(FM_KVQA_BUF_BLOCK_TABLE.rawValue)
    /// Dense K / V caches (FunctionConstantIndex.kvqAppendKDense / VDense).
    public static let kDense = Int(FM_KVQA_BUF_K_DENSE.rawValue), vDense = Int(FM_KVQA_BUF_V_DENSE.rawValue)
}

/// kv_codes_append (flash_attn_with_kvcache's k/v over quantized caches):
/// row i of sequence b of k_new/v_new encoded into both code caches at key
/// seqlens[b] + i, through the block table when paged, in one dispatch.
/// Every seqlens[b] + n_new is checked against the capacity and every table
/// entry the writes go through against the pages first: a bad table writes
/// nothing.
public enum KVCodesAppendDispatcher {
    /// The op name errors carry.
    public static let op = "kv_codes_append"

    /// Validates a call and builds its dispatch; nil when n_new == 0, after
    /// the same validation. `kNewName`/`vNewName` name the new rows in errors.
    /// Validates the two sides of a call: at least one quantized, both of
    /// head dim `headDim`, with one leading shape [first, rows, Hkv]; a dense
    /// side [first, rows, Hkv, D] of float32, float16 or bfloat16. Returns the
    /// leading shape and a quantized side's codec.
    public static func requireSides(_ k: KVSide, _ v: KVSide, headDim d: Int, headDimOf: String,
                                    op: String) throws -> (lead: [Int], codec: KVCodec) {
        guard let any = k.quantized ?? v.quantized else {
            throw FlashMetalError.value(op, "k_cache or v_cache must be quantized (both dense take the dense path)", arg: "k_cache")
        }
        for (side, name) in [(k, "k_cache"), (v, "v_cache")] {
            if let c = side.quantized, c.codec.headDim != d {
                throw FlashMetalError.value(op, "\(name)'s codec head_dim \(c.codec.headDim) must equal \(headDimOf)'s head dim \(d)", arg: name)
            }
        }
        try any.codes.requireDType([.u8], op: op, name: "\(k.quantized == nil ? "v_cache" : "k_cache") codes")
        guard any.codes.rank == 4 else {
            throw FlashMetalError.value(
                op, "the caches must have leading shape [B, cap, Hkv] (or [num_pages, page_size, Hkv] with block_table), "
                    + "got codes shape \(any.codes.shape)", arg: k.quantized == nil ? "v_cache" : "k_cache")
        }
        let lead = Array(any.codes.shape.dropLast())
        for (side, name) in [(k, "k_cache"), (v, "v_cache")] {
            switch side {
            case let .codes(c): try KVCodesDecodeDispatcher.requireStorage(c, name, lead: lead, op: op)
            case let .dense(t):
                try t.requireDType(KVCodecCapability.encodeTypes, op: op, name: name)
                try t.requireBytes(op: op, name: name)
                if t.shape != lead + [d] {
                    throw FlashMetalError.value(op, "\(name) shape \(t.shape) must be \(lead + [d]) (the other cache's rows of head dim \(d))", arg: name)
                }
            }
        }
        return (lead, any.codec)
    }

    public static func makeDispatch(kNew: TensorRef, vNew: TensorRef, k: KVSide, v: KVSide,
                                    seqlens: TensorRef, blockTable: TensorRef?, kNewName: String = "k_new",
                                    vNewName: String = "v_new") throws -> Dispatch? {
        try kNew.requireDType(KVCodecCapability.encodeTypes, op: op, name: kNewName)
        if vNew.dtype != kNew.dtype {
            throw FlashMetalError.type(op, "\(vNewName) dtype \(vNew.dtype.name) does not match \(kNewName) dtype \(kNew.dtype.name)", arg: vNewName)
        }
        for (x, n) in [(kNew, kNewName), (vNew, vNewName)] {
            try x.requireRank([4], op: op, name: n)
            try x.requireBytes(op: op, name: n)
        }
        try Checks.sameShape(vNew, vNewName, as: kNew, kNewName, op: op)
        let (batch, nNew, kvHeads, d) = (kNew.shape[0], kNew.shape[1], kNew.shape[2], kNew.shape[3])
        let (lead, codec) = try requireSides(k, v, headDim: d, headDimOf: kNewName, op: op)
        for (side, name) in [(k, "k_cache"), (v, "v_cache")] {
            if case let .dense(t) = side, t.dtype != kNew.dtype {
                throw FlashMetalError.type(op, "\(name) dtype \(t.dtype.name) does not match \(kNewName) dtype \(kNew.dtype.name) (a dense cache receives the new rows' bits)", arg: name)
            }
        }
        let (first, rows, cacheHeads) = (lead[0], lead[1], lead[2])
        if cacheHeads != kvHeads {
            throw FlashMetalError.value(op, "\(kNewName) [B, n_new, Hkv, D] = \(kNew.shape) must match k_cache's Hkv = \(cacheHeads)", arg: kNewName)
        }
        try Checks.positive("batch", batch, op: op, arg: kNewName)
        try Checks.positive("the \(kNewName) heads", kvHeads, op: op, arg: kNewName)
        let cache = try CacheCapacity(op: op, cacheShape: lead, blockTable: blockTable, batch: batch, batchName: kNewName)
        let (capacity, maxPages) = (cache.rows, cache.maxPages)
        let limit = Int(Int32.max)
        if [nNew, kvHeads, rows, maxPages, batch].contains(where: { $0 > limit }) {
            throw FlashMetalError.value(op, "batch, n_new, num_kv_heads, the page size and max_pages must fit int32", arg: kNewName)
        }

        let capacityName = blockTable == nil ? "the cache capacity, k_cache's dim 1"
            : SequenceTables.pagedCapacity(pages: maxPages, pageSize: rows, table: "block_table", cache: "k_cache")
        let starts = try SequenceTables.seqlens(seqlens, op: op, name: "cache_seqlens", batch: batch,
                                                capacity: capacity, capacityName: capacityName)
        for (b, start) in starts.enumerated() where start + nNew > capacity {
            throw FlashMetalError.value(
                op, "cache_seqlens[\(b)] + the new rows of \(kNewName) (its dim 1) = \(start) + \(nNew) = "
                    + "\(start + nNew) exceeds \(capacityName) (\(capacity))", arg: "cache_seqlens")
        }
        if let bt = blockTable {
            try SequenceTables.blockTable(bt, op: op, name: "block_table", lengths: starts.map { $0 + nNew },
                                          numPages: first, pageSize: rows, cacheName: "k_cache")
            try SequenceTables.requireDistinctWrites(bt, op: op, name: "block_table", starts: starts, count: nNew,
                                                     pageSize: rows)
        }
        if nNew == 0 { return nil }

        let (h, dd) = (Int64(kvHeads), Int64(d))
        let params = KVCodesAppendParams(
            k: (k.quantized?.codec ?? codec).params, v: (v.quantized?.codec ?? codec).params, new_strides: (Int64(nNew) * h * dd, h * dd, dd),
            cache_strides: (Int64(rows) * h, h, 1), n_new: Int32(nNew),
            page_size: Int32(blockTable == nil ? 0 : rows), max_pages: Int32(maxPages), _pad: 0)
        var bindings: [Int: Binding] = [
            KVCodesAppendBuffer.params: .bytes(bytesOf(params)),
            KVCodesAppendBuffer.kNew: .buffer(kNew), KVCodesAppendBuffer.vNew: .buffer(vNew),
            KVCodesAppendBuffer.seqlens: .buffer(seqlens),
        ]
        var writes: Set<Int> = []
        for (side, codes, norms, dense) in [(k, KVCodesAppendBuffer.kCodes, KVCodesAppendBuffer.kNorms, KVCodesAppendBuffer.kDense),
                                            (v, KVCodesAppendBuffer.vCodes, KVCodesAppendBuffer.vNorms, KVCodesAppendBuffer.vDense)] {
            switch side {
            case let .codes(c):
                (bindings[codes], bindings[norms]) = (.buffer(c.codes), .buffer(c.norms))
                writes.formUnion([codes, norms])
            case let .dense(t):
                bindings[dense] = .buffer(t)
                writes.insert(dense)
            }
        }
        if let bt = blockTable { bindings[KVCodesAppendBuffer.blockTable] = .buffer(bt) }
        return Dispatch(
            kernel: .kvCodesAppend(input: kNew.dtype),
            constants: FunctionConstants([
                (FunctionConstantIndex.kvqAppendPaged, .bool(blockTable != nil)),
                (FunctionConstantIndex.kvqAppendKDense, .bool(k.quantized == nil)),
                (FunctionConstantIndex.kvqAppendVDense, .bool(v.quantized == nil)),
            ]),
            grid: Size3(nNew, kvHeads, batch), threadgroup: Size3(KVCodecCapability.threads, 1, 1),
            bindings: bindings, writes: writes)
    }
}
