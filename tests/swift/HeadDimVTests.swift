import CFlashMetal
import FlashMetalCore
import XCTest

/// v of its own head dim (flash-attn's head_dim_v): the tile of max(D, Dv),
/// both dims in the params, V/out strides in Dv, and the refusals by name.
final class HeadDimVTests: XCTestCase {
    func prefill(d: Int, dv: Int, outDim: Int? = nil, dtype: DType = .bf16) throws -> Dispatch {
        let q = HostTensor([1, 4, 50, d], dtype), k = HostTensor([1, 2, 64, d], dtype)
        let v = HostTensor([1, 2, 64, dv], dtype), o = HostTensor([1, 4, 50, outDim ?? dv], dtype)
        let t = PrefillTensors(q: q.ref, k: k.ref, v: v.ref, out: o.ref)
        return try withExtendedLifetime([q, k, v, o]) { try PrefillDispatcher.makeDispatch(t, PrefillOptions(scale: 1)) }
    }

    func testPrefillRunsTheTileOfTheLargerDim() throws {
        let d = try prefill(d: 192, dv: 128)
        XCTAssertEqual(d.kernel, "flash_attn_prefill_bf16_d192")
        let p = try d.params(PrefillBuffer.params, as: AttnParams.self)
        XCTAssertEqual([p.D, p.Dv], [192, 128])
        XCTAssertEqual([p.K_strides.0, p.K_strides.1, p.K_strides.2], [2 * 64 * 192, 64 * 192, 192])
        XCTAssertEqual([p.V_strides.0, p.V_strides.1, p.V_strides.2], [2 * 64 * 128, 64 * 128, 128])
        XCTAssertEqual([p.O_strides.0, p.O_strides.1, p.O_strides.2], [4 * 50 * 128, 50 * 128, 128])
        XCTAssertEqual(try prefill(d: 40, dv: 111).kernel, "flash_attn_prefill_bf16_d128")
        // Pairs up to 512 run the 512 tile, each side at its own dim.
        let wide = try prefill(d: 64, dv: 300)
        XCTAssertEqual(wide.kernel, "flash_attn_prefill_bf16_d512")
        let wp = try wide.params(PrefillBuffer.params, as: AttnParams.self)
        XCTAssertEqual([wp.D, wp.Dv], [64, 300])
        XCTAssertEqual(try prefill(d: 512, dv: 128).kernel, "flash_attn_prefill_bf16_d512")
        let same = try prefill(d: 64, dv: 64).params(PrefillBuffer.params, as: AttnParams.self)
        XCTAssertEqual(same.Dv, 64)
    }

    /// MLA's q/k 576 over v 512: the d576 kernel (the wide body, 16 x 64
    /// tiles of 8 simdgroups), AttnParams' NQ/NK on the 8 x 8 blk grid, V and
    /// O strides in 512.
    func testPrefillOfMLAShapesRunsThe576Kernel() throws {
        let d = try prefill(d: 576, dv: 512, dtype: .f16)
        XCTAssertEqual(d.kernel, "flash_attn_prefill_f16_d576")
        XCTAssertEqual(d.threadgroup, Size3(32, 1, 8))
        XCTAssertEqual(d.grid, Size3(4, 4, 1))
        let p = try d.params(PrefillBuffer.params, as: AttnParams.self)
        XCTAssertEqual([p.D, p.Dv, p.NQ, p.NK], [576, 512, 7, 8])
        XCTAssertEqual([p.K_strides.0, p.K_strides.1, p.K_strides.2], [2 * 64 * 576, 64 * 576, 576])
        XCTAssertEqual([p.V_strides.0, p.V_strides.1, p.V_strides.2], [2 * 64 * 512, 64 * 512, 512])
        XCTAssertEqual([p.O_strides.0, p.O_strides.1, p.O_strides.2], [4 * 50 * 512, 50 * 512, 512])
        XCTAssertEqual(try prefill(d: 576, dv: 512).kernel, "flash_attn_prefill_bf16_d576")
        XCTAssertEqual(PrefillCapability.kernelGeometry(io: .bf16, headDim: 576), PrefillGeometry(bq: 16, bk: 64, wm: 1, wn: 8))
        XCTAssertEqual(PrefillGeometry.forHeadDim(576), PrefillGeometry(bq: 8, bk: 8, wm: 1, wn: 1))
        XCTAssertFalse(PrefillCapability.headDims.contains(576), "576 runs only over v 512")
        XCTAssertTrue(PrefillCapability.runs(io: .bf16, headDim: 576, headDimV: 512))
        XCTAssertFalse(PrefillCapability.runs(io: .f32, headDim: 576, headDimV: 512))
        XCTAssertFalse(PrefillCapability.runs(io: .bf16, headDim: 576, headDimV: 576))
        XCTAssertFalse(PrefillCapability.runs(io: .bf16, headDim: 512, headDimV: 576))
    }

