import CFlashMetal

/// The tensors of one kv_append call.
public struct KVAppendTensors {
    /// [B, n_new, Hkv, D] new rows, the caches' dtype.
    public var kNew: TensorRef, vNew: TensorRef
    /// [B, cap, Hkv, D], or paged [num_pages, page_size, Hkv, D].
    public var kCache: TensorRef, vCache: TensorRef
    /// int32 [B]: row n_new rows start at in each sequence (not changed).
    public var seqlens: TensorRef
    /// int32 [B, max_pages]: the caches are paged.
    public var blockTable: TensorRef?
    /// The caller's names of k_new and v_new in errors (flash_attn_with_kvcache
    /// calls them k and v).
    public var kNewName = "k_new", vNewName = "v_new"

    /// The tensors of a call; the block table is optional.
    public init(kNew: TensorRef, vNew: TensorRef, kCache: TensorRef, vCache: TensorRef, seqlens: TensorRef,
                blockTable: TensorRef? = nil) {
        self.kNew = kNew; self.vNew = vNew; self.kCache = kCache; self.vCache = vCache
        self.seqlens = seqlens; self.blockTable = blockTable
    }
}

/// kv_append (flash_attn_with_kvcache's k/v): writes row i of
/// sequence b of k_new/v_new into the caches at row seqlens[b] + i, through
/// the block table when paged. Every seqlens[b] + n_new is checked against
/// the capacity and every table entry the writes go through against the
/// pages before the dispatch is made: a bad table writes nothing.
///
/// Grid (n_new, Hkv, B) of KVAppendCapability.threads threads (a loop
/// covers D); buffers KVAppendBuffer; constant appendPaged. Copies are
/// bit-exact (no conversion).
public enum KVAppendDispatcher {
    /// The op name errors carry.
    public static let op = "kv_append"

