#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Library-owned host memory whose size a call decides (kernel scratch,
/// packed panels, copies of tables): an allocation the machine cannot
/// satisfy is a BackendError naming the op, and the process keeps working
/// (Swift's `allocate` traps instead).
public enum HostMemory {
    /// `count * stride` bytes, 64-byte aligned; release with `free`.
    public static func allocate(count: Int, stride: Int, op: String, what: String) throws -> UnsafeMutableRawPointer {
        let (bytes, overflow) = count.multipliedReportingOverflow(by: stride)
        guard !overflow, count >= 0, stride >= 0 else {
            throw FlashMetalError.backend(op, "cannot allocate \(count) x \(stride) bytes of \(what) (too large)")
        }
        var p: UnsafeMutableRawPointer? = nil
        guard posix_memalign(&p, 64, max(bytes, 1)) == 0, let p else {
            throw FlashMetalError.backend(op, "cannot allocate \(bytes) bytes of \(what)")
        }
        return p
    }

    /// `count` values of `T`, 64-byte aligned; release with `free`.
    public static func allocate<T>(_: T.Type, count: Int, op: String, what: String) throws -> UnsafeMutablePointer<T> {
        try allocate(count: count, stride: MemoryLayout<T>.stride, op: op, what: what)
            .bindMemory(to: T.self, capacity: max(count, 0))
    }

    /// Releases memory from `allocate`.
    public static func free(_ p: UnsafeMutableRawPointer) {
        #if canImport(Glibc)
        Glibc.free(p)
        #else
        Darwin.free(p)
        #endif
    }

    /// Releases typed memory from `allocate`.
    public static func free<T>(_ p: UnsafeMutablePointer<T>) { free(UnsafeMutableRawPointer(p)) }
}
