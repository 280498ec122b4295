/// Host validation of the serving calls' int32 index tensors (cu_seqlens,
/// seqlens, block_table). The kernels read through these tables
/// without bounds checks, so every entry a kernel will read is checked here,
/// before any Dispatch is made: a bad table is a ValueError naming the op,
/// the argument and the offending index and value, never an out-of-bounds
/// read. Each function returns what the dispatcher needs (the lengths).
public enum SequenceTables {
    /// The `i`-th int32 of `t`; the caller proved `t` holds it (requireBytes).
    @inline(__always)
    static func int32(_ t: TensorRef, _ i: Int) -> Int {
        Int(t.data.loadUnaligned(fromByteOffset: i * 4, as: Int32.self))
    }

    /// The sequences of a serving call: cu_seqlens_q's entries less one when
    /// q is packed, else q's dim 0.
    public static func sequences(q: TensorRef, cuSeqlensQ: TensorRef?) -> Int {
        if let cu = cuSeqlensQ { return max(cu.shape.first ?? 0, 1) - 1 }
        return q.shape.first ?? 0
    }

    /// Checks the dtype (int32) and the shape of an index tensor.
    static func requireInt32(_ t: TensorRef, shape want: [Int?], op: String, name: String) throws {
        try t.requireDType([.i32], op: op, name: name)
        try t.requireRank([want.count], op: op, name: name)
        for (axis, w) in want.enumerated() {
            if let w, t.shape[axis] != w {
                let spelled = want.map { $0.map(String.init) ?? "_" }.joined(separator: ", ")
                throw FlashMetalError.value(op, "\(name) must have shape [\(spelled)], got \(t.shape)", arg: name)
            }
        }
        try t.requireBytes(op: op, name: name)
    }

    /// Validates cumulative sequence offsets, int32 [B+1]: cu[0] == 0,
    /// non-decreasing, cu[B] <= `tokens` (the packed tensor's first axis),
    /// every length cu[b+1] - cu[b] <= `maxSeqlen`. `batch` (when known, e.g.
    /// from cu_seqlens_q for cu_seqlens_k) pins B. Returns the B lengths.
    public static func cuSeqlens(_ t: TensorRef, op: String, name: String, batch: Int? = nil,
                                 tokens: Int, tokensName: String, maxSeqlen: Int,
                                 maxSeqlenName: String) throws -> [Int] {
        try requireInt32(t, shape: [batch.map { $0 + 1 }], op: op, name: name)
        guard t.shape[0] >= 2 else {
            throw FlashMetalError.value(op, "\(name) must have shape [B+1] with B >= 1, got \(t.shape)", arg: name)
        }
        guard maxSeqlen >= 0 else {
            throw FlashMetalError.value(op, "\(maxSeqlenName) must be >= 0, got \(maxSeqlen)", arg: maxSeqlenName)
        }
        let first = int32(t, 0)
        guard first == 0 else { throw FlashMetalError.value(op, "\(name)[0] must be 0, got \(first)", arg: name) }
        var lengths = [Int]()
        lengths.reserveCapacity(t.shape[0] - 1)
        var previous = 0
        for b in 1..<t.shape[0] {
            let c = int32(t, b)
            if c < previous {
                throw FlashMetalError.value(
                    op, "\(name) must be non-decreasing: \(name)[\(b)] = \(c) < \(name)[\(b - 1)] = \(previous)", arg: name)
            }
            if c > tokens {
                throw FlashMetalError.value(
                    op, "\(name)[\(b)] = \(c) exceeds the \(tokens) tokens of \(tokensName)", arg: name)
            }
            let length = c - previous
            if length > maxSeqlen {
                throw FlashMetalError.value(
                    op, "sequence \(b - 1) has length \(length) (\(name)[\(b)] - \(name)[\(b - 1)]) "
                        + "> \(maxSeqlenName) = \(maxSeqlen)", arg: maxSeqlenName)
            }
            lengths.append(length)
            previous = c
        }
        return lengths
    }

    /// Validates per-sequence lengths, int32 [B], each in 0...capacity
    /// (`capacityName` says where the capacity comes from). Returns them.
    public static func seqlens(_ t: TensorRef, op: String, name: String, batch: Int,
                               capacity: Int, capacityName: String) throws -> [Int] {
        try requireInt32(t, shape: [batch], op: op, name: name)
        return try (0..<batch).map { b in
            try requireInRange(int32(t, b), capacity, op: op, name: name, index: b, of: capacityName)
        }
    }

    /// Validates per-sequence used lengths, int32 [B]: entry b in
    /// 0...lengths[b] (flash-attn 3's seqused_q / seqused_k beside the
    /// lengths cu_seqlens gives, which `lengthsName` names). Returns them.
    public static func used(_ t: TensorRef, op: String, name: String, lengths: [Int],
                            lengthsName: String) throws -> [Int] {
        try requireInt32(t, shape: [lengths.count], op: op, name: name)
        return try lengths.indices.map { b in
            try requireInRange(int32(t, b), lengths[b], op: op, name: name, index: b, of: lengthsName)
        }
    }

    /// `n`, the entry `name`[`index`], when in 0...`capacity` (which `of`
    /// names); else a ValueError naming the entry, its value and the range.
    @discardableResult
    public static func requireInRange(_ n: Int, _ capacity: Int, op: String, name: String, index: Int,
                                      of: String) throws -> Int {
        if n < 0 || n > capacity {
            throw FlashMetalError.value(op, "\(name)[\(index)] = \(n) is out of range [0, \(capacity)] (\(of))",
                                        arg: name)
        }
        return n
    }

