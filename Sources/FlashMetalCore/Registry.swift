#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Owns a backend and its pipeline cache keyed by (kernel, constants).
/// Safe to share between threads: the cache is behind a lock and pipelines
/// are immutable once made.
public final class Registry: @unchecked Sendable {
    /// The engine that runs this registry's dispatches.
    public let backend: Backend
    private let lock = Lock()
    private var cache: [PipelineKey: AnyObject] = [:]
    private var batchDepth = 0
    /// Scratch of work a deferring backend has not run yet: given back to
    /// `scratch` when the outermost batch scope ends (and the work ran).
    private var deferredScratch: [HostAllocations.Allocation] = []
    /// Blocks for scratch and table copies, reused from call to call.
    private let scratch = ScratchPool()

    /// A registry with an empty pipeline cache on `backend`.
    public init(backend: Backend) {
        self.backend = backend
    }

    deinit {
        // close() normally ran; this only covers a registry dropped without it.
        deferredScratch.forEach(scratch.give)
        scratch.drain()
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

    /// The keys whose pipelines have been made.
    public var cachedKeys: [PipelineKey] { lock.withLock { Array(cache.keys) } }

    /// Open batch scopes (nesting depth).
    public var openBatches: Int { lock.withLock { batchDepth } }

    /// Library-owned scratch blocks waiting for a deferring backend's batch.
    public var deferredScratchCount: Int { lock.withLock { deferredScratch.count } }

    /// Idle scratch blocks kept for the next calls.
    public var idleScratchCount: Int { scratch.idleCount }

    /// Runs a sequence of dispatches (e.g. decode, then its reduce): the
    /// work of one call of `op`, whose outputs must not overlap anything
    /// else it binds (Dispatch.requireDisjointOutputs).
    public func run(_ dispatches: [Dispatch], op: String) throws {
        try Dispatch.requireDisjointOutputs(dispatches, op: op)
        let pipelines = try dispatches.map { try pipeline($0.pipeline) }
        try backend.run(dispatches, pipelines: pipelines)
    }

    /// Opens a (nestable) batch scope. The registry counts the nesting; the
    /// backend sees only the outermost scope (one beginBatch, one endBatch).
    public func beginBatch() throws {
        try lock.withLock {
            if batchDepth == 0 { try backend.beginBatch() }
            batchDepth += 1
        }
    }

    /// Closes the innermost batch scope; the outermost one flushes the work.
    public func endBatch() throws {
        try lock.withLock {
            guard batchDepth > 0 else { throw FlashMetalError.value("end_batch", "no batch is open") }
            try endOneBatch()
        }
    }

    /// Ends every open batch scope, so deferred work runs and its scratch is
    /// freed: a registry closed inside a batch loses nothing. The first
    /// backend error is rethrown after all scopes are closed.
    public func close() throws {
        try lock.withLock {
            var failure: Error? = nil
            while batchDepth > 0 {
                do { try endOneBatch() } catch { failure = failure ?? error }
            }
            if let f = failure { throw f }
        }
    }

    /// Called with the lock held and batchDepth > 0.
    private func endOneBatch() throws {
        batchDepth -= 1
        guard batchDepth == 0 else { return }
        defer {
            deferredScratch.forEach(scratch.give)
            deferredScratch = []
        }
        try backend.endBatch()
    }

    /// Runs `body` with library-owned f32 scratch memory that lives exactly
    /// as long as the work using it: a synchronous backend has run the work
    /// when `body` returns, so the scratch is freed then, batch or not; a
    /// deferring backend runs it when the open batch ends, so it is kept
    /// until then. An allocation the machine cannot satisfy is an error.
    public func withScratch(op: String, bytes: Int, _ body: (TensorRef) throws -> Void) throws {
        try withOwnedMemory(op: op, bytes: bytes, what: "scratch memory") { p in
            try body(TensorRef(data: p, byteCount: bytes, dtype: .f32, shape: [bytes / 4], name: "tmp"))
        }
    }

    /// Runs `body` with private copies of `tables` (nil stays nil), made
    /// before anything reads them: the dispatchers validate the copies and
    /// the kernels read them, so a caller (or another thread) rewriting a
    /// table during the call cannot make a kernel follow an entry nobody
    /// checked. Each copy still stands for the caller's memory in overlap
    /// checks, and lives as long as the work (withScratch).
    public func withPrivateCopies(op: String, _ tables: [TensorRef?],
                                  _ body: ([TensorRef?]) throws -> Void) throws {
        var offsets: [Int] = []
        var total = 0
        for t in tables {
            offsets.append(total)
            total += ((t?.usedByteCount ?? 0) + 63) & ~63
        }
        try withOwnedMemory(op: op, bytes: total, what: "table copies") { p in
            let copies = zip(tables, offsets).map { t, offset -> TensorRef? in
                guard let t else { return nil }
                let dst = p + offset
                dst.copyMemory(from: t.data, byteCount: t.usedByteCount)
                return t.copied(to: dst)
            }
            try body(copies)
        }
    }

    /// `bytes` of library memory (a block of `scratch`) for the work `body`
    /// starts, given back when that work has run (see withScratch).
    private func withOwnedMemory(op: String, bytes: Int, what: String,
                                 _ body: (UnsafeMutableRawPointer) throws -> Void) throws {
        let block = try scratch.take(bytes, op: op, what: what)
        defer {
            let keep = backend.defersWork && lock.withLock {
                if batchDepth > 0 { deferredScratch.append(block); return true }
                return false
            }
            if !keep { scratch.give(block) }
        }
        try body(block.base)
    }
}
