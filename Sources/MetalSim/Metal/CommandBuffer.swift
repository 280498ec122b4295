import FlashMetalSim
import FlashMetalSimDispatch
import Glibc

/// One compute pass as recorded by its encoder.
final class Pass {
    enum Command {
        case dispatch(Recorded)
        case barrier
    }
    /// A dispatch with everything it binds, captured when it was encoded.
    struct Recorded {
        let pipeline: SimPipeline
        let buffers: [Int: (SimBuffer, Int)]
        let bytes: [Int: [UInt8]]
        let threadgroupMemory: [Int: Int]
        let grid: MTLSize
        let threads: MTLSize
    }
    let dispatchType: MTLDispatchType
    var commands: [Command] = []
    var ended = false
    init(_ t: MTLDispatchType) { dispatchType = t }
}

/// A command buffer: records passes, runs them on the simulator when
/// committed (synchronously: it has completed when commit() returns), and
/// reports status and error as Metal does: .notEnqueued until commit, then
/// .completed, or .error with an MTLCommandBufferError.
/// https://developer.apple.com/documentation/metal/mtlcommandbuffer/status
/// https://developer.apple.com/documentation/metal/mtlcommandbuffer/error
final class SimCommandBuffer: MTLCommandBuffer {
    let queue: SimCommandQueue
    private(set) var status: MTLCommandBufferStatus = .notEnqueued
    private(set) var error: Error?
    private var passes: [Pass] = []
    /// The first violation while encoding: the command buffer fails with it.
    private var violation: MetalSim.Violation?

    init(queue: SimCommandQueue) { self.queue = queue }

    deinit {
        if status == .notEnqueued { queue.release() }
        MetalSim.count { $0.liveCommandBuffers -= 1 }
    }

    var committed: Bool { status != .notEnqueued }

    func fail(_ v: MetalSim.Violation) {
        if violation == nil { violation = v }
    }

    /// One encoder at a time, none after commit; the encoder is autoreleased.
    /// https://developer.apple.com/documentation/metal/mtlcommandencoder/endencoding()
    /// https://developer.apple.com/documentation/metal/mtlcommandbuffer/commit()
    func makeComputeCommandEncoder(dispatchType: MTLDispatchType) -> MTLComputeCommandEncoder? {
        if committed {
            fail(MetalSim.violate(.encodeAfterCommit, "makeComputeCommandEncoder on a committed command buffer"))
            return nil
        }
        if let open = passes.last, !open.ended {
            fail(MetalSim.violate(.oneEncoderAtATime,
                                  "makeComputeCommandEncoder while the previous encoder has not called endEncoding()"))
        }
        let pass = Pass(dispatchType)
        passes.append(pass)
        let enc = SimComputeEncoder(commandBuffer: self, pass: pass)
        MetalSim.count { $0.encoders += 1 }
        if let v = AutoreleasePools.autorelease(enc, what: "a compute command encoder") { fail(v) }
        return enc
    }

    func commit() {
        if committed {
            MetalSim.violate(.commitOnce, "commit() of a command buffer already committed")
            return
        }
        if let open = passes.last, !open.ended {
            fail(MetalSim.violate(.endEncodingBeforeCommit, "commit() while an encoder has not called endEncoding()"))
        }
        status = .committed
        MetalSim.count { $0.commits += 1 }
        if let v = violation {
            finish(MTLCommandBufferError(code: .invalidResource, message: v.description))
            return
        }
        status = .scheduled
        var used: [SimBuffer] = []
        for p in passes {
            for d in Self.executionOrder(p) {
                used.append(contentsOf: d.buffers.values.map { $0.0 })
                if let e = run(d) {
                    finish(e)
                    return
                }
            }
        }
        used.forEach { $0.usedByCompleted = true }
        finish(nil)
    }

    private func finish(_ e: MTLCommandBufferError?) {
        error = e
        status = e == nil ? .completed : .error
        queue.release()
    }

    /// Blocks until the command buffer completed; before commit() it would
    /// block forever.
    /// https://developer.apple.com/documentation/metal/mtlcommandbuffer/waituntilcompleted()
    func waitUntilCompleted() {
        if !committed {
            MetalSim.violate(.waitBeforeCommit,
                             "waitUntilCompleted() on a command buffer never committed blocks forever (deadlock)")
        }
    }

