// INTERIM (decode-gpu): a minimal stand-in for serving-api's
// SequenceTables.swift until it lands on main; same signatures, so the switch
// is a rename. Delete this file after `git merge main` brings SequenceTables.

/// Host checks of the int32 tables a serving decode or kv_append reads through.
enum InterimSequenceTables {
    static func int32(_ t: TensorRef, _ i: Int) -> Int {
        Int(t.data.loadUnaligned(fromByteOffset: i * 4, as: Int32.self))
    }

    static func requireInt32(_ t: TensorRef, shape want: [Int?], op: String, name: String) throws {
        try t.requireDType([.i32], op: op, name: name)
        try t.requireRank([want.count], op: op, name: name)
        for (axis, w) in want.enumerated() where w != nil && t.shape[axis] != w {
            throw FlashMetalError.value(op, "\(name) must have shape \(want.map { $0.map(String.init) ?? "_" }), got \(t.shape)")
        }
        try t.requireBytes(op: op, name: name)
    }

    /// int32 [batch], each in 0...capacity. Returns the lengths.
    static func seqlens(_ t: TensorRef, op: String, name: String, batch: Int,
                        capacity: Int, capacityName: String) throws -> [Int] {
        try requireInt32(t, shape: [batch], op: op, name: name)
        return try (0..<batch).map { b in
            let n = int32(t, b)
            if n < 0 || n > capacity {
                throw FlashMetalError.value(op, "\(name)[\(b)] = \(n) is out of range [0, \(capacity)] (\(capacityName))")
            }
            return n
        }
    }

    /// int32 [B, max_pages]: page_size a positive multiple of `tile`, and
    /// every entry of the pages holding keys < lengths[b] in [0, numPages).
    @discardableResult
    static func blockTable(_ t: TensorRef, op: String, name: String, lengths: [Int],
                           numPages: Int, pageSize: Int, tile: Int, cacheName: String) throws -> Int {
        try requireInt32(t, shape: [lengths.count, nil], op: op, name: name)
        guard pageSize > 0 && pageSize % tile == 0 else {
            throw FlashMetalError.value(op, "\(cacheName) page size \(pageSize) (its dim 1) must be a positive multiple of \(tile)")
        }
        let maxPages = t.shape[1]
        for (b, length) in lengths.enumerated() {
            let pages = (length + pageSize - 1) / pageSize
            if pages > maxPages {
                throw FlashMetalError.value(op, "sequence \(b) has \(length) keys but \(name) holds \(maxPages) pages of \(pageSize)")
            }
            for j in 0..<pages {
                let page = int32(t, b * maxPages + j)
                if page < 0 || page >= numPages {
                    throw FlashMetalError.value(op, "\(name)[\(b), \(j)] = \(page) is out of range [0, \(numPages)) (the pages of \(cacheName))")
                }
            }
        }
        return maxPages
    }
}
