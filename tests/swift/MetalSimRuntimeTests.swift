#if os(Linux)
import CFlashMetal
import FlashMetalCore
import FlashMetalShaders
import FlashMetalSim
import Glibc
@testable import Metal
import XCTest

/// Planted errors against the metal-sim runtime: each breaks one Metal rule
/// and must fail as Metal would (a violation naming the rule, a failed
/// command buffer, nil, or a thrown error), while the same code done right
/// runs the kernel and gets the right numbers. The kernel is
/// fm_selftest_reduce: out[row] = scale * sum(in[row, :]), scale = constant 700.
final class MetalSimRuntimeTests: XCTestCase {
    private var seen: [MetalSim.Violation] = []
    private var device: MTLDevice!
    private var queue: MTLCommandQueue!

    override func setUp() {
        seen = []
        MetalSim.onViolation = { [unowned self] in self.seen.append($0) }
        device = MTLCreateSystemDefaultDevice()
        queue = device.makeCommandQueue()
    }

    override func tearDown() { MetalSim.onViolation = nil }

    private func options() -> MTLCompileOptions {
        let o = MTLCompileOptions()
        o.languageVersion = .version3_1
        o.mathMode = .safe
        o.mathFloatingPointFunctions = .precise
        return o
    }

    private func pipeline(scale: Int32 = 3, type: MTLDataType = .int) throws -> MTLComputePipelineState {
        let lib = try device.makeLibrary(source: Shaders.source(forKernel: "fm_selftest_reduce")!.text,
                                         options: options())
        let values = MTLFunctionConstantValues()
        var s = scale
        values.setConstantValue(&s, type: type, index: 700)
        return try device.makeComputePipelineState(
            function: try lib.makeFunction(name: "fm_selftest_reduce", constantValues: values))
    }

    private func floats(_ v: [Float]) -> MTLBuffer { device.makeBuffer(bytes: v, length: v.count * 4, options: .storageModeShared)! }

    private func read(_ b: MTLBuffer, _ n: Int) -> [Float] {
        Array(UnsafeBufferPointer(start: b.contents().assumingMemoryBound(to: Float.self), count: n))
    }

    /// Encodes out[row] = scale * sum(input[row, :]) for `rows` rows of `n`.
    private func reduce(_ enc: MTLComputeCommandEncoder, _ pso: MTLComputePipelineState, _ input: MTLBuffer,
                        _ out: MTLBuffer, rows: Int, n: Int, threads: Int = 64) {
        var params = UInt32(n)
        enc.setComputePipelineState(pso)
        enc.setBuffer(input, offset: 0, index: 0)
        enc.setBuffer(out, offset: 0, index: 1)
        enc.setBytes(&params, length: 4, index: 2)
        enc.dispatchThreadgroups(MTLSize(width: rows, height: 1, depth: 1),
                                 threadsPerThreadgroup: MTLSize(width: threads, height: 1, depth: 1))
    }

    private func broke(_ rule: MetalSim.Rule, file: StaticString = #filePath, line: UInt = #line) {
        XCTAssertTrue(seen.contains { $0.rule == rule }, "expected a \(rule.rawValue) violation, saw \(seen.map(\.rule))",
                      file: file, line: line)
        XCTAssertTrue(MetalSim.lastViolation?.description.contains("developer.apple.com") ?? false, file: file, line: line)
    }

    // MARK: the rules kept: the kernel runs

    func testValidCommandBufferRunsTheKernel() throws {
        let pso = try pipeline()
        let before = MetalSim.counters
        try autoreleasepool {
            let input = floats((0..<6).map(Float.init)), out = floats([0, 0])
            let cb = queue.makeCommandBuffer()!
            let enc = cb.makeComputeCommandEncoder(dispatchType: .concurrent)!
            reduce(enc, pso, input, out, rows: 2, n: 3)
            enc.endEncoding()
            XCTAssertEqual(cb.status, .notEnqueued)
            cb.commit()
            cb.waitUntilCompleted()
            XCTAssertEqual(cb.status, .completed, "\(String(describing: cb.error))")
            XCTAssertNil(cb.error)
            XCTAssertEqual(read(out, 2), [9, 36])
        }
        let after = MetalSim.counters
        XCTAssertEqual(after.commandBuffers - before.commandBuffers, 1)
        XCTAssertEqual(after.encoders - before.encoders, 1)
        XCTAssertEqual(after.dispatches - before.dispatches, 1)
        XCTAssertEqual(after.bytesCopiedIn - before.bytesCopiedIn, 32)
        XCTAssertEqual(after.bytesCopiedOut - before.bytesCopiedOut, 8)
        XCTAssertEqual(after.liveCommandBuffers, before.liveCommandBuffers, "the pool released the command buffer")
        XCTAssertEqual(seen.count, 0)
    }

