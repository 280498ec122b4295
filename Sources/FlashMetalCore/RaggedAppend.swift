/// flash_attn_with_kvcache's ragged new keys (flash-attn 3's
/// cu_seqlens_k_new): sequence b appends rows cu[b] ..< cu[b+1] of k_new/v_new
/// [total_k_new, Hkv, D] at its cache rows seqlens[b] ..., as one kv_append
/// over a token-major view: every new row is its own one-row sequence whose
/// one-page table names the page (or, unpaged, the cache row b) it lands in
/// and whose length is its row there, so sequences of different lengths
/// share one dispatch.
public struct RaggedAppend {
    /// The append over the token-major view: k_new/v_new [T, 1, Hkv, ...],
    /// each row's slot in its page (int32 [T], as cache_seqlens) and its page
    /// (int32 [T, 1], as block_table).
    public typealias MakeView = (_ kNew: TensorRef, _ vNew: TensorRef, _ seqlens: TensorRef, _ blockTable: TensorRef)
        throws -> Dispatch?

    /// The caches' leading shape: [B, cap, ...], or [num_pages, page_size, ...] with `blockTable`.
    public let cacheShape: [Int]
    public let blockTable: TensorRef?
    /// int32 [B+1] (a private copy: the values checked are those read).
    public let cuSeqlensKNew: TensorRef
    /// The caller's names of the new rows.
    public let names: (k: String, v: String)
    /// Rank-4 caches checked before anything else (the dense append's k_cache and v_cache).
    let caches: [(TensorRef, String)]
    let makeView: MakeView

    public init(cacheShape: [Int], blockTable: TensorRef?, cuSeqlensKNew: TensorRef, names: (k: String, v: String),
                makeView: @escaping MakeView) {
        (self.cacheShape, self.blockTable, self.cuSeqlensKNew, self.names) = (cacheShape, blockTable, cuSeqlensKNew, names)
        (self.caches, self.makeView) = ([], makeView)
    }

    /// The dense caches' ragged append (kv_append): [B, cap, Hkv, D] or [num_pages, page_size, Hkv, D].
    public init(kCache: TensorRef, vCache: TensorRef, blockTable: TensorRef?, cuSeqlensKNew: TensorRef,
                names: (k: String, v: String)) {
        (self.cacheShape, self.blockTable, self.cuSeqlensKNew, self.names) = (kCache.shape, blockTable, cuSeqlensKNew,
                                                                              names)
        caches = [(kCache, "k_cache"), (vCache, "v_cache")]
        makeView = { kNew, vNew, seqlens, table in
            var t = KVAppendTensors(kNew: kNew, vNew: vNew, kCache: kCache, vCache: vCache, seqlens: seqlens,
                                    blockTable: table)
            (t.kNewName, t.vNewName) = names
            return try KVAppendDispatcher.makeDispatch(t)
        }
    }

    /// Bytes of the per-row tables for `rows` new rows (one page and one row
    /// index each, the second table 64-byte aligned as buffer offsets must be).
    public static func tableBytes(rows: Int) -> Int { 2 * tableStride(rows) * 4 }

    /// Int32 entries from the page table's start to the row table's.
    static func tableStride(_ rows: Int) -> Int { (max(rows, 1) + 15) & ~15 }

    /// The append's dispatch (nil without rows) and the rows each sequence
    /// gains, its per-row tables written to `tables` (`tableBytes` bytes).
    /// Refuses, before anything is written: a cu_seqlens_k_new that does not
    /// split k_new's rows exactly, a sequence whose new rows overflow its
    /// cache, a block-table entry of a page in use outside the cache, and two
    /// new rows landing on one slot.
    public func plan(rows: (k: TensorRef, v: TensorRef), ends: TensorRef,
                     tables: UnsafeMutableRawPointer) throws -> (dispatch: Dispatch?, added: [Int]) {
        let op = KVAppendDispatcher.op
        for (x, n) in [(rows.k, names.k), (rows.v, names.v)] { try x.requireRank([3], op: op, name: n) }
        for (x, n) in caches { try x.requireRank([4], op: op, name: n) }
        let total = rows.k.shape[0]
        let batch = max(cuSeqlensKNew.shape.first ?? 0, 1) - 1
        let added = try SequenceTables.cuSeqlens(
            cuSeqlensKNew, op: op, name: "cu_seqlens_k_new", tokens: total, tokensName: names.k, maxSeqlen: Int.max,
            maxSeqlenName: "")
        if added.reduce(0, +) != total {
            throw FlashMetalError.value(op, "cu_seqlens_k_new[\(batch)] = \(added.reduce(0, +)) must equal the rows of "
                + "\(names.k) (its dim 0, \(total))", arg: "cu_seqlens_k_new")
        }
        let pageSize = cacheShape[1]
        let cache = try CacheCapacity(op: op, cacheShape: cacheShape, blockTable: blockTable, batch: batch,
                                      batchName: "cu_seqlens_k_new")
        let capacity = min(cache.rows, Int(Int32.max))
        let starts = try SequenceTables.seqlens(ends, op: op, name: "cache_seqlens", batch: batch, capacity: capacity,
                                                capacityName: "the keys a sequence's cache holds")
        for b in 0..<batch where starts[b] + added[b] > capacity {
            throw FlashMetalError.value(op, "sequence \(b)'s new keys overflow its cache: cache_seqlens[\(b)] + "
                + "\(added[b]) new keys (cu_seqlens_k_new) = \(starts[b] + added[b]) exceeds the \(capacity) keys a "
                + "sequence's cache holds", arg: "cu_seqlens_k_new")
        }
        if let bt = blockTable {
            try SequenceTables.blockTable(bt, op: op, name: "block_table", lengths: zip(starts, added).map { $0 + $1 },
                                          numPages: cacheShape[0], pageSize: pageSize, cacheName: "k_cache")
        }
        // Each new row's page (the cache row b when unpaged) and its row in it.
        let page = tables.assumingMemoryBound(to: Int32.self), row = page + RaggedAppend.tableStride(total)
        var landed: [Int: (b: Int, column: Int)] = [:]
        var i = 0
        for b in 0..<batch {
            for position in starts[b]..<starts[b] + added[b] {
                let column = position / pageSize
                let p = blockTable.map { Int(SequenceTables.int32($0, b * $0.shape[1] + column)) } ?? b
                let slot = p * pageSize + position % pageSize
                if blockTable != nil, let other = landed[slot] {
                    throw FlashMetalError.value(op, "block_table[\(other.b), \(other.column)] and block_table[\(b), "
                        + "\(column)] both name page \(p), and new keys of sequences \(other.b) and \(b) would both "
                        + "land in its row \(position % pageSize): sequences may not share the slots an append "
                        + "writes", arg: "block_table")
                }
                landed[slot] = (b, column)
                (page[i], row[i]) = (Int32(p), Int32(position % pageSize))
                i += 1
            }
        }
        if total == 0 { return (nil, added) }
        // The token-major view: k_new [T, 1, Hkv, D], the caches as pages of page_size rows.
        func oneRow(_ x: TensorRef) -> TensorRef { x.reshaped([x.shape[0], 1] + x.shape.dropFirst()) }
        let slots = TensorRef(data: UnsafeMutableRawPointer(row), byteCount: total * 4, dtype: .i32, shape: [total],
                              name: "cache_seqlens")
        let pages = TensorRef(data: UnsafeMutableRawPointer(page), byteCount: total * 4, dtype: .i32,
                              shape: [total, 1], name: "block_table")
        return (try makeView(oneRow(rows.k), oneRow(rows.v), slots, pages), added)
    }
}
