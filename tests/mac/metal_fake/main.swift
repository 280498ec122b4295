// The Metal backend (Sources/FlashMetalMetal, unchanged) run on Linux
// against a fake Metal device built on the stand-in declarations: the only
// execution its host logic gets off a Mac. The fake records what the backend
// encodes and, at commit, "runs" each dispatch with a small Swift kernel on
// the bound buffers, so stale copies, wrong ordering or copies written back
// into read-only inputs show up as wrong bytes or a crash.
//   device fallback (MTLCreateSystemDefaultDevice nil -> MTLCopyAllDevices)
//   one MTLBuffer per tensor per command buffer, copy back only written tensors
//   one concurrent encoder per command buffer, a barrier between dispatches
//   the encoder ended on every error path, nothing committed after an error
//   flexible threadgroups narrowed to the pipeline's limit (multiple of 32)
//   batches: one command buffer for all calls, committed at the end
//   the serving dispatchers' writes (kv_append's caches, the decode reduce's
//   lse) come back from copies; their read-only inputs are never written
import FlashMetalCore
import FlashMetalMetal
import Glibc
import Metal

var failures = 0
func check(_ ok: Bool, _ what: String, line: Int = #line) {
    print("\(ok ? "PASS" : "FAIL") \(what)")
    if !ok { failures += 1 }
}

// MARK: the fake device

final class FakeBuffer: MTLBuffer {
    let storage: UnsafeMutableRawPointer
    let length: Int
    init(_ storage: UnsafeMutableRawPointer, _ length: Int) {
        self.storage = storage
        self.length = length
    }
    func contents() -> UnsafeMutableRawPointer { storage }
}

/// A kernel of the fake: gets each bound buffer index's memory.
typealias FakeKernel = ([Int: UnsafeMutableRawPointer]) -> Void

final class FakePipeline: MTLComputePipelineState {
    let maxTotalThreadsPerThreadgroup: Int
    let kernel: FakeKernel
    init(max: Int = 1024, _ kernel: @escaping FakeKernel = { _ in }) {
        maxTotalThreadsPerThreadgroup = max
        self.kernel = kernel
    }
}

enum Event: Equatable {
    case barrier, end
    case buffer(index: Int, id: ObjectIdentifier, offset: Int)
    case dispatch(threads: Int)
}

final class FakeEncoder: MTLComputeCommandEncoder {
    let dispatchType: MTLDispatchType
    var events: [Event] = []
    private var pipeline: FakePipeline?
    private var bound: [Int: UnsafeMutableRawPointer] = [:]
    /// Dispatches in encoding order, run at commit.
    var work: [() -> Void] = []
    init(_ type: MTLDispatchType) { dispatchType = type }

    func endEncoding() { events.append(.end) }
    func setComputePipelineState(_ state: MTLComputePipelineState) { pipeline = state as? FakePipeline }
    func setBytes(_ bytes: UnsafeRawPointer, length: Int, index: Int) {}
    func setBuffer(_ buffer: MTLBuffer?, offset: Int, index: Int) {
        let b = buffer as! FakeBuffer
        events.append(.buffer(index: index, id: ObjectIdentifier(b), offset: offset))
        bound[index] = b.storage + offset
    }
    func setThreadgroupMemoryLength(_ length: Int, index: Int) {}
    func dispatchThreadgroups(_ threadgroupsPerGrid: MTLSize, threadsPerThreadgroup: MTLSize) {
        events.append(.dispatch(threads: threadsPerThreadgroup.width * threadsPerThreadgroup.height))
        let (k, args) = (pipeline!.kernel, bound)
        work.append { k(args) }
        bound = [:]
    }
    func memoryBarrier(scope: MTLBarrierScope) { if scope.contains(.buffers) { events.append(.barrier) } }
}

final class FakeCommandBuffer: MTLCommandBuffer {
    var status: MTLCommandBufferStatus = .notEnqueued
    var error: Error? { nil }
    var encoders: [FakeEncoder] = []
    func makeComputeCommandEncoder(dispatchType: MTLDispatchType) -> MTLComputeCommandEncoder? {
        let e = FakeEncoder(dispatchType)
        encoders.append(e)
        return e
    }
    func commit() {
        precondition(encoders.allSatisfy { $0.events.last == .end }, "committed with an open encoder")
        status = .committed
    }
    func waitUntilCompleted() {
        for e in encoders { for w in e.work { w() } }
        status = .completed
    }
}

final class FakeQueue: MTLCommandQueue {
    var buffers: [FakeCommandBuffer] = []
    func makeCommandBuffer() -> MTLCommandBuffer? {
        let b = FakeCommandBuffer()
        buffers.append(b)
        return b
    }
}

