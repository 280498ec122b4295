import FlashMetalSim
import Glibc

/// A compute command encoder: checks each call against Apple's rules and
/// records it into its pass; the command buffer runs the pass at commit.
final class SimComputeEncoder: MTLComputeCommandEncoder {
    private let commandBuffer: SimCommandBuffer
    private let pass: Pass
    private var pipeline: SimPipeline?
    private var buffers: [Int: (SimBuffer, Int)] = [:]
    private var bytes: [Int: [UInt8]] = [:]
    private var threadgroupMemory: [Int: Int] = [:]
    /// memoryBarrier calls so far (FLASHMETAL_METAL_SIM_DROP_BARRIER=<n>
    /// ignores the n-th of each encoder: a test that a missing barrier shows).
    private var barriersSeen = 0

    init(commandBuffer: SimCommandBuffer, pass: Pass) {
        self.commandBuffer = commandBuffer
        self.pass = pass
    }

    /// An encoder released before endEncoding(): Metal's validation layer
    /// asserts ("Command encoder released without endEncoding").
    deinit {
        if !pass.ended {
            let v = MetalSim.violate(.encoderReleasedOpen, "a compute command encoder was released without endEncoding()")
            if !commandBuffer.committed { commandBuffer.fail(v) }
        }
    }

    private func violate(_ rule: MetalSim.Rule, _ message: String) {
        commandBuffer.fail(MetalSim.violate(rule, message))
    }

    /// Whether the encoder may still encode: not after endEncoding(), not
    /// once its command buffer is committed.
    /// https://developer.apple.com/documentation/metal/mtlcommandencoder/endencoding()
    private func usable(_ call: String) -> Bool {
        if commandBuffer.committed {
            MetalSim.violate(.encodeAfterCommit, "\(call) on an encoder of a committed command buffer")
            return false
        }
        if pass.ended {
            violate(.encodeAfterEnd, "\(call) after endEncoding()")
            return false
        }
        return true
    }

    func endEncoding() {
        guard usable("endEncoding()") else { return }
        pass.ended = true
    }

    func setComputePipelineState(_ state: MTLComputePipelineState) {
        guard usable("setComputePipelineState") else { return }
        guard let p = state as? SimPipeline else {
            violate(.noPipeline, "setComputePipelineState with a pipeline not made by this device")
            return
        }
        pipeline = p
    }

    /// At most 4 KiB: "Use this method for single-use data smaller than 4 KB".
    /// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setbytes(_:length:index:)
    func setBytes(_ bytes: UnsafeRawPointer, length: Int, index: Int) {
        guard usable("setBytes") else { return }
        guard length > 0, length <= 4096 else {
            violate(.setBytesLength, "setBytes of \(length) bytes at index \(index) (1...4096 allowed)")
            return
        }
        guard (0..<31).contains(index) else {
            violate(.bufferOffset, "setBytes at index \(index) (0...30 allowed)")
            return
        }
        self.bytes[index] = Array(UnsafeRawBufferPointer(start: bytes, count: length))
        buffers[index] = nil
    }

    /// The offset lies inside the buffer; its alignment is checked against
    /// the kernel's parameter when a dispatch is encoded.
    /// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setbuffer(_:offset:index:)
    func setBuffer(_ buffer: MTLBuffer?, offset: Int, index: Int) {
        guard usable("setBuffer") else { return }
        guard (0..<31).contains(index) else {
            violate(.bufferOffset, "setBuffer at index \(index) (0...30 allowed)")
            return
        }
        guard let buffer else {
            buffers[index] = nil
            return
        }
        guard let b = buffer as? SimBuffer else {
            violate(.bufferOffset, "setBuffer with a buffer not made by this device")
            return
        }
        guard offset >= 0, offset < b.length else {
            violate(.bufferOffset, "setBuffer offset \(offset) at index \(index) is outside the \(b.length)-byte buffer")
            return
        }
        buffers[index] = (b, offset)
        bytes[index] = nil
    }