    /// An encoder's bindings outlive a dispatch; one at an index the next
    /// kernel does not declare (left by an earlier, wider kernel) is ignored,
    /// as Metal ignores it.
    func testBindingsTheKernelDoesNotDeclareAreIgnored() throws {
        let pso = try pipeline()
        try autoreleasepool {
            let input = floats((0..<6).map(Float.init)), out = floats([0, 0]), unused = floats([1, 2, 3, 4])
            let cb = queue.makeCommandBuffer()!
            let enc = cb.makeComputeCommandEncoder(dispatchType: .serial)!
            enc.setBuffer(unused, offset: 0, index: 8)
            var wide: UInt32 = 5
            enc.setBytes(&wide, length: 4, index: 9)
            reduce(enc, pso, input, out, rows: 2, n: 3)
            enc.endEncoding()
            cb.commit()
            cb.waitUntilCompleted()
            XCTAssertEqual(cb.status, .completed, "\(String(describing: cb.error))")
            XCTAssertEqual(read(out, 2), [9, 36])
        }
        XCTAssertEqual(seen.count, 0)
    }

    // MARK: lifecycle

    func testSecondEncoderWhileOneIsOpen() throws {
        try autoreleasepool {
            let cb = queue.makeCommandBuffer()!
            let first = cb.makeComputeCommandEncoder(dispatchType: .serial)!
            let second = cb.makeComputeCommandEncoder(dispatchType: .serial)
            broke(.oneEncoderAtATime)
            first.endEncoding()
            second?.endEncoding()
            cb.commit()
            XCTAssertEqual(cb.status, .error)
            XCTAssertTrue("\(String(describing: cb.error))".contains("one-encoder-at-a-time"))
        }
    }

    func testCommitWithAnOpenEncoder() {
        autoreleasepool {
            let cb = queue.makeCommandBuffer()!
            let enc = cb.makeComputeCommandEncoder(dispatchType: .serial)!
            cb.commit()
            broke(.endEncodingBeforeCommit)
            XCTAssertEqual(cb.status, .error)
            XCTAssertNotNil(cb.error)
            enc.endEncoding()  // after commit: one more violation
            broke(.encodeAfterCommit)
        }
    }

    func testEncodingAfterEndEncoding() throws {
        let pso = try pipeline()
        autoreleasepool {
            let cb = queue.makeCommandBuffer()!
            let enc = cb.makeComputeCommandEncoder(dispatchType: .serial)!
            enc.endEncoding()
            enc.setComputePipelineState(pso)
            broke(.encodeAfterEnd)
            cb.commit()
            XCTAssertEqual(cb.status, .error)
        }
    }

    func testEncoderAfterCommit() {
        autoreleasepool {
            let cb = queue.makeCommandBuffer()!
            cb.commit()
            XCTAssertEqual(cb.status, .completed)
            XCTAssertNil(cb.makeComputeCommandEncoder(dispatchType: .serial))
            broke(.encodeAfterCommit)
        }
    }

    func testCommitTwice() {
        autoreleasepool {
            let cb = queue.makeCommandBuffer()!
            cb.commit()
            cb.commit()
            broke(.commitOnce)
        }
    }

    func testWaitBeforeCommit() {
        autoreleasepool {
            let cb = queue.makeCommandBuffer()!
            cb.waitUntilCompleted()
            broke(.waitBeforeCommit)
        }
    }

