import CFlashMetal
import FlashMetalCore

/// fm_dispatch_attn of flashmetal.h: the serving prefill (flash_attn_func,
/// flash_attn_varlen_func, flash_attn_with_kvcache with qL > 1). Errors name
/// the flash-attn function the caller names in FMError.public_op, else the
/// one the tables present imply (AttnOp).
@_cdecl("fm_dispatch_attn")
public func fm_dispatch_attn(
    _ registry: OpaquePointer?, _ q: UnsafePointer<FMTensor>?, _ k: UnsafePointer<FMTensor>?,
    _ v: UnsafePointer<FMTensor>?, _ seq: UnsafePointer<FMSeqTensors>?, _ out: UnsafePointer<FMTensor>?,
    _ options: UnsafePointer<FMAttnOptions>?,
    _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) {
        let s = seq?.pointee ?? FMSeqTensors()
        let kind = publicOp(err).flatMap { AttnOp(name: $0) }
            ?? AttnOp(varlen: s.cu_seqlens_q != nil || s.cu_seqlens_k != nil, cache: s.seqlens_k != nil || s.block_table != nil)
        let op = kind.name
        let reg = try Handles.registry(registry, op: op)
        guard let options = options else { throw FlashMetalError.value(op, "options is null", arg: "options") }
        var t = AttnTensors(q: try TensorRef(q, op: op, name: "q"), k: try TensorRef(k, op: op, name: kind.kName),
                            v: try TensorRef(v, op: op, name: kind.vName), out: try TensorRef(out, op: op, name: "out"))
        t.sinks = try optionalTensor(s.sinks, op: op, name: "sinks")
        t.lse = try optionalTensor(s.lse, op: op, name: "softmax_lse")
        t.alibiSlopes = try optionalTensor(s.alibi_slopes, op: op, name: "alibi_slopes")
        t.kind = kind
        let o = try AttnOptions(options.pointee, op: op)
        let tables = [try optionalTensor(s.cu_seqlens_q, op: op, name: "cu_seqlens_q"),
                      try optionalTensor(s.cu_seqlens_k, op: op, name: "cu_seqlens_k"),
                      try optionalTensor(s.seqlens_k, op: op, name: kind.seqlensKName),
                      try optionalTensor(s.block_table, op: op, name: "block_table"),
                      try optionalTensor(s.seqused_q, op: op, name: "seqused_q")]
        let names = newRowNames(err)
        let appended = try newRows(s.k_new, s.v_new, op: op, names: names)
        if appended != nil && s.cu_seqlens_k != nil {
            throw FlashMetalError.value(op, "\(names.k)/\(names.v) are appended into a cache: cu_seqlens_k must be NULL "
                + "(cu_seqlens_k_new splits the new rows)", arg: "cu_seqlens_k")
        }
        if appended == nil && s.cu_seqlens_k_new != nil {
            throw FlashMetalError.value(op, "cu_seqlens_k_new is given without \(names.k) and \(names.v) (it splits the "
                + "new keys between the sequences)", arg: "cu_seqlens_k_new")
        }
        let ragged = try optionalTensor(s.cu_seqlens_k_new, op: op, name: "cu_seqlens_k_new")
        let newRowCount = ragged == nil ? 0 : appended?.k.shape.first ?? 0
        try requireCacheRowsWithoutPackedKeys(s, op: op)
        let batchIdx = try optionalTensor(s.cache_batch_idx, op: op, name: CacheBatchIndex.name)
        try reg.withPrivateCopies(op: op, tables + [ragged, batchIdx]) { c in
            // With cache_batch_idx the kernels read the block table it makes.
            let newRows = c[0] == nil ? rowsPerSequence(appended, ragged: ragged != nil) : nil
            let batch = SequenceTables.sequences(q: t.q, cuSeqlensQ: c[0])
            try withCacheRows(c[6], blockTable: c[3], cacheShape: t.k.shape, batch: batch,
                              appending: appended != nil, seqlens: c[2], newRows: newRows,
                              written: [t.out, t.lse].compactMap { $0 } + (appended == nil ? [] : [t.k, t.v]),
                              on: reg, op: op) { pages in
                (t.cuSeqlensQ, t.cuSeqlensK, t.blockTable, t.sequsedQ) = (c[0], c[1], pages, c[4])
                func attend(_ makeAppend: AppendBeforeAttention.MakeAppend) throws {
                    try reg.appendingBeforeAttention(appended, seqlens: c[2], op: op, names: names,
                                                     makeAppend: makeAppend) { append, seqlens in
                        t.seqlensK = seqlens
                        let plan = try AttnDispatcher.makePlan(t, o)
                        if plan.tableBytes == 0 {
                            try reg.run(append + plan.dispatches(tables: nil), op: op)
                        } else {
                            try reg.withScratch(op: op, bytes: plan.tableBytes) { m in
                                try reg.run(append + plan.dispatches(tables: m.data), op: op)
                            }
                        }
                        // Once the run accepted the call (its overlap checks included): no kernel writes these rows.
                        plan.clearUnownedRows()
                    }
                }
                guard let cu = c[5] else {
                    return try attend(AppendBeforeAttention.dense(kCache: t.k, vCache: t.v, blockTable: pages, names: names))
                }
                // Ragged new rows: their per-row tables live in scratch as long as the work; no kernel
                // reads cu_seqlens_k_new, so what the call writes is checked against it here.
                try Dispatch.requireDisjoint([t.k, t.v, t.out, t.lse].compactMap { $0 }, from: [cu], op: op)
                try reg.withScratch(op: op, bytes: RaggedAppend.tableBytes(rows: newRowCount)) { slots in
                    let split = RaggedAppend(kCache: t.k, vCache: t.v, blockTable: pages, cuSeqlensKNew: cu, names: names)
                    try attend { rows, ends in try split.plan(rows: rows, ends: ends, tables: slots.data) }
                }
            }
        }
    }
}