final class FakeDevice: MTLDevice {
    let noCopy: Bool
    let queue = FakeQueue()
    var copies = 0
    init(noCopy: Bool) { self.noCopy = noCopy }
    let name = "fake"
    func supportsFamily(_ gpuFamily: MTLGPUFamily) -> Bool { true }
    func makeCommandQueue() -> MTLCommandQueue? { queue }
    func makeBuffer(bytes pointer: UnsafeRawPointer, length: Int, options: MTLResourceOptions) -> MTLBuffer? {
        copies += 1
        let p = UnsafeMutableRawPointer.allocate(byteCount: length, alignment: 16)
        p.copyMemory(from: pointer, byteCount: length)
        return FakeBuffer(p, length)
    }
    func makeBuffer(bytesNoCopy pointer: UnsafeMutableRawPointer, length: Int, options: MTLResourceOptions,
                    deallocator: ((UnsafeMutableRawPointer, Int) -> Void)?) -> MTLBuffer? {
        noCopy ? FakeBuffer(pointer, length) : nil
    }
    func makeLibrary(source: String, options: MTLCompileOptions?) throws -> MTLLibrary {
        throw FlashMetalError.backend("fake: no compiler")
    }
    func makeComputePipelineState(function computeFunction: MTLFunction) throws -> MTLComputePipelineState {
        throw FlashMetalError.backend("fake: no compiler")
    }
}

// MARK: helpers

let page = Int(sysconf(Int32(_SC_PAGESIZE)))

/// `n` floats in their own pages; `readOnly` makes them PROT_READ after filling.
func floats(_ n: Int, _ fill: (Int) -> Float, readOnly: Bool = false) -> TensorRef {
    let bytes = (n * 4 + page - 1) / page * page
    let p = mmap(nil, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)!
    let f = p.assumingMemoryBound(to: Float.self)
    for i in 0..<n { f[i] = fill(i) }
    if readOnly { _ = mprotect(p, bytes, PROT_READ) }
    return TensorRef(data: p, byteCount: n * 4, dtype: .f32, shape: [n])
}

func values(_ t: TensorRef) -> [Float] {
    Array(UnsafeBufferPointer(start: t.data.assumingMemoryBound(to: Float.self), count: t.byteCount / 4))
}

let n = 64
/// tmp[i] = 2 * q[i]
let double: FakeKernel = { b in
    let (q, tmp) = (b[0]!.assumingMemoryBound(to: Float.self), b[1]!.assumingMemoryBound(to: Float.self))
    for i in 0..<n { tmp[i] = 2 * q[i] }
}
/// out[i] = tmp[i] + 1
let addOne: FakeKernel = { b in
    let (tmp, out) = (b[0]!.assumingMemoryBound(to: Float.self), b[1]!.assumingMemoryBound(to: Float.self))
    for i in 0..<n { out[i] = tmp[i] + 1 }
}

func pair(_ q: TensorRef, _ tmp: TensorRef, _ out: TensorRef) -> [Dispatch] {
    [Dispatch(kernel: .vec(kv: .f32, headDim: 64), grid: Size3(1, 1, 1), threadgroup: Size3(32, 1, 1),
              bindings: [0: .buffer(q), 1: .buffer(tmp)], writes: [1]),
     Dispatch(kernel: .vecReduce(headDim: 64, fwht: false), grid: Size3(1, 1, 1), threadgroup: Size3(32, 1, 1),
              bindings: [0: .buffer(tmp), 1: .buffer(out)], writes: [1])]
}

func backend(_ device: FakeDevice) -> MetalBackend {
    _StandIn.defaultDevice = nil
    _StandIn.allDevices = [device]
    return try! MetalBackend()
}

func errorMessage(_ body: () throws -> Void) -> String? {
    do { try body() } catch let e as FlashMetalError { return e.message } catch { return "\(error)" }
    return nil
}

// MARK: tests

_StandIn.defaultDevice = nil
_StandIn.allDevices = []
check(errorMessage { _ = try MetalBackend() } == "metal backend: no Metal device", "no device at all: BackendError")

