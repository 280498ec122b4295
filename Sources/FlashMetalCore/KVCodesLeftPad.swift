/// flash_attn_with_kvcache's cache_leftpad over quantized caches, as a view
/// the codes attention already reads: the storage [num_pages, page_size,
/// Hkv, ...] (contiguous [B, cap, Hkv, ...] is B pages of cap keys) seen as
/// [num_pages * page_size, 1, Hkv, ...] pages of one key, and a block table
/// whose row b lists the physical rows of sequence b's keys [first[b],
/// end[b]) in order. Sequence b is then those end[b] - first[b] keys (none
/// when first[b] >= end[b]) with positions counted from its first key,
/// which is flash-attn's cache_leftpad.
public struct KVCodesLeftPad {
    /// Each sequence's end (row 0 of the [2, B] table) and first key (row 1).
    let ends: [Int], starts: [Int]
    /// The storage's pages and keys per page (its dims 0 and 1).
    let pages: Int, pageSize: Int
    /// The caller's block table (checked for the keys below each end), nil
    /// when the storage is [B, cap, Hkv].
    let blockTable: TensorRef?
    /// The rows table's dim 1: the most keys of any sequence, at least 1.
    public let width: Int

    /// Validates a [2, B] cache_seqlens table (ends, then first keys) over
    /// storage of leading shape `lead` ([B, cap, Hkv], or [num_pages,
    /// page_size, Hkv] with `blockTable`) for `batch` sequences; nil for a
    /// [B] table, which the attention reads as it is.
    public init?(seqlens: TensorRef?, lead: [Int], blockTable: TensorRef?, batch: Int, op: String) throws {
        guard let seqlens, seqlens.rank == 2 else { return nil }
        let cache = try CacheCapacity(op: op, cacheShape: lead, blockTable: blockTable, batch: batch, batchName: "q")
        let capacityName = blockTable == nil ? "the cache capacity, k_cache's dim 1"
            : SequenceTables.pagedCapacity(pages: cache.maxPages, pageSize: lead[1], table: "block_table", cache: "k_cache")
        let (lengths, _) = try SequenceTables.seqlensAndStarts(
            seqlens, op: op, name: "cache_seqlens", startsName: "cache_leftpad", batch: batch,
            capacity: min(cache.rows, Int(Int32.max)), capacityName: capacityName)
        let (rows, overflow) = lead[0].multipliedReportingOverflow(by: lead[1])
        if overflow || rows > Int(Int32.max) {
            throw FlashMetalError.unsupported(op, "cache_leftpad over quantized caches of more than 2**31 - 1 rows "
                + "(\(lead[0]) x \(lead[1]))", arg: "cache_leftpad")
        }
        if let bt = blockTable {
            _ = try SequenceTables.blockTable(bt, op: op, name: "block_table", lengths: lengths, numPages: lead[0],
                                              pageSize: lead[1], cacheName: "k_cache")
        }
        ends = lengths
        starts = (0..<batch).map { SequenceTables.int32(seqlens, batch + $0) }
        (pages, pageSize, self.blockTable) = (lead[0], lead[1], blockTable)
        width = max(1, zip(ends, starts).map { max($0 - $1, 0) }.max() ?? 0)
    }

    /// Bytes `view` writes: the int32 rows table [B, width] and key counts [B].
    public var byteCount: Int { ends.count * (width + 1) * 4 }

    /// `t` with its caches seen as one-key pages, its block table the rows
    /// of each sequence's keys and its lengths their counts, both written
    /// into `memory` (`byteCount` bytes, living as long as the work).
    public func view(of t: KVCodesAttnTensors, memory: UnsafeMutableRawPointer) -> KVCodesAttnTensors {
        let batch = ends.count
        let table = memory.assumingMemoryBound(to: Int32.self)
        let counts = table + batch * width
        for b in 0..<batch {
            let n = max(ends[b] - starts[b], 0)
            counts[b] = Int32(n)
            for j in 0..<width {
                guard j < n else { table[b * width + j] = 0; continue }
                let position = starts[b] + j
                let page = blockTable.map { SequenceTables.int32($0, b * $0.shape[1] + position / pageSize) } ?? b
                table[b * width + j] = Int32(page * pageSize + position % pageSize)
            }
        }
        var v = t
        (v.k, v.v) = (oneKeyPages(t.k), oneKeyPages(t.v))
        v.blockTable = TensorRef(data: memory, byteCount: batch * width * 4, dtype: .i32, shape: [batch, width],
                                 name: "block_table")
        v.seqlens = TensorRef(data: UnsafeMutableRawPointer(counts), byteCount: batch * 4, dtype: .i32, shape: [batch],
                              name: "cache_seqlens")
        return v
    }

    func oneKeyPages(_ side: KVSide) -> KVSide {
        func flat(_ x: TensorRef) -> TensorRef { x.reshaped([pages * pageSize, 1] + x.shape.dropFirst(2)) }
        switch side {
        case let .codes(c): return .codes(QuantizedCache(codec: c.codec, codes: flat(c.codes), norms: flat(c.norms)))
        case let .dense(x): return .dense(flat(x))
        }
    }
}
