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
