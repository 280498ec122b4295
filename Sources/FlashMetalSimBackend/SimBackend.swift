import CFlashMetal
import FlashMetalCore
import FlashMetalCPUKernels
import FlashMetalSim
import FlashMetalSimDispatch

/// The "sim" backend: runs Dispatch values on the GPU simulator, against the
/// .metal kernels compiled as C++ into FlashMetalSim and registered by host
/// name. Buffers bind by index, `.bytes` params are copied, threadgroup
/// memory lengths come from the Dispatch. Every simulator failure (unknown
/// kernel, unset constant, divergent barrier, deadlock, over 32 KiB of
/// threadgroup memory, bad binding, no memory or threads left) comes back as
/// FlashMetalError.backend; a SIGINT stops a dispatch between scheduler
/// passes and comes back as FM_ERROR_INTERRUPTED. The simulator's workers
/// are shared by the process; closing a registry frees the idle ones.
/// With FLASHMETAL_SIM_COUNTS=<file> in the environment, every dispatch runs
/// the counted copy of its kernel (same results) and appends its counts to
/// that file, one JSON line each: the input of the GPU cost model.
public final class SimBackend: Backend, @unchecked Sendable {
    /// "sim".
    public let name = "sim"
    /// Every dispatch has run when `run` returns.
    public var defersWork: Bool { false }
    /// OS worker threads per dispatch; 0 = one per core.
    public let workers: Int
    /// Scrambled schedule (FLASHMETAL_SIM_SCRAMBLE does this for every dispatch).
    public let scramble: Bool
    /// Seed of the scrambled schedule.
    public let seed: UInt64

    /// A simulator backend: `workers` OS threads per dispatch (0 = one per
    /// core), optionally a scrambled schedule from `seed`.
    public init(workers: Int = 0, scramble: Bool = false, seed: UInt64 = 0) {
        self.workers = workers
        self.scramble = scramble
        self.seed = seed
    }

    deinit {
        fmsim_release_idle()
    }

    /// Host names of the kernels compiled into the simulator.
    public static var kernelNames: [String] {
        (0..<Int(fmsim_kernel_count())).compactMap { i in
            fmsim_kernel_name(Int32(i)).map { String(cString: $0) }
        }
    }

    final class Pipeline {
        let key: PipelineKey
        init(_ key: PipelineKey) { self.key = key }
    }

    /// A pipeline for a kernel compiled into the simulator; unknown names are a backend error.
    public func makePipeline(_ key: PipelineKey) throws -> AnyObject {
        guard fmsim_has_kernel(key.kernel) != 0 else {
            throw FlashMetalError.backend("sim: no kernel named '\(key.kernel)' is compiled into the simulator")
        }
        return Pipeline(key)
    }

    /// Runs each dispatch on the simulator, in order, synchronously.
    public func run(_ dispatches: [Dispatch], pipelines: [AnyObject]) throws {
        let previous = fm_interrupt_arm()
        defer { fm_interrupt_disarm(previous) }
        for d in dispatches { try run(d, interruptToken: fm_interrupt_token()) }
    }

    private func u32(_ v: Int, _ what: String, _ d: Dispatch) throws -> UInt32 {
        guard v >= 0, v <= Int(UInt32.max) else {
            throw FlashMetalError.backend("sim: \(d.kernel): \(what) \(v) is out of range")
        }
        return UInt32(v)
    }

    private func run(_ d: Dispatch, interruptToken: UInt64) throws {
        var constants: [FMSimConstant] = []
        for e in d.constants.entries {
            switch e.value {
            case .bool(let b): constants.append(FMSimConstant(index: Int32(e.index), is_bool: 1, value: b ? 1 : 0))
            case .int(let i): constants.append(FMSimConstant(index: Int32(e.index), is_bool: 0, value: i))
            }
        }
        var sd = SimDispatch(kernel: d.kernel)
        sd.constants = constants
        for (index, b) in d.bindings.sorted(by: { $0.key < $1.key }) {
            guard index >= 0, index < FMSIM_MAX_BINDINGS else {
                throw FlashMetalError.backend(
                    "sim: \(d.kernel): binding index \(index) is out of range 0..\(FMSIM_MAX_BINDINGS - 1)")
            }
            switch b {
            case .buffer(let t): sd.buffers.append((index, t.data, t.byteCount))
            case .bytes(let bytes): sd.bytes.append((index, bytes))
            }
        }
        for (index, len) in d.threadgroupMemory {
            guard index >= 0, index < FMSIM_MAX_BINDINGS else {
                throw FlashMetalError.backend("sim: \(d.kernel): threadgroup memory index \(index) is out of range")
            }
            sd.threadgroupMemory[index] = try u32(len, "threadgroup memory length", d)
        }
        sd.grid = (try u32(d.grid.x, "grid.x", d), try u32(d.grid.y, "grid.y", d), try u32(d.grid.z, "grid.z", d))
        sd.threads = (try u32(d.threadgroup.x, "threads.x", d), try u32(d.threadgroup.y, "threads.y", d),
                      try u32(d.threadgroup.z, "threads.z", d))
        let countsLog = fmsim_counts_log_path()
        let counts = UnsafeMutablePointer<FMSimCounts>.allocate(capacity: 1)
        defer { counts.deallocate() }
        var logFailed = false
        let (status, msg) = sd.run(configure: {
            $0.workers = Int32(clamping: workers)
            $0.scramble = scramble ? 1 : 0
            $0.seed = seed
            $0.interrupted = { fm_interrupt_since($0) }
            $0.interrupt_token = interruptToken
            $0.counts = countsLog != nil ? counts : nil
        }, completed: { p, st in
            if st == 0, let path = countsLog { logFailed = fmsim_counts_append(path, p, counts) != 0 }
        })
        if status == Int32(FMSIM_INTERRUPTED.rawValue) {
            throw FlashMetalError(FM_ERROR_INTERRUPTED, "sim: \(d.kernel): interrupted by SIGINT (the output is unspecified)")
        }
        if status != 0 {
            throw FlashMetalError.backend(msg.hasPrefix("sim") ? msg : "sim: \(msg)")
        }
        if logFailed {
            throw FlashMetalError.backend("sim: \(d.kernel): cannot append counts to FLASHMETAL_SIM_COUNTS="
                                          + String(cString: countsLog!))
        }
    }
}
