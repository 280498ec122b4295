import CFlashMetal
import FlashMetalCore
import XCTest

final class AttentionRouterTests: XCTestCase {
    func call(_ dtype: DType = .bf16, rows: Int = 1, d: Int = 64, dv: Int? = nil, keys: Int = 40, mask: Bool = false,
              ranges: Bool = false, causal: Bool = true, offset: Int? = nil, window: Int? = nil, sinks: Bool = false)
        -> AttentionRouter.Call {
        AttentionRouter.Call(dtype: dtype, queryRows: rows, headDim: d, headDimV: dv ?? d, keys: keys, mask: mask,
                             maskIsKeyRanges: ranges, causal: causal, queryOffset: offset ?? keys - rows,
                             window: window, sinks: sinks)
    }

    func testDecodeRoutes() throws {
        XCTAssertEqual(try AttentionRouter.route(call()).kernel, .decode)
        // A mask keeping one key range per batch row: the decode over ranges, unless sinks apply.
        XCTAssertTrue(try AttentionRouter.route(call(mask: true, ranges: true)).reason.contains("per-row key ranges"))
        XCTAssertEqual(try AttentionRouter.route(call(mask: true, ranges: true, sinks: true)).kernel, .prefill)
        // Top-left causal (not the newest position): the prefill.
        XCTAssertEqual(try AttentionRouter.route(call(offset: 0)).kernel, .prefill)
        // Short queries: 2...8 rows at the newest positions, within the keys, head dims both kernels run.
        XCTAssertEqual(try AttentionRouter.route(call(rows: 8)).kernel, .decode)
        XCTAssertEqual(try AttentionRouter.route(call(rows: 9)).kernel, .prefill)
        XCTAssertEqual(try AttentionRouter.route(call(rows: 4, keys: 3, causal: false)).kernel, .prefill)
        XCTAssertEqual(try AttentionRouter.route(call(rows: 4, d: 600)).kernel, .sdpa)
    }

    func testPrefillPaddingAndGeneralKernel() throws {
        let padded = try AttentionRouter.route(call(.f16, rows: 32, d: 300, keys: 64))
        XCTAssertEqual(padded.kernel, .prefill)
        XCTAssertEqual(padded.padTo, 512)
        XCTAssertEqual(padded.reason, "tiled flash attention, head dim 300 zero-padded to 512")
        let few = try AttentionRouter.route(call(.f16, rows: 31, d: 300, keys: 64))
        XCTAssertEqual(few.kernel, .sdpa)
        XCTAssertTrue(few.reason.contains("padded only for >= \(AttentionRouter.padMinQueryRows) query rows"), few.reason)
        // Causal rows before the first key: only the general kernel places them.
        let outside = try AttentionRouter.route(call(rows: 12, keys: 10))
        XCTAssertEqual(outside.kernel, .sdpa)
        XCTAssertTrue(outside.reason.contains("causal rows at positions -2..9 outside the 10 keys"), outside.reason)
        XCTAssertTrue(try AttentionRouter.route(call(rows: 40, keys: 64, window: 8)).reason.contains("window in the kernel"))
    }

    func testRefusals() {
        let op = AttentionRouter.op
        expectFMError(op, status: FM_ERROR_UNSUPPORTED, contains: "sinks are applied by the prefill kernel only") {
            _ = try AttentionRouter.route(call(rows: 12, keys: 10, sinks: true))
        }
        expectFMError(op, contains: "head dim 70000 is above 65536") {
            _ = try AttentionRouter.route(call(rows: 40, d: 70000, keys: 64))
        }
    }
}
