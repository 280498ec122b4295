#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// blk buffers handed out by fm_alloc_blk. Each carries a tag (FMTensor.tag)
/// that is never handed out twice, so a stale copy of a freed descriptor is
/// recognised even when malloc has reused its address; the record also
/// remembers the geometry the blk is for, which prefill checks.
public enum BlkAllocations {
    /// What a tagged blk was allocated for.
    public struct Record: Sendable {
        /// The buffer and its byte length.
        public let address: UInt, bytes: Int
        /// The head dim of the consuming prefill and the mask shape.
        public let headDim: Int, qL: Int, kL: Int
    }

    private static let lock = Lock()
    nonisolated(unsafe) private static var live: [UInt64: Record] = [:]
    nonisolated(unsafe) private static var lastTag: UInt64 = 0

    /// A zeroed buffer of `bytes` for a [qL, kL] mask and `headDim`, and its new tag.
    public static func allocate(bytes: Int, headDim: Int, qL: Int, kL: Int, op: String) throws
        -> (data: UnsafeMutableRawPointer, tag: UInt64)
    {
        guard let p = calloc(bytes, 1) else { throw FlashMetalError.value(op, "cannot allocate \(bytes) bytes") }
        let tag: UInt64 = lock.withLock {
            lastTag += 1
            live[lastTag] = Record(address: UInt(bitPattern: p), bytes: bytes, headDim: headDim, qL: qL, kL: kL)
            return lastTag
        }
        return (p, tag)
    }

    /// Frees the buffer of a live tag whose address matches; anything else
    /// (a freed tag, a forged one, a mismatched address) is an error.
    public static func free(tag: UInt64, data: UnsafeMutableRawPointer, op: String) throws {
        let found: Bool = lock.withLock {
            guard let r = live[tag], r.address == UInt(bitPattern: data) else { return false }
            live[tag] = nil
            return true
        }
        guard found else {
            throw FlashMetalError.value(op, "blk (tag \(tag), data \(data)) is not a live buffer from fm_alloc_blk: already freed, a stale copy, or never allocated", arg: "blk")
        }
        cFree(data)
    }

    /// Checks a tagged tensor against its live record; caller memory (tag 0) passes.
    static func validate(tag: UInt64, data: UnsafeMutableRawPointer, byteCount: Int, op: String, name: String) throws {
        guard tag != 0 else { return }
        let r = lock.withLock { live[tag] }
        guard let r = r, r.address == UInt(bitPattern: data), byteCount <= r.bytes else {
            throw FlashMetalError.value(op, "\(name) carries tag \(tag) that is not a live fm_alloc_blk buffer (freed, stale or forged)", arg: name)
        }
    }

    /// Throws when a tagged tensor was allocated for another head dim or
    /// mask shape (a blk's classes are only valid for its own geometry);
    /// caller memory (tag 0) passes.
    public static func requireMadeFor(_ t: TensorRef, headDim: Int, qL: Int, kL: Int, op: String, name: String) throws {
        if let r = provenance(t), r.headDim != headDim || r.qL != qL || r.kL != kL {
            throw FlashMetalError.value(op, "\(name) was built for head_dim \(r.headDim) and a [\(r.qL), \(r.kL)] mask, not head_dim \(headDim) and a [\(qL), \(kL)] mask", arg: name)
        }
    }

    /// The record of a tagged tensor (nil for caller memory).
    public static func provenance(_ t: TensorRef) -> Record? {
        t.tag == 0 ? nil : lock.withLock { live[t.tag] }
    }
}

/// libc free: inside BlkAllocations its own `free` member would shadow it.
@inline(__always) private func cFree(_ p: UnsafeMutableRawPointer) { free(p) }
