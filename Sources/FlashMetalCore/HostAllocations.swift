#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Library-owned host memory for long-lived tensors (a KV cache), handed out
/// by fm_alloc_host: zeroed, aligned to and rounded up to 16 KiB (Apple
/// silicon's page), so the Metal backend can wrap a whole allocation in one
/// no-copy MTLBuffer once for its lifetime instead of on every call.
public enum HostAllocations {
    /// Alignment and length granule of every allocation.
    public static let granule = 16384

    /// One live allocation; `id` is never handed out twice.
    public struct Allocation: Sendable {
        public let id: UInt64
        public let address: UInt
        public let length: Int
        public var base: UnsafeMutableRawPointer { UnsafeMutableRawPointer(bitPattern: address)! }
    }

    private static let lock = Lock()
    nonisolated(unsafe) private static var live: [UInt: Allocation] = [:]
    nonisolated(unsafe) private static var lastID: UInt64 = 0
    nonisolated(unsafe) private static var hooks: [UInt64: (Allocation) -> Void] = [:]
    nonisolated(unsafe) private static var lastHook: UInt64 = 0

    /// `bytes` (> 0) zeroed bytes, rounded up to the granule.
    public static func allocate(bytes: Int, op: String) throws -> Allocation {
        guard bytes > 0, bytes <= Int.max - granule else {
            throw FlashMetalError.value(op, "bytes must be 1...\(Int.max - granule), got \(bytes)")
        }
        let length = (bytes + granule - 1) / granule * granule
        var p: UnsafeMutableRawPointer?
        guard posix_memalign(&p, granule, length) == 0, let mem = p else {
            throw FlashMetalError.value(op, "cannot allocate \(bytes) bytes")
        }
        mem.initializeMemory(as: UInt8.self, repeating: 0, count: length)
        return lock.withLock {
            lastID += 1
            let a = Allocation(id: lastID, address: UInt(bitPattern: mem), length: length)
            live[a.address] = a
            return a
        }
    }

    /// Frees a live allocation by its base address; anything else is an
    /// error. Release hooks run first, so no backend keeps a wrapper of
    /// freed memory.
    public static func free(_ p: UnsafeMutableRawPointer?, op: String) throws {
        let a: Allocation? = lock.withLock { p.flatMap { live.removeValue(forKey: UInt(bitPattern: $0)) } }
        guard let a else {
            throw FlashMetalError.value(op, "\(p.map { "\($0)" } ?? "NULL") is not a live allocation of fm_alloc_host")
        }
        for hook in lock.withLock({ Array(hooks.values) }) { hook(a) }
        libcFree(a.base)
    }

    /// The live allocation that holds all of [start, end), if any.
    public static func containing(_ start: UInt, _ end: UInt) -> Allocation? {
        lock.withLock { live.values.first { $0.address <= start && end <= $0.address + UInt($0.length) } }
    }

    /// Registers `hook`, called with each allocation about to be freed;
    /// returns a token for `removeReleaseHook`.
    public static func addReleaseHook(_ hook: @escaping (Allocation) -> Void) -> UInt64 {
        lock.withLock {
            lastHook += 1
            hooks[lastHook] = hook
            return lastHook
        }
    }

    public static func removeReleaseHook(_ token: UInt64) {
        _ = lock.withLock { hooks.removeValue(forKey: token) }
    }
}

/// libc's free (the enum's own `free` shadows it inside the type).
private func libcFree(_ p: UnsafeMutableRawPointer) { free(p) }