    func testPrefillRefusesPairsWithoutATileAndAWrongOut() {
        for (d, dv) in [(576, 500), (512, 576), (600, 128), (64, 520)] {
            XCTAssertThrowsError(try prefill(d: d, dv: dv)) { e in
                let m = (e as? FlashMetalError)?.message ?? ""
                XCTAssertTrue(m.contains("v head dim \(dv) differs from q's \(d)"), m)
                XCTAssertTrue(m.contains("or q/k 576 with 512"), m)
            }
        }
        XCTAssertThrowsError(try prefill(d: 576, dv: 576)) { e in
            let m = (e as? FlashMetalError)?.message ?? ""
            XCTAssertTrue(m.contains("head_dim must be in 1...512, got 576 (q/k of 576 run only with a v head dim of 512)"), m)
        }
        XCTAssertThrowsError(try prefill(d: 576, dv: 512, dtype: .f32)) { e in
            let m = (e as? FlashMetalError)?.message ?? ""
            XCTAssertTrue(m.contains("q/k head dim 576 with v head dim 512 runs on bfloat16 and float16 only"), m)
        }
        XCTAssertThrowsError(try prefill(d: 192, dv: 128, outDim: 192)) { e in
            let m = (e as? FlashMetalError)?.message ?? ""
            XCTAssertTrue(m.contains("out shape [1, 4, 50, 192] must be [1, 4, 50, 128]"), m)
        }
    }

    func decode(d: Int, dv: Int) throws -> [Dispatch] {
        let q = HostTensor([2, 4, d], .f32), k = HostTensor([2, 2, 40, d], .f16), v = HostTensor([2, 2, 40, dv], .f16)
        let out = HostTensor([2, 4, dv], .f32)
        let tmp = HostTensor([1], .f32, bytes: VecDispatcher.tmpByteCount(rows: 8, headDim: dv))
        var o = VecOptions(scale: 1)
        o.kvLen = 33
        let t = VecTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref, tmp: tmp.ref)
        return try withExtendedLifetime([q, k, v, out, tmp]) { try VecDispatcher.makeDispatches(t, o) }
    }

    func testDecodeOfMLAShapesRunsThe576TileAndThe512Reduce() throws {
        let ds = try decode(d: 576, dv: 512)
        XCTAssertEqual(ds[0].kernel, "flash_attn_vec_f16kv_dk576")
        XCTAssertEqual(ds[1].kernel, "flash_attn_vec_reduce_dk512")
        let p = try ds[0].params(VecBuffer.params, as: FlashAttnVecParams.self)
        XCTAssertEqual([p.head_dim, p.head_dim_v], [576, 512])
        let rp = try ds[1].params(VecReduceBuffer.params, as: FlashAttnVecReduceParams.self)
        XCTAssertEqual(rp.head_dim, 512)
        XCTAssertEqual(try decode(d: 64, dv: 111)[0].kernel, "flash_attn_vec_f16kv_dk128")
        XCTAssertThrowsError(try decode(d: 576, dv: 600)) { e in
            let m = (e as? FlashMetalError)?.message ?? ""
            XCTAssertTrue(m.contains("v head dim 600 with q's 576"), m)
        }
    }

    func testSdpaBindsTheExtensionForAValueHeadDim() throws {
        let q = HostTensor([1, 2, 3, 576], .f16), k = HostTensor([1, 1, 9, 576], .f16)
        let v = HostTensor([1, 1, 9, 512], .f16), o = HostTensor([1, 2, 3, 512], .f16)
        let d = try withExtendedLifetime([q, k, v, o]) {
            try SdpaDispatcher.makeDispatch(q: q.ref, k: k.ref, v: v.ref, out: o.ref, SdpaOptions(scale: 1))
        }
        let ext = try d.params(SdpaBuffer.ext, as: SdpaExtParams.self)
        XCTAssertEqual(ext.head_dim_v, 512)
        XCTAssertEqual(ext.q_offset, 6)  // the plain kernel's bottom-right kv_len - qL
    }
}
