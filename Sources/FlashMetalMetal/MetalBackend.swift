#if canImport(Metal)
#if canImport(Darwin)
import Darwin  // on Linux, the metal-sim Metal module brings in glibc
#endif
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
///
/// Command buffers and encoders are autoreleased objects and the calling
/// threads (Python's) have no autorelease pool: every entry point drains
/// its own pool, so they are released when the call or batch scope ends.
///
/// On Linux the same code runs as "metal-sim" against the metal-sim runtime
/// (a Metal implementation whose GPU is the simulator).
public final class MetalBackend: Backend {
    #if os(Linux)
    public let name = "metal-sim"
    #else
    public let name = "metal"
    #endif
    let device: MTLDevice
    let queue: MTLCommandQueue
    private let lock = Lock()
    private var libraries: [String: MTLLibrary] = [:]
    /// The open batch's command buffer; nil outside a batch.
    private var batch: Submission?
    /// One no-copy buffer per fm_alloc_host allocation used so far, by id:
    /// wrapped once, dropped when the allocation is freed.
    private var persistent: [UInt64: MTLBuffer] = [:]
    private var releaseHook: UInt64 = 0

    /// The Metal device's name.
    public var deviceName: String { device.name }

    /// One command buffer being encoded: its single encoder and the
    /// buffers bound for it.
    private final class Submission {
        let commandBuffer: MTLCommandBuffer
        let encoder: MTLComputeCommandEncoder
        let binder: BufferBinder
        var dispatched = 0
        private var ended = false

        init(queue: MTLCommandQueue, device: MTLDevice,
             persistent: @escaping (UInt, UInt) -> (buffer: MTLBuffer, base: UInt)?) throws {
            guard let cb = queue.makeCommandBuffer() else {
                throw FlashMetalError.backend("metal backend: cannot create a command buffer")
            }
            guard let enc = cb.makeComputeCommandEncoder(dispatchType: .concurrent) else {
                throw FlashMetalError.backend("metal backend: cannot create a compute encoder")
            }
            commandBuffer = cb
            encoder = enc
            binder = BufferBinder(device: device, persistent: persistent)
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
        let device = try Self.chooseDevice()
        guard let queue = device.makeCommandQueue() else {
            throw FlashMetalError.backend("metal backend: cannot create a command queue")
        }
        self.device = device
        self.queue = queue
        releaseHook = HostAllocations.addReleaseHook { [weak self] a in self?.dropPersistent(a.id) }
    }

    deinit { HostAllocations.removeReleaseHook(releaseHook) }

    /// FLASHMETAL_METAL_DEVICE (a device's name, or a part of exactly one
    /// name, any case), else the system default device. The kernels need an
    /// Apple7 (M1) or newer GPU with Metal 3: a device without both (such
    /// as the paravirtual GPU of a macOS virtual machine) is refused.
    static func chooseDevice() throws -> MTLDevice {
        let all = MTLCopyAllDevices()
        let names = all.map { "'\($0.name)'" }.joined(separator: ", ")
        let device: MTLDevice
        if let env = getenv("FLASHMETAL_METAL_DEVICE"), !String(cString: env).isEmpty {
            let want = String(cString: env)
            let lower = want.lowercased()
            let matches = all.filter { $0.name == want }.isEmpty
                ? all.filter { $0.name.lowercased().contains(lower) } : all.filter { $0.name == want }
            guard matches.count == 1 else {
                throw FlashMetalError.backend(
                    "metal backend: FLASHMETAL_METAL_DEVICE='\(want)' matches \(matches.count) devices; devices: \(names.isEmpty ? "none" : names)")
            }
            device = matches[0]
        } else {
            // In SSH and CI sessions MTLCreateSystemDefaultDevice() can return
            // nil for a command-line process while the GPU is still listed.
            guard let d = MTLCreateSystemDefaultDevice() ?? all.first else {
                throw FlashMetalError.backend("metal backend: no Metal device")
            }
            device = d
        }
        // https://developer.apple.com/documentation/metal/mtldevice/supportsfamily(_:)
        guard device.supportsFamily(.apple7), device.supportsFamily(.metal3) else {
            throw FlashMetalError.backend(
                "metal backend: device '\(device.name)' is not an Apple7 (M1) or newer GPU with Metal 3 support; "
                    + "set FLASHMETAL_METAL_DEVICE to one that is (devices: \(names))")
        }
        return device
    }

    /// The no-copy buffer over the fm_alloc_host allocation that holds
    /// [start, end), made on first use. Called with `lock` held.
    private func persistentBuffer(_ start: UInt, _ end: UInt) -> (buffer: MTLBuffer, base: UInt)? {
        guard let a = HostAllocations.containing(start, end) else { return nil }
        if let b = persistent[a.id] { return (b, a.address) }
        guard let b = device.makeBuffer(bytesNoCopy: a.base, length: a.length, options: .storageModeShared,
                                        deallocator: nil) else { return nil }
        persistent[a.id] = b
        return (b, a.address)
    }

    private func dropPersistent(_ id: UInt64) {
        _ = lock.withLock { persistent.removeValue(forKey: id) }
    }

    private func submission() throws -> Submission {
        try Submission(queue: queue, device: device) { [unowned self] in self.persistentBuffer($0, $1) }
    }

    private func library(_ kernel: String) throws -> MTLLibrary {
        guard let (file, text) = Shaders.source(forKernel: kernel) else {
            throw FlashMetalError.backend("metal backend: no shader defines kernel '\(kernel)'")
        }
        return try lock.withLock {
            if let lib = libraries[file] { return lib }
            let options = MTLCompileOptions()
            options.languageVersion = .version3_1
            // Precise math on every macOS: from 15, mathMode = .safe leaves
            // mathFloatingPointFunctions at its default, .fast.
            // https://developer.apple.com/documentation/metal/mtlcompileoptions/mathfloatingpointfunctions
            if #available(macOS 15.0, *) {
                options.mathMode = .safe
                options.mathFloatingPointFunctions = .precise
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
        try autoreleasepool { try makePipelineInPool(key) }
    }

    private func makePipelineInPool(_ key: PipelineKey) throws -> AnyObject {
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
        // Nothing to run: no command buffer (one made and never committed
        // would hold one of the queue's slots until released).
        if dispatches.isEmpty { return }
        try autoreleasepool { try lock.withLock { try runLocked(dispatches, pipelines: pipelines) } }
    }

    private func runLocked(_ dispatches: [Dispatch], pipelines: [AnyObject]) throws {
        let sub = try batch ?? submission()
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
        try autoreleasepool {
            try lock.withLock {
                guard batch == nil else { throw FlashMetalError.internalError("metal backend: a batch is already open") }
                batch = try submission()
            }
        }
    }

    public func endBatch() throws {
        try autoreleasepool {
            try lock.withLock {
                guard let sub = batch else { throw FlashMetalError.value("end_batch", "no batch is open") }
                batch = nil
                try finish(sub)
            }
        }
    }
}
#endif
