/// Library-owned blocks (HostAllocations) that one registry's calls borrow
/// for scratch and table copies and give back when their work has run.
/// Reusing blocks keeps their addresses stable, so a backend that wraps host
/// memory (Metal: one no-copy MTLBuffer per HostAllocations allocation,
/// dropped when it is freed) wraps each block once, not on every call.
///
/// At most `keptBlocks` idle blocks and `keptBytes` idle bytes are kept; a
/// block beyond either is freed when given back, the oldest first.
public final class ScratchPool: @unchecked Sendable {
    public static let keptBlocks = 64
    public static let keptBytes = 64 << 20

    private let lock = Lock()
    /// Idle blocks, oldest first.
    private var idle: [HostAllocations.Allocation] = []

    /// The smallest idle block of at least `bytes`, else a new one. An
    /// allocation the machine cannot satisfy is a BackendError naming `op`.
    func take(_ bytes: Int, op: String, what: String) throws -> HostAllocations.Allocation {
        let need = max(bytes, 1)
        let reused: HostAllocations.Allocation? = lock.withLock {
            let fits = idle.indices.filter { idle[$0].length >= need }
            guard let i = fits.min(by: { idle[$0].length < idle[$1].length }) else { return nil }
            return idle.remove(at: i)
        }
        if let reused { return reused }
        guard bytes >= 0, bytes <= Int.max - HostAllocations.granule,
              let a = try? HostAllocations.allocate(bytes: need, op: op) else {
            throw FlashMetalError.backend(op, "cannot allocate \(bytes) bytes of \(what)")
        }
        return a
    }

    /// Gives `block` back once no work uses it any more.
    func give(_ block: HostAllocations.Allocation) {
        let evicted: [HostAllocations.Allocation] = lock.withLock {
            idle.append(block)
            var out: [HostAllocations.Allocation] = []
            while idle.count > Self.keptBlocks || idle.reduce(0, { $0 + $1.length }) > Self.keptBytes {
                out.append(idle.removeFirst())
            }
            return out
        }
        evicted.forEach(Self.release)
    }

    /// Frees every idle block.
    func drain() {
        let all: [HostAllocations.Allocation] = lock.withLock {
            defer { idle = [] }
            return idle
        }
        all.forEach(Self.release)
    }

    /// Idle blocks kept for reuse.
    var idleCount: Int { lock.withLock { idle.count } }

    private static func release(_ a: HostAllocations.Allocation) {
        // The block came from HostAllocations.allocate and is no longer
        // listed anywhere else: freeing it cannot fail.
        try? HostAllocations.free(a.base, op: "scratch")
    }

    deinit { drain() }
}
