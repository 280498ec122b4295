#if canImport(Metal)
import FlashMetalCore
import FlashMetalShaders
import Metal

/// Runs Dispatch values on the Metal device. Libraries are compiled from the
/// embedded sources (MSL 3.1 for bfloat, safe math), one per shader file, on
/// first use; pipelines are specialised by function constants and cached by
/// the registry. Caller memory is bound without a copy where Metal allows it.
///
/// Ordering: a command buffer has one compute encoder of dispatch type
/// `.concurrent` and a `memoryBarrier(scope: .buffers)` before every
/// dispatch but the first. Apple's MTLDispatchType.concurrent documentation
/// makes synchronising accesses to one resource the caller's job, and
/// memoryBarrier(scope:) "ensures the relevant passes finish updating
/// resources before starting ... subsequent commands that depend on those
/// resources". Automatic hazard tracking is not relied on: two calls in a
/// batch may wrap the same host memory (or overlapping pages) in different
/// MTLBuffers, which tracking cannot relate.
public final class MetalBackend: Backend {
    public let name = "metal"
    let device: MTLDevice
    let queue: MTLCommandQueue
    private let lock = Lock()
    private var libraries: [String: MTLLibrary] = [:]
    /// The open batch's command buffer; nil outside a batch.
    private var batch: Submission?

    /// One command buffer being encoded: its single encoder and the
    /// buffers bound for it.
    private final class Submission {
        let commandBuffer: MTLCommandBuffer
        let encoder: MTLComputeCommandEncoder
        let binder: BufferBinder
        var dispatched = 0
        private var ended = false

        init(queue: MTLCommandQueue, device: MTLDevice) throws {
            guard let cb = queue.makeCommandBuffer() else {
                throw FlashMetalError.backend("metal backend: cannot create a command buffer")
            }
            guard let enc = cb.makeComputeCommandEncoder(dispatchType: .concurrent) else {
                throw FlashMetalError.backend("metal backend: cannot create a compute encoder")
            }
            commandBuffer = cb
            encoder = enc
            binder = BufferBinder(device: device)
        }

        /// Metal asserts if a command buffer with an open encoder is
        /// released or committed: every path ends it exactly once.
        func endEncoding() {
            if !ended { encoder.endEncoding() }
            ended = true
        }

        deinit { endEncoding() }
    }

    public init() throws {
        // In SSH and CI sessions MTLCreateSystemDefaultDevice() can return
        // nil for a command-line process while the GPU is still listed.
        guard let device = MTLCreateSystemDefaultDevice() ?? MTLCopyAllDevices().first else {
            throw FlashMetalError.backend("metal backend: no Metal device")
        }
        guard let queue = device.makeCommandQueue() else {
            throw FlashMetalError.backend("metal backend: cannot create a command queue")
        }
        self.device = device
        self.queue = queue
    }

