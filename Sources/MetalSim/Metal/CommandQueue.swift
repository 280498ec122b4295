/// A queue with at most `maxCommandBufferCount` uncompleted command buffers:
/// Metal blocks the thread that asks for one more until one completes; a
/// thread that will never complete one waits forever, which this runtime
/// reports as a deadlock (a violation) and answers with nil.
/// https://developer.apple.com/documentation/metal/mtldevice/makecommandqueue(maxcommandbuffercount:)
final class SimCommandQueue: MTLCommandQueue {
    let device: SimDevice
    let maxCommandBufferCount: Int
    private let lock = SimLock()
    private var uncompleted = 0

    init(device: SimDevice, maxCommandBufferCount: Int) {
        self.device = device
        self.maxCommandBufferCount = maxCommandBufferCount
    }

    /// The command buffer is autoreleased (it lives until the enclosing
    /// pool drains).
    /// https://developer.apple.com/documentation/metal/mtlcommandqueue/makecommandbuffer()
    func makeCommandBuffer() -> MTLCommandBuffer? {
        let full = lock.locked { () -> Bool in
            if uncompleted >= maxCommandBufferCount { return true }
            uncompleted += 1
            return false
        }
        if full {
            MetalSim.violate(.queueDeadlock,
                             "makeCommandBuffer() with \(maxCommandBufferCount) uncompleted command buffers on the queue "
                                 + "blocks until one completes: none will (deadlock)")
            return nil
        }
        let cb = SimCommandBuffer(queue: self)
        MetalSim.count { $0.commandBuffers += 1; $0.liveCommandBuffers += 1 }
        if let v = AutoreleasePools.autorelease(cb, what: "a command buffer") { cb.fail(v) }
        return cb
    }

    /// A command buffer completed, or was released without a commit.
    func release() { lock.locked { uncompleted -= 1 } }
}