    /// The order dispatches run in. A serial pass runs them as encoded. A
    /// concurrent pass lets the GPU run dispatches no memoryBarrier separates
    /// in any order: each such group runs reversed (or, with
    /// FLASHMETAL_METAL_SIM_ORDER=shuffle:<seed>, shuffled), so a dispatch
    /// that depends on an earlier one without a barrier reads stale memory.
    /// https://developer.apple.com/documentation/metal/mtldispatchtype/concurrent
    /// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/memorybarrier(scope:)
    static func executionOrder(_ p: Pass) -> [Pass.Recorded] {
        var groups: [[Pass.Recorded]] = [[]]
        for c in p.commands {
            switch c {
            case .barrier: groups.append([])
            case .dispatch(let d): groups[groups.count - 1].append(d)
            }
        }
        guard p.dispatchType == .concurrent else { return groups.flatMap { $0 } }
        let order = getenv("FLASHMETAL_METAL_SIM_ORDER").map { String(cString: $0) } ?? "reverse"
        if order.hasPrefix("shuffle:"), var seed = UInt64(order.dropFirst(8)) {
            seed = seed == 0 ? 0x9E37_79B9_7F4A_7C15 : seed
            return groups.flatMap { g -> [Pass.Recorded] in
                var g = g
                for i in stride(from: g.count - 1, to: 0, by: -1) {
                    seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17
                    g.swapAt(i, Int(seed % UInt64(i + 1)))
                }
                return g
            }
        }
        return groups.flatMap { $0.reversed() }
    }

    /// Runs one dispatch on the simulator, every device access checked
    /// against the buffers bound (FLASHMETAL_METAL_SIM_BOUNDS=0: unchecked);
    /// the error that fails the command buffer, if any.
    private func run(_ d: Pass.Recorded) -> MTLCommandBufferError? {
        let fn = d.pipeline.function
        var sd = SimDispatch(kernel: fn.name)
        sd.constants = fn.constants.sorted { $0.key < $1.key }.map {
            FMSimConstant(index: Int32($0.key), is_bool: $0.value.type == .bool ? 1 : 0, value: $0.value.int)
        }
        // Encoder bindings persist across dispatches: a buffer an earlier
        // dispatch bound at an index this kernel does not declare is ignored,
        // as Metal ignores it.
        sd.buffers = d.buffers.filter { fmsim_kernel_param(fn.name, Int32($0.key), nil, nil) != 0 }
            .map { (i, bo) in (i, bo.0.base + bo.1, bo.0.length - bo.1) }
        sd.bytes = d.bytes.map { ($0.key, $0.value) }
        sd.threadgroupMemory = d.threadgroupMemory.mapValues { UInt32($0) }
        sd.grid = (UInt32(d.grid.width), UInt32(d.grid.height), UInt32(d.grid.depth))
        sd.threads = (UInt32(d.threads.width), UInt32(d.threads.height), UInt32(d.threads.depth))
        let check: Int32 = MetalSim.env("FLASHMETAL_METAL_SIM_BOUNDS", 1) != 0 ? 1 : 0
        let (status, msg) = sd.run(configure: { $0.check_bounds = check })
        // An access outside every bound buffer: a GPU reads garbage or
        // faults; Metal reports a page fault when it faults.
        // https://developer.apple.com/documentation/metal/mtlcommandbuffererror/code/pagefault
        if status == Int32(FMSIM_ERROR_BOUNDS.rawValue) {
            let v = MetalSim.violate(.outOfBounds, msg)
            return MTLCommandBufferError(code: .pageFault, message: v.description)
        }
        if status != 0 {
            return MTLCommandBufferError(code: .internal, message: "\(fn.name): \(msg)")
        }
        // Writes just outside a runtime-owned copy land in its red zones.
        for (i, (b, _)) in d.buffers where !b.redZoneIntact {
            let v = MetalSim.violate(.outOfBounds,
                                     "\(fn.name) wrote outside the \(b.length)-byte buffer bound at index \(i)")
            return MTLCommandBufferError(code: .pageFault, message: v.description)
        }
        return nil
    }
}
