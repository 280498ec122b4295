import FlashMetalCore
import FlashMetalCPUKernels

/// The native backend: maps each kernel spec and its function constants to
/// a native kernel; the registry caches what it makes. Synchronous: every
/// dispatch has run when `run` returns.
public final class CPUBackend: Backend {
    /// "cpu".
    public let name = "cpu"
    /// Work never waits for a batch to end.
    public var defersWork: Bool { false }
    /// A decode over codes splits its keys over the workers inside its one
    /// dispatch (kv_codes_decode writes the output; no reduce is dispatched).
    public var splitsKeysInGrid: Bool { false }
    let pool = WorkerPool()

    /// Threads the process's worker pool may use, the caller included, as
    /// the pool decided them (FLASHMETAL_NUM_THREADS as it reads it, else
    /// the online CPUs).
    public static var poolThreads: Int { Int(fm_pool_threads()) }

    /// Announces a job soon: the pool's sleeping workers wake now, so their
    /// wake-up overlaps the caller's preparation instead of the job.
    public static func prepareWorkers() { fm_pool_prepare() }

    /// Turns SIGINT interruption of the main thread's calls on or off;
    /// returns the previous setting.
    public static func setInterruptible(_ on: Bool) -> Bool { fm_interrupt_set_enabled(on ? 1 : 0) != 0 }

    /// A cpu backend on the shared worker pool.
    public init() {}

    /// The native kernel of `key.spec`, specialised by its constants.
    public func makePipeline(_ key: PipelineKey) throws -> AnyObject {
        switch key.spec {
        case let .prefill(io, headDim, boolMask):
            return try PrefillKernel(key, io: io, headDim: headDim, boolMask: boolMask)
        case let .blk(mask): return try BlkKernel(key, maskType: mask)
        case let .maskBuilder(out): return MaskKernel(key, outType: out)
        case .vec: return try VecKernel(key)
        case let .vecReduce(headDim, fwht): return try VecReduceKernel(key, headDim: headDim, fwht: fwht)
        case let .sdpa(io): return try SdpaKernel(key, io: io)
        case .kvAppend: return try KVAppendKernel(key)
        case .rotary: return RotaryKernel(key)
        case .kvEncode, .kvDequantize: return KVCodecKernel(key)
        case .kvCodesDecode: return KVCodesDecodeKernel(key)
        case .kvCodesPrefill: return KVCodesPrefillKernel(key)
        case .kvCodesReduce: return KVCodesReduceKernel()
        case .kvCodesAppend: return KVCodesAppendKernel(key)
        case .simSelftest: throw FlashMetalError.backend("cpu backend: \(key.kernel) runs only on the sim backend")
        }
    }

    /// Runs each dispatch with its kernel, in order, on the worker pool.
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
