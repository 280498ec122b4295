import CFlashMetal
import FlashMetalCore

/// Copies a message into a caller's C buffer, truncated and NUL-terminated.
func writeMessage(_ message: String, _ buf: UnsafeMutablePointer<CChar>?, _ len: Int) {
    guard let buf = buf, len > 0 else { return }
    let bytes = Array(message.utf8.prefix(len - 1))
    bytes.withUnsafeBufferPointer { src in
        for (i, b) in src.enumerated() { buf[i] = CChar(bitPattern: b) }
    }
    buf[bytes.count] = 0
}

/// Copies a string into a fixed C char array of an FMError, truncated and
/// NUL-terminated.
private func writeField<T>(_ s: String, _ field: inout T) {
    withUnsafeMutableBytes(of: &field) { raw in
        let buf = raw.bindMemory(to: CChar.self)
        writeMessage(s, buf.baseAddress, buf.count)
    }
}

/// The public function the caller of an entry point named in `err`
/// (FMError.public_op), or nil when it named none.
func publicOp(_ err: UnsafeMutablePointer<FMError>?) -> String? {
    guard let p = err?.pointee.public_op else { return nil }
    let s = String(cString: p)
    return s.isEmpty ? nil : s
}

/// Runs an entry point's body; every error becomes a status and the fields
/// of `err`, under the public function the caller named.
func guarded(_ err: UnsafeMutablePointer<FMError>?, _ body: () throws -> Void) -> Int32 {
    let e: FlashMetalError
    do {
        try body()
        e = FlashMetalError(FM_OK, "")
    } catch let thrown as FlashMetalError {
        e = thrown
    } catch {
        e = FlashMetalError.internalError("\(error)")
    }
    if let err = err {
        let op = publicOp(err) ?? e.op
        err.pointee.status = Int32(e.status.rawValue)
        writeField(e.status == FM_OK ? "" : op, &err.pointee.op)
        writeField(e.argument, &err.pointee.argument)
        writeField(e.what, &err.pointee.message)
    }
    return Int32(e.status.rawValue)
}

/// Live registry handles. A handle is an id from a counter, never a pointer
/// and never handed out twice: a destroyed registry's handle (kept by a stale
/// copy, or by a thread racing destroy) is an error, never another registry.
enum Handles {
    private static let lock = Lock()
    nonisolated(unsafe) private static var live: [UInt: Registry] = [:]
    /// Ids start high so a small integer passed by mistake is never live.
    nonisolated(unsafe) private static var lastId: UInt = 0x464D_0000

    static func register(_ r: Registry) -> OpaquePointer {
        let id: UInt = lock.withLock {
            lastId += 1
            live[lastId] = r
            return lastId
        }
        return OpaquePointer(bitPattern: id)!
    }

    static func registry(_ h: OpaquePointer?, op: String) throws -> Registry {
        guard let h = h else { throw FlashMetalError.value(op, "registry is null", arg: "registry") }
        let id = UInt(bitPattern: h)
        guard let r = lock.withLock({ live[id] }) else {
            throw FlashMetalError.value(op, "registry \(h) is not a live registry (destroyed or invalid)", arg: "registry")
        }
        return r
    }

    /// Removes the handle, then closes the registry (its open batches end).
    /// Calls already running on other threads hold their own reference.
    static func destroy(_ h: OpaquePointer) throws {
        let id = UInt(bitPattern: h)
        guard let r = lock.withLock({ live.removeValue(forKey: id) }) else {
            throw FlashMetalError.value("destroy_registry", "registry \(h) is not a live registry (destroyed or invalid)", arg: "registry")
        }
        try r.close()
    }
}

/// Reads an optional ABI tensor: NULL means absent.
func optionalTensor(_ t: UnsafePointer<FMTensor>?, op: String, name: String) throws -> TensorRef? {
    guard t != nil else { return nil }
    return try TensorRef(t, op: op, name: name)
}

/// The names of FMSeqTensors' k_new/v_new in errors: k and v under
/// flash_attn_with_kvcache (its arguments), else the fields' own.
func newRowNames(_ err: UnsafeMutablePointer<FMError>?) -> (k: String, v: String) {
    publicOp(err) == AttnOp.kvcache.name ? ("k", "v") : ("k_new", "v_new")
}

/// FMSeqTensors' k_new/v_new (flash_attn_with_kvcache's k and v): both or
/// neither (Registry.appendingBeforeAttention requires their lengths).
func newRows(_ kNew: UnsafePointer<FMTensor>?, _ vNew: UnsafePointer<FMTensor>?, op: String,
             names: (k: String, v: String)) throws -> (k: TensorRef, v: TensorRef)? {
    if kNew == nil && vNew == nil { return nil }
    guard kNew != nil && vNew != nil else {
        throw FlashMetalError.value(op, "\(names.k) and \(names.v) must be given together to append them",
                                    arg: kNew == nil ? names.k : names.v)
    }
    return (try TensorRef(kNew, op: op, name: names.k), try TensorRef(vNew, op: op, name: names.v))
}

/// Runs `body` with the block table the serving kernels read: the caller's
/// (`blockTable`), or with cache_batch_idx (`idx`) the one CacheBatchIndex
/// writes into scratch for the work. `cacheShape`: the cache's (k_cache's)
/// shape; `batch`: the sequences; `newRows`: the rows each sequence
/// appends when the cache's own rows must hold them (nil skips that check:
/// ragged new rows are checked by the append); `written`: what the call
/// writes (no kernel binds the caller's cache_batch_idx and block table, so
/// their overlap with it is checked here).
func withCacheRows(_ idx: TensorRef?, blockTable: TensorRef?, cacheShape: [Int], batch: Int, appending: Bool,
                   seqlens: TensorRef?, newRows: Int?, written: [TensorRef], on reg: Registry, op: String,
                   _ body: (TensorRef?) throws -> Void) throws {
    guard let idx else { return try body(blockTable) }
    let rows = try CacheBatchIndex(idx, blockTable: blockTable, cacheShape: cacheShape, batch: batch,
                                   appending: appending, op: op)
    if let newRows { try rows.requireRowRoom(seqlens: seqlens, newRows: newRows, op: op) }
    try Dispatch.requireDisjoint(written, from: [idx] + [blockTable].compactMap { $0 }, op: op)
    try reg.withScratch(op: op, bytes: max(rows.byteCount, 4)) { m in try body(rows.table(memory: m.data)) }
}

/// cache_batch_idx picks rows of flash_attn_with_kvcache's caches: packed
/// keys (cu_seqlens_k) have none.
func requireCacheRowsWithoutPackedKeys(_ s: FMSeqTensors?, op: String) throws {
    if s?.cache_batch_idx != nil && s?.cu_seqlens_k != nil {
        throw FlashMetalError.value(op, "cache_batch_idx picks rows of a cache: cu_seqlens_k must be NULL with it",
                                    arg: CacheBatchIndex.name)
    }
}

/// The rows each sequence appends into its own cache row (k_new's dim 1 when
/// it is [B, n_new, Hkv, D]; 0 without new rows); nil for ragged new rows.
func rowsPerSequence(_ appended: (k: TensorRef, v: TensorRef)?, ragged: Bool) -> Int? {
    if ragged { return nil }
    guard let k = appended?.k else { return 0 }
    return k.rank == 4 ? k.shape[1] : 0
}