    /// "The length must be a multiple of 16 bytes."
    /// https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setthreadgroupmemorylength(_:index:)
    func setThreadgroupMemoryLength(_ length: Int, index: Int) {
        guard usable("setThreadgroupMemoryLength") else { return }
        guard length >= 0, length % 16 == 0, (0..<31).contains(index) else {
            violate(.threadgroupMemoryLength,
                    "setThreadgroupMemoryLength(\(length), index: \(index)): the length must be a multiple of 16")
            return
        }
        threadgroupMemory[index] = length
    }

    func dispatchThreadgroups(_ threadgroupsPerGrid: MTLSize, threadsPerThreadgroup: MTLSize) {
        guard usable("dispatchThreadgroups") else { return }
        guard let p = pipeline else {
            violate(.noPipeline, "dispatchThreadgroups with no compute pipeline state set")
            return
        }
        let t = threadsPerThreadgroup, g = threadgroupsPerGrid
        let total = t.width * t.height * t.depth
        guard t.width > 0, t.height > 0, t.depth > 0, total <= p.maxTotalThreadsPerThreadgroup,
              g.width >= 0, g.height >= 0, g.depth >= 0, g.width <= Int(UInt32.max), g.height <= Int(UInt32.max),
              g.depth <= Int(UInt32.max) else {
            violate(.threadsPerThreadgroup,
                    "\(p.function.name): threadsPerThreadgroup (\(t.width), \(t.height), \(t.depth)) = \(total) threads "
                        + "exceeds the pipeline's maxTotalThreadsPerThreadgroup \(p.maxTotalThreadsPerThreadgroup) "
                        + "(or a size is not positive)")
            return
        }
        // The sum of threadgroup memory lengths stays within the device's
        // maxThreadgroupMemoryLength.
        let tgTotal = threadgroupMemory.values.reduce(0, +)
        let maxTG = commandBuffer.queue.device.maxThreadgroupMemoryLength
        guard tgTotal <= maxTG else {
            violate(.threadgroupMemoryTotal,
                    "\(p.function.name): threadgroup memory lengths total \(tgTotal) bytes, over \(maxTG)")
            return
        }
        // Device buffers: the offset is aligned to the type the kernel reads;
        // constant-space buffers: to 256 bytes on macOS.
        // https://developer.apple.com/documentation/metal/mtlcomputecommandencoder/setbuffer(_:offset:index:)
        for (i, (b, off)) in buffers {
            var kind: Int32 = 0, align: UInt32 = 1
            guard fmsim_kernel_param(p.function.name, Int32(i), &kind, &align) != 0 else { continue }
            let need = kind == 1 ? 256 : Int(align)
            if off % need != 0 || UInt(bitPattern: b.base) % UInt(need) != 0 {
                violate(.bufferOffset, "\(p.function.name): buffer index \(i) is bound at offset \(off), which is not "
                            + "a multiple of \(need) (\(kind == 1 ? "constant address space" : "the type the kernel reads"))")
                return
            }
        }
        // The encoder's bindings outlive a dispatch; Metal ignores those at
        // indices the kernel does not declare (left by an earlier kernel of
        // the encoder), so only the kernel's own buffer parameters are passed.
        func declared(_ index: Int) -> Bool {
            var kind: Int32 = 0, align: UInt32 = 1
            return fmsim_kernel_param(p.function.name, Int32(index), &kind, &align) != 0 && kind != 2
        }
        pass.commands.append(.dispatch(Pass.Recorded(pipeline: p, buffers: buffers.filter { declared($0.key) },
                                                     bytes: bytes.filter { declared($0.key) },
                                                     threadgroupMemory: threadgroupMemory, grid: g, threads: t)))
        MetalSim.count { $0.dispatches += 1 }
    }

    func memoryBarrier(scope: MTLBarrierScope) {
        guard usable("memoryBarrier") else { return }
        guard scope.contains(.buffers) else { return }
        barriersSeen += 1
        MetalSim.count { $0.barriers += 1 }
        if barriersSeen == MetalSim.env("FLASHMETAL_METAL_SIM_DROP_BARRIER", 0) { return }
        pass.commands.append(.barrier)
    }
}
