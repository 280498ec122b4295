import CFlashMetal
import FlashMetalCore
import XCTest

final class SdpaDispatcherTests: XCTestCase {
    func make(q: [Int], k: [Int], dtypes: [DType] = [.f32, .f32, .f32, .f32], _ o: SdpaOptions = SdpaOptions(scale: 1),
              qBytes: Int? = nil) throws -> Dispatch {
        let ts = [HostTensor(q, dtypes[0], bytes: qBytes), HostTensor(k, dtypes[1]), HostTensor(k, dtypes[2]),
                  HostTensor(q, dtypes[3])]
        return try withExtendedLifetime(ts) {
            try SdpaDispatcher.makeDispatch(q: ts[0].ref, k: ts[1].ref, v: ts[2].ref, out: ts[3].ref, o)
        }
    }

    func testDispatch() throws {
        let d = try make(q: [2, 16, 70, 256], k: [2, 8, 128, 256], dtypes: [.bf16, .bf16, .bf16, .bf16],
                         SdpaOptions(scale: 0.0625, causal: false, kvLen: 100))
        XCTAssertEqual(d.kernel, "sdpa_bf16")
        XCTAssertEqual(d.writes, [SdpaBuffer.out])
        XCTAssertEqual(d.grid, Size3(2, 16, 3))
        XCTAssertEqual(d.threadgroup, Size3(32, 1, 1))
        XCTAssertEqual(Set(d.bindings.keys), [0, 1, 2, 3, 4])
        let p = try d.params(4, as: SdpaParams.self)
        XCTAssertEqual([p.n_heads, p.n_kv_heads, p.head_dim, p.seq_len, p.kv_seq_len, p.kv_capacity, p.do_causal],
                       [16, 8, 256, 70, 100, 128, 0])
        XCTAssertEqual(p.scale, 0.0625)
        let d2 = try make(q: [1, 2, 1, 512], k: [1, 2, 5, 512])
        XCTAssertEqual(d2.kernel, "sdpa")
        XCTAssertEqual(try d2.params(4, as: SdpaParams.self).do_causal, 0)  // causal only when asked
        XCTAssertEqual(try d2.params(4, as: SdpaParams.self).kv_capacity, 5)
        XCTAssertEqual(d2.grid, Size3(1, 2, 1))
    }

    func testValidation() {
        let op = SdpaDispatcher.op
        expectFMError(op, status: FM_ERROR_TYPE, contains: "k dtype bfloat16 does not match q dtype float32") {
            _ = try make(q: [1, 2, 4, 8], k: [1, 2, 4, 8], dtypes: [.f32, .bf16, .f32, .f32])
        }
        expectFMError(op, status: FM_ERROR_TYPE, contains: "out dtype float32 does not match q dtype bfloat16") {
            _ = try make(q: [1, 2, 4, 8], k: [1, 2, 4, 8], dtypes: [.bf16, .bf16, .bf16, .f32])
        }
        expectFMError(op, status: FM_ERROR_TYPE, contains: "q must be float32 or float16 or bfloat16, got bool") {
            _ = try make(q: [1, 2, 4, 8], k: [1, 2, 4, 8], dtypes: [.bool, .bool, .bool, .bool])
        }
        expectFMError(op, contains: "head_dim must be <= 65536, got 65537") { _ = try make(q: [1, 1, 1, 65537], k: [1, 1, 1, 65537]) }
        expectFMError(op, contains: "head_dim must be > 0") { _ = try make(q: [1, 2, 4, 0], k: [1, 2, 4, 0]) }
        expectFMError(op, contains: "the q heads (6) must be a multiple of the k heads (4)") { _ = try make(q: [1, 6, 4, 8], k: [1, 4, 4, 8]) }
        expectFMError(op, contains: "the k heads must be > 0") { _ = try make(q: [1, 6, 4, 8], k: [1, 0, 4, 8]) }
        expectFMError(op, contains: "q_len must be > 0") { _ = try make(q: [1, 2, 0, 8], k: [1, 2, 4, 8]) }
        expectFMError(op, contains: "the cache capacity must be > 0") { _ = try make(q: [1, 2, 4, 8], k: [1, 2, 0, 8]) }
        expectFMError(op, contains: "kv_len (9) must be <= the cache capacity (4)") {
            _ = try make(q: [1, 2, 4, 8], k: [1, 2, 4, 8], SdpaOptions(scale: 1, kvLen: 9))
        }
        expectFMError(op, contains: "q buffer too small") { _ = try make(q: [1, 2, 4, 8], k: [1, 2, 4, 8], qBytes: 10) }
        expectFMError(op, contains: "q must have rank 4") { _ = try make(q: [2, 4, 8], k: [1, 2, 4, 8]) }
        expectFMError(op, contains: "causal must be 0 or 1, got 2") {
            _ = try SdpaOptions(FMSdpaOptions(scale: 1, causal: 2, kv_len: 0, has_q_offset: 0, q_offset: 0,
                                              window: 0, softcap: 0, _pad: 0))
        }
        expectFMError(op, contains: "window must be >= 0 (0 = none), got -1") {
            _ = try SdpaOptions(FMSdpaOptions(scale: 1, causal: 0, kv_len: 0, has_q_offset: 0, q_offset: 0,
                                              window: -1, softcap: 0, _pad: 0))
        }
        expectFMError(op, contains: "softcap must be 0 (off) or a finite value > 0, got -1.0") {
            _ = try make(q: [1, 2, 4, 8], k: [1, 2, 4, 8], SdpaOptions(scale: 1, softcap: -1))
        }
    }

