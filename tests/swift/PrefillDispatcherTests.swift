import CFlashMetal
import FlashMetalCore
import XCTest

/// Host memory for dispatcher tests; the dispatcher only reads shapes and sizes.
final class HostTensor {
    let data: UnsafeMutableRawPointer
    let ref: TensorRef
    init(_ shape: [Int], _ dtype: DType, bytes: Int? = nil) {
        let n = bytes ?? shape.reduce(1, *) * dtype.byteSize
        data = .allocate(byteCount: max(n, 1), alignment: 64)
        ref = TensorRef(data: data, byteCount: n, dtype: dtype, shape: shape)
    }
    deinit { data.deallocate() }
}

final class PrefillDispatcherTests: XCTestCase {
    struct Case {
        var b = 1, h = 4, hkv = 2, qL = 50, kL = 64, d = 128
        var dtype = DType.bf16
    }

    func tensors(_ c: Case, mask: HostTensor? = nil, blk: HostTensor? = nil) -> (PrefillTensors, [HostTensor]) {
        let q = HostTensor([c.b, c.h, c.qL, c.d], c.dtype)
        let k = HostTensor([c.b, c.hkv, c.kL, c.d], c.dtype)
        let v = HostTensor([c.b, c.hkv, c.kL, c.d], c.dtype)
        let o = HostTensor([c.b, c.h, c.qL, c.d], c.dtype)
        let t = PrefillTensors(q: q.ref, k: k.ref, v: v.ref, out: o.ref, mask: mask?.ref, blk: blk?.ref)
        return (t, [q, k, v, o])
    }

    func dispatch(_ c: Case, _ o: PrefillOptions? = nil, mask: HostTensor? = nil, blk: HostTensor? = nil) throws -> Dispatch {
        let (t, keep) = tensors(c, mask: mask, blk: blk)
        defer { withExtendedLifetime(keep) {} }
        return try PrefillDispatcher.makeDispatch(t, o ?? PrefillOptions(scale: 0.125))
    }

    func expectError(_ c: Case, _ o: PrefillOptions? = nil, mask: HostTensor? = nil, blk: HostTensor? = nil,
                     status: FMStatus = FM_ERROR_VALUE, contains: String, line: UInt = #line) {
        do {
            _ = try dispatch(c, o, mask: mask, blk: blk)
            XCTFail("no error; expected '\(contains)'", line: line)
        } catch let e as FlashMetalError {
            XCTAssertEqual(e.status, status, e.message, line: line)
            XCTAssertTrue(e.message.hasPrefix("flash_attn_prefill: "), e.message, line: line)
            XCTAssertTrue(e.message.contains(contains), "\(e.message) lacks '\(contains)'", line: line)
        } catch {
            XCTFail("unexpected \(error)", line: line)
        }
    }

