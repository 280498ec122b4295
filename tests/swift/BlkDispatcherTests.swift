import CFlashMetal
import FlashMetalCore
import XCTest

/// Asserts `body` throws a FlashMetalError with `status`, prefixed by `op`, containing `contains`.
func expectFMError(_ op: String, status: FMStatus = FM_ERROR_VALUE, contains: String,
                   line: UInt = #line, _ body: () throws -> Void) {
    do {
        try body()
        XCTFail("no error; expected '\(contains)'", line: line)
    } catch let e as FlashMetalError {
        XCTAssertEqual(e.status, status, e.message, line: line)
        XCTAssertTrue(e.message.hasPrefix("\(op): "), e.message, line: line)
        XCTAssertTrue(e.message.contains(contains), "\(e.message) lacks '\(contains)'", line: line)
    } catch {
        XCTFail("unexpected \(error)", line: line)
    }
}

final class BlkDispatcherTests: XCTestCase {
    func testByteLength() throws {
        XCTAssertEqual(try BlkDispatcher.byteLength(qL: 1, kL: 1, headDim: 256), 32)
        XCTAssertEqual(try BlkDispatcher.byteLength(qL: 2455, kL: 2455, headDim: 256), 11872)
        XCTAssertEqual(try BlkDispatcher.byteLength(qL: 2455, kL: 2455, headDim: 512), 94272)
        XCTAssertEqual(try BlkDispatcher.byteLength(qL: 256, kL: 256, headDim: 128), 128)
        expectFMError("blk_byte_len", contains: "q_len must be > 0") {
            _ = try BlkDispatcher.byteLength(qL: 0, kL: 8, headDim: 128)
        }
        expectFMError("blk_byte_len", contains: "kv_len must be > 0") {
            _ = try BlkDispatcher.byteLength(qL: 8, kL: 0, headDim: 128)
        }
        expectFMError("blk_byte_len", contains: "head_dim must be in 1...512 or 576, got 600") {
            _ = try BlkDispatcher.byteLength(qL: 8, kL: 8, headDim: 600)
        }
    }

    func testGeometryComesFromPrefill() throws {
        for d in PrefillGeometry.headDims {
            let g = PrefillGeometry.forHeadDim(d)!
            let t = try BlkDispatcher.tiles(qL: 100, kL: 70, headDim: d)
            XCTAssertEqual(t.nq, (100 + g.bq - 1) / g.bq)
            XCTAssertEqual(t.nk, (70 + g.bk - 1) / g.bk)
        }
    }

    func testDispatch() throws {
        let mask = HostTensor([100, 70], .bf16)
        let blk = HostTensor([1000], .u8)
        let d = try BlkDispatcher.makeDispatch(mask: mask.ref, blk: blk.ref, headDim: 512)
        XCTAssertEqual(d.kernel, "flash_attn_prefill_blk_bf16")
        XCTAssertEqual(d.writes, [BlkBuffer.out])
        XCTAssertEqual(d.constants.int(400), 8)
        XCTAssertEqual(d.constants.int(401), 8)
        XCTAssertEqual(d.grid, Size3(9, 13, 1))
        XCTAssertEqual(d.threadgroup, Size3(32, 1, 1))
        let p = try d.params(2, as: BlkParams.self)
        XCTAssertEqual([p.seq_len_q, p.seq_len_k, p.mask_row_stride, p._pad], [100, 70, 70, 0])
        XCTAssertEqual(try d.buffer(0).data, mask.data)
        XCTAssertEqual(try d.buffer(1).data, blk.data)

        let f16 = HostTensor([64, 64], .f16)
        let d2 = try BlkDispatcher.makeDispatch(mask: f16.ref, blk: blk.ref, headDim: 128)
        XCTAssertEqual(d2.kernel, "flash_attn_prefill_blk_f16")
        XCTAssertEqual(d2.constants.int(400), 32)
        XCTAssertEqual(d2.constants.int(401), 16)
        XCTAssertEqual(d2.grid, Size3(4, 2, 1))
    }

    func testValidation() {
        let op = BlkDispatcher.op
        let blk = HostTensor([1000], .u8)
        expectFMError(op, status: FM_ERROR_TYPE, contains: "mask must be bfloat16 or float16 or float32 or bool, got int32") {
            _ = try BlkDispatcher.makeDispatch(mask: HostTensor([8, 8], .i32).ref, blk: blk.ref, headDim: 128)
        }
        expectFMError(op, contains: "mask must have rank 2") {
            _ = try BlkDispatcher.makeDispatch(mask: HostTensor([1, 8, 8], .bf16).ref, blk: blk.ref, headDim: 128)
        }
        expectFMError(op, status: FM_ERROR_TYPE, contains: "blk_out must be uint8") {
            _ = try BlkDispatcher.makeDispatch(mask: HostTensor([8, 8], .bf16).ref, blk: HostTensor([8], .f16).ref, headDim: 128)
        }
        expectFMError(op, contains: "blk_out buffer too small: expected at least 8 bytes (NQ=2, NK=4), got 7") {
            _ = try BlkDispatcher.makeDispatch(mask: HostTensor([64, 64], .bf16).ref, blk: HostTensor([7], .u8).ref, headDim: 128)
        }
        expectFMError(op, contains: "mask buffer too small") {
            _ = try BlkDispatcher.makeDispatch(mask: HostTensor([64, 64], .bf16, bytes: 100).ref, blk: blk.ref, headDim: 128)
        }
        expectFMError(op, contains: "q_len must be > 0") {
            _ = try BlkDispatcher.makeDispatch(mask: HostTensor([0, 64], .bf16).ref, blk: blk.ref, headDim: 128)
        }
        expectFMError(op, contains: "head_dim must be in 1...512 or 576, got 0") {
            _ = try BlkDispatcher.makeDispatch(mask: HostTensor([8, 8], .bf16).ref, blk: blk.ref, headDim: 0)
        }
    }
}
