/// How many key rows each sequence of a KV cache can hold, and the block
/// table's width: one owner of the rule the append and the attention over
/// caches share.
///
/// A contiguous cache `[B, cap, ...]` gives sequence b row b, so its dim 0
/// must equal the batch and the capacity is `cap`. A paged cache
/// `[num_pages, page_size, ...]` with a block table `[B, max_pages]` holds
/// `max_pages × page_size` rows per sequence (`Int.max` when that product
/// overflows, so every length check still refuses what does not fit).
public struct CacheCapacity {
    /// Rows one sequence can hold.
    public let rows: Int
    /// The block table's dim 1, 0 without one.
    public let maxPages: Int

    /// - Parameters: `cacheShape` is `k_cache`'s shape; `batch` the number of
    ///   sequences, read from `batchName`.
    public init(op: String, cacheShape: [Int], blockTable: TensorRef?, batch: Int, batchName: String) throws {
        let pageRows = cacheShape[1]
        guard let bt = blockTable else {
            try Checks.sameDim("batch", cacheShape[0], of: "k_cache", as: batch, of: batchName, op: op)
            rows = pageRows
            maxPages = 0
            return
        }
        try bt.requireRank([2], op: op, name: "block_table")
        try SequenceTables.requirePageSize(pageRows, op: op, cacheName: "k_cache")
        maxPages = bt.shape[1]
        let (product, overflow) = maxPages.multipliedReportingOverflow(by: pageRows)
        rows = overflow ? Int.max : product
    }
}