    func testGeometryPerHeadDim() {
        for d in [64, 80, 96, 128, 192, 256] {
            XCTAssertEqual(PrefillGeometry.forHeadDim(d), PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1))
        }
        XCTAssertEqual(PrefillGeometry.forHeadDim(512), PrefillGeometry(bq: 8, bk: 8, wm: 1, wn: 1))
        // Any other head dim up to 256 runs on the next tile (the same geometry).
        for d in [1, 32, 48, 59, 160, 255] {
            XCTAssertEqual(PrefillGeometry.forHeadDim(d), PrefillGeometry(bq: 32, bk: 16, wm: 4, wn: 1))
        }
        // ... and up to 512 on the 512 tile.
        for d in [257, 300, 511] {
            XCTAssertEqual(PrefillGeometry.forHeadDim(d), PrefillGeometry(bq: 8, bk: 8, wm: 1, wn: 1))
        }
        for d in [0, -1, 513, 1024] { XCTAssertNil(PrefillGeometry.forHeadDim(d)) }
        XCTAssertEqual([1, 64, 65, 80, 81, 111, 129, 160, 193, 224, 256, 257, 300, 512].map { PrefillCapability.tileHeadDim($0) },
                       [64, 64, 80, 80, 96, 128, 192, 192, 256, 256, 256, 512, 512, 512])
    }

    func testPaddedHeadDimRunsTheNextTileWithTheTrueD() throws {
        // D = 59 (odd): the d64 kernel, params and strides of the true D.
        let d = try dispatch(Case(d: 59))
        XCTAssertEqual(d.kernel, "flash_attn_prefill_bf16_d64")
        let p = try d.params(PrefillBuffer.params, as: AttnParams.self)
        XCTAssertEqual(p.D, 59)
        XCTAssertEqual([p.Q_strides.0, p.Q_strides.1, p.Q_strides.2], [4 * 50 * 59, 50 * 59, 59])
        XCTAssertEqual([p.K_strides.0, p.K_strides.1, p.K_strides.2], [2 * 64 * 59, 64 * 59, 59])
        XCTAssertEqual(try dispatch(Case(d: 224)).kernel, "flash_attn_prefill_bf16_d256")
    }

    func testFloat32Geometry() {
        XCTAssertEqual(PrefillCapability.headDims(io: .f32), [64, 80, 96, 128, 192, 256, 512])
        for d in [64, 80, 96, 128] {
            XCTAssertEqual(PrefillCapability.kernelGeometry(io: .f32, headDim: d), PrefillGeometry.forHeadDim(d))
        }
        XCTAssertEqual(PrefillCapability.kernelGeometry(io: .f32, headDim: 192), PrefillGeometry(bq: 32, bk: 8, wm: 4, wn: 1))
        XCTAssertEqual(PrefillCapability.kernelGeometry(io: .f32, headDim: 256), PrefillGeometry(bq: 32, bk: 16, wm: 1, wn: 8))
        XCTAssertEqual(PrefillCapability.kernelGeometry(io: .f32, headDim: 512), PrefillGeometry(bq: 32, bk: 8, wm: 1, wn: 16))
        XCTAssertEqual(KernelSpec.prefill(io: .f32, headDim: 256, boolMask: false).instantiation.function,
                       "flash_attn_prefill_split")
        XCTAssertEqual(KernelSpec.prefill(io: .f32, headDim: 192, boolMask: false).instantiation.function,
                       "flash_attn_prefill")
        XCTAssertEqual(PrefillCapability.kernelGeometry(io: .bf16, headDim: 256), PrefillGeometry.forHeadDim(256))
    }

    /// Float32 D = 256 and 512 calls: the grid counts the kernel's 32-row
    /// tiles of 8 (16) simdgroups and the alignment constants its 32 x 16
    /// (32 x 8) tiles; AttnParams' NQ/NK stay the tile-skip (blk) grid of
    /// 32 x 16 (8 x 8) tiles.
    func testFloat32GridAndParams() throws {
        // Per (head dim, rows, keys): AttnParams' [NQ, NK, qL_rem, kL_rem], the grid, the threadgroup, the
        // kernel, and whether the rows (constant 200) and keys (201) fill whole tiles; nil: not pinned.
        typealias Row = (d: Int, qL: Int, kL: Int, tiles: [Int32]?, grid: Size3, threadgroup: Size3, kernel: String?,
                         wholeRows: (Bool, String), wholeKeys: (Bool, String)?)
        let rows: [Row] = [
            (256, 48, 56, [2, 4, 16, 8], Size3(2, 2, 1), Size3(32, 1, 8), "flash_attn_prefill_f32_d256",
             (false, "a partial 32-row tile"), (false, "a partial 16-key tile")),
            (512, 64, 72, [8, 9, 0, 0], Size3(2, 2, 1), Size3(32, 1, 16), "flash_attn_prefill_f32_d512",
             (true, "whole 32-row tiles"), (true, "whole 8-key tiles")),
            (192, 48, 56, nil, Size3(2, 2, 1), Size3(32, 4, 1), nil, (false, "a partial 32-row tile"), nil),
        ]
        for r in rows {
            let d = try dispatch(Case(b: 1, h: 2, hkv: 2, qL: r.qL, kL: r.kL, d: r.d, dtype: .f32))
            let what = "D=\(r.d)"
            if let tiles = r.tiles {
                let p = try d.params(4, as: AttnParams.self)
                XCTAssertEqual([p.NQ, p.NK, p.qL_rem, p.kL_rem], tiles, what)
            }
            XCTAssertEqual(d.grid, r.grid, what)
            XCTAssertEqual(d.threadgroup, r.threadgroup, what)
            if let kernel = r.kernel { XCTAssertEqual(d.kernel, kernel, what) }
            XCTAssertEqual(d.constants.bool(200), r.wholeRows.0, "\(what), \(r.qL) rows: \(r.wholeRows.1)")
            if let keys = r.wholeKeys {
                XCTAssertEqual(d.constants.bool(201), keys.0, "\(what), \(r.kL) keys: \(keys.1)")
            }
        }
    }

    /// D = 512 (two-byte): the kernel's 16 x 64 tiles of 8 simdgroups set the
    /// grid and the alignment constants; AttnParams' NQ/NK and the blk stay
    /// the 8 x 8 tile-skip grid.
    func testWideGridAndParams() throws {
        XCTAssertEqual(PrefillCapability.kernelGeometry(io: .f16, headDim: 512), PrefillGeometry(bq: 16, bk: 64, wm: 1, wn: 8))
        XCTAssertEqual(PrefillGeometry.forHeadDim(512), PrefillGeometry(bq: 8, bk: 8, wm: 1, wn: 1))
        let d = try dispatch(Case(b: 1, h: 2, hkv: 2, qL: 48, kL: 136, d: 512))
        let p = try d.params(4, as: AttnParams.self)
        XCTAssertEqual([p.NQ, p.NK, p.qL_rem, p.kL_rem], [6, 17, 0, 0])
        XCTAssertEqual(d.grid, Size3(3, 2, 1))
        XCTAssertEqual(d.threadgroup, Size3(32, 1, 8))
        XCTAssertEqual(d.kernel, "flash_attn_prefill_bf16_d512")
        XCTAssertEqual(d.constants.bool(200), true, "48 rows: whole 16-row tiles")
        XCTAssertEqual(d.constants.bool(201), false, "136 keys: a partial 64-key tile")
        let d2 = try dispatch(Case(b: 1, h: 2, hkv: 2, qL: 40, kL: 128, d: 512))
        XCTAssertEqual(d2.grid, Size3(3, 2, 1))
        XCTAssertEqual(d2.constants.bool(200), false, "40 rows: a partial 16-row tile")
        XCTAssertEqual(d2.constants.bool(201), true, "128 keys: whole 64-key tiles")
    }

    func testTileCounts() {
        let g = PrefillGeometry.forHeadDim(256)!
        XCTAssertEqual(g.tiles(qL: 50, kL: 64),
                       PrefillTiles(nq: 2, nk: 4, nqAligned: 1, nkAligned: 4, qLRem: 18, kLRem: 0))
        XCTAssertEqual(g.tiles(qL: 32, kL: 50),
                       PrefillTiles(nq: 1, nk: 4, nqAligned: 1, nkAligned: 3, qLRem: 0, kLRem: 2))
        let g512 = PrefillGeometry.forHeadDim(512)!
        XCTAssertEqual(g512.tiles(qL: 17, kL: 9),
                       PrefillTiles(nq: 3, nk: 2, nqAligned: 2, nkAligned: 1, qLRem: 1, kLRem: 1))
    }

    /// The tile loaders' load width (constant 312): 16 or 8 bytes when q, k and
    /// v all start on such a boundary and the head dim (hence every stride of
    /// these contiguous tensors) is whole runs of that many bytes; else 4.
    func testTileLoadBytes() throws {
        func width(_ dtype: DType, d: Int, q qOff: Int = 0, k kOff: Int = 0, v vOff: Int = 0) throws -> Int32? {
            func at(_ shape: [Int], _ off: Int) -> (HostTensor, TensorRef) {
                let n = shape.reduce(1, *) * dtype.byteSize
                let h = HostTensor(shape, dtype, bytes: n + 64)
                return (h, TensorRef(data: h.data + off, byteCount: n, dtype: dtype, shape: shape))
            }
            let (q, k, v, o) = (at([1, 2, 9, d], qOff), at([1, 1, 13, d], kOff), at([1, 1, 13, d], vOff),
                                at([1, 2, 9, d], 0))
            defer { withExtendedLifetime([q.0, k.0, v.0, o.0]) {} }
            let t = PrefillTensors(q: q.1, k: k.1, v: v.1, out: o.1)
            return try PrefillDispatcher.makeDispatch(t, PrefillOptions(scale: 0.125)).constants.int(312)
        }
        XCTAssertEqual(try width(.bf16, d: 128), 16)
        XCTAssertEqual(try width(.bf16, d: 512), 16)
        XCTAssertEqual(try width(.bf16, d: 128, q: 8), 8, "q 8 bytes off a 16-byte boundary")
        XCTAssertEqual(try width(.bf16, d: 128, v: 24), 8)
        XCTAssertEqual(try width(.bf16, d: 128, k: 4), 4, "k on a 4-byte boundary only")
        XCTAssertEqual(try width(.f16, d: 128, k: 2), 4)
        XCTAssertEqual(try width(.bf16, d: 36), 8, "rows 72 bytes apart: 8-byte runs only")
        XCTAssertEqual(try width(.bf16, d: 34), 4, "rows 68 bytes apart")
        XCTAssertEqual(try width(.bf16, d: 59), 4, "odd rows")
        XCTAssertEqual(try width(.f32, d: 36), 16)
        XCTAssertEqual(try width(.f32, d: 34), 8)
        XCTAssertEqual(try width(.f32, d: 59), 4)
        XCTAssertEqual(try width(.f32, d: 64, q: 4), 4)
        XCTAssertEqual(try width(.f32, d: 64, q: 8, k: 8, v: 8), 8)
    }

    func testParamsGridAndConstants() throws {
        var o = PrefillOptions(scale: 0.25)
        o.causal = true
        o.qOffset = 10
        o.softcap = 30
        let d = try dispatch(Case(b: 2, h: 4, hkv: 2, qL: 50, kL: 64, d: 128), o)
        XCTAssertEqual(d.writes, [PrefillBuffer.out])
        let p = try d.params(4, as: AttnParams.self)
        XCTAssertEqual([p.B, p.H, p.D, p.qL, p.kL, p.gqa_factor], [2, 4, 128, 50, 64, 2])
        XCTAssertEqual([p.NQ, p.NK, p.NQ_aligned, p.NK_aligned, p.qL_rem, p.kL_rem, p.qL_off], [2, 4, 1, 4, 18, 0, 10])
        XCTAssertEqual(p.scale, 0.25)
        XCTAssertEqual(p.softcapping, 30)
        XCTAssertEqual([p.Q_strides.0, p.Q_strides.1, p.Q_strides.2], [4 * 50 * 128, 50 * 128, 128])
        XCTAssertEqual([p.K_strides.0, p.K_strides.1, p.K_strides.2], [2 * 64 * 128, 64 * 128, 128])
        XCTAssertEqual(d.grid, Size3(2, 4, 2))
        XCTAssertEqual(d.threadgroup, Size3(32, 4, 1))
        XCTAssertEqual(d.kernel, "flash_attn_prefill_bf16_d128")
        XCTAssertEqual(d.constants, FunctionConstants([
            (200, .bool(false)), (201, .bool(true)), (300, .bool(false)), (301, .bool(true)), (303, .bool(false)),
            (302, .bool(false)), (304, .bool(false)), (305, .bool(false)), (306, .bool(false)), (307, .bool(false)),
            (308, .bool(false)), (309, .bool(false)), (310, .bool(false)), (311, .bool(false)), (312, .int(16)),
        ]))
        XCTAssertEqual(Set(d.bindings.keys), [0, 1, 2, 3, 4])
    }

    func testWindowIsInKernel() throws {
        var o = PrefillOptions(scale: 0.125)
        o.window = 5
        o.causal = true
        let d = try dispatch(Case(), o)
        XCTAssertEqual(d.constants.bool(304), true)
        XCTAssertEqual(d.constants.bool(305), true)
        XCTAssertEqual(d.constants.bool(300), false, "no mask")
        for fc in [302, 306, 307, 308, 309, 310] { XCTAssertEqual(d.constants.bool(fc), false, "\(fc)") }
        let s = try d.params(PrefillBuffer.seqParams, as: AttnSeqParams.self)
        XCTAssertEqual([s.window_left, s.window_right], [4, -1])
        XCTAssertEqual(Set(d.bindings.keys), [0, 1, 2, 3, 4, 8])
        var bad = PrefillOptions(scale: 0.125)
        bad.window = -3
        expectError(Case(), bad, contains: "window must be >= 0 (0 = none), got -3")
    }

    func testSeqMajorStridesAndCapacity() throws {
        var o = PrefillOptions(scale: 0.125)
        o.layout = .seqMajor
        o.kvLen = 40
        let c = Case(b: 1, h: 4, hkv: 2, qL: 8, kL: 64, d: 64)
        let q = HostTensor([1, 8, 4, 64], .f16), k = HostTensor([1, 64, 2, 64], .f16)
        let v = HostTensor([1, 64, 2, 64], .f16), out = HostTensor([1, 8, 4, 64], .f16)
        _ = c
        let d = try PrefillDispatcher.makeDispatch(PrefillTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref), o)
        let p = try d.params(4, as: AttnParams.self)
        XCTAssertEqual([p.Q_strides.0, p.Q_strides.1, p.Q_strides.2], [8 * 4 * 64, 64, 4 * 64])
        XCTAssertEqual([p.K_strides.0, p.K_strides.1, p.K_strides.2], [64 * 2 * 64, 64, 2 * 64])
        XCTAssertEqual(p.kL, 40)
        XCTAssertEqual(d.kernel, "flash_attn_prefill_f16_d64")
    }

    func testMaskStridesAndBoolKernel() throws {
        let c = Case(b: 2, h: 4, hkv: 2, qL: 16, kL: 24, d: 512)
        let m2 = HostTensor([16, 24], .bool)
        let d2 = try dispatch(c, mask: m2)
        XCTAssertEqual(d2.kernel, "flash_attn_prefill_bf16_d512_boolmask")
        let mp2 = try d2.params(5, as: AttnMaskParams.self)
        XCTAssertEqual([mp2.M_strides.0, mp2.M_strides.1, mp2.M_strides.2], [0, 0, 24])
        XCTAssertEqual(d2.constants.bool(300), true)
        XCTAssertEqual(d2.threadgroup, Size3(32, 1, 8))
        let m4 = HostTensor([2, 4, 16, 24], .bf16)
        let d4 = try dispatch(c, mask: m4)
        XCTAssertEqual(d4.kernel, "flash_attn_prefill_bf16_d512")
        let mp4 = try d4.params(5, as: AttnMaskParams.self)
        XCTAssertEqual([mp4.M_strides.0, mp4.M_strides.1, mp4.M_strides.2], [4 * 16 * 24, 16 * 24, 24])
        let blk = HostTensor([2, 3], .u8)
        let db = try dispatch(c, mask: m2, blk: blk)
        XCTAssertEqual(db.constants.bool(303), true)
        XCTAssertEqual(Set(db.bindings.keys), [0, 1, 2, 3, 4, 5, 6, 7])
    }

    func testSeedValidationErrors() {
        expectError(Case(h: 0), contains: "the q heads must be > 0")
        expectError(Case(h: 4, hkv: 0), contains: "the k heads must be > 0")
        expectError(Case(h: 6, hkv: 4), contains: "the q heads (6) must be a multiple of the k heads (4)")
        expectError(Case(qL: 0), contains: "q_len must be > 0")
        expectError(Case(kL: 0), contains: "the cache capacity must be > 0")
        expectError(Case(b: 0), contains: "batch must be > 0")
        expectError(Case(d: 600), contains: "head_dim must be in 1...512, got 600")
        expectError(Case(d: 0), contains: "head_dim must be in 1...512, got 0")
        expectError(Case(dtype: .i32), status: FM_ERROR_TYPE, contains: "q must be bfloat16 or float16 or float32, got int32")
        expectError(Case(d: 600, dtype: .f32), contains: "head_dim of float32 I/O must be in 1...512, got 600")
        var resume = PrefillOptions(scale: 0.1)
        resume.qOffset = 20
        resume.causal = true
        expectError(Case(qL: 50, kL: 64), resume, contains: "q_offset (20) + q_len (50) must be <= kv_len (64)")
        resume.causal = false
        resume.window = 8
        expectError(Case(qL: 50, kL: 64), resume, contains: "q_offset (20) + q_len (50) must be <= kv_len (64)")
        resume.window = 0  // no position matters: rows past the keys run
        XCTAssertNoThrow(try dispatch(Case(qL: 50, kL: 64), resume))
        XCTAssertNoThrow(try dispatch(Case(qL: 70, kL: 64)))
        var over = PrefillOptions(scale: 0.1)
        over.kvLen = 65
        expectError(Case(kL: 64), over, contains: "kv_len (65) must be <= the cache capacity (64)")
        let m = HostTensor([50, 64], .bf16)
        let blk = HostTensor([32], .u8)
        expectError(Case(), blk: blk, contains: "blk requires mask")
        let m4 = HostTensor([1, 4, 50, 64], .bf16)
        expectError(Case(), mask: m4, blk: blk, contains: "blk requires a rank-2")
        let tiny = HostTensor([2], .u8)
        expectError(Case(), mask: m, blk: tiny, contains: "blk shape [2] must be [NQ, NK] = [2, 4]")
        expectError(Case(), mask: HostTensor([50, 63], .bf16), contains: "mask shape [50, 63] must be [50, 64]")
        expectError(Case(), mask: HostTensor([50, 64], .f16), status: FM_ERROR_TYPE, contains: "mask must be bfloat16 (additive) or bool")
        expectError(Case(), PrefillOptions(scale: .nan), contains: "scale must be finite")
        var badCap = PrefillOptions(scale: 1)
        badCap.softcap = -1
        expectError(Case(), badCap, contains: "softcap must be 0 (off) or a finite value > 0")
    }

    func testUndersizedBuffersRejected() {
        let c = Case()
        let q = HostTensor([1, 4, 50, 128], .bf16, bytes: 100)
        let k = HostTensor([1, 2, 64, 128], .bf16), v = HostTensor([1, 2, 64, 128], .bf16)
        let o = HostTensor([1, 4, 50, 128], .bf16)
        _ = c
        XCTAssertThrowsError(try PrefillDispatcher.makeDispatch(
            PrefillTensors(q: q.ref, k: k.ref, v: v.ref, out: o.ref), PrefillOptions(scale: 1))) { e in
            XCTAssertTrue((e as! FlashMetalError).message.contains("q buffer too small"), "\(e)")
        }
    }

    func testKernelNames() {
        let names = Set(PrefillCapability.kernels.map(\.name))
        XCTAssertEqual(names.count, 28 + 14 + 4)
        for seed in ["flash_attn_prefill_bf16_d256", "flash_attn_prefill_f16_d512_boolmask", "flash_attn_prefill_bf16_d64_boolmask",
                     "flash_attn_prefill_f32_d64", "flash_attn_prefill_f32_d256_boolmask", "flash_attn_prefill_f32_d512",
                     "flash_attn_prefill_bf16_d576", "flash_attn_prefill_f16_d576_boolmask"] {
            XCTAssertTrue(names.contains(seed), seed)
        }
    }

    func testDistinctConstantsAreDistinctCacheKeys() {
        let a = PipelineKey(spec: .sdpa(io: .f32), constants: FunctionConstants([(200, .bool(true)), (301, .bool(false))]))
        let b = PipelineKey(spec: .sdpa(io: .f32), constants: FunctionConstants([(301, .bool(false)), (200, .bool(true))]))
        let c = PipelineKey(spec: .sdpa(io: .f32), constants: FunctionConstants([(200, .bool(true)), (301, .bool(true))]))
        let d = PipelineKey(spec: .sdpa(io: .f32), constants: FunctionConstants([(200, .int(1)), (301, .bool(false))]))
        XCTAssertEqual(a, b)
        XCTAssertEqual(a.hashValue, b.hashValue)
        XCTAssertEqual(Set([a, b, c, d]).count, 3)
    }
}
