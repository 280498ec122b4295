import FlashMetalCore

/// The native backend: resolves each kernel name and its function constants
/// to a native kernel; the registry caches what it makes.
public final class CPUBackend: Backend {
    public let name = "cpu"
    let pool = WorkerPool()

    public init() {}

    public func makePipeline(_ key: PipelineKey) throws -> AnyObject {
        if PrefillDispatcher.allKernelNames.contains(key.kernel) {
            return try PrefillKernel(key)
        }
        if BlkDispatcher.allKernelNames.contains(key.kernel) { return try BlkKernel(key) }
        if MaskDispatcher.allKernelNames.contains(key.kernel) { return MaskKernel(key) }
        if VecDispatcher.mainKernelNames.contains(key.kernel) { return VecKernel(key) }
        if VecDispatcher.reduceKernelNames.contains(key.kernel) { return try VecReduceKernel(key) }
        if SdpaDispatcher.allKernelNames.contains(key.kernel) { return try SdpaKernel(key) }
        throw FlashMetalError.backend("cpu backend: unknown kernel '\(key.kernel)'")
    }

    public func run(_ dispatches: [Dispatch], pipelines: [AnyObject]) throws {
        try pool.interruptible("cpu: \(dispatches.first?.kernel ?? "")") {
            for (d, p) in zip(dispatches, pipelines) {
                guard let k = p as? CPUKernel else {
                    throw FlashMetalError.internalError("cpu backend: pipeline for \(d.kernel) is not a cpu kernel")
                }
                try k.run(d, pool: pool)
            }
        }
    }
}