    func testEncoderReleasedWithoutEndEncoding() {
        autoreleasepool {
            let cb = queue.makeCommandBuffer()!
            _ = cb.makeComputeCommandEncoder(dispatchType: .serial)
        }
        broke(.encoderReleasedOpen)
    }

    // MARK: autorelease

    func testCommandBufferWithNoPoolLeaksAndFails() {
        let before = MetalSim.counters.liveCommandBuffers
        let cb = queue.makeCommandBuffer()!
        broke(.noAutoreleasePool)
        cb.commit()
        XCTAssertEqual(cb.status, .error)
        XCTAssertEqual(MetalSim.counters.liveCommandBuffers, before + 1, "leaked: nothing releases it")
    }

    func testObjectsLiveUntilThePoolDrains() {
        let before = MetalSim.counters.liveCommandBuffers
        weak var weakCB: MTLCommandBuffer?
        autoreleasepool {
            autoreleasepool { weakCB = queue.makeCommandBuffer() }
            // The caller kept no reference: the inner pool held it, and drained.
            XCTAssertNil(weakCB)
            _ = queue.makeCommandBuffer()
            XCTAssertEqual(MetalSim.counters.liveCommandBuffers, before + 1, "alive until the pool drains")
        }
        XCTAssertEqual(MetalSim.counters.liveCommandBuffers, before)
        XCTAssertEqual(seen.count, 0)
    }

    func testSixtyFifthUncompletedCommandBufferDeadlocks() {
        autoreleasepool {
            let held = (0..<64).map { _ in queue.makeCommandBuffer()! }
            XCTAssertEqual(seen.count, 0)
            XCTAssertNil(queue.makeCommandBuffer())
            broke(.queueDeadlock)
            held[0].commit()  // one completes: a slot is free again
            XCTAssertNotNil(queue.makeCommandBuffer())
        }
        autoreleasepool { XCTAssertNotNil(queue.makeCommandBuffer(), "released buffers free their slots") }
    }

    // MARK: buffers

    func testBytesNoCopyNeedsSixteenKiBPages() {
        let page = 16384
        let mem = UnsafeMutableRawPointer.allocate(byteCount: 4 * page, alignment: page)
        defer { mem.deallocate() }
        XCTAssertNotNil(device.makeBuffer(bytesNoCopy: mem, length: page, options: .storageModeShared, deallocator: nil))
        XCTAssertNil(device.makeBuffer(bytesNoCopy: mem + 4096, length: page, options: .storageModeShared,
                                       deallocator: nil), "4 KiB-aligned is not an Apple silicon page")
        XCTAssertNil(device.makeBuffer(bytesNoCopy: mem, length: page + 4096, options: .storageModeShared,
                                       deallocator: nil))
        XCTAssertNil(device.makeBuffer(bytesNoCopy: mem, length: 0, options: .storageModeShared, deallocator: nil))
        var byte: UInt8 = 0
        XCTAssertNil(device.makeBuffer(bytes: &byte, length: (device as! SimDevice).maxBufferLength + 1, options: .storageModeShared))
    }

    func testSetBytesOverFourKiB() {
        autoreleasepool {
            let cb = queue.makeCommandBuffer()!
            let enc = cb.makeComputeCommandEncoder(dispatchType: .serial)!
            let big = [UInt8](repeating: 0, count: 4097)
            enc.setBytes(big, length: 4097, index: 2)
            broke(.setBytesLength)
            enc.endEncoding()
            cb.commit()
            XCTAssertEqual(cb.status, .error)
        }
    }

    func testBufferOffsetsOutsideOrMisaligned() throws {
        let pso = try pipeline()
        autoreleasepool {
            let input = floats([1, 2, 3, 4]), out = floats([0, 0])
            let cb = queue.makeCommandBuffer()!
            let enc = cb.makeComputeCommandEncoder(dispatchType: .serial)!
            enc.setBuffer(input, offset: 16, index: 0)
            broke(.bufferOffset)
            seen = []
            var params = UInt32(1)
            enc.setComputePipelineState(pso)
            enc.setBuffer(input, offset: 2, index: 0)  // the kernel reads floats
            enc.setBuffer(out, offset: 0, index: 1)
            enc.setBytes(&params, length: 4, index: 2)
            enc.dispatchThreadgroups(MTLSize(width: 1, height: 1, depth: 1),
                                     threadsPerThreadgroup: MTLSize(width: 32, height: 1, depth: 1))
            broke(.bufferOffset)
            seen = []
            enc.setBuffer(input, offset: 0, index: 0)
            enc.setBuffer(input, offset: 4, index: 2)  // constant address space: 256-byte offsets
            enc.dispatchThreadgroups(MTLSize(width: 1, height: 1, depth: 1),
                                     threadsPerThreadgroup: MTLSize(width: 32, height: 1, depth: 1))
            broke(.bufferOffset)
            enc.endEncoding()
            cb.commit()
            XCTAssertEqual(cb.status, .error)
        }
    }

