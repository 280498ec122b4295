import CFlashMetal
import FlashMetalCore

/// fm_dispatch_vec_seq of flashmetal.h: serving decode (per-sequence kv
/// lengths, paged K/V, window, sinks, LSE), then its reduce; without a caller
/// tmp the library allocates scratch for exactly as long as the work.
@_cdecl("fm_dispatch_vec_seq")
public func fm_dispatch_vec_seq(
    _ registry: OpaquePointer?, _ q: UnsafePointer<FMTensor>?, _ k: UnsafePointer<FMTensor>?,
    _ v: UnsafePointer<FMTensor>?, _ seq: UnsafePointer<FMSeqTensors>?, _ tmp: UnsafePointer<FMTensor>?,
    _ out: UnsafePointer<FMTensor>?, _ options: UnsafePointer<FMAttnOptions>?,
    _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) {
        let op = VecSeqDispatcher.op
        let reg = try Handles.registry(registry, op: op)
        guard let options = options else { throw FlashMetalError.value(op, "options is null", arg: "options") }
        let o = try VecSeqOptions(options.pointee)
        let s = seq?.pointee
        if s?.cu_seqlens_q != nil || s?.cu_seqlens_k != nil {
            throw FlashMetalError.value(op, "cu_seqlens_q/cu_seqlens_k must be NULL: decode takes q [B, H, D] and a cache per sequence", arg: "cu_seqlens_q")
        }
        if s?.seqused_q != nil {
            throw FlashMetalError.value(op, "seqused_q must be NULL: decode has one query row per sequence", arg: "seqused_q")
        }
        if s?.cu_seqlens_k_new != nil {
            throw FlashMetalError.value(op, "cu_seqlens_k_new must be NULL: decode appends k_new [B, n_new, Hkv, D]",
                                        arg: "cu_seqlens_k_new")
        }
        if o.headMajor && (s?.k_new != nil || s?.cache_batch_idx != nil) {
            throw FlashMetalError.value(op, "head_major takes neither k_new nor cache_batch_idx: they need flash-attn's [B, cap, Hkv, D] caches", arg: "head_major")
        }
        // The flash-attn function the caller runs names k, v and lse its own way.
        let kind = publicOp(err).flatMap { AttnOp(name: $0) }
        let (kName, vName) = (kind?.kName ?? "k", kind?.vName ?? "v")
        let lseName = kind == nil ? "lse" : "softmax_lse"
        let (qt, kt) = (try TensorRef(q, op: op, name: "q"), try TensorRef(k, op: op, name: kName))
        let (vt, outT) = (try TensorRef(v, op: op, name: vName), try TensorRef(out, op: op, name: "out"))
        let given = try optionalTensor(tmp, op: op, name: "tmp")
        let sinks = try optionalTensor(s?.sinks, op: op, name: "sinks")
        let lse = try optionalTensor(s?.lse, op: op, name: lseName)
        let slopes = try optionalTensor(s?.alibi_slopes, op: op, name: "alibi_slopes")
        let names = newRowNames(err)
        let appended = try newRows(s?.k_new, s?.v_new, op: op, names: names)
        let tables = [try optionalTensor(s?.seqlens_k, op: op, name: "cache_seqlens"),
                      try optionalTensor(s?.block_table, op: op, name: "block_table"),
                      try optionalTensor(s?.cache_batch_idx, op: op, name: CacheBatchIndex.name)]
        try reg.withPrivateCopies(op: op, tables) { c in
            // With cache_batch_idx the kernels read the block table it makes.
            let batch = SequenceTables.sequences(q: qt, cuSeqlensQ: nil)
            try withCacheRows(c[2], blockTable: c[1], cacheShape: kt.shape, batch: batch,
                              appending: appended != nil, seqlens: c[0], newRows: rowsPerSequence(appended, ragged: false),
                              written: [outT, lse].compactMap { $0 } + (appended == nil ? [] : [kt, vt]),
                              on: reg, op: op) { pages in
                let dense = AppendBeforeAttention.dense(kCache: kt, vCache: vt, blockTable: pages, names: names)
                try reg.appendingBeforeAttention(appended, seqlens: c[0], op: op, names: names,
                                                 makeAppend: dense) { append, seqlens in
                    let table = pages
                    func tensors(_ tmp: TensorRef) -> VecSeqTensors {
                        var t = VecSeqTensors(q: qt, k: kt, v: vt, out: outT, tmp: tmp, seqlensK: seqlens, blockTable: table,
                                              sinks: sinks, lse: lse)
                        (t.kName, t.vName, t.lseName) = (kName, vName, lseName)
                        t.alibiSlopes = slopes
                        return t
                    }
                    if let given = given {
                        try reg.run(append + VecSeqDispatcher.makeDispatches(tensors(given), o), op: op)
                        return
                    }
                    // Sized from validated shapes; the full validation runs in makeDispatches.
                    let sh = try VecSeqDispatcher.shapes(q: qt, k: kt, v: vt, blockTable: table, kName: kName, vName: vName,
                                                         headMajor: o.headMajor)
                    try reg.withScratch(op: op, bytes: VecDispatcher.tmpByteCount(rows: sh.rows, headDim: sh.headDimV)) { scratch in
                        try reg.run(append + VecSeqDispatcher.makeDispatches(tensors(scratch), o), op: op)
                    }
                }
            }
        }
    }
}
