import FlashMetalCPU
import FlashMetalCore
import XCTest

final class RegistryTests: XCTestCase {
    func testCacheMakesOnePipelinePerKey() throws {
        let r = Registry(backend: CPUBackend())
        // mlx-native's constants plus the serving extension's (302, 304-311), all off, and the load width.
        let consts = FunctionConstants([(200, .bool(true)), (201, .bool(true)), (300, .bool(false)),
                                        (301, .bool(false)), (303, .bool(false)), (312, .int(16))]
                                       + [302, 304, 305, 306, 307, 308, 309, 310, 311].map { ($0, .bool(false)) })
        let key = PipelineKey(spec: .prefill(io: .bf16, headDim: 128, boolMask: false), constants: consts)
        let p1 = try r.pipeline(key)
        let p2 = try r.pipeline(key)
        XCTAssertTrue(p1 === p2)
        var other = consts.entries.map { ($0.index, $0.value) }
        other[3] = (301, .bool(true))
        let p3 = try r.pipeline(PipelineKey(spec: key.spec, constants: FunctionConstants(other)))
        XCTAssertFalse(p1 === p3)
        XCTAssertEqual(r.cachedKeys.count, 2)
    }

    func testUnsetConstant() {
        let r = Registry(backend: CPUBackend())
        let partial = PipelineKey(spec: .prefill(io: .f16, headDim: 64, boolMask: false),
                                  constants: FunctionConstants([(300, .bool(true))]))
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
        var begins = 0, ends = 0
        func beginBatch() throws { depth += 1; begins += 1 }
        func endBatch() throws {
            ends += 1
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
            try r.run([Dispatch(kernel: .sdpa(io: .f32), grid: Size3(1, 1, 1), threadgroup: Size3(1, 1, 1),
                                bindings: [0: .buffer(tmp)])], op: "test")
        }
        XCTAssertEqual(backend.pending.count, 1)
        try r.endBatch()  // writes into the scratch: must still be allocated (ASan would catch it)
        XCTAssertTrue(backend.pending.isEmpty)
        XCTAssertEqual(r.deferredScratchCount, 0)
        XCTAssertThrowsError(try r.endBatch())
    }

    /// A synchronous backend has run the work when the call
    /// returns, so a batch keeps no scratch at all.
    func testSynchronousBackendKeepsNoScratchInABatch() throws {
        let r = Registry(backend: CPUBackend())
        try r.beginBatch()
        for _ in 0..<3 { try r.withScratch(op: "test", bytes: 1 << 20) { _ in } }
        XCTAssertEqual(r.deferredScratchCount, 0)
        try r.endBatch()
    }

    /// The registry alone counts nesting: the backend sees the outermost scope once.
    func testBackendSeesOnlyTheOutermostScope() throws {
        let backend = DeferringBackend()
        let r = Registry(backend: backend)
        for _ in 0..<3 { try r.beginBatch() }
        XCTAssertEqual(r.openBatches, 3)
        for _ in 0..<2 { try r.endBatch() }
        XCTAssertEqual([backend.begins, backend.ends], [1, 0])
        try r.endBatch()
        XCTAssertEqual([backend.begins, backend.ends], [1, 1])
        XCTAssertThrowsError(try r.endBatch())
    }

    /// close() inside an open batch runs the deferred work and frees its
    /// scratch: nothing is lost.
    func testCloseInsideABatchLosesNothing() throws {
        let backend = DeferringBackend()
        let r = Registry(backend: backend)
        try r.beginBatch()
        try r.beginBatch()
        try r.withScratch(op: "test", bytes: 64) { tmp in
            try r.run([Dispatch(kernel: .sdpa(io: .f32), grid: Size3(1, 1, 1), threadgroup: Size3(1, 1, 1),
                                bindings: [0: .buffer(tmp)])], op: "test")
        }
        XCTAssertEqual(r.deferredScratchCount, 1)
        try r.close()
        XCTAssertTrue(backend.pending.isEmpty, "the deferred work ran")
        XCTAssertEqual(r.openBatches, 0)
        XCTAssertEqual(r.deferredScratchCount, 0)
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

/// Scratch blocks are the registry's own (HostAllocations), reused from call
/// to call so a backend that wraps host memory wraps each block once.
final class ScratchPoolTests: XCTestCase {
    private func address(_ r: Registry, bytes: Int) throws -> UInt {
        var a: UInt = 0
        try r.withScratch(op: "test", bytes: bytes) { a = UInt(bitPattern: $0.data) }
        return a
    }

    func testCallsReuseOneBlockThatTheBackendCanWrapOnce() throws {
        let r = Registry(backend: CPUBackend())
        let first = try address(r, bytes: 1000)
        for _ in 0..<5 { XCTAssertEqual(try address(r, bytes: 4000), first) }
        XCTAssertEqual(r.idleScratchCount, 1)
        let block = try XCTUnwrap(HostAllocations.containing(first, first + 4000))
        XCTAssertEqual(block.address % UInt(HostAllocations.granule), 0)
        // A larger request gets a block that holds it.
        let big = try address(r, bytes: 3 * HostAllocations.granule)
        XCTAssertNotNil(HostAllocations.containing(big, big + UInt(3 * HostAllocations.granule)))
    }

    func testWorkDeferredInABatchGetsDistinctBlocksReusedByTheNextBatch() throws {
        let backend = ScratchLifetimeTests.DeferringBackend()
        let r = Registry(backend: backend)
        func batch() throws -> Set<UInt> {
            try r.beginBatch()
            var seen = Set<UInt>()
            for _ in 0..<4 {
                try r.withScratch(op: "test", bytes: 64) { tmp in
                    seen.insert(UInt(bitPattern: tmp.data))
                    try r.run([Dispatch(kernel: .sdpa(io: .f32), grid: Size3(1, 1, 1), threadgroup: Size3(1, 1, 1),
                                        bindings: [0: .buffer(tmp)])], op: "test")
                }
            }
            XCTAssertEqual(r.deferredScratchCount, 4)
            try r.endBatch()
            return seen
        }
        let one = try batch()
        XCTAssertEqual(one.count, 4, "pending work never shares scratch")
        XCTAssertEqual(r.idleScratchCount, 4)
        XCTAssertEqual(try batch(), one, "the next batch reuses the same blocks")
    }

    func testIdleBlocksAreBoundedAndFreedWithTheRegistry() throws {
        var addresses: [UInt] = []
        do {
            let backend = ScratchLifetimeTests.DeferringBackend()
            let r = Registry(backend: backend)
            try r.beginBatch()
            for _ in 0..<(ScratchPool.keptBlocks + 3) {
                try r.withScratch(op: "test", bytes: 64) { addresses.append(UInt(bitPattern: $0.data)) }
            }
            try r.endBatch()
            XCTAssertEqual(r.idleScratchCount, ScratchPool.keptBlocks)
            XCTAssertEqual(addresses.filter { HostAllocations.containing($0, $0 + 64) != nil }.count,
                           ScratchPool.keptBlocks)
        }
        XCTAssertTrue(addresses.allSatisfy { HostAllocations.containing($0, $0 + 64) == nil },
                      "a released registry frees its blocks")
    }
}