    /// Runs one reduce over `input` bound at `offset` and returns the error
    /// of its command buffer (nil when it completed).
    private func reduceError(_ input: MTLBuffer, offset: Int = 0, out: MTLBuffer? = nil, rows: Int,
                             n: Int) throws -> MTLCommandBufferError? {
        let pso = try pipeline()
        return autoreleasepool {
            let cb = queue.makeCommandBuffer()!
            let enc = cb.makeComputeCommandEncoder(dispatchType: .serial)!
            reduce(enc, pso, input, out ?? floats([Float](repeating: 0, count: rows)), rows: rows, n: n)
            enc.setBuffer(input, offset: offset, index: 0)
            enc.dispatchThreadgroups(MTLSize(width: rows, height: 1, depth: 1),
                                     threadsPerThreadgroup: MTLSize(width: 64, height: 1, depth: 1))
            enc.endEncoding()
            cb.commit()
            XCTAssertEqual(cb.status, cb.error == nil ? .completed : .error)
            return cb.error as? MTLCommandBufferError
        }
    }

    private func assertOutOfBounds(_ e: MTLCommandBufferError?, _ says: String, file: StaticString = #filePath,
                                   line: UInt = #line) {
        XCTAssertEqual(e?.code, .pageFault, file: file, line: line)
        broke(.outOfBounds, file: file, line: line)
        let msg = MetalSim.lastViolation?.message ?? ""
        XCTAssertTrue(msg.hasPrefix("fm_selftest_reduce " + says), msg, file: file, line: line)
        seen = []
    }

    func testKernelWritingPastABufferFails() throws {
        let out = floats([0])  // 3 rows, room for 1
        assertOutOfBounds(try reduceError(floats([Float](repeating: 1, count: 12)), out: out, rows: 3, n: 4),
                          "wrote 4 bytes at offset 4 of the 4-byte buffer bound at index 1")
    }

    func testKernelReadingOneElementPastACopyFails() throws {
        // 2 rows of 3 need 6 floats; the buffer holds 5.
        assertOutOfBounds(try reduceError(floats([1, 2, 3, 4, 5]), rows: 2, n: 3),
                          "read 4 bytes at offset 20 of the 20-byte buffer bound at index 0")
        XCTAssertNil(try reduceError(floats([1, 2, 3, 4, 5, 6]), rows: 2, n: 3))
        XCTAssertTrue(seen.isEmpty, "\(seen)")
    }

    func testKernelReadingPastABindingOffsetFails() throws {
        // Bound at offset 16 of 32 bytes: 4 floats visible, the kernel reads 5.
        let input = floats([1, 2, 3, 4, 5, 6, 7, 8])
        assertOutOfBounds(try reduceError(input, offset: 16, rows: 1, n: 5),
                          "read 4 bytes at offset 16 of the 16-byte buffer bound at index 0")
        XCTAssertNil(try reduceError(input, offset: 16, rows: 1, n: 4))
        XCTAssertTrue(seen.isEmpty, "\(seen)")
    }