    /// Validates a call and builds its dispatch; nil when there is nothing to
    /// write (n_new == 0), after the same validation.
    public static func makeDispatch(_ t: KVAppendTensors) throws -> Dispatch? {
        try t.kCache.requireDType(KVAppendCapability.cacheTypes, op: op, name: "k_cache")
        for (x, n) in [(t.vCache, "v_cache"), (t.kNew, t.kNewName), (t.vNew, t.vNewName)] where x.dtype != t.kCache.dtype {
            throw FlashMetalError.type(op, "\(n) dtype \(x.dtype.name) does not match k_cache dtype \(t.kCache.dtype.name)", arg: n)
        }
        for (x, n) in [(t.kNew, t.kNewName), (t.vNew, t.vNewName), (t.kCache, "k_cache"), (t.vCache, "v_cache")] {
            try x.requireRank([4], op: op, name: n)
            try x.requireBytes(op: op, name: n)
        }
        // v has a head dim of its own (flash-attn's head_dim_v): its shapes are k's but for the last dim.
        for (x, n, ref, rn) in [(t.vNew, t.vNewName, t.kNew, t.kNewName), (t.vCache, "v_cache", t.kCache, "k_cache")]
        where Array(x.shape.dropLast()) != Array(ref.shape.dropLast()) {
            throw FlashMetalError.value(op, "\(n) shape \(x.shape) must equal \(rn) shape \(ref.shape) but for the head dim",
                                        arg: n)
        }
        let dv = t.vNew.shape[3]
        if t.vCache.shape[3] != dv {
            throw FlashMetalError.value(op, "\(t.vNewName) head dim (\(dv)) must equal v_cache's (\(t.vCache.shape[3]))",
                                        arg: t.vNewName)
        }
        try Checks.positive("the head dim of \(t.vNewName)", dv, op: op, arg: t.vNewName)
        let (batch, nNew, kvHeads, d) = (t.kNew.shape[0], t.kNew.shape[1], t.kNew.shape[2], t.kNew.shape[3])
        let (cacheRows, cacheHeads, cacheD) = (t.kCache.shape[1], t.kCache.shape[2], t.kCache.shape[3])
        if cacheHeads != kvHeads || cacheD != d {
            throw FlashMetalError.value(op, "\(t.kNewName) [B, n_new, Hkv, D] = \(t.kNew.shape) must match k_cache's (Hkv, D) = (\(cacheHeads), \(cacheD))", arg: t.kNewName)
        }
        try Checks.positive("batch", batch, op: op, arg: t.kNewName)
        try Checks.positive("the \(t.kNewName) heads", kvHeads, op: op, arg: t.kNewName)
        try Checks.positive("head_dim", d, op: op, arg: t.kNewName)
        let cache = try CacheCapacity(op: op, cacheShape: t.kCache.shape, blockTable: t.blockTable, batch: batch,
                                      batchName: t.kNewName)
        let (capacity, maxPages) = (cache.rows, cache.maxPages)
        let limit = Int(Int32.max)
        if [nNew, kvHeads, d, dv, cacheRows, maxPages].contains(where: { $0 > limit }) {
            throw FlashMetalError.value(op, "n_new, num_kv_heads, head_dim, the page size and max_pages must fit int32", arg: t.kNewName)
        }

        // Table contents, before any write: each sequence's rows end within its capacity.
        let capacityName = t.blockTable == nil ? "the cache capacity, k_cache's dim 1"
            : SequenceTables.pagedCapacity(pages: maxPages, pageSize: cacheRows, table: "block_table", cache: "k_cache")
        let starts = try SequenceTables.seqlens(t.seqlens, op: op, name: "cache_seqlens", batch: batch,
                                                       capacity: capacity, capacityName: capacityName)
        for (b, start) in starts.enumerated() where start + nNew > capacity {
            throw FlashMetalError.value(
                op, "cache_seqlens[\(b)] + the new rows of \(t.kNewName) (its dim 1) = \(start) + \(nNew) = "
                    + "\(start + nNew) exceeds \(capacityName) (\(capacity))", arg: "cache_seqlens")
        }
        if let bt = t.blockTable {
            try SequenceTables.blockTable(bt, op: op, name: "block_table", lengths: starts.map { $0 + nNew },
                                                 numPages: t.kCache.shape[0], pageSize: cacheRows,
                                                 cacheName: "k_cache")
            try SequenceTables.requireDistinctWrites(bt, op: op, name: "block_table", starts: starts, count: nNew,
                                                     pageSize: cacheRows)
        }
        if nNew == 0 { return nil }

        let (h, dd) = (Int64(kvHeads), Int64(d))
        let params = KVAppendParams(
            n_new: Int32(nNew), n_kv_heads: Int32(kvHeads), head_dim: Int32(d),
            page_size: Int32(t.blockTable == nil ? 0 : cacheRows), max_pages: Int32(maxPages), head_dim_v: Int32(dv),
            new_strides: (Int64(nNew) * h * dd, h * dd, dd),
            cache_strides: (Int64(cacheRows) * h * dd, h * dd, dd))
        var bindings: [Int: Binding] = [
            KVAppendBuffer.params: .bytes(bytesOf(params)),
            KVAppendBuffer.kNew: .buffer(t.kNew), KVAppendBuffer.vNew: .buffer(t.vNew),
            KVAppendBuffer.kCache: .buffer(t.kCache), KVAppendBuffer.vCache: .buffer(t.vCache),
            KVAppendBuffer.seqlens: .buffer(t.seqlens),
        ]
        if let bt = t.blockTable { bindings[KVAppendBuffer.blockTable] = .buffer(bt) }
        return Dispatch(
            kernel: .kvAppend(cache: t.kCache.dtype),
            constants: FunctionConstants([(FunctionConstantIndex.appendPaged, .bool(t.blockTable != nil))]),
            grid: Size3(nNew, kvHeads, batch), threadgroup: Size3(KVAppendCapability.threads, 1, 1),
            bindings: bindings, writes: [KVAppendBuffer.kCache, KVAppendBuffer.vCache])
    }
}
