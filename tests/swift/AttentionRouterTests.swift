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

    func testPrefillTakesEveryHeadDimUpTo512AndTheGeneralKernelTheRest() throws {
        // Any head dim up to 512 runs the next tile up with its true D, for any number of rows.
        for (dtype, rows, d) in [(DType.f16, 32, 300), (.f16, 9, 300), (.f32, 40, 511), (.bf16, 9, 257)] {
            let r = try AttentionRouter.route(call(dtype, rows: rows, d: d, keys: 64))
            XCTAssertEqual(r.kernel, .prefill, "\(dtype) \(rows) \(d)")
            XCTAssertEqual(r.reason, "tiled flash attention")
        }
        XCTAssertEqual(try AttentionRouter.route(call(.bf16, rows: 1, d: 300, keys: 64)).kernel, .decode)
        XCTAssertEqual(try AttentionRouter.route(call(.bf16, rows: 4, d: 300, dv: 500, keys: 64)).kernel, .decode)
        // Above 512 (and not MLA's 576 over 512): the general kernel.
        let wide = try AttentionRouter.route(call(.f16, rows: 40, d: 520, keys: 64))
        XCTAssertEqual(wide.kernel, .sdpa)
        XCTAssertTrue(wide.reason.contains("head dim 520 (prefill runs 1...512)"), wide.reason)
        XCTAssertEqual(try AttentionRouter.route(call(.bf16, rows: 40, d: 576, dv: 512, keys: 64)).kernel, .prefill)
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