    func testKernelReadingPastAWrapOfCallerMemoryFails() throws {
        // Two pages of caller memory, the first wrapped: the second is
        // mapped and readable, but no buffer covers it.
        var p: UnsafeMutableRawPointer?
        XCTAssertEqual(posix_memalign(&p, 16384, 2 * 16384), 0)
        let mem = try XCTUnwrap(p)
        defer { free(mem) }
        mem.initializeMemory(as: Float.self, repeating: 1, count: 2 * 4096)
        try autoreleasepool {
            let wrap = try XCTUnwrap(device.makeBuffer(bytesNoCopy: mem, length: 16384, options: .storageModeShared,
                                                       deallocator: nil))
            XCTAssertNil(try reduceError(wrap, rows: 1, n: 4096))
            XCTAssertTrue(seen.isEmpty, "\(seen)")
            assertOutOfBounds(try reduceError(wrap, rows: 1, n: 4097),
                              "read 4 bytes at offset 16384 of the 16384-byte buffer bound at index 0")
        }
    }

    /// The decode reduce (D = 64, one row, one workgroup, a sink) with its
    /// FlashAttnVecReduceExtParams (16 bytes) given as `extBytes` bytes of
    /// setBytes; the output row, or the command buffer's error.
    private func reduceWithSink(extBytes: Int) throws -> ([Float], MTLCommandBufferError?) {
        let kernel = "flash_attn_vec_reduce_dk64"
        let lib = try device.makeLibrary(source: Shaders.source(forKernel: kernel)!.text, options: options())
        let values = MTLFunctionConstantValues()
        var no = false, yes = true
        values.setConstantValue(&no, type: .bool, index: 500)
        values.setConstantValue(&yes, type: .bool, index: 504)
        values.setConstantValue(&no, type: .bool, index: 505)
        values.setConstantValue(&no, type: .bool, index: 506)
        values.setConstantValue(&no, type: .bool, index: 509)
        values.setConstantValue(&no, type: .bool, index: 510)
        let pso = try device.makeComputePipelineState(function: try lib.makeFunction(name: kernel, constantValues: values))
        return autoreleasepool {
            // One workgroup's partial O (ones) and its (S, M) = (1, 0).
            let tmp = floats([Float](repeating: 1, count: 64) + [1, 0]), out = floats([Float](repeating: 0, count: 64))
            let sinks = floats([0])
            var params: [UInt32] = [1, 64]  // FlashAttnVecReduceParams: nrows, head_dim
            var nwg: UInt32 = 1
            var ext = [UInt32](repeating: 0, count: 4)
            ext[0] = 1  // n_heads
            let cb = queue.makeCommandBuffer()!
            let enc = cb.makeComputeCommandEncoder(dispatchType: .serial)!
            enc.setComputePipelineState(pso)
            enc.setBytes(&params, length: 8, index: 0)
            enc.setBuffer(tmp, offset: 0, index: 1)
            enc.setBuffer(out, offset: 0, index: 2)
            enc.setBytes(&nwg, length: 4, index: 3)
            enc.setBuffer(sinks, offset: 0, index: 5)
            enc.setBytes(&ext, length: extBytes, index: 7)
            enc.dispatchThreadgroups(MTLSize(width: 1, height: 1, depth: 1),
                                     threadsPerThreadgroup: MTLSize(width: 32, height: 1, depth: 1))
            enc.endEncoding()
            cb.commit()
            return (read(out, 64), cb.error as? MTLCommandBufferError)
        }
    }

    func testKernelReadingPastSetBytesFails() throws {
        let (good, none) = try reduceWithSink(extBytes: 16)
        XCTAssertNil(none)
        // S = 1 + e^(sink - M) = 2 with the sink: each output is 1 / 2.
        XCTAssertEqual(good, [Float](repeating: 0.5, count: 64))
        XCTAssertTrue(seen.isEmpty, "\(seen)")
        let (_, e) = try reduceWithSink(extBytes: 2)
        XCTAssertEqual(e?.code, .pageFault)
        broke(.outOfBounds)
        let msg = MetalSim.lastViolation?.message ?? ""
        XCTAssertTrue(msg.hasPrefix("flash_attn_vec_reduce_dk64 read 4 bytes at offset 0 of the 2-byte setBytes data bound at index 7"),
                      msg)
    }

    /// metal-sim runs each kernel's counted copy to check its accesses.
    func testEveryKernelHasACountedCopy() {
        XCTAssertGreaterThan(fmsim_kernel_count(), 0)
        for i in 0..<fmsim_kernel_count() {
            let name = fmsim_kernel_name(i)!
            XCTAssertEqual(fmsim_has_counted_kernel(name), 1, String(cString: name))
        }
    }

