import CFlashMetal
import FlashMetalCore
import XCTest

final class VecDispatcherTests: XCTestCase {
    struct Case {
        var b: Int? = nil, h = 16, hkv = 8, cap = 1024, d = 256
        var kv = DType.f32
    }

    func dispatches(_ c: Case, _ o: VecOptions? = nil, signs: HostTensor? = nil, tmpBytes: Int? = nil,
                    q: HostTensor? = nil) throws -> [Dispatch] {
        let qs = c.b.map { [$0, c.h, c.d] } ?? [c.h, c.d]
        let ks = c.b.map { [$0, c.hkv, c.cap, c.d] } ?? [c.hkv, c.cap, c.d]
        let q = q ?? HostTensor(qs, .f32)
        let k = HostTensor(ks, c.kv), v = HostTensor(ks, c.kv), out = HostTensor(qs, .f32)
        let rows = (c.b ?? 1) * c.h
        let tmp = HostTensor([1], .f32, bytes: tmpBytes ?? VecDispatcher.tmpByteCount(rows: rows, headDim: c.d))
        var opts = o ?? VecOptions(scale: 1)
        if o == nil { opts.kvLen = 100 }
        let t = VecTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref, tmp: tmp.ref, signs: signs?.ref)
        return try withExtendedLifetime([q, k, v, out, tmp]) { try VecDispatcher.makeDispatches(t, opts) }
    }

    func testTmpAndSharedMemory() {
        XCTAssertEqual(VecDispatcher.tmpByteCount(rows: 16, headDim: 256), 16 * 32 * 258 * 4)  // 528384
        XCTAssertEqual(VecDispatcher.tmpByteCount(rows: 16, headDim: 256), 528384)
        // 32 probabilities per head, plus two stages of RS rows when heads share a group.
        XCTAssertEqual(VecDispatcher.threadgroupMemoryBytes(headDim: 256, elementBytes: 4), 32 * 4)
        XCTAssertEqual(VecDispatcher.threadgroupMemoryBytes(headDim: 256, heads: 2, elementBytes: 2),
                       64 * 4 + 2 * 16 * 256 * 2)
        XCTAssertEqual(VecDispatcher.threadgroupMemoryBytes(headDim: 512, heads: 8, elementBytes: 4),
                       256 * 4 + 2 * 4 * 512 * 4)
        XCTAssertEqual(VecDispatcher.threadgroupMemoryBytes(headDim: 64, heads: 4, elementBytes: 2),
                       128 * 4 + 2 * 32 * 64 * 2)
        XCTAssertEqual(VecDispatcher.threadgroupMemoryBytes(headDim: 128, heads: 8, elementBytes: 2),
                       256 * 4 + 2 * 32 * 128 * 2)
        for d in VecCapability.headDims {
            for eb in [2, 4] {
                let bytes = VecDispatcher.threadgroupMemoryBytes(headDim: d, heads: VecCapability.groupRows(headDim: d),
                                                                 elementBytes: eb)
                XCTAssertLessThanOrEqual(bytes, 32768, "D=\(d)")
                XCTAssertEqual(bytes % 16, 0, "D=\(d)")
            }
        }
        XCTAssertEqual(VecDispatcher.nwg, 32)
    }

    func testHeadsPerGroupStageRowsAndVectorWidth() {
        // Every row of a kv head up to the tile's cap, else the largest divisor under it.
        let rows = [1, 2, 3, 4, 6, 7, 8, 12, 16, 24, 32, 40, 64]
        XCTAssertEqual(rows.map { VecDispatcher.headsPerGroup(rows: $0, headDim: 128) },
                       [1, 2, 3, 4, 6, 7, 8, 12, 16, 24, 32, 20, 32])
        XCTAssertEqual(rows.map { VecDispatcher.headsPerGroup(rows: $0, headDim: 256) },
                       [1, 2, 3, 4, 6, 7, 8, 12, 16, 12, 16, 10, 16])
        XCTAssertEqual(rows.map { VecDispatcher.headsPerGroup(rows: $0, headDim: 576) },
                       [1, 2, 3, 4, 6, 7, 8, 6, 8, 8, 8, 8, 8])
        XCTAssertEqual(VecCapability.headDims.map { VecCapability.groupRows(headDim: $0) },
                       [32, 32, 32, 32, 16, 16, 8, 8])
        XCTAssertEqual(VecCapability.headDims.map { VecDispatcher.stageRows(headDim: $0, elementBytes: 2) },
                       [32, 32, 32, 32, 16, 16, 8, 4])
        XCTAssertEqual(VecCapability.headDims.map { VecDispatcher.stageRows(headDim: $0, elementBytes: 4) },
                       [32, 16, 16, 16, 8, 8, 4, 4])
        XCTAssertEqual(VecCapability.headDims.map { VecDispatcher.vectorWidth(headDim: $0) }, [2, 4, 4, 4, 2, 4, 4, 2])
    }

    func testKernelNames() {
        XCTAssertEqual(KernelSpec.vec(kv: .f32, headDim: 256).name, "flash_attn_vec_dk256")
        XCTAssertEqual(KernelSpec.vec(kv: .f16, headDim: 512).name, "flash_attn_vec_f16kv_dk512")
        XCTAssertEqual(KernelSpec.vec(kv: .bf16, headDim: 64).name, "flash_attn_vec_bf16kv_dk64")
        XCTAssertEqual(KernelSpec.vecReduce(headDim: 128, fwht: false).name, "flash_attn_vec_reduce_dk128")
        XCTAssertEqual(KernelSpec.vecReduce(headDim: 256, fwht: true).name, "flash_attn_vec_reduce_tq_hb_undo_dk256")
        XCTAssertEqual(VecCapability.kernels.count, 3 * 8 + 8 + 4)
        XCTAssertEqual(VecCapability.fwhtHeadDims, [64, 128, 256, 512])
    }

    func testPaddedHeadDimRunsTheNextTileWithTheTrueD() throws {
        // D = 111 (odd): the dk128 kernels with head_dim 111, scalar loads (506) as its rows are off
        // vector boundaries, threadgroup staging of the tile's width.
        let ds = try dispatches(Case(d: 111, kv: .bf16))
        let (m, r) = (ds[0], ds[1])
        XCTAssertEqual(m.kernel, "flash_attn_vec_bf16kv_dk128")
        XCTAssertEqual(try m.params(0, as: FlashAttnVecParams.self).head_dim, 111)
        XCTAssertEqual(m.constants.bool(FunctionConstantIndex.vecUnaligned), true)
        XCTAssertEqual(m.threadgroupMemory, [0: VecDispatcher.threadgroupMemoryBytes(headDim: 128, heads: 2, elementBytes: 2)])
        XCTAssertEqual(r.kernel, "flash_attn_vec_reduce_dk128")
        XCTAssertEqual(try r.params(0, as: FlashAttnVecReduceParams.self).head_dim, 111)
        // D = 40 keeps the vector loads (a multiple of the d64 kernel's width 2).
        let m40 = try dispatches(Case(d: 40))[0]
        XCTAssertEqual(m40.kernel, "flash_attn_vec_dk64")
        XCTAssertEqual(m40.constants.bool(FunctionConstantIndex.vecUnaligned), false)
        XCTAssertEqual(VecCapability.tileHeadDim(160), 192)
        XCTAssertEqual(VecCapability.tileHeadDim(257), 512)
        XCTAssertEqual(VecCapability.tileHeadDim(511), 512)
        XCTAssertNil(VecCapability.tileHeadDim(513))
        // D = 300: the dk512 kernels with head_dim 300.
        let m300 = try dispatches(Case(d: 300))[0]
        XCTAssertEqual(m300.kernel, "flash_attn_vec_dk512")
        XCTAssertEqual(try m300.params(0, as: FlashAttnVecParams.self).head_dim, 300)
    }

    func testMainAndReduce() throws {
        var o = VecOptions(scale: 0.5)
        o.kvLen = 100; o.maskType = 2; o.window = 64; o.softcap = 30
        let ds = try dispatches(Case(kv: .f16), o)
        XCTAssertEqual(ds.count, 2)
        let (m, r) = (ds[0], ds[1])
        XCTAssertEqual(m.kernel, "flash_attn_vec_f16kv_dk256")
        // H / Hkv = 2: two query heads per threadgroup share their K/V reads.
        XCTAssertEqual(m.grid, Size3(1, 8, 32))
        XCTAssertEqual(m.threadgroup, Size3(64, 1, 1))
        XCTAssertEqual(VecDispatcher.rows(of: m), 16)
        XCTAssertEqual(m.threadgroupMemory, [0: 64 * 4 + 2 * 16 * 256 * 2])
        XCTAssertEqual(m.constants.bool(FunctionConstantIndex.vecUnaligned), false)
        XCTAssertEqual(Set(m.bindings.keys), [0, 1, 2, 3, 4])
        let p = try m.params(0, as: FlashAttnVecParams.self)
        XCTAssertEqual([p.n_heads, p.n_kv_heads, p.head_dim, p.kv_seq_len, p.kv_capacity, p.mask_type,
                        p.sliding_window, p.nwg], [16, 8, 256, 100, 1024, 2, 64, 32])
        XCTAssertEqual(p.scale, 0.5)
        XCTAssertEqual(p.softcap, 30)
        XCTAssertEqual(r.kernel, "flash_attn_vec_reduce_dk256")
        XCTAssertEqual(r.grid, Size3(16, 1, 1))
        XCTAssertEqual(r.threadgroup, Size3(1024, 1, 1))
        XCTAssertEqual(try r.params(0, as: FlashAttnVecReduceParams.self).nrows, 16)
        XCTAssertEqual(try r.params(0, as: FlashAttnVecReduceParams.self).head_dim, 256)
        XCTAssertEqual(try r.params(3, as: UInt32.self), 32)
        XCTAssertEqual(try r.buffer(1).data, try m.buffer(4).data)
        XCTAssertEqual(Set(r.bindings.keys), [0, 1, 2, 3])
        XCTAssertTrue(r.threadgroupMemory.isEmpty)
        // The plain decode: every serving constant off, nothing bound at their indices.
        XCTAssertEqual(r.constants.bool(FunctionConstantIndex.vecHasSigns), false)
        XCTAssertEqual(r.constants.bool(FunctionConstantIndex.vecSinks), false)
        XCTAssertEqual(r.constants.bool(FunctionConstantIndex.vecLSE), false)
        for i in [FunctionConstantIndex.vecSeq, FunctionConstantIndex.vecKVLens, FunctionConstantIndex.vecPaged] {
            XCTAssertEqual(m.constants.bool(i), false, "constant \(i)")
        }
        // Metal copies back only what a kernel writes, and may narrow the reduce.
        XCTAssertEqual(m.writes, [VecBuffer.tmp])
        XCTAssertFalse(m.threadgroupFlexible)
        XCTAssertEqual(r.writes, [VecReduceBuffer.out])
        XCTAssertTrue(r.threadgroupFlexible)
    }

    func testBatchFoldsIntoHeads() throws {
        let ds = try dispatches(Case(b: 3, h: 4, hkv: 2, cap: 128, d: 128, kv: .bf16))
        let p = try ds[0].params(0, as: FlashAttnVecParams.self)
        XCTAssertEqual([p.n_heads, p.n_kv_heads], [12, 6])
        XCTAssertEqual(ds[0].kernel, "flash_attn_vec_bf16kv_dk128")
        XCTAssertEqual(ds[0].grid, Size3(1, 6, 32))  // pairs of query heads per kv head
        XCTAssertEqual(VecDispatcher.rows(of: ds[0]), 12)
        XCTAssertEqual(ds[1].grid, Size3(12, 1, 1))
    }

    func testFwhtReduce() throws {
        var o = VecOptions(scale: 1)
        o.kvLen = 100; o.fwht = true
        let signs = HostTensor([64], .u8)
        let with = try dispatches(Case(d: 512), o, signs: signs)[1]
        XCTAssertEqual(with.kernel, "flash_attn_vec_reduce_tq_hb_undo_dk512")
        XCTAssertEqual(with.constants.bool(500), true)
        XCTAssertEqual(try with.buffer(4).data, signs.data)
        XCTAssertEqual(with.threadgroupMemory, [0: 2048])
        XCTAssertEqual(with.threadgroup, Size3(1024, 1, 1))
        let without = try dispatches(Case(d: 512), o)[1]
        XCTAssertEqual(without.constants.bool(500), false)
        XCTAssertNil(without.bindings[4])
        XCTAssertNotEqual(with.pipeline, without.pipeline)
        expectFMError(VecDispatcher.reduceOp, contains: "nwg must be > 0") {
            _ = try VecDispatcher.reduceDispatch(tmp: signs.ref, out: signs.ref, rows: 1, headDim: 256, nwg: 0,
                                                 fwht: true, signs: nil)
        }
        expectFMError(VecDispatcher.reduceOp, contains: "the FWHT undo needs a power-of-two head_dim (64, 128, 256 or 512), got 96") {
            _ = try VecDispatcher.reduceDispatch(tmp: signs.ref, out: signs.ref, rows: 1, headDim: 96, nwg: 32,
                                                 fwht: true, signs: nil)
        }
    }

    func testValidation() {
        let op = VecDispatcher.op
        expectFMError(op, contains: "head_dim must be in 1...512 or 576, got 600") { _ = try dispatches(Case(d: 600)) }
        expectFMError(op, contains: "head_dim must be in 1...512 or 576, got 0") { _ = try dispatches(Case(d: 0)) }
        expectFMError(op, contains: "the q heads (16) must be a multiple of the k heads (3)") { _ = try dispatches(Case(hkv: 3)) }
        expectFMError(op, contains: "the k heads must be > 0") { _ = try dispatches(Case(hkv: 0)) }
        var o = VecOptions(scale: 1)
        o.kvLen = 2000
        expectFMError(op, contains: "kv_len (2000) must be <= the cache capacity (1024)") { _ = try dispatches(Case(), o) }
        o.kvLen = 0
        expectFMError(op, contains: "kv_len must be > 0") { _ = try dispatches(Case(), o) }
        o.kvLen = 10; o.maskType = 2; o.window = 0
        expectFMError(op, contains: "window must be > 0 with the sliding-window mask") { _ = try dispatches(Case(), o) }
        o.maskType = 7
        expectFMError(op, contains: "mask_type must be 0 (none), 1 (causal) or 2 (sliding window), got 7") { _ = try dispatches(Case(), o) }
        o.maskType = 0; o.scale = .nan
        expectFMError(op, contains: "scale must be finite") { _ = try dispatches(Case(), o) }
        expectFMError(op, status: FM_ERROR_TYPE, contains: "k must be float32 or float16 or bfloat16, got uint8") {
            _ = try dispatches(Case(kv: .u8))
        }
        expectFMError(op, status: FM_ERROR_TYPE, contains: "q must be float32, got float16") {
            _ = try dispatches(Case(), q: HostTensor([16, 256], .f16))
        }
        expectFMError(op, contains: "tmp buffer too small: expected at least 528384 bytes") {
            _ = try dispatches(Case(), tmpBytes: 528383)
        }
        expectFMError(op, contains: "q buffer too small") {
            _ = try dispatches(Case(), q: HostTensor([16, 256], .f32, bytes: 64))
        }
        var f = VecOptions(scale: 1)
        f.kvLen = 10; f.fwht = true
        expectFMError(VecDispatcher.reduceOp, contains: "fwht_signs must hold head_dim/8 = 32 bytes") {
            _ = try dispatches(Case(), f, signs: HostTensor([31], .u8))
        }
        expectFMError(op, contains: "fwht_signs given without fwht") {
            _ = try dispatches(Case(), nil, signs: HostTensor([32], .u8))
        }
    }
}
