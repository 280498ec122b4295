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

/// Runs an entry point's body; every error becomes a status and a message.
func guarded(_ err: UnsafeMutablePointer<CChar>?, _ errlen: Int, _ body: () throws -> Void) -> Int32 {
    do {
        try body()
        writeMessage("", err, errlen)
        return Int32(FM_OK.rawValue)
    } catch let e as FlashMetalError {
        writeMessage(e.message, err, errlen)
        return Int32(e.status.rawValue)
    } catch {
        writeMessage("internal error: \(error)", err, errlen)
        return Int32(FM_ERROR_INTERNAL.rawValue)
    }
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
        guard let h = h else { throw FlashMetalError.value(op, "registry is null") }
        let id = UInt(bitPattern: h)
        guard let r = lock.withLock({ live[id] }) else {
            throw FlashMetalError.value(op, "registry \(h) is not a live registry (destroyed or invalid)")
        }
        return r
    }

    /// Removes the handle, then closes the registry (its open batches end).
    /// Calls already running on other threads hold their own reference.
    static func destroy(_ h: OpaquePointer) throws {
        let id = UInt(bitPattern: h)
        guard let r = lock.withLock({ live.removeValue(forKey: id) }) else {
            throw FlashMetalError.value("destroy_registry", "registry \(h) is not a live registry (destroyed or invalid)")
        }
        try r.close()
    }
}

/// Reads an optional ABI tensor: NULL means absent.
func optionalTensor(_ t: UnsafePointer<FMTensor>?, op: String, name: String) throws -> TensorRef? {
    guard t != nil else { return nil }
    return try TensorRef(t, op: op, name: name)
}
