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

/// Live registry handles: a destroyed or foreign pointer is rejected with
/// an error instead of being dereferenced.
enum Handles {
    private static let lock = Lock()
    nonisolated(unsafe) private static var live: Set<UnsafeMutableRawPointer> = []

    static func register(_ r: Registry) -> OpaquePointer {
        let p = Unmanaged.passRetained(r).toOpaque()
        lock.withLock { _ = live.insert(p) }
        return OpaquePointer(p)
    }

    static func registry(_ h: OpaquePointer?, op: String) throws -> Registry {
        guard let h = h else { throw FlashMetalError.value(op, "registry is null") }
        let p = UnsafeMutableRawPointer(h)
        return try lock.withLock {
            guard live.contains(p) else {
                throw FlashMetalError.value(op, "registry \(p) is not a live registry (destroyed or invalid)")
            }
            return Unmanaged<Registry>.fromOpaque(p).takeUnretainedValue()
        }
    }

    static func destroy(_ h: OpaquePointer) throws {
        let p = UnsafeMutableRawPointer(h)
        let found = lock.withLock { live.remove(p) != nil }
        guard found else {
            throw FlashMetalError.value("destroy_registry", "registry \(p) is not a live registry (destroyed or invalid)")
        }
        Unmanaged<Registry>.fromOpaque(p).release()
    }
}

/// Reads an optional ABI tensor: NULL means absent.
func optionalTensor(_ t: UnsafePointer<FMTensor>?, op: String, name: String) throws -> TensorRef? {
    guard t != nil else { return nil }
    return try TensorRef(t, op: op, name: name)
}