    /// Validates a seqlens_k table that may carry each sequence's first key:
    /// int32 [B] (lengths) or [2, B] (lengths, then first keys: flash-attn's
    /// cache_leftpad, named `startsName`), every entry in 0...capacity. A
    /// first key at or past its length leaves the sequence no key. Returns
    /// the lengths and whether first keys follow them.
    public static func seqlensAndStarts(_ t: TensorRef, op: String, name: String, startsName: String,
                                        batch: Int, capacity: Int,
                                        capacityName: String) throws -> (lengths: [Int], starts: Bool) {
        if t.shape.count != 2 {
            return (try seqlens(t, op: op, name: name, batch: batch, capacity: capacity,
                                capacityName: capacityName), false)
        }
        try requireInt32(t, shape: [2, batch], op: op, name: name)
        var lengths = [Int]()
        lengths.reserveCapacity(batch)
        for row in 0..<2 {
            let what = row == 0 ? name : startsName
            for b in 0..<batch {
                let n = try requireInRange(int32(t, row * batch + b), capacity, op: op, name: what, index: b,
                                           of: capacityName)
                if row == 0 { lengths.append(n) }
            }
        }
        return (lengths, true)
    }

    /// How a paged cache's capacity reads in a message: the table's pages
    /// times the cache's page size, each named as the caller passed it.
    public static func pagedCapacity(pages: Int, pageSize: Int, table: String, cache: String) -> String {
        "\(table)'s \(pages) pages (its dim 1) of \(pageSize) keys (\(cache)'s dim 1)"
    }

    /// Validates a page table, int32 [B, max_pages], for sequences of the
    /// given `lengths` over a paged cache of `numPages` pages of `pageSize`
    /// keys: page_size is positive (any size: the kernels look a key's page
    /// up per key where a page splits their key tile), max_pages * page_size >= each length, and every
    /// entry a sequence reads (the pages holding its keys < length) is in
    /// [0, numPages). Entries past a sequence's length are never read and
    /// may hold anything (e.g. -1 padding). Returns max_pages.
    /// A paged cache's page size (its dim 1) is positive.
    public static func requirePageSize(_ pageSize: Int, op: String, cacheName: String) throws {
        guard pageSize > 0 else {
            throw FlashMetalError.value(op, "\(cacheName) page size \(pageSize) (its dim 1) must be positive", arg: cacheName)
        }
    }

    @discardableResult
    public static func blockTable(_ t: TensorRef, op: String, name: String, lengths: [Int],
                                  numPages: Int, pageSize: Int,
                                  cacheName: String) throws -> Int {
        try requireInt32(t, shape: [lengths.count, nil], op: op, name: name)
        try requirePageSize(pageSize, op: op, cacheName: cacheName)
        let maxPages = t.shape[1]
        for (b, length) in lengths.enumerated() {
            let pages = (length + pageSize - 1) / pageSize
            if pages > maxPages {
                throw FlashMetalError.value(
                    op, "sequence \(b) has \(length) keys but \(name) holds \(maxPages) pages of \(pageSize) "
                        + "(\(maxPages * pageSize) keys)", arg: name)
            }
            for j in 0..<pages {
                let page = int32(t, b * maxPages + j)
                if page < 0 || page >= numPages {
                    throw FlashMetalError.value(
                        op, "\(name)[\(b), \(j)] = \(page) is out of range [0, \(numPages)) "
                            + "(the pages of \(cacheName))", arg: name)
                }
            }
        }
        return maxPages
    }

    /// Refuses a page table (already checked by `blockTable`) under which
    /// two writes of an append land on one cache slot: rows [starts[b],
    /// starts[b] + count) of every sequence b go through its table row, and
    /// two entries naming the same page (of two sequences, or twice in one
    /// row) whose written rows of it meet would leave the slot to whichever
    /// write lands last (a race on a GPU). The error names both entries.
    public static func requireDistinctWrites(_ t: TensorRef, op: String, name: String, starts: [Int], count: Int,
                                             pageSize: Int) throws {
        guard count > 0 else { return }
        let maxPages = t.shape[1]
        // (page, first row, last row written in it, sequence, table column)
        var writes: [(page: Int, lo: Int, hi: Int, b: Int, j: Int)] = []
        for (b, start) in starts.enumerated() {
            let end = start + count - 1
            for j in (start / pageSize)...(end / pageSize) {
                let lo = max(start, j * pageSize) - j * pageSize, hi = min(end, j * pageSize + pageSize - 1) - j * pageSize
                writes.append((int32(t, b * maxPages + j), lo, hi, b, j))
            }
        }
        writes.sort { ($0.page, $0.lo) < ($1.page, $1.lo) }
        var last: (page: Int, lo: Int, hi: Int, b: Int, j: Int)? = nil
        for w in writes {
            if let p = last, p.page == w.page, w.lo <= p.hi {
                throw FlashMetalError.value(
                    op, "\(name)[\(p.b), \(p.j)] and \(name)[\(w.b), \(w.j)] both name page \(w.page), and the "
                        + "append writes row \(w.lo) of it through both (cache_seqlens[\(p.b)] = \(starts[p.b]), "
                        + "cache_seqlens[\(w.b)] = \(starts[w.b]), \(count) new rows each): two sequences may not "
                        + "share the slots an append writes")
            }
            if last == nil || last!.page != w.page || w.hi > last!.hi { last = w }
        }
    }
}
