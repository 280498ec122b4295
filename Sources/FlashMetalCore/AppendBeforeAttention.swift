/// flash_attn_with_kvcache's new k/v: appended into the caches at each
/// sequence's length, then attended with the lengths grown by the new rows.
/// The serving entry points (fm_dispatch_attn, fm_dispatch_vec_seq over
/// dense caches, fm_dispatch_kv_codes_attn over quantized ones) build the
/// append's dispatch with this and the attention's from the grown lengths,
/// both before either runs: a call the append or the attention refuses
/// writes nothing, so no cache row ever needs restoring.
public enum AppendBeforeAttention {
    /// Makes the append's dispatch (nil when there are no new rows, after
    /// the same validation) from the new rows and each sequence's length
    /// (int32 [B]) before it; with it the rows each sequence gains.
    public typealias MakeAppend = (_ rows: (k: TensorRef, v: TensorRef), _ ends: TensorRef) throws
        -> (dispatch: Dispatch?, added: [Int])

    /// The append's dispatch and the lengths after it, written into `grown`
    /// (`seqlens.usedByteCount` bytes): `seqlens`' shape, row 0 each sequence's length
    /// plus n_new, a [2, B] table's row 1 (each sequence's first key) as given.
    public static func plan(rows: (k: TensorRef, v: TensorRef), seqlens: TensorRef, grown: UnsafeMutableRawPointer,
                            op: String, makeAppend: MakeAppend) throws -> (append: Dispatch?, grown: TensorRef) {
        try seqlens.requireDType([.i32], op: op, name: "cache_seqlens")
        let paired = seqlens.rank == 2 && seqlens.shape[0] == 2
        if seqlens.rank != 1 && !paired {
            throw FlashMetalError.value(op, "cache_seqlens must have shape [B] (or [2, B] with cache_leftpad) to append "
                + "k/v, got \(seqlens.shape)", arg: "cache_seqlens")
        }
        try seqlens.requireBytes(op: op, name: "cache_seqlens")
        let batch = paired ? seqlens.shape[1] : seqlens.shape[0]
        let ends = paired ? seqlens.reshaped([batch], byteCount: batch * 4) : seqlens
        // The append checks every length plus its new rows against the capacity and every table entry; its
        // errors name the caller's op.
        let append: (dispatch: Dispatch?, added: [Int])
        do { append = try makeAppend(rows, ends) } catch let e as FlashMetalError { throw e.naming(op: op) }
        let src = seqlens.data.assumingMemoryBound(to: Int32.self)
        let dst = grown.assumingMemoryBound(to: Int32.self)
        for b in 0..<batch {
            // A paged capacity may exceed int32; the lengths the attention reads may not.
            let sum = Int(src[b]) + append.added[b]
            guard sum <= Int(Int32.max) else {
                throw FlashMetalError.value(op, "cache_seqlens[\(b)] + its \(append.added[b]) new rows = \(sum) "
                    + "exceeds the int32 lengths the attention reads (\(Int32.max))", arg: "cache_seqlens")
            }
            dst[b] = Int32(sum)
        }
        if paired { for b in 0..<batch { dst[batch + b] = src[batch + b] } }
        // Still the caller's lengths in overlap checks: an output sharing their bytes is refused.
        return (append.dispatch, seqlens.copied(to: grown))
    }

    /// The dense caches' append (kv_append), naming the new rows `names`.
    public static func dense(kCache: TensorRef, vCache: TensorRef, blockTable: TensorRef?,
                             names: (k: String, v: String)) -> MakeAppend {
        { rows, ends in
            var t = KVAppendTensors(kNew: rows.k, vNew: rows.v, kCache: kCache, vCache: vCache, seqlens: ends,
                                    blockTable: blockTable)
            (t.kNewName, t.vNewName) = names
            return (try KVAppendDispatcher.makeDispatch(t), Array(repeating: rows.k.shape[1], count: ends.shape[0]))
        }
    }
}

extension Registry {
    /// Runs `body` with the append's dispatches ([] when `rows` is nil) and
    /// the lengths the attention reads: `seqlens` as given, or grown by the
    /// new rows (`rows`: k_new, v_new) in scratch that lives as long as the work.
    public func appendingBeforeAttention(_ rows: (k: TensorRef, v: TensorRef)?, seqlens: TensorRef?, op: String,
                                         names: (k: String, v: String), makeAppend: AppendBeforeAttention.MakeAppend,
                                         _ body: ([Dispatch], TensorRef?) throws -> Void) throws {
        guard let rows else { return try body([], seqlens) }
        guard let seqlens else {
            throw FlashMetalError.value(op, "cache_seqlens is required when appending \(names.k)/\(names.v)",
                                        arg: "cache_seqlens")
        }
        try withScratch(op: op, bytes: max(seqlens.usedByteCount, 4)) { m in
            let (append, grown) = try AppendBeforeAttention.plan(rows: rows, seqlens: seqlens, grown: m.data, op: op,
                                                                 makeAppend: makeAppend)
            try body(append.map { [$0] } ?? [], grown)
        }
    }
}
