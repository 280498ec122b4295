/// Which keys one query row sees under an attention mask, when they are a
/// range: the split-KV decode reads per-sequence key ranges [start, end)
/// (a [2, B] lengths table) instead of a mask, so a single-row step whose
/// mask only hides keys (padding, a sliding window) stays on the decode.
public enum MaskKeyRanges {
    /// The op name errors carry.
    public static let op = "mask_key_ranges"

    /// For `mask` [B or 1, H or 1, 1, kL] (bool: true = attend; or additive
    /// float32/float16/bfloat16: 0 = attend, -inf = hidden), a query row at
    /// position `queryPosition`, `causal` (keys after it hidden) and
    /// `window` (keys p with queryPosition - p < window; nil: none): writes
    /// each batch row's visible keys to `out` int32 [2, B] (row 0 the ends,
    /// row 1 the starts; [0, 0) for a row that sees none) and returns true
    /// when they are one contiguous range per batch row, the same for every
    /// head, biased by nothing but 0. Returns false, leaving `out` as it
    /// was, for a hole, a finite bias or heads that differ.
    public static func find(_ mask: TensorRef, causal: Bool, queryPosition: Int, window: Int?,
                            out: TensorRef) throws -> Bool {
        try mask.requireDType([.bool, .f32, .f16, .bf16], op: op, name: "mask")
        try mask.requireRank([4], op: op, name: "mask")
        try mask.requireBytes(op: op, name: "mask")
        if mask.shape[2] != 1 {
            throw FlashMetalError.value(op, "mask must be [B or 1, H or 1, 1, kL] (one query row), got \(mask.shape)",
                                        arg: "mask")
        }
        let (batch, heads, keys) = (mask.shape[0], mask.shape[1], mask.shape[3])
        if heads == 0 && batch > 0 {
            throw FlashMetalError.value(op, "mask must have a head (its dim 1 is 0), got \(mask.shape)", arg: "mask")
        }
        try out.requireDType([.i32], op: op, name: "out")
        if out.shape != [2, batch] {
            throw FlashMetalError.value(op, "out must have shape [2, \(batch)] (the mask's batch), got \(out.shape)",
                                        arg: "out")
        }
        try out.requireBytes(op: op, name: "out")
        try Dispatch.requireDisjoint([out], from: [mask], op: op)
        if let window, window < 1 { throw FlashMetalError.value(op, "window must be >= 1, got \(window)", arg: "window") }
        if keys > Int(Int32.max) {
            throw FlashMetalError.value(op, "the mask's \(keys) keys must fit int32", arg: "mask")
        }
        let visible: [[Bool]]?
        switch mask.dtype {
        case .bool: visible = visibility(mask, UInt8.self, magnitude: 0xFF, negativeInfinity: nil)
        case .f32: visible = visibility(mask, UInt32.self, magnitude: 0x7FFF_FFFF, negativeInfinity: 0xFF80_0000)
        case .f16: visible = visibility(mask, UInt16.self, magnitude: 0x7FFF, negativeInfinity: 0xFC00)
        default: visible = visibility(mask, UInt16.self, magnitude: 0x7FFF, negativeInfinity: 0xFF80)  // bfloat16
        }
        guard let visible else { return false }
        // The keys causal and the window leave: [lowest, highest].
        let highest = causal ? min(queryPosition, keys - 1) : keys - 1
        let lowest = window.map { max(queryPosition - $0 + 1, 0) } ?? 0
        var ranges = [(start: Int, end: Int)]()
        ranges.reserveCapacity(batch)
        for row in visible {
            var (start, end, count) = (0, 0, 0)
            if lowest <= highest {
                for k in lowest...highest where row[k] {
                    if count == 0 { start = k }
                    end = k + 1
                    count += 1
                }
            }
            if end - start != count { return false }  // a hole inside the range
            ranges.append((start, end))
        }
        let table = out.data.assumingMemoryBound(to: Int32.self)
        for (b, r) in ranges.enumerated() {
            table[b] = Int32(r.end)
            table[batch + b] = Int32(r.start)
        }
        return true
    }

    /// Each batch row's visible keys (its first head's; every other head
    /// must see the same): an element is visible when its bits under
    /// `magnitude` are not all 0 for a bool mask, all 0 (+-0) for an
    /// additive one. nil when heads differ or an additive mask holds a value
    /// other than +-0 and `negativeInfinity` (a bias the decode cannot add).
    static func visibility<T: FixedWidthInteger>(_ mask: TensorRef, _: T.Type, magnitude: T,
                                                 negativeInfinity: T?) -> [[Bool]]? {
        let (batch, heads, keys) = (mask.shape[0], mask.shape[1], mask.shape[3])
        let p = mask.data.assumingMemoryBound(to: T.self)
        let additive = negativeInfinity != nil
        @inline(__always) func visible(_ x: T) -> Bool { (x & magnitude == 0) == additive }
        @inline(__always) func biased(_ x: T) -> Bool { additive && x & magnitude != 0 && x != negativeInfinity }
        var rows = [[Bool]]()
        rows.reserveCapacity(batch)
        for b in 0..<batch {
            let first = p + b * heads * keys
            var row = [Bool](repeating: false, count: keys)
            for k in 0..<keys {
                if biased(first[k]) { return nil }
                row[k] = visible(first[k])
            }
            for h in 1..<max(heads, 1) {
                let head = first + h * keys
                if sameBytes(head, first, keys * MemoryLayout<T>.size) { continue }  // the same bits: the same keys
                for k in 0..<keys where biased(head[k]) || visible(head[k]) != row[k] { return nil }
            }
            rows.append(row)
        }
        return rows
    }

    /// Whether `count` bytes at `a` and `b` are equal, compared 8 at a time.
    static func sameBytes(_ a: UnsafeRawPointer, _ b: UnsafeRawPointer, _ count: Int) -> Bool {
        var i = 0
        while i + 8 <= count {
            if a.loadUnaligned(fromByteOffset: i, as: UInt64.self) != b.loadUnaligned(fromByteOffset: i, as: UInt64.self) {
                return false
            }
            i += 8
        }
        while i < count {
            if a.load(fromByteOffset: i, as: UInt8.self) != b.load(fromByteOffset: i, as: UInt8.self) { return false }
            i += 1
        }
        return true
    }
}
