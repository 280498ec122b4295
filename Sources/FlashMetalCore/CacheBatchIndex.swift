/// flash_attn_with_kvcache's cache_batch_idx: sequence b reads and appends
/// through cache row idx[b]. Over a paged cache that is row idx[b] of the
/// block table [batch_cache, max_pages] (flash-attn 3's); over a cache
/// [batch_cache, cap, Hkv, ...] it is row idx[b] of the cache, read as one
/// page of cap keys. Either way the append and the attention read a block
/// table [B, pages] written into scratch, every entry checked before
/// anything reads through it, so the paged path serves both.
public struct CacheBatchIndex {
    public static let name = "cache_batch_idx"
    /// Each sequence's cache row.
    let rows: [Int]
    /// The caller's block table (a private copy), nil when the cache's rows
    /// are the pages.
    let blockTable: TensorRef?
    /// The cache's capacity per row (its dim 1) when its rows are the pages.
    let rowCapacity: Int

    /// Validates `idx` (int32 [batch]) against the block table's rows, or
    /// against the cache's (`cacheShape`, k_cache's, a rank-4 shape whose
    /// dim 1 holds at least one key) when there is none; with `appending`
    /// no two sequences may share a row (it would be written twice).
    public init(_ idx: TensorRef, blockTable: TensorRef?, cacheShape: [Int], batch: Int, appending: Bool,
                op: String) throws {
        let name = Self.name
        try idx.requireDType([.i32], op: op, name: name)
        if idx.shape != [batch] {
            throw FlashMetalError.value(op, "\(name) must have shape [\(batch)] (q's batch), got \(idx.shape)", arg: name)
        }
        try idx.requireBytes(op: op, name: name)
        let count: Int, of: String
        if let bt = blockTable {
            if bt.rank != 2 {
                throw FlashMetalError.value(op, "block_table must be int32 [batch_cache, max_pages] with \(name), "
                    + "got shape \(bt.shape)", arg: "block_table")
            }
            try SequenceTables.requireInt32(bt, shape: [nil, nil], op: op, name: "block_table")
            (count, of) = (bt.shape[0], "block_table's dim 0")
        } else {
            if cacheShape.count != 4 {
                throw FlashMetalError.value(op, "k_cache must be [batch_cache, cap, Hkv, D] with \(name), "
                    + "got shape \(cacheShape)", arg: "k_cache")
            }
            (count, of) = (cacheShape[0], "k_cache's dim 0")
        }
        var first: [Int: Int] = [:]
        var rows: [Int] = []
        for b in 0..<batch {
            let r = SequenceTables.int32(idx, b)
            if !(0..<count).contains(r) {
                throw FlashMetalError.value(op, "\(name)[\(b)] = \(r) is out of range [0, \(count)) (\(of))", arg: name)
            }
            if appending, let a = first[r] {
                throw FlashMetalError.value(op, "\(name)[\(a)] and \(name)[\(b)] both name cache row \(r): appending "
                    + "k/v would write it twice", arg: name)
            }
            if first[r] == nil { first[r] = b }
            rows.append(r)
        }
        if blockTable == nil && cacheShape[1] == 0 {
            throw FlashMetalError.value(op, "\(name) needs a cache capacity (k_cache's dim 1) of at least one key, got 0",
                                        arg: name)
        }
        (self.rows, self.blockTable) = (rows, blockTable)
        rowCapacity = blockTable == nil ? cacheShape[1] : 0
    }

    /// The written table's dim 1: the block table's, else 1 (a row is a page).
    var width: Int { blockTable?.shape[1] ?? 1 }

    /// Bytes `table` writes.
    public var byteCount: Int { rows.count * width * 4 }

    /// With the cache's rows as pages: each sequence's keys, and the `newRows`
    /// appended after them, stay in its own row of the cache. `seqlens`: the
    /// int32 lengths [B], or [2, B] (lengths, then cache_leftpad's first
    /// keys); a table of another shape or dtype is left to the attention's
    /// own checks.
    public func requireRowRoom(seqlens: TensorRef?, newRows: Int, op: String) throws {
        let batch = rows.count
        guard blockTable == nil, let seqlens,
              (try? SequenceTables.requireInt32(seqlens, shape: seqlens.rank == 2 ? [2, batch] : [batch], op: op,
                                                name: "cache_seqlens")) != nil
        else { return }
        let cap = rowCapacity
        for b in 0..<batch {
            let n = SequenceTables.int32(seqlens, b)
            if n < 0 || n > cap - newRows {
                let room = newRows > 0
                    ? "[0, \(cap - newRows)] (k_cache's dim 1, \(cap), less the \(newRows) appended rows)"
                    : "[0, \(cap)] (k_cache's dim 1)"
                throw FlashMetalError.value(op, "cache_seqlens[\(b)] = \(n) is out of range \(room)", arg: "cache_seqlens")
            }
        }
    }

    /// The block table [B, width] sequence by sequence, written into `memory`
    /// (`byteCount` bytes, living as long as the work).
    public func table(memory: UnsafeMutableRawPointer) -> TensorRef {
        let out = memory.assumingMemoryBound(to: Int32.self)
        let w = width
        for (b, r) in rows.enumerated() {
            if let bt = blockTable {
                for j in 0..<w { out[b * w + j] = Int32(SequenceTables.int32(bt, r * w + j)) }
            } else {
                out[b] = Int32(r)
            }
        }
        return TensorRef(data: memory, byteCount: byteCount, dtype: .i32, shape: [rows.count, w], name: "block_table")
    }
}