    func testMaskConstantsAndBindings() throws {
        let q = HostTensor([2, 4, 5, 64], .f32), k = HostTensor([2, 2, 9, 64], .f32)
        let v = HostTensor([2, 2, 9, 64], .f32), o = HostTensor([2, 4, 5, 64], .f32)
        let opts = SdpaOptions(scale: 0.125, causal: true, kvLen: 7)
        let none = try SdpaDispatcher.makeDispatch(q: q.ref, k: k.ref, v: v.ref, out: o.ref, opts)
        XCTAssertEqual(none.constants, FunctionConstants([(600, .bool(false)), (601, .bool(false)), (602, .bool(false)),
                                                       (603, .bool(false))]))
        XCTAssertEqual(Set(none.bindings.keys), [0, 1, 2, 3, 4])
        let bmask = HostTensor([5, 7], .bool)
        let b = try SdpaDispatcher.makeDispatch(q: q.ref, k: k.ref, v: v.ref, mask: bmask.ref, out: o.ref, opts)
        XCTAssertEqual(b.constants, FunctionConstants([(600, .bool(true)), (601, .bool(false)), (602, .bool(false)),
                                                    (603, .bool(false))]))
        XCTAssertEqual(Set(b.bindings.keys), [0, 1, 2, 3, 4, 5, 7])
        let mp = try b.params(5, as: AttnMaskParams.self)
        XCTAssertEqual([mp.M_strides.0, mp.M_strides.1, mp.M_strides.2], [0, 0, 7])
        let amask = HostTensor([2, 4, 5, 7], .f32)
        let a = try SdpaDispatcher.makeDispatch(q: q.ref, k: k.ref, v: v.ref, mask: amask.ref, out: o.ref, opts)
        XCTAssertEqual(a.constants, FunctionConstants([(600, .bool(false)), (601, .bool(true)), (602, .bool(false)),
                                                    (603, .bool(false))]))
        XCTAssertEqual(Set(a.bindings.keys), [0, 1, 2, 3, 4, 5, 6])
        let mp4 = try a.params(5, as: AttnMaskParams.self)
        XCTAssertEqual([mp4.M_strides.0, mp4.M_strides.1, mp4.M_strides.2], [4 * 5 * 7, 5 * 7, 7])
        let wrong = HostTensor([5, 9], .f32)  // kv_len is 7, not the capacity
        XCTAssertThrowsError(try SdpaDispatcher.makeDispatch(q: q.ref, k: k.ref, v: v.ref, mask: wrong.ref,
                                                             out: o.ref, opts)) { e in
            XCTAssertTrue("\(e)".contains("sdpa: mask shape [5, 9] must be [5, 7]"), "\(e)")
        }
    }

    func testExtParamsBindAtBuffer8() throws {
        let q = HostTensor([1, 2, 5, 80], .f16), k = HostTensor([1, 1, 9, 80], .f16)
        let v = HostTensor([1, 1, 9, 80], .f16), o = HostTensor([1, 2, 5, 80], .f16)
        let d = try SdpaDispatcher.makeDispatch(q: q.ref, k: k.ref, v: v.ref, out: o.ref,
                                                SdpaOptions(scale: 0.5, causal: true, qOffset: 0, window: 3,
                                                            softcap: 30))
        XCTAssertEqual(d.kernel, "sdpa_f16")
        XCTAssertEqual(Set(d.bindings.keys), [0, 1, 2, 3, 4, 8])
        XCTAssertEqual(d.constants, FunctionConstants([(600, .bool(false)), (601, .bool(false)),
                                                       (602, .bool(true)), (603, .bool(true))]))
        let e = try d.params(8, as: SdpaExtParams.self)
        XCTAssertEqual([e.q_offset, e.window], [0, 3])
        XCTAssertEqual(e.softcap, 30)
        // A window alone keeps the plain kernel's bottom-right position, now explicit.
        let w = try SdpaDispatcher.makeDispatch(q: q.ref, k: k.ref, v: v.ref, out: o.ref,
                                                SdpaOptions(scale: 0.5, kvLen: 7, window: 2))
        XCTAssertEqual(try w.params(8, as: SdpaExtParams.self).q_offset, 7 - 5)
        XCTAssertEqual(w.constants, FunctionConstants([(600, .bool(false)), (601, .bool(false)),
                                                       (602, .bool(true)), (603, .bool(false))]))
    }

    func testBroadcastMaskStrides() throws {
        let q = HostTensor([2, 4, 5, 64], .f32), k = HostTensor([2, 2, 7, 64], .f32)
        let o = HostTensor([2, 4, 5, 64], .f32)
        let opts = SdpaOptions(scale: 0.125)
        for (shape, want) in [([2, 1, 5, 7], [35, 0, 7]), ([2, 1, 1, 7], [7, 0, 0]), ([4, 5, 7], [0, 35, 7]),
                              ([1, 7], [0, 0, 0]), ([1, 4, 1, 7], [0, 7, 0])] as [([Int], [Int64])] {
            let m = HostTensor(shape, .bool)
            let d = try SdpaDispatcher.makeDispatch(q: q.ref, k: k.ref, v: k.ref, mask: m.ref, out: o.ref, opts)
            let mp = try d.params(5, as: AttnMaskParams.self)
            XCTAssertEqual([mp.M_strides.0, mp.M_strides.1, mp.M_strides.2], want, "\(shape)")
        }
        for bad in [[3, 1, 5, 7], [2, 4, 5, 1], [5, 6]] {
            XCTAssertThrowsError(try SdpaDispatcher.makeDispatch(q: q.ref, k: k.ref, v: k.ref,
                                                                 mask: HostTensor(bad, .bool).ref, out: o.ref, opts)) { e in
                XCTAssertTrue("\(e)".contains("sdpa: mask shape \(bad) must be"), "\(e)")
            }
        }
    }
}