    func testRedZonesOnBothSidesOfACopy() throws {
        for delta in [-1, 16, 16 + 255] {
            let b = try XCTUnwrap(floats([1, 2, 3, 4]) as? SimBuffer)
            XCTAssertTrue(b.redZoneIntact)
            (b.contents() + delta).storeBytes(of: 0, as: UInt8.self)
            XCTAssertFalse(b.redZoneIntact, "a byte written at \(delta)")
        }
    }

    // MARK: pipelines

    func testDispatchWithoutPipeline() {
        autoreleasepool {
            let cb = queue.makeCommandBuffer()!
            let enc = cb.makeComputeCommandEncoder(dispatchType: .serial)!
            enc.dispatchThreadgroups(MTLSize(width: 1, height: 1, depth: 1),
                                     threadsPerThreadgroup: MTLSize(width: 32, height: 1, depth: 1))
            broke(.noPipeline)
            enc.endEncoding()
        }
    }

    func testThreadsAbovePipelineLimit() throws {
        for limit in [1024, 768, 512, 256] {
            setenv("FLASHMETAL_METAL_SIM_MAX_THREADS", "\(limit)", 1)
            defer { unsetenv("FLASHMETAL_METAL_SIM_MAX_THREADS") }
            let pso = try pipeline()
            XCTAssertEqual(pso.maxTotalThreadsPerThreadgroup, limit)
            try autoreleasepool {
                let input = floats([Float](repeating: 1, count: 64)), out = floats([0])
                let cb = queue.makeCommandBuffer()!
                let enc = cb.makeComputeCommandEncoder(dispatchType: .serial)!
                reduce(enc, pso, input, out, rows: 1, n: 64, threads: limit)
                XCTAssertEqual(seen.count, 0, "\(limit) threads are allowed")
                reduce(enc, pso, input, out, rows: 1, n: 64, threads: limit + 32)
                broke(.threadsPerThreadgroup)
                enc.endEncoding()
                cb.commit()
                XCTAssertEqual(cb.status, .error)
            }
            seen = []
        }
    }

    func testThreadgroupMemoryLengths() throws {
        let pso = try pipeline()
        autoreleasepool {
            let cb = queue.makeCommandBuffer()!
            let enc = cb.makeComputeCommandEncoder(dispatchType: .serial)!
            enc.setThreadgroupMemoryLength(20, index: 0)
            broke(.threadgroupMemoryLength)
            seen = []
            enc.setThreadgroupMemoryLength(16384, index: 0)
            enc.setThreadgroupMemoryLength(16400, index: 1)
            enc.setComputePipelineState(pso)
            enc.dispatchThreadgroups(MTLSize(width: 1, height: 1, depth: 1),
                                     threadsPerThreadgroup: MTLSize(width: 32, height: 1, depth: 1))
            broke(.threadgroupMemoryTotal)
            enc.endEncoding()
        }
    }

    func testFunctionConstantsAndLibraries() throws {
        let source = Shaders.source(forKernel: "fm_selftest_reduce")!.text
        // Apple's defaults are fast math: refused, as are half-precise settings.
        XCTAssertThrowsError(try device.makeLibrary(source: source, options: nil))
        let o = options()
        o.mathFloatingPointFunctions = .fast
        XCTAssertThrowsError(try device.makeLibrary(source: source, options: o))
        let bf = options()
        bf.languageVersion = .version3_0
        XCTAssertThrowsError(try device.makeLibrary(source: "kernel void k(device bfloat *x) {}", options: bf))
        let lib = try device.makeLibrary(source: source, options: options())
        XCTAssertThrowsError(try lib.makeFunction(name: "flash_attn_prefill_bf16_d128", constantValues: MTLFunctionConstantValues()),
                             "a kernel of another library")
        // Unset, or set with another type than declared: makeFunction fails
        // and names the constant.
        let bool = MTLFunctionConstantValues()
        var b = true
        bool.setConstantValue(&b, type: .bool, index: 700)
        for (values, says) in [(MTLFunctionConstantValues(), "has no value"), (bool, "is declared int and set as bool")] {
            XCTAssertThrowsError(try lib.makeFunction(name: "fm_selftest_reduce", constantValues: values)) {
                let e = $0 as? MTLLibraryError
                XCTAssertEqual(e?.code, .compileFailure)
                XCTAssertTrue(e?.message.contains("'selftest_scale' (index 700") ?? false, "\($0)")
                XCTAssertTrue(e?.message.contains(says) ?? false, "\($0)")
            }
        }
        XCTAssertThrowsError(try pipeline(type: .uint), "the kernel declares an int, not a uint")
        // A value at an index the kernel does not declare is ignored.
        var s: Int32 = 2
        bool.setConstantValue(&s, type: .int, index: 700)
        bool.setConstantValue(&b, type: .bool, index: 123)
        XCTAssertNoThrow(try lib.makeFunction(name: "fm_selftest_reduce", constantValues: bool))
    }

