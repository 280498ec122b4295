import CFlashMetal
import FlashMetalCore
import XCTest

final class MaskDispatcherTests: XCTestCase {
    func testLayout() {
        XCTAssertEqual(MemoryLayout<MaskParams>.size, 24)
        XCTAssertEqual(MemoryLayout<MaskParams>.offset(of: \.window), 12)
        XCTAssertEqual(MemoryLayout<MaskParams>.offset(of: \.causal), 16)
    }

    func testDispatch() throws {
        let out = HostTensor([5, 300], .f16)
        let d = try MaskDispatcher.makeDispatch(out: out.ref, MaskOptions(causal: true, window: 7, qOffset: 295))
        XCTAssertEqual(d.kernel, "flash_attn_prefill_mask_f16")
        XCTAssertEqual(d.grid, Size3(2, 5, 1))
        XCTAssertEqual(d.threadgroup, Size3(256, 1, 1))
        let p = try d.params(1, as: MaskParams.self)
        XCTAssertEqual([p.seq_len_q, p.seq_len_k, p.q_offset, p.window, p.causal], [5, 300, 295, 7, 1])
        XCTAssertEqual(d.writes, [MaskBuilderBuffer.out])
        let d2 = try MaskDispatcher.makeDispatch(out: HostTensor([2, 2], .bf16).ref, MaskOptions(causal: false))
        XCTAssertEqual(d2.kernel, "flash_attn_prefill_mask_bf16")
        XCTAssertEqual(try d2.params(1, as: MaskParams.self).window, 0)
    }

    func testValidation() {
        let op = MaskDispatcher.op
        expectFMError(op, status: FM_ERROR_TYPE, contains: "out must be bfloat16 or float16") {
            _ = try MaskDispatcher.makeDispatch(out: HostTensor([4, 4], .f32).ref, MaskOptions())
        }
        expectFMError(op, contains: "window must be > 0") {
            _ = try MaskDispatcher.makeDispatch(out: HostTensor([4, 4], .bf16).ref, MaskOptions(window: 0))
        }
        expectFMError(op, contains: "q_offset must be in") {
            _ = try MaskDispatcher.makeDispatch(out: HostTensor([4, 4], .bf16).ref, MaskOptions(qOffset: -1))
        }
        expectFMError(op, contains: "kv_len must be > 0") {
            _ = try MaskDispatcher.makeDispatch(out: HostTensor([4, 0], .bf16).ref, MaskOptions())
        }
        expectFMError(op, contains: "window must be 0 (none) or > 0, got -2") {
            _ = try MaskOptions(FMMaskOptions(causal: 1, window: -2, q_offset: 0, _pad: 0))
        }
        expectFMError(op, contains: "causal must be 0 or 1, got 5") {
            _ = try MaskOptions(FMMaskOptions(causal: 5, window: 0, q_offset: 0, _pad: 0))
        }
    }
}
