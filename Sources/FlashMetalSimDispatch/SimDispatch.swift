import FlashMetalSim

/// One simulator dispatch as Swift values, and the one place that turns it
/// into an `FMSimDispatch` (pointers valid for the call) and runs it: the sim
/// backend and the metal-sim runtime both dispatch through it.
public struct SimDispatch {
    public var kernel: String
    public var constants: [FMSimConstant] = []
    /// Device memory by buffer index: (address, bytes).
    public var buffers: [(index: Int, data: UnsafeMutableRawPointer, length: Int)] = []
    /// setBytes payloads by buffer index; the simulator copies each to
    /// aligned memory of its own.
    public var bytes: [(index: Int, bytes: [UInt8])] = []
    /// Threadgroup memory lengths by index.
    public var threadgroupMemory: [Int: UInt32] = [:]
    public var grid: (UInt32, UInt32, UInt32) = (1, 1, 1)
    public var threads: (UInt32, UInt32, UInt32) = (1, 1, 1)

    public init(kernel: String) { self.kernel = kernel }

    /// Runs it: `configure` sets the remaining fields (workers, counts,
    /// check_bounds, ...) and `completed` sees the dispatch and its status
    /// while the pointers are still valid. Returns the status and, when it
    /// is not FMSIM_OK, the simulator's message.
    public func run(configure: (inout FMSimDispatch) -> Void = { _ in },
                    completed: (UnsafePointer<FMSimDispatch>, Int32) -> Void = { _, _ in }) -> (Int32, String) {
        // The setBytes payloads back to back in one array, bound by offset.
        var blob: [UInt8] = []
        var spans: [(index: Int, start: Int, count: Int)] = []
        for (i, b) in bytes {
            spans.append((i, blob.count, b.count))
            blob.append(contentsOf: b)
        }
        let tg = threadgroupMemory.sorted { $0.key < $1.key }.map { FMSimTGMemory(index: Int32($0.key), length: $0.value) }
        var err = [CChar](repeating: 0, count: 2048)
        let status: Int32 = kernel.withCString { kname in
            blob.withUnsafeMutableBytes { bl in
                var bindings = buffers.map {
                    FMSimBinding(index: Int32($0.index), is_bytes: 0, data: $0.data, length: UInt64($0.length))
                }
                for s in spans {
                    bindings.append(FMSimBinding(index: Int32(s.index), is_bytes: 1,
                                                 data: bl.baseAddress.map { $0 + s.start }, length: UInt64(s.count)))
                }
                return constants.withUnsafeBufferPointer { cp in
                    bindings.withUnsafeBufferPointer { bp in
                        tg.withUnsafeBufferPointer { tp in
                            var sd = FMSimDispatch()
                            sd.name = kname
                            sd.constants = cp.baseAddress
                            sd.n_constants = Int32(cp.count)
                            sd.bindings = bp.baseAddress
                            sd.n_bindings = Int32(bp.count)
                            sd.tg_memory = tp.baseAddress
                            sd.n_tg_memory = Int32(tp.count)
                            sd.grid = grid
                            sd.threads = threads
                            configure(&sd)
                            let st = err.withUnsafeMutableBufferPointer { fmsim_dispatch(&sd, $0.baseAddress, $0.count) }
                            completed(&sd, st)
                            return st
                        }
                    }
                }
            }
        }
        return (status, status == 0 ? "" : err.withUnsafeBufferPointer { String(cString: $0.baseAddress!) })
    }
}
