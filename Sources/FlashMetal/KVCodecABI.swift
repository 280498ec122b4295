import CFlashMetal
import FlashMetalCore

/// The codec an FMKVCodec pointer describes; NULL is a value error.
func kvCodec(_ c: UnsafePointer<FMKVCodec>?, op: String) throws -> KVCodec {
    guard let c = c else { throw FlashMetalError.value(op, "codec must not be NULL") }
    return try KVCodec(c.pointee, op: op)
}

/// fm_kv_codec_layout of flashmetal.h: a codec validated, its row layout out.
@_cdecl("fm_kv_codec_layout")
public func fm_kv_codec_layout(
    _ codec: UnsafePointer<FMKVCodec>?, _ out: UnsafeMutablePointer<FMKVCodecLayout>?,
    _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) {
        let c = try kvCodec(codec, op: KVCodec.op)
        guard let out = out else { throw FlashMetalError.value(KVCodec.op, "out must not be NULL") }
        out.pointee = FMKVCodecLayout(block: Int32(c.block), num_blocks: Int32(c.numBlocks),
                                      row_bytes: Int32(c.rowBytes), _pad: 0)
    }
}

/// fm_dispatch_kv_encode of flashmetal.h: rows to codes and norms.
@_cdecl("fm_dispatch_kv_encode")
public func fm_dispatch_kv_encode(
    _ registry: OpaquePointer?, _ codec: UnsafePointer<FMKVCodec>?, _ x: UnsafePointer<FMTensor>?,
    _ codes: UnsafePointer<FMTensor>?, _ norms: UnsafePointer<FMTensor>?,
    _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) {
        let op = KVCodecDispatcher.encodeOp
        let reg = try Handles.registry(registry, op: op)
        let c = try kvCodec(codec, op: op)
        if let d = try KVCodecDispatcher.encode(
            c, x: try TensorRef(x, op: op, name: "x"), codes: try TensorRef(codes, op: op, name: "codes"),
            norms: try TensorRef(norms, op: op, name: "norms")) {
            try reg.run([d], op: op)
        }
    }
}

/// fm_dispatch_kv_dequantize of flashmetal.h: codes and norms back to float32 rows.
@_cdecl("fm_dispatch_kv_dequantize")
public func fm_dispatch_kv_dequantize(
    _ registry: OpaquePointer?, _ codec: UnsafePointer<FMKVCodec>?, _ codes: UnsafePointer<FMTensor>?,
    _ norms: UnsafePointer<FMTensor>?, _ out: UnsafePointer<FMTensor>?,
    _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) {
        let op = KVCodecDispatcher.dequantizeOp
        let reg = try Handles.registry(registry, op: op)
        let c = try kvCodec(codec, op: op)
        if let d = try KVCodecDispatcher.dequantize(
            c, codes: try TensorRef(codes, op: op, name: "codes"), norms: try TensorRef(norms, op: op, name: "norms"),
            out: try TensorRef(out, op: op, name: "out")) {
            try reg.run([d], op: op)
        }
    }
}

/// fm_dispatch_kv_codes_decode of flashmetal.h: decode over quantized caches.
@_cdecl("fm_dispatch_kv_codes_decode")
public func fm_dispatch_kv_codes_decode(
    _ registry: OpaquePointer?, _ q: UnsafePointer<FMTensor>?, _ kCodec: UnsafePointer<FMKVCodec>?,
    _ kCodes: UnsafePointer<FMTensor>?, _ kNorms: UnsafePointer<FMTensor>?, _ vCodec: UnsafePointer<FMKVCodec>?,
    _ vCodes: UnsafePointer<FMTensor>?, _ vNorms: UnsafePointer<FMTensor>?, _ out: UnsafePointer<FMTensor>?,
    _ options: UnsafePointer<FMKVCodesDecodeOptions>?, _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) {
        let op = KVCodesDecodeDispatcher.op
        let reg = try Handles.registry(registry, op: op)
        guard let options = options else { throw FlashMetalError.value(op, "options must not be NULL", arg: "options") }
        let k = QuantizedCache(codec: try kvCodec(kCodec, op: op), codes: try TensorRef(kCodes, op: op, name: "k_cache codes"),
                               norms: try TensorRef(kNorms, op: op, name: "k_cache norms"))
        let v = QuantizedCache(codec: try kvCodec(vCodec, op: op), codes: try TensorRef(vCodes, op: op, name: "v_cache codes"),
                               norms: try TensorRef(vNorms, op: op, name: "v_cache norms"))
        let plan = try KVCodesDecodeDispatcher.makePlan(
            q: try TensorRef(q, op: op, name: "q"), k: k, v: v, out: try TensorRef(out, op: op, name: "out"),
            options: options.pointee, splitKeys: reg.backend.splitsKeysInGrid)
        try run(plan, on: reg, op: op)
    }
}

