import FlashMetalCPU
import FlashMetalCore
import XCTest

final class RegistryTests: XCTestCase {
    func testCacheMakesOnePipelinePerKey() throws {
        let r = Registry(backend: CPUBackend())
        let consts = FunctionConstants([(200, .bool(true)), (201, .bool(true)), (300, .bool(false)),
                                        (301, .bool(false)), (303, .bool(false))])
        let key = PipelineKey(kernel: "flash_attn_prefill_bf16_d128", constants: consts)
        let p1 = try r.pipeline(key)
        let p2 = try r.pipeline(key)
        XCTAssertTrue(p1 === p2)
        var other = consts.entries.map { ($0.index, $0.value) }
        other[3] = (301, .bool(true))
        let p3 = try r.pipeline(PipelineKey(kernel: key.kernel, constants: FunctionConstants(other)))
        XCTAssertFalse(p1 === p3)
        XCTAssertEqual(r.cachedKeys.count, 2)
    }

    func testUnknownKernelAndUnsetConstant() {
        let r = Registry(backend: CPUBackend())
        XCTAssertThrowsError(try r.pipeline(PipelineKey(kernel: "nope", constants: FunctionConstants()))) { e in
            XCTAssertTrue("\(e)".contains("unknown kernel 'nope'"))
        }
        let partial = PipelineKey(kernel: "flash_attn_prefill_f16_d64", constants: FunctionConstants([(300, .bool(true))]))
        XCTAssertThrowsError(try r.pipeline(partial)) { e in
            XCTAssertTrue("\(e)".contains("function constant 301"), "\(e)")
        }
    }
}

final class ScratchLifetimeTests: XCTestCase {
    /// A backend that defers work inside a batch, as Metal does: it runs
    /// dispatches only at endBatch, so scratch must live until then.
    final class DeferringBackend: Backend {
        let name = "deferring"
        var pending: [() -> Void] = []
        var depth = 0
        func makePipeline(_ key: PipelineKey) throws -> AnyObject { NSNullish() }
        func run(_ dispatches: [Dispatch], pipelines: [AnyObject]) throws {
            for d in dispatches {
                let t = try d.buffer(0)
                let work = { t.data.storeBytes(of: 42, as: Int32.self) }
                if depth > 0 { pending.append(work) } else { work() }
            }
        }
        func beginBatch() throws { depth += 1 }
        func endBatch() throws {
            depth -= 1
            if depth == 0 { pending.forEach { $0() }; pending = [] }
        }
    }
    final class NSNullish {}

    func testScratchOutlivesTheBatchThatUsesIt() throws {
        let backend = DeferringBackend()
        let r = Registry(backend: backend)
        try r.beginBatch()
        try r.withScratch(op: "test", bytes: 64) { tmp in
            try r.run([Dispatch(kernel: "k", grid: Size3(1, 1, 1), threadgroup: Size3(1, 1, 1),
                                bindings: [0: .buffer(tmp)])])
        }
        XCTAssertEqual(backend.pending.count, 1)
        try r.endBatch()  // writes into the scratch: must still be allocated (ASan would catch it)
        XCTAssertTrue(backend.pending.isEmpty)
        XCTAssertThrowsError(try r.endBatch())
    }
}

extension ScratchLifetimeTests {
    func testUnsatisfiableScratchIsAnError() {
        let r = Registry(backend: DeferringBackend())
        XCTAssertThrowsError(try r.withScratch(op: "flash_attn_vec", bytes: Int.max / 2) { _ in
            XCTFail("body must not run")
        }) { e in
            XCTAssertTrue("\(e)".hasPrefix("flash_attn_vec: cannot allocate"), "\(e)")
        }
    }
}