for noCopy in [false, true] {
    let mode = noCopy ? "bytesNoCopy" : "copy fallback"
    let dev = FakeDevice(noCopy: noCopy)
    let b = backend(dev)
    check(true, "\(mode): MTLCreateSystemDefaultDevice nil falls back to MTLCopyAllDevices")
    let q = floats(n, { Float($0) }, readOnly: true)
    let tmp = floats(n, { _ in -7 })
    let out = floats(n, { _ in -9 })
    do {
        try b.run(pair(q, tmp, out), pipelines: [FakePipeline(double), FakePipeline(addOne)])
        check(values(out) == (0..<n).map { 2 * Float($0) + 1 },
              "\(mode): the second dispatch reads the first one's tmp (one buffer per tensor)")
        check(values(q) == (0..<n).map { Float($0) }, "\(mode): the read-only input is never written back")
        let cb = dev.queue.buffers.last!
        let enc = cb.encoders.first!
        check(cb.encoders.count == 1 && enc.dispatchType == .concurrent, "\(mode): one concurrent encoder")
        let ids = enc.events.compactMap { e -> ObjectIdentifier? in
            if case .buffer(_, let id, _) = e { return id } else { return nil }
        }
        check(enc.events.filter { $0 == .barrier }.count == 1
              && enc.events.firstIndex(of: .barrier)! < enc.events.lastIndex(of: .dispatch(threads: 32))!,
              "\(mode): a buffer barrier before the second dispatch")
        check(dev.copies == (noCopy ? 0 : 3),
              noCopy ? "\(mode): no copies when Metal wraps the memory"
                     : "\(mode): three tensors, three copies (tmp bound twice, copied once)")
        check(ids.count == 4 && ids[1] == ids[2] && Set(ids).count == 3,
              "\(mode): tmp is the same MTLBuffer in both dispatches, q and out their own")
        check(enc.events.last == .end && enc.events.filter { $0 == .end }.count == 1, "\(mode): encoder ended once")
    } catch {
        check(false, "\(mode): run threw \(error)")
    }
}

do {
    let dev = FakeDevice(noCopy: false)
    let b = backend(dev)
    let t = floats(n, { _ in 0 })
    let d = Dispatch(kernel: .sdpa(io: .f32), grid: Size3(1, 1, 1), threadgroup: Size3(1024, 1, 1), bindings: [0: .buffer(t)])
    let msg = errorMessage { try b.run([d], pipelines: [FakePipeline(max: 256)]) }
    check(msg?.contains("needs 1024 threads per threadgroup, the pipeline allows 256") == true,
          "a fixed 1024-thread dispatch on a 256-thread pipeline is a BackendError")
    let cb = dev.queue.buffers.last!
    check(cb.encoders.first?.events == [.end] && cb.status == .notEnqueued,
          "after that error the encoder is ended, nothing was encoded or committed")
    let notMetal = errorMessage { try b.run([d], pipelines: [NSObjectStandIn()]) }
    check(notMetal?.contains("is not Metal's") == true && dev.queue.buffers.last!.encoders.first?.events == [.end],
          "a foreign pipeline object: error, encoder ended")

    let flex = Dispatch(kernel: .vecReduce(headDim: 64, fwht: true), grid: Size3(1, 1, 1), threadgroup: Size3(1024, 1, 1),
                        bindings: [0: .buffer(t)], threadgroupFlexible: true)
    try b.run([flex], pipelines: [FakePipeline(max: 300)])
    check(dev.queue.buffers.last!.encoders.first!.events.contains(.dispatch(threads: 288)),
          "a flexible 1024-thread dispatch runs 288 wide on a 300-thread pipeline")
    let tooSmall = errorMessage { try b.run([flex], pipelines: [FakePipeline(max: 31)]) }
    check(tooSmall?.contains("allows 31") == true, "a flexible dispatch still needs 32 threads")

    let overlap = TensorRef(data: t.data + 8, byteCount: t.byteCount, dtype: .f32, shape: [n])
    let two = [Dispatch(kernel: .sdpa(io: .bf16), grid: Size3(1, 1, 1), threadgroup: Size3(32, 1, 1),
                        bindings: [0: .buffer(t), 1: .buffer(overlap)])]
    let o = errorMessage { try b.run(two, pipelines: [FakePipeline()]) }
    check(o?.contains("partly overlaps") == true, "copies of partly overlapping tensors are refused")
} catch {
    check(false, "error-path checks threw \(error)")
}

do {
    let dev = FakeDevice(noCopy: false)
    let b = backend(dev)
    let q = floats(n, { Float($0) }, readOnly: true)
    let tmp = floats(n, { _ in -7 })
    let out = floats(n, { _ in -9 })
    try b.beginBatch()
    let ds = pair(q, tmp, out)
    try b.run([ds[0]], pipelines: [FakePipeline(double)])
    try b.run([ds[1]], pipelines: [FakePipeline(addOne)])
    check(dev.queue.buffers.count == 1 && dev.queue.buffers[0].status == .notEnqueued && values(out)[1] == -9,
          "batch: nothing committed before endBatch")
    try b.endBatch()
    let enc = dev.queue.buffers[0].encoders
    check(enc.count == 1 && enc[0].events.filter { $0 == .barrier }.count == 1,
          "batch: two calls share one encoder, a barrier between them")
    check(values(out) == (0..<n).map { 2 * Float($0) + 1 } && dev.copies == 3,
          "batch: the second call reads the first call's tmp, each tensor copied once")
} catch {
    check(false, "batch checks threw \(error)")
}