    /// Each kernel reads the constants its function, the functions it calls
    /// and the constant expressions it reads name.
    func testConstantsEachKernelReads() throws {
        func names(_ kernel: String) -> [String] {
            FunctionConstantTable(source: Shaders.source(forKernel: kernel)!.text).required(byKernel: kernel).map(\.name)
        }
        XCTAssertEqual(names("fm_selftest_reduce"), ["selftest_scale"])
        XCTAssertEqual(names("flash_attn_vec_reduce_dk64"),
                       ["vec_has_signs", "vec_sinks", "vec_lse", "vec_unaligned", "vec_out_f16", "vec_out_bf16"])
        XCTAssertEqual(names("kv_append_f32"), ["append_paged"])
        let t = FunctionConstantTable(source: """
            FUNCTION_CONSTANT(bool, a, 1)
            FUNCTION_CONSTANT(int, b, 2)
            FUNCTION_CONSTANT(bool, c, 3)
            FUNCTION_CONSTANT_EXPR(bool, ab, a && b > 0)
            // c named in a comment
            template <typename T> void helper(device T *x) { if (ab) { x[0] = 0; } }
            template <typename T>
            kernel void k(device T *x [[buffer(0)]]) {
                if (is_function_constant_defined(c)) { helper(x); }
            }
            INSTANTIATE_KERNEL("k_f32", k, float)
            """)
        XCTAssertEqual(t.required(byKernel: "k_f32").map(\.name), ["a", "b"])
        XCTAssertEqual(t.required(byKernel: "unknown").map(\.name), [])
    }

    // MARK: ordering

    /// Two dependent dispatches: stage 2 reduces what stage 1 wrote. In a
    /// concurrent pass only a memoryBarrier between them orders them.
    private func twoStages(_ type: MTLDispatchType, barrier: Bool) throws -> Float {
        let pso = try pipeline(scale: 1)
        return autoreleasepool {
            let input = floats([1, 2, 3, 4]), mid = floats([0, 0]), out = floats([0])
            let cb = queue.makeCommandBuffer()!
            let enc = cb.makeComputeCommandEncoder(dispatchType: type)!
            reduce(enc, pso, input, mid, rows: 2, n: 2)  // mid = [3, 7]
            if barrier { enc.memoryBarrier(scope: .buffers) }
            reduce(enc, pso, mid, out, rows: 1, n: 2)  // out = 10
            enc.endEncoding()
            cb.commit()
            XCTAssertEqual(cb.status, .completed)
            return read(out, 1)[0]
        }
    }

    func testConcurrentPassNeedsBarriers() throws {
        XCTAssertEqual(try twoStages(.concurrent, barrier: true), 10)
        XCTAssertEqual(try twoStages(.serial, barrier: false), 10)
        XCTAssertEqual(try twoStages(.concurrent, barrier: false), 0, "without a barrier stage 2 ran first")
        setenv("FLASHMETAL_METAL_SIM_DROP_BARRIER", "1", 1)
        defer { unsetenv("FLASHMETAL_METAL_SIM_DROP_BARRIER") }
        XCTAssertEqual(try twoStages(.concurrent, barrier: true), 0, "the dropped barrier no longer orders them")
    }
}
#endif