/// Runs a plan's dispatches after `append`'s, with library scratch for its
/// partials when it has any.
func run(_ plan: KVCodesPlan, after append: [Dispatch] = [], on reg: Registry, op: String) throws {
    if !plan.unbound.isEmpty {
        try Dispatch.requireDisjoint(Dispatch.written(by: append), from: plan.unbound, op: op)
    }
    if plan.tmpBytes == 0 {
        try reg.run(append + plan.dispatches(tmp: nil), op: op)
    } else {
        try reg.withScratch(op: op, bytes: plan.tmpBytes) { tmp in
            try reg.run(append + plan.dispatches(tmp: tmp), op: op)
        }
    }
    // Once the run accepted the call (its overlap checks included): no kernel writes these rows.
    plan.unowned.clear()
}

/// One cache argument: its codec and storage, or with a NULL codec a dense
/// cache passed as `codes` (norms then NULL).
func kvSide(_ codec: UnsafePointer<FMKVCodec>?, _ codes: UnsafePointer<FMTensor>?,
            _ norms: UnsafePointer<FMTensor>?, name: String, op: String) throws -> KVSide {
    if codec == nil {
        if norms != nil {
            throw FlashMetalError.value(op, "\(name) norms must be NULL for a dense \(name) (NULL codec)", arg: name)
        }
        return .dense(try TensorRef(codes, op: op, name: name))
    }
    return .codes(QuantizedCache(codec: try kvCodec(codec, op: op), codes: try TensorRef(codes, op: op, name: "\(name) codes"),
                                 norms: try TensorRef(norms, op: op, name: "\(name) norms")))
}