/// `t` viewed with another dtype and shape (same bytes).
func view(_ t: TensorRef, _ dtype: DType, _ shape: [Int]) -> TensorRef {
    TensorRef(data: t.data, byteCount: t.byteCount, dtype: dtype, shape: shape)
}

do {
    // kv_append through its real dispatcher: B=1, 2 new rows of Hkv=1, D=4
    // into a [1, 4, 1, 4] cache at row seqlens[0] = 1. The fake kernel is the
    // op's copy; inputs are read-only pages, so a copy back would crash.
    let dev = FakeDevice(noCopy: false)
    let b = backend(dev)
    let kNew = view(floats(8, { Float($0) + 100 }, readOnly: true), .f32, [1, 2, 1, 4])
    let vNew = view(floats(8, { Float($0) + 200 }, readOnly: true), .f32, [1, 2, 1, 4])
    let kCache = view(floats(16, { _ in -1 }), .f32, [1, 4, 1, 4])
    let vCache = view(floats(16, { _ in -2 }), .f32, [1, 4, 1, 4])
    let seqlens = view(floats(1, { _ in Float(bitPattern: 1) }, readOnly: true), .i32, [1])
    let append: FakeKernel = { m in
        let start = Int(m[KVAppendBuffer.seqlens]!.load(as: Int32.self))
        for (src, dst) in [(KVAppendBuffer.kNew, KVAppendBuffer.kCache), (KVAppendBuffer.vNew, KVAppendBuffer.vCache)] {
            let (s, d) = (m[src]!.assumingMemoryBound(to: Float.self), m[dst]!.assumingMemoryBound(to: Float.self))
            for i in 0..<8 { d[start * 4 + i] = s[i] }
        }
    }
    let d = try KVAppendDispatcher.makeDispatch(KVAppendTensors(kNew: kNew, vNew: vNew, kCache: kCache,
                                                                vCache: vCache, seqlens: seqlens))!
    try b.run([d], pipelines: [FakePipeline(append)])
    check(values(kCache) == [-1, -1, -1, -1] + (100..<108).map(Float.init) + [-1, -1, -1, -1]
          && values(vCache) == [-2, -2, -2, -2] + (200..<208).map(Float.init) + [-2, -2, -2, -2],
          "kv_append: both caches come back with the rows written, the rest unchanged")
    check(dev.copies == 5, "kv_append: five tensors, five copies")

    // Serving decode: the reduce's lse output is in its writes, so it comes back.
    let q = view(floats(64, { _ in 0 }, readOnly: true), .f32, [1, 1, 64])
    let k = view(floats(16 * 64, { _ in 0 }, readOnly: true), .f32, [1, 16, 1, 64])
    let v = view(floats(16 * 64, { _ in 0 }, readOnly: true), .f32, [1, 16, 1, 64])
    let out = view(floats(64, { _ in -9 }), .f32, [1, 1, 64])
    let lse = view(floats(1, { _ in -9 }), .f32, [1, 1])
    let lens = view(floats(1, { _ in Float(bitPattern: 3) }, readOnly: true), .i32, [1])
    let tmp = floats(VecDispatcher.tmpByteCount(rows: 1, headDim: 64) / 4, { _ in 0 })
    let ds = try VecSeqDispatcher.makeDispatches(
        VecSeqTensors(q: q, k: k, v: v, out: out, tmp: tmp, seqlensK: lens, lse: lse), VecSeqOptions(scale: 1))
    let reduce: FakeKernel = { m in
        m[VecReduceBuffer.out]!.assumingMemoryBound(to: Float.self)[0] = 1
        m[VecReduceBuffer.lse]!.assumingMemoryBound(to: Float.self)[0] = 2
    }
    try b.run(ds, pipelines: [FakePipeline(), FakePipeline(reduce)])
    check(values(out)[0] == 1 && values(lse) == [2], "serving decode: out and lse come back from their copies")
} catch {
    check(false, "serving dispatch checks threw \(error)")
}

print(failures == 0 ? "metal_fake: all passed" : "metal_fake: \(failures) failed")
exit(failures == 0 ? 0 : 1)

/// A pipeline object that is not an MTLComputePipelineState.
final class NSObjectStandIn {}
