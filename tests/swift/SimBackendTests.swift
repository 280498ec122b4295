import CFlashMetal
import FlashMetalCore
import FlashMetalSimBackend
import XCTest

/// The sim backend runs a kernel from Resources/shaders (sim_selftest.metal,
/// host name fm_selftest_reduce) through the registry, and reports kernel
/// failures as thrown FlashMetalErrors.
final class SimBackendTests: XCTestCase {
    struct SelftestParams { var n: UInt32 }

    private func selftestDispatch(rows: Int, n: Int, threads: Int, input: UnsafeMutablePointer<Float>,
                                  output: UnsafeMutablePointer<Float>,
                                  constants: FunctionConstants) -> Dispatch {
        Dispatch(kernel: .simSelftest, constants: constants,
                 grid: Size3(rows, 1, 1), threadgroup: Size3(threads, 1, 1),
                 bindings: [
                     0: .buffer(TensorRef(data: input, byteCount: rows * n * 4, dtype: .f32, shape: [rows, n])),
                     1: .buffer(TensorRef(data: output, byteCount: rows * 4, dtype: .f32, shape: [rows])),
                     2: .bytes(bytesOf(SelftestParams(n: UInt32(n)))),
                 ])
    }

    func testSelftestKernelRunsThroughRegistry() throws {
        XCTAssertTrue(SimBackend.kernelNames.contains("fm_selftest_reduce"))
        let rows = 3, n = 300
        var input = (0..<(rows * n)).map { Float(($0 * 7) % 23) - 11 }
        var output = [Float](repeating: -1, count: rows)
        let registry = Registry(backend: SimBackend(workers: 2))
        XCTAssertEqual(registry.backend.name, "sim")
        for threads in [32, 96, 128] {
            try input.withUnsafeMutableBufferPointer { ip in
                try output.withUnsafeMutableBufferPointer { op in
                    let d = selftestDispatch(rows: rows, n: n, threads: threads, input: ip.baseAddress!,
                                             output: op.baseAddress!, constants: FunctionConstants([(700, .int(3))]))
                    try registry.run([d], op: "test")
                }
            }
            for r in 0..<rows {
                let want = 3 * input[(r * n)..<((r + 1) * n)].reduce(Float(0), +)
                XCTAssertEqual(output[r], want, accuracy: 1e-3, "row \(r), \(threads) threads")
            }
        }
        XCTAssertEqual(registry.cachedKeys.count, 1)
    }

    func testUnsetFunctionConstantThrows() {
        var input = [Float](repeating: 1, count: 64)
        var output = [Float](repeating: 0, count: 1)
        let registry = Registry(backend: SimBackend())
        XCTAssertThrowsError(try input.withUnsafeMutableBufferPointer { ip in
            try output.withUnsafeMutableBufferPointer { op in
                try registry.run([selftestDispatch(rows: 1, n: 64, threads: 32, input: ip.baseAddress!,
                                                   output: op.baseAddress!, constants: FunctionConstants())], op: "test")
            }
        }) { error in
            guard let e = error as? FlashMetalError else { return XCTFail("not a FlashMetalError: \(error)") }
            XCTAssertEqual(e.status, FM_ERROR_BACKEND)
            XCTAssertTrue(e.message.contains("selftest_scale"), e.message)
            XCTAssertTrue(e.message.contains("not set"), e.message)
        }
    }

    func testBadBindingIndexAndThreadgroupMemoryThrow() {
        let out = UnsafeMutablePointer<Float>.allocate(capacity: 4)
        defer { out.deallocate() }
        let registry = Registry(backend: SimBackend())
        let t = TensorRef(data: out, byteCount: 16, dtype: .f32, shape: [4])
        let bad = Dispatch(kernel: .simSelftest, constants: FunctionConstants([(700, .int(1))]),
                           grid: Size3(1, 1, 1), threadgroup: Size3(32, 1, 1), bindings: [40: .buffer(t)])
        XCTAssertThrowsError(try registry.run([bad], op: "test")) { error in
            XCTAssertTrue("\(error)".contains("out of range"), "\(error)")
        }
        let big = Dispatch(kernel: .simSelftest, constants: FunctionConstants([(700, .int(1))]),
                           grid: Size3(1, 1, 1), threadgroup: Size3(32, 1, 1), bindings: [1: .buffer(t)],
                           threadgroupMemory: [0: 40000])
        XCTAssertThrowsError(try registry.run([big], op: "test")) { error in
            XCTAssertTrue("\(error)".contains("32 KiB"), "\(error)")
        }
    }
}