/// fm_dispatch_kv_codes_attn of flashmetal.h: flash_attn_with_kvcache's
/// attention over quantized caches (lengths, pages, sinks, LSE).
@_cdecl("fm_dispatch_kv_codes_attn")
public func fm_dispatch_kv_codes_attn(
    _ registry: OpaquePointer?, _ q: UnsafePointer<FMTensor>?, _ kCodec: UnsafePointer<FMKVCodec>?,
    _ kCodes: UnsafePointer<FMTensor>?, _ kNorms: UnsafePointer<FMTensor>?, _ vCodec: UnsafePointer<FMKVCodec>?,
    _ vCodes: UnsafePointer<FMTensor>?, _ vNorms: UnsafePointer<FMTensor>?, _ seq: UnsafePointer<FMSeqTensors>?,
    _ out: UnsafePointer<FMTensor>?, _ options: UnsafePointer<FMAttnOptions>?, _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) {
        let op = KVCodesAttnDispatcher.op
        let reg = try Handles.registry(registry, op: op)
        guard let options = options else { throw FlashMetalError.value(op, "options must not be NULL", arg: "options") }
        let s = seq?.pointee
        let names = newRowNames(err)
        let appended = try newRows(s?.k_new, s?.v_new, op: op, names: names)
        if appended == nil && s?.cu_seqlens_k_new != nil {
            throw FlashMetalError.value(op, "cu_seqlens_k_new is given without \(names.k) and \(names.v) (it splits the "
                + "new keys between the sequences)", arg: "cu_seqlens_k_new")
        }
        let lseName = publicOp(err) == nil ? "lse" : "softmax_lse"
        var t = KVCodesAttnTensors(
            q: try TensorRef(q, op: op, name: "q"), k: try kvSide(kCodec, kCodes, kNorms, name: "k_cache", op: op),
            v: try kvSide(vCodec, vCodes, vNorms, name: "v_cache", op: op), out: try TensorRef(out, op: op, name: "out"))
        t.sinks = try optionalTensor(s?.sinks, op: op, name: "sinks")
        t.alibi = try optionalTensor(s?.alibi_slopes, op: op, name: "alibi_slopes")
        t.lse = try optionalTensor(s?.lse, op: op, name: lseName)
        t.lseName = lseName
        if appended != nil && s?.cu_seqlens_k != nil {
            throw FlashMetalError.value(op, "\(names.k)/\(names.v) are appended into a cache: cu_seqlens_k must be NULL "
                + "(cu_seqlens_k_new splits the new rows)", arg: "cu_seqlens_k")
        }
        let lensName = s?.cu_seqlens_k == nil ? "cache_seqlens" : "seqused_k"
        let tables = [try optionalTensor(s?.seqlens_k, op: op, name: lensName),
                      try optionalTensor(s?.block_table, op: op, name: "block_table"),
                      try optionalTensor(s?.cu_seqlens_q, op: op, name: "cu_seqlens_q"),
                      try optionalTensor(s?.cu_seqlens_k, op: op, name: "cu_seqlens_k"),
                      try optionalTensor(s?.seqused_q, op: op, name: "seqused_q")]
        let ragged = try optionalTensor(s?.cu_seqlens_k_new, op: op, name: "cu_seqlens_k_new")
        let newRowCount = ragged == nil ? 0 : appended?.k.shape.first ?? 0
        try requireCacheRowsWithoutPackedKeys(s, op: op)
        let batchIdx = try optionalTensor(s?.cache_batch_idx, op: op, name: CacheBatchIndex.name)
        try reg.withPrivateCopies(op: op, tables + [ragged, batchIdx]) { c in
            // With cache_batch_idx the kernels read the block table it makes (over the rows of a
            // quantized side's codes, as the attention reads them).
            let rowsShape = (t.k.quantized ?? t.v.quantized)?.codes.shape ?? t.k.tensors[0].shape
            let newRows = c[2] == nil ? rowsPerSequence(appended, ragged: ragged != nil) : nil
            let batch = SequenceTables.sequences(q: t.q, cuSeqlensQ: c[2])
            try withCacheRows(c[6], blockTable: c[1], cacheShape: rowsShape, batch: batch,
                              appending: appended != nil, seqlens: c[0], newRows: newRows,
                              written: [t.out, t.lse].compactMap { $0 } + (appended == nil ? [] : t.k.tensors + t.v.tensors),
                              on: reg, op: op) { pages in
                (t.blockTable, t.cuSeqlensQ, t.cuSeqlensK, t.sequsedQ) = (pages, c[2], c[3], c[4])
                let (k, v, table) = (t.k, t.v, pages)
                func attend(_ makeAppend: AppendBeforeAttention.MakeAppend) throws {
                    try reg.appendingBeforeAttention(appended, seqlens: c[0], op: op, names: names,
                                                     makeAppend: makeAppend) { append, seqlens in
                        t.seqlens = seqlens
                        try attendOverCodes(t, options.pointee, after: append, on: reg, op: op)
                    }
                }
                func codesAppend(_ kNew: TensorRef, _ vNew: TensorRef, _ ends: TensorRef, _ pages: TensorRef?) throws
                    -> Dispatch? {
                    try KVCodesAppendDispatcher.makeDispatch(kNew: kNew, vNew: vNew, k: k, v: v, seqlens: ends,
                                                             blockTable: pages, kNewName: names.k, vNewName: names.v)
                }
                guard let cu = c[5] else {
                    return try attend { rows, ends in
                        (try codesAppend(rows.k, rows.v, ends, table), Array(repeating: rows.k.shape[1], count: ends.shape[0]))
                    }
                }
                // Ragged new rows: their per-row tables live in scratch as long as the work; no kernel
                // reads cu_seqlens_k_new, so what the call writes is checked against it here.
                let lead = try KVCodesAttnDispatcher.shape(t).lead
                let written = [t.out, t.lse].compactMap { $0 } + [k, v].flatMap { $0.tensors }
                try Dispatch.requireDisjoint(written, from: [cu], op: op)
                try reg.withScratch(op: op, bytes: RaggedAppend.tableBytes(rows: newRowCount)) { slots in
                    let split = RaggedAppend(cacheShape: lead, blockTable: table, cuSeqlensKNew: cu, names: names,
                                             makeView: codesAppend)
                    try attend { rows, ends in try split.plan(rows: rows, ends: ends, tables: slots.data) }
                }
            }
        }
    }
}

