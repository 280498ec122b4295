#if os(Linux)
import CFlashMetal
import FlashMetalCore
import FlashMetalMetal
import Glibc
import Metal
import XCTest

/// The Metal backend (Sources/FlashMetalMetal, unchanged from what a Mac
/// runs) on the metal-sim runtime: its pools, command buffers and device
/// choice, seen through the runtime's counters.
final class MetalSimBackendTests: XCTestCase {
    struct SelftestParams { var n: UInt32 }

    private var seen: [MetalSim.Violation] = []
    override func setUp() {
        seen = []
        MetalSim.onViolation = { [unowned self] in self.seen.append($0) }
    }
    override func tearDown() { MetalSim.onViolation = nil }

    private func selftest(_ input: UnsafeMutablePointer<Float>, _ output: UnsafeMutablePointer<Float>,
                          rows: Int, n: Int) -> Dispatch {
        Dispatch(kernel: .simSelftest, constants: FunctionConstants([(700, .int(2))]),
                 grid: Size3(rows, 1, 1), threadgroup: Size3(64, 1, 1),
                 bindings: [
                     0: .buffer(TensorRef(data: input, byteCount: rows * n * 4, dtype: .f32, shape: [rows, n])),
                     1: .buffer(TensorRef(data: output, byteCount: rows * 4, dtype: .f32, shape: [rows])),
                     2: .bytes(bytesOf(SelftestParams(n: UInt32(n)))),
                 ])
    }

    func testCallsAndBatchesDrainTheirPools() throws {
        let registry = Registry(backend: try MetalBackend())
        XCTAssertEqual(registry.backend.name, "metal-sim")
        var input = (0..<40).map(Float.init), output = [Float](repeating: 0, count: 4)
        let c0 = MetalSim.counters
        try registry.run([], op: "test")
        XCTAssertEqual(MetalSim.counters, c0, "an empty dispatch list makes no command buffer")
        try input.withUnsafeMutableBufferPointer { ip in
            try output.withUnsafeMutableBufferPointer { op in
                try registry.run([selftest(ip.baseAddress!, op.baseAddress!, rows: 4, n: 10)], op: "test")
                let c1 = MetalSim.counters
                XCTAssertEqual(c1.commandBuffers - c0.commandBuffers, 1)
                XCTAssertEqual(c1.liveCommandBuffers, c0.liveCommandBuffers, "released when the call returned")
                try registry.beginBatch()
                try registry.run([selftest(ip.baseAddress!, op.baseAddress!, rows: 4, n: 10)], op: "test")
                try registry.run([], op: "test")
                try registry.run([selftest(ip.baseAddress!, op.baseAddress!, rows: 4, n: 10)], op: "test")
                XCTAssertEqual(MetalSim.counters.liveCommandBuffers, c0.liveCommandBuffers + 1, "the batch's")
                try registry.endBatch()
                let c2 = MetalSim.counters
                XCTAssertEqual(c2.commandBuffers - c1.commandBuffers, 1, "one command buffer per batch")
                XCTAssertEqual(c2.dispatches - c1.dispatches, 2)
                XCTAssertEqual(c2.barriers - c1.barriers, 1)
                XCTAssertEqual(c2.liveCommandBuffers, c0.liveCommandBuffers)
            }
        }
        XCTAssertEqual(output, (0..<4).map { r in 2 * (0..<10).reduce(Float(0)) { $0 + Float(r * 10 + $1) } })
        XCTAssertEqual(seen.count, 0, "\(seen)")
    }

    func testDeviceChoice() throws {
        defer {
            unsetenv("FLASHMETAL_METAL_SIM_DEVICES")
            unsetenv("FLASHMETAL_METAL_DEVICE")
        }
        setenv("FLASHMETAL_METAL_SIM_DEVICES", "paravirtual", 1)
        XCTAssertThrowsError(try MetalBackend()) { e in
            let m = (e as? FlashMetalError)?.message ?? ""
            XCTAssertTrue(m.contains("Paravirtual") && m.contains("Apple7") && m.contains("FLASHMETAL_METAL_DEVICE"), m)
        }
        setenv("FLASHMETAL_METAL_SIM_DEVICES", "paravirtual,m2", 1)
        XCTAssertThrowsError(try MetalBackend(), "the default device is the paravirtual one")
        setenv("FLASHMETAL_METAL_DEVICE", "apple m2", 1)
        XCTAssertTrue(try MetalBackend().deviceName.hasPrefix("Apple M2"))
        setenv("FLASHMETAL_METAL_DEVICE", "Apple", 1)
        XCTAssertThrowsError(try MetalBackend(), "two devices match") { e in
            XCTAssertTrue(((e as? FlashMetalError)?.message ?? "").contains("matches 2 devices"))
        }
        setenv("FLASHMETAL_METAL_DEVICE", "no such gpu", 1)
        XCTAssertThrowsError(try MetalBackend())
    }

    func testHostAllocationsAreWrappedOnce() throws {
        let registry = Registry(backend: try MetalBackend())
        let n = 4096
        let input = try HostAllocations.allocate(bytes: n * 4, op: "test")
        let output = try HostAllocations.allocate(bytes: 16, op: "test")
        let ip = input.base.assumingMemoryBound(to: Float.self), op = output.base.assumingMemoryBound(to: Float.self)
        for i in 0..<n { ip[i] = 1 }
        let c0 = MetalSim.counters
        try registry.run([selftest(ip, op, rows: 4, n: n / 4)], op: "test")
        let c1 = MetalSim.counters
        XCTAssertEqual(c1.bytesWrapped - c0.bytesWrapped, input.length + output.length)
        for _ in 0..<3 { try registry.run([selftest(ip, op, rows: 4, n: n / 4)], op: "test") }
        let c2 = MetalSim.counters
        XCTAssertEqual(c2.bytesWrapped, c1.bytesWrapped, "wrapped once")
        XCTAssertEqual(c2.bytesCopiedIn, c0.bytesCopiedIn)
        XCTAssertEqual(c2.bytesCopiedOut, c0.bytesCopiedOut)
        XCTAssertEqual(Array(UnsafeBufferPointer(start: op, count: 4)), [2048, 2048, 2048, 2048])
        try HostAllocations.free(input.base, op: "test")
        try HostAllocations.free(output.base, op: "test")
        XCTAssertThrowsError(try HostAllocations.free(output.base, op: "test"))
    }
}
#endif