    private func library(_ kernel: String) throws -> MTLLibrary {
        guard let (file, text) = Shaders.source(forKernel: kernel) else {
            throw FlashMetalError.backend("metal backend: no shader defines kernel '\(kernel)'")
        }
        return try lock.withLock {
            if let lib = libraries[file] { return lib }
            let options = MTLCompileOptions()
            options.languageVersion = .version3_1
            if #available(macOS 15.0, *) {
                options.mathMode = .safe
            } else {
                options.fastMathEnabled = false
            }
            do {
                let lib = try device.makeLibrary(source: text, options: options)
                libraries[file] = lib
                return lib
            } catch {
                throw FlashMetalError.backend("metal backend: compiling \(file) failed: \(error)")
            }
        }
    }

    public func makePipeline(_ key: PipelineKey) throws -> AnyObject {
        let lib = try library(key.kernel)
        let values = MTLFunctionConstantValues()
        for e in key.constants.entries {
            switch e.value {
            case .bool(let b):
                var v = b
                values.setConstantValue(&v, type: .bool, index: e.index)
            case .int(let i):
                var v = i
                values.setConstantValue(&v, type: .int, index: e.index)
            }
        }
        do {
            let fn = try lib.makeFunction(name: key.kernel, constantValues: values)
            return try device.makeComputePipelineState(function: fn)
        } catch {
            throw FlashMetalError.backend("metal backend: pipeline \(key) failed: \(error)")
        }
    }

    /// Threads per threadgroup for `d` on `pso`: the dispatch's own, or for a
    /// flexible kernel the widest multiple of 32 the pipeline allows.
    static func threadsPerGroup(_ d: Dispatch, maxThreads: Int) throws -> MTLSize {
        let t = d.threadgroup
        if t.count <= maxThreads { return MTLSize(width: t.x, height: t.y, depth: t.z) }
        let width = min(t.x, maxThreads / 32 * 32)
        guard d.threadgroupFlexible, t.y == 1, t.z == 1, width >= 32 else {
            throw FlashMetalError.backend(
                "metal backend: \(d.kernel) needs \(t.count) threads per threadgroup, the pipeline allows \(maxThreads)")
        }
        return MTLSize(width: width, height: 1, depth: 1)
    }

    /// A dispatch with every buffer bound: encoding it cannot fail.
    private struct Planned {
        let dispatch: Dispatch
        let pso: MTLComputePipelineState
        let threads: MTLSize
        let buffers: [BoundBuffer]
    }

    private struct BoundBuffer {
        let index: Int
        let tensor: TensorRef
        let buffer: MTLBuffer
        let offset: Int
    }

    public func run(_ dispatches: [Dispatch], pipelines: [AnyObject]) throws {
        try lock.withLock {
            let sub = try batch ?? Submission(queue: queue, device: device)
            // Everything that can throw happens before the first encode, so
            // an error leaves no half-encoded call behind (and `sub`'s
            // deinit ends the encoder of a synchronous call).
            let plan = try zip(dispatches, pipelines).map { d, p -> Planned in
                guard let pso = p as? MTLComputePipelineState else {
                    throw FlashMetalError.internalError("metal backend: pipeline for \(d.kernel) is not Metal's")
                }
                let threads = try Self.threadsPerGroup(d, maxThreads: pso.maxTotalThreadsPerThreadgroup)
                let buffers = try d.bindings.sorted { $0.key < $1.key }.compactMap { index, binding -> BoundBuffer? in
                    guard case .buffer(let t) = binding else { return nil }
                    let (buf, offset) = try sub.binder.bind(t)
                    return BoundBuffer(index: index, tensor: t, buffer: buf, offset: offset)
                }
                return Planned(dispatch: d, pso: pso, threads: threads, buffers: buffers)
            }
            for p in plan { encode(p, into: sub) }
            if batch == nil { try finish(sub) }
        }
    }

    private func encode(_ p: Planned, into sub: Submission) {
        let enc = sub.encoder
        let d = p.dispatch
        if sub.dispatched > 0 { enc.memoryBarrier(scope: .buffers) }
        enc.setComputePipelineState(p.pso)
        for (index, binding) in d.bindings {
            if case .bytes(let b) = binding {
                b.withUnsafeBytes { enc.setBytes($0.baseAddress!, length: $0.count, index: index) }
            }
        }
        for b in p.buffers {
            enc.setBuffer(b.buffer, offset: b.offset, index: b.index)
            if d.writes.contains(b.index) { sub.binder.markWritten(b.tensor) }
        }
        for (index, length) in d.threadgroupMemory {
            enc.setThreadgroupMemoryLength((length + 15) & ~15, index: index)
        }
        enc.dispatchThreadgroups(MTLSize(width: d.grid.x, height: d.grid.y, depth: d.grid.z),
                                 threadsPerThreadgroup: p.threads)
        sub.dispatched += 1
    }

    private func finish(_ sub: Submission) throws {
        sub.endEncoding()
        if sub.dispatched == 0 { return }
        let cb = sub.commandBuffer
        cb.commit()
        cb.waitUntilCompleted()
        if cb.status == .error {
            throw FlashMetalError.backend("metal backend: command buffer failed: \(String(describing: cb.error))")
        }
        sub.binder.copyBack()
    }

    public func beginBatch() throws {
        // The registry counts nesting and calls this for the outermost scope only.
        try lock.withLock {
            guard batch == nil else { throw FlashMetalError.internalError("metal backend: a batch is already open") }
            batch = try Submission(queue: queue, device: device)
        }
    }

    public func endBatch() throws {
        try lock.withLock {
            guard let sub = batch else { throw FlashMetalError.value("end_batch", "no batch is open") }
            batch = nil
            try finish(sub)
        }
    }
}
#endif