/// Plans and runs the codes attention after the `append` dispatches; a
/// [2, B] lengths table (cache_leftpad) is read through a view of one-key
/// pages, seqused_q through a split of every sequence (UsedRowsSplit), their
/// tables in scratch as long as the work.
func attendOverCodes(_ t: KVCodesAttnTensors, _ o: FMAttnOptions, after append: [Dispatch], on reg: Registry,
                     op: String) throws {
    func attend(_ t: KVCodesAttnTensors) throws {
        try run(try KVCodesAttnDispatcher.makePlan(t, o, splitKeys: reg.backend.splitsKeysInGrid), after: append,
                on: reg, op: op)
    }
    if let split = try KVCodesAttnDispatcher.usedRowsSplit(t, o) {
        // The kernels read the split's copies: the caller's tables meet the outputs here.
        try Dispatch.requireDisjoint([t.out, t.lse].compactMap { $0 },
                                     from: [t.cuSeqlensQ, t.cuSeqlensK, t.seqlens, t.blockTable, t.sequsedQ,
                                            t.alibi].compactMap { $0 }, op: op)
        let tables = KVCodesAttnDispatcher.tables(t)
        return try reg.withScratch(op: op, bytes: split.bytes(tables)) { m in
            try attend(KVCodesAttnDispatcher.view(t, split: split, memory: m.data))
        }
    }
    guard t.cuSeqlensK == nil else { return try attend(t) }  // seqused_k, not first keys, beside cu_seqlens_k
    let shape = try KVCodesAttnDispatcher.shape(t)
    guard let pad = try KVCodesLeftPad(seqlens: t.seqlens, lead: shape.lead, blockTable: t.blockTable,
                                       batch: shape.batch, op: op) else { return try attend(t) }
    // The kernels read the view's tables: the caller's meet the outputs (and what the append writes) here.
    try Dispatch.requireDisjoint([t.out, t.lse].compactMap { $0 } + Dispatch.written(by: append),
                                 from: [t.seqlens, t.blockTable].compactMap { $0 }, op: op)
    try reg.withScratch(op: op, bytes: pad.byteCount) { m in try attend(pad.view(of: t, memory: m.data)) }
}

/// fm_dispatch_kv_codes_append of flashmetal.h: new K/V rows encoded into
/// quantized caches at each sequence's current length, in one dispatch.
@_cdecl("fm_dispatch_kv_codes_append")
public func fm_dispatch_kv_codes_append(
    _ registry: OpaquePointer?, _ kNew: UnsafePointer<FMTensor>?, _ vNew: UnsafePointer<FMTensor>?,
    _ kCodec: UnsafePointer<FMKVCodec>?, _ kCodes: UnsafePointer<FMTensor>?, _ kNorms: UnsafePointer<FMTensor>?,
    _ vCodec: UnsafePointer<FMKVCodec>?, _ vCodes: UnsafePointer<FMTensor>?, _ vNorms: UnsafePointer<FMTensor>?,
    _ cacheSeqlens: UnsafePointer<FMTensor>?, _ blockTable: UnsafePointer<FMTensor>?,
    _ err: UnsafeMutablePointer<FMError>?
) -> Int32 {
    guarded(err) {
        let op = KVCodesAppendDispatcher.op
        let reg = try Handles.registry(registry, op: op)
        // flash_attn_with_kvcache calls the new rows k and v.
        let (kName, vName) = publicOp(err) == nil ? ("k_new", "v_new") : ("k", "v")
        let (kn, vn) = (try TensorRef(kNew, op: op, name: kName), try TensorRef(vNew, op: op, name: vName))
        let k = try kvSide(kCodec, kCodes, kNorms, name: "k_cache", op: op)
        let v = try kvSide(vCodec, vCodes, vNorms, name: "v_cache", op: op)
        let tables = [try TensorRef(cacheSeqlens, op: op, name: "cache_seqlens"),
                      try optionalTensor(blockTable, op: op, name: "block_table")]
        try reg.withPrivateCopies(op: op, tables) { c in
            if let d = try KVCodesAppendDispatcher.makeDispatch(kNew: kn, vNew: vn, k: k, v: v, seqlens: c[0]!,
                                                                blockTable: c[1], kNewName: kName, vNewName: vName) {
                try reg.run([d], op: op)
            }
        }
    }
}
