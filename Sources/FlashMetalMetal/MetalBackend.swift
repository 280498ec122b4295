#if canImport(Metal)
import FlashMetalCore
import FlashMetalShaders
import Metal

/// Runs Dispatch values on the Metal device. Libraries are compiled from the
/// embedded sources (MSL 3.1 for bfloat, safe math), one per shader file, on
/// first use; pipelines are specialised by function constants and cached by
/// the registry. Caller memory is bound without a copy where Metal allows it.
public final class MetalBackend: Backend {
    public let name = "metal"
    let device: MTLDevice
    let queue: MTLCommandQueue
    private let lock = Lock()
    private var libraries: [String: MTLLibrary] = [:]
    private var batch: MTLCommandBuffer?
    private var batchDepth = 0
    private var batchCopies: [BufferBinder.Copy] = []

    public init() throws {
        guard let device = MTLCreateSystemDefaultDevice() else {
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

    public func run(_ dispatches: [Dispatch], pipelines: [AnyObject]) throws {
        try lock.withLock {
            let cb = try batch ?? newCommandBuffer()
            guard let enc = cb.makeComputeCommandEncoder() else {
                throw FlashMetalError.backend("metal backend: cannot create a compute encoder")
            }
            var binder = BufferBinder(device: device)
            for (d, p) in zip(dispatches, pipelines) {
                guard let pso = p as? MTLComputePipelineState else {
                    enc.endEncoding()
                    throw FlashMetalError.internalError("metal backend: pipeline for \(d.kernel) is not Metal's")
                }
                if d.threadgroup.count > pso.maxTotalThreadsPerThreadgroup {
                    enc.endEncoding()
                    throw FlashMetalError.backend(
                        "metal backend: \(d.kernel) needs \(d.threadgroup.count) threads per threadgroup, the pipeline allows \(pso.maxTotalThreadsPerThreadgroup)")
                }
                enc.setComputePipelineState(pso)
                for (index, binding) in d.bindings {
                    switch binding {
                    case .bytes(let b):
                        b.withUnsafeBytes { enc.setBytes($0.baseAddress!, length: $0.count, index: index) }
                    case .buffer(let t):
                        let (buf, offset) = try binder.bind(t)
                        enc.setBuffer(buf, offset: offset, index: index)
                    }
                }
                for (index, length) in d.threadgroupMemory {
                    enc.setThreadgroupMemoryLength((length + 15) & ~15, index: index)
                }
                enc.dispatchThreadgroups(MTLSize(width: d.grid.x, height: d.grid.y, depth: d.grid.z),
                                         threadsPerThreadgroup: MTLSize(width: d.threadgroup.x,
                                                                        height: d.threadgroup.y,
                                                                        depth: d.threadgroup.z))
            }
            enc.endEncoding()
            if batch != nil {
                batchCopies += binder.copies
                return
            }
            try finish(cb, copies: binder.copies)
        }
    }

    private func newCommandBuffer() throws -> MTLCommandBuffer {
        guard let cb = queue.makeCommandBuffer() else {
            throw FlashMetalError.backend("metal backend: cannot create a command buffer")
        }
        return cb
    }

    private func finish(_ cb: MTLCommandBuffer, copies: [BufferBinder.Copy]) throws {
        cb.commit()
        cb.waitUntilCompleted()
        if cb.status == .error {
            throw FlashMetalError.backend("metal backend: command buffer failed: \(String(describing: cb.error))")
        }
        for c in copies { c.copyBack() }
    }

    public func beginBatch() throws {
        try lock.withLock {
            if batchDepth == 0 { batch = try newCommandBuffer() }
            batchDepth += 1
        }
    }

    public func endBatch() throws {
        try lock.withLock {
            guard batchDepth > 0 else { throw FlashMetalError.value("end_batch", "no batch is open") }
            batchDepth -= 1
            if batchDepth == 0, let cb = batch {
                batch = nil
                let copies = batchCopies
                batchCopies = []
                try finish(cb, copies: copies)
            }
        }
    }
}
#endif
