import CFlashMetal
import FlashMetalCore
import XCTest

/// attention_chunk in the serving dispatchers: read from FMAttnOptions
/// (negative refused, naming the function), carried in AttnSeqParams with the
/// window constant on (the kernels read it under FM_FC_WINDOW) and in
/// FlashAttnVecSeqParams for decode.
final class AttentionChunkTests: XCTestCase {
    func testPrefillCarriesTheChunkUnderTheWindowConstant() throws {
        let q = HostTensor([1, 5, 2, 64], .bf16), out = HostTensor([1, 5, 2, 64], .bf16)
        let k = HostTensor([1, 30, 2, 64], .bf16), v = HostTensor([1, 30, 2, 64], .bf16)
        let t = AttnTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref)
        var o = AttnOptions(scale: 1)
        let plain = try AttnDispatcher.makeDispatches(t, o)[0]
        XCTAssertEqual(plain.constants.bool(305), false)
        o.attentionChunk = 8
        let dp = try AttnDispatcher.makeDispatches(t, o)[0]
        XCTAssertEqual(dp.constants.bool(305), true)
        let s = try dp.params(PrefillBuffer.seqParams, as: AttnSeqParams.self)
        XCTAssertEqual([s.window_left, s.window_right, s.attention_chunk], [-1, -1, 8])
    }

    func testDecodeCarriesTheChunk() throws {
        let q = HostTensor([2, 4, 64], .f32), out = HostTensor([2, 4, 64], .f32)
        let k = HostTensor([2, 40, 2, 64], .f16), v = HostTensor([2, 40, 2, 64], .f16)
        let tmp = HostTensor([1], .f32, bytes: VecDispatcher.tmpByteCount(rows: 8, headDim: 64))
        let t = VecSeqTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref, tmp: tmp.ref)
        var o = VecSeqOptions(scale: 0.5)
        o.attentionChunk = 5
        let m = try VecSeqDispatcher.makeDispatches(t, o)[0]
        let sp = try m.params(VecBuffer.seqParams, as: FlashAttnVecSeqParams.self)
        XCTAssertEqual(sp.attention_chunk, 5)
    }

    func testNegativeChunkIsRefused() throws {
        var c = FMAttnOptions()
        c.scale = 1; c.window_left = -1; c.window_right = -1; c.attention_chunk = -4
        expectFMError("flash_attn_varlen_func", contains: "attention_chunk must be >= 0 (0 = off), got -4") {
            _ = try AttnOptions(c, op: "flash_attn_varlen_func")
        }
        expectFMError(VecSeqDispatcher.op, contains: "attention_chunk must be >= 0 (0 = off), got -4") {
            _ = try VecSeqOptions(c)
        }
        c.attention_chunk = 16
        XCTAssertEqual(try AttnOptions(c, op: "flash_attn_func").attentionChunk, 16)
        XCTAssertEqual(try VecSeqOptions(c).attentionChunk, 16)
    }
}
