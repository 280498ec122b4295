/// flash_attn_with_kvcache's new k/v: appended into the caches at each
/// sequence's length, then attended with the lengths grown by the new rows.
/// The serving entry points (fm_dispatch_attn, fm_dispatch_vec_seq) build
/// the append's dispatch with this and the attention's from the grown
/// lengths, both before either runs: a call the append or the attention
/// refuses writes nothing, so no cache row ever needs restoring.
public enum AppendBeforeAttention {
    /// The append's dispatch (nil when there are no new rows, after the same
    /// validation) and the lengths after it, written into `grown`
    /// (`seqlens.usedByteCount` bytes): `seqlens`' shape, row 0 each sequence's length
    /// plus n_new, a [2, B] table's row 1 (each sequence's first key) as given.
    public static func plan(kNew: TensorRef, vNew: TensorRef, kCache: TensorRef, vCache: TensorRef,
                            seqlens: TensorRef, blockTable: TensorRef?, grown: UnsafeMutableRawPointer,
                            op: String, names: (k: String, v: String)) throws -> (append: Dispatch?, grown: TensorRef) {
        try seqlens.requireDType([.i32], op: op, name: "cache_seqlens")
        let paired = seqlens.rank == 2 && seqlens.shape[0] == 2
        if seqlens.rank != 1 && !paired {
            throw FlashMetalError.value(op, "cache_seqlens must have shape [B] (or [2, B] with cache_leftpad) to append "
                + "k/v, got \(seqlens.shape)", arg: "cache_seqlens")
        }
        try seqlens.requireBytes(op: op, name: "cache_seqlens")
        let batch = paired ? seqlens.shape[1] : seqlens.shape[0]
        let ends = paired ? seqlens.reshaped([batch], byteCount: batch * 4) : seqlens
        var t = KVAppendTensors(kNew: kNew, vNew: vNew, kCache: kCache, vCache: vCache, seqlens: ends,
                                blockTable: blockTable)
        (t.kNewName, t.vNewName) = names
        // Checks every length plus n_new against the capacity (so the sums fit int32) and every table entry;
        // its errors name the caller's op.
        let append: Dispatch?
        do { append = try KVAppendDispatcher.makeDispatch(t) } catch let e as FlashMetalError { throw e.naming(op: op) }
        let rows = kNew.shape[1]
        let src = seqlens.data.assumingMemoryBound(to: Int32.self)
        let dst = grown.assumingMemoryBound(to: Int32.self)
        for b in 0..<batch { dst[b] = src[b] + Int32(rows) }
        if paired { for b in 0..<batch { dst[batch + b] = src[batch + b] } }
        let table = TensorRef(data: grown, byteCount: seqlens.usedByteCount, dtype: .i32, shape: seqlens.shape,
                              name: seqlens.name)
        return (append, table)
    }
}

extension Registry {
    /// Runs `body` with the append's dispatches ([] when `rows` is nil) and
    /// the lengths the attention reads: `seqlens` as given, or grown by the
    /// new rows (`rows`: k_new, v_new) in scratch that lives as long as the work.
    public func appendingBeforeAttention(_ rows: (k: TensorRef, v: TensorRef)?, kCache: TensorRef, vCache: TensorRef,
                                         seqlens: TensorRef?, blockTable: TensorRef?, op: String,
                                         names: (k: String, v: String),
                                         _ body: ([Dispatch], TensorRef?) throws -> Void) throws {
        guard let rows else { return try body([], seqlens) }
        guard let seqlens else {
            throw FlashMetalError.value(op, "cache_seqlens is required when appending \(names.k)/\(names.v)",
                                        arg: "cache_seqlens")
        }
        try withScratch(op: op, bytes: max(seqlens.usedByteCount, 4)) { m in
            let (append, grown) = try AppendBeforeAttention.plan(
                kNew: rows.k, vNew: rows.v, kCache: kCache, vCache: vCache, seqlens: seqlens, blockTable: blockTable,
                grown: m.data, op: op, names: names)
            try body(append.map { [$0] } ?? [], grown)
        }
    }
}
