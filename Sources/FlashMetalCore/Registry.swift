#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Owns a backend and its pipeline cache keyed by (kernel, constants).
/// Safe to share between threads: the cache is behind a lock and pipelines
/// are immutable once made.
public final class Registry: @unchecked Sendable {
    public let backend: Backend
    private let lock = Lock()
    private var cache: [PipelineKey: AnyObject] = [:]
    private var batchDepth = 0
    /// Library-owned scratch used inside the open batch: freed when it flushes.
    private var batchScratch: [UnsafeMutableRawPointer] = []

    public init(backend: Backend) {
        self.backend = backend
    }

    /// The cached pipeline for a key, made on first use.
    public func pipeline(_ key: PipelineKey) throws -> AnyObject {
        if let p = lock.withLock({ cache[key] }) { return p }
        // Made outside the lock so a slow compile does not stall other keys;
        // a racing duplicate is dropped in favour of the first one stored.
        let made = try backend.makePipeline(key)
        return lock.withLock {
            if let p = cache[key] { return p }
            cache[key] = made
            return made
        }
    }

    public var cachedKeys: [PipelineKey] { lock.withLock { Array(cache.keys) } }

    /// Runs a sequence of dispatches (e.g. decode, then its reduce).
    public func run(_ dispatches: [Dispatch]) throws {
        let pipelines = try dispatches.map { try pipeline($0.pipeline) }
        try backend.run(dispatches, pipelines: pipelines)
    }

    /// Opens a (nestable) batch scope on the backend.
    public func beginBatch() throws {
        try lock.withLock {
            try backend.beginBatch()
            batchDepth += 1
        }
    }

    /// Closes the innermost batch scope; the outermost one flushes the work.
    public func endBatch() throws {
        try lock.withLock {
            guard batchDepth > 0 else { throw FlashMetalError.value("end_batch", "no batch is open") }
            batchDepth -= 1
            defer {
                if batchDepth == 0 {
                    for p in batchScratch { free(p) }
                    batchScratch = []
                }
            }
            try backend.endBatch()
        }
    }

    /// Runs `body` with library-owned f32 scratch memory that lives as long
    /// as the work using it: to the end of the call, or to the end of the
    /// open batch scope (a deferring backend runs the work only then).
    /// An allocation the machine cannot satisfy is an error, not an abort.
    public func withScratch(op: String, bytes: Int, _ body: (TensorRef) throws -> Void) throws {
        guard let p = malloc(max(bytes, 1)) else {
            throw FlashMetalError.value(op, "cannot allocate \(bytes) bytes of scratch memory")
        }
        defer {
            lock.withLock {
                if batchDepth > 0 { batchScratch.append(p) } else { free(p) }
            }
        }
        try body(TensorRef(data: p, byteCount: bytes, dtype: .f32, shape: [bytes / 4]))
    }
}
