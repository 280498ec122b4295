import CFlashMetal
import FlashMetalCore
import XCTest

/// fm_dispatch_vec_seq's dispatcher: the contract's bindings, constants and
/// structs, and validation before any table entry is trusted.
final class VecSeqDispatcherTests: XCTestCase {
    struct Case {
        var b = 3, h = 8, hkv = 2, cap = 64, d = 128
        var kv = DType.f16
        var pages: (num: Int, size: Int, max: Int)? = nil
    }

    /// int32 host memory filled with `values`.
    func ints(_ shape: [Int], _ values: [Int32]) -> HostTensor {
        let t = HostTensor(shape, .i32)
        for (i, x) in values.enumerated() { t.data.storeBytes(of: x, toByteOffset: 4 * i, as: Int32.self) }
        return t
    }

    func dispatches(_ c: Case, _ o: VecSeqOptions = VecSeqOptions(scale: 0.5), seqlens: HostTensor? = nil,
                    table: HostTensor? = nil, sinks: HostTensor? = nil, lse: HostTensor? = nil,
                    q: HostTensor? = nil) throws -> [Dispatch] {
        let ks = c.pages.map { [$0.num, $0.size, c.hkv, c.d] } ?? [c.b, c.cap, c.hkv, c.d]
        let q = q ?? HostTensor([c.b, c.h, c.d], .f32)
        let k = HostTensor(ks, c.kv), v = HostTensor(ks, c.kv), out = HostTensor([c.b, c.h, c.d], .f32)
        let tmp = HostTensor([1], .f32, bytes: VecDispatcher.tmpByteCount(rows: c.b * c.h, headDim: c.d))
        let t = VecSeqTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref, tmp: tmp.ref, seqlensK: seqlens?.ref,
                              blockTable: table?.ref, sinks: sinks?.ref, lse: lse?.ref)
        return try withExtendedLifetime([q, k, v, out, tmp]) { try VecSeqDispatcher.makeDispatches(t, o) }
    }

    /// Short queries: q [B, L, H, D] runs L * H rows per sequence; the L rows
    /// of a kv head's group share its threadgroups; causal is window_right 0.
    func testShortQueryRowsGroupAndRightBound() throws {
        var o = VecSeqOptions(scale: 0.5)
        o.causal = true
        let q = HostTensor([2, 4, 4, 64], .f32), out = HostTensor([2, 4, 4, 64], .f32)
        let k = HostTensor([2, 64, 4, 64], .bf16), v = HostTensor([2, 64, 4, 64], .bf16)
        let rows = 2 * 4 * 4
        let tmp = HostTensor([1], .f32, bytes: VecDispatcher.tmpByteCount(rows: rows, headDim: 64))
        let lse = HostTensor([2, 4, 4], .f32)
        let t = VecSeqTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref, tmp: tmp.ref, lse: lse.ref)
        let ds = try withExtendedLifetime([q, k, v, out, tmp, lse]) { try VecSeqDispatcher.makeDispatches(t, o) }
        XCTAssertEqual(ds[0].grid, Size3(1, rows / 4, 32))  // MHA: the 4 query rows of a head share a threadgroup
        XCTAssertEqual(ds[0].threadgroup, Size3(128, 1, 1))
        // GQA 8 with 8 rows: the 64 rows of a kv head span two threadgroups of 32
        // at D = 128, four of 16 at D = 256; GQA 4 with 8 rows fits one of 32.
        for (h, d, hg) in [(8, 128, 32), (8, 256, 16), (4, 128, 32), (4, 512, 8)] {
            let q8 = HostTensor([1, 8, h, d], .f32), o8 = HostTensor([1, 8, h, d], .f32)
            let k8 = HostTensor([1, 64, 1, d], .bf16), v8 = HostTensor([1, 64, 1, d], .bf16)
            let t8 = HostTensor([1], .f32, bytes: VecDispatcher.tmpByteCount(rows: 8 * h, headDim: d))
            let g = VecSeqTensors(q: q8.ref, k: k8.ref, v: v8.ref, out: o8.ref, tmp: t8.ref)
            let m = try withExtendedLifetime([q8, o8, k8, v8, t8]) { try VecSeqDispatcher.makeDispatches(g, o)[0] }
            XCTAssertEqual(m.grid, Size3(1, 8 * h / hg, 32), "GQA \(h) D=\(d)")
            XCTAssertEqual(m.threadgroup, Size3(32 * hg, 1, 1), "GQA \(h) D=\(d)")
            XCTAssertEqual(m.threadgroupMemory[0], VecDispatcher.threadgroupMemoryBytes(headDim: d, heads: hg, elementBytes: 2))
        }
        let sp = try ds[0].params(VecBuffer.seqParams, as: FlashAttnVecSeqParams.self)
        XCTAssertEqual(sp.q_rows, 4)
        XCTAssertEqual(sp.window_right, 0)
        XCTAssertEqual(ds[1].grid, Size3(rows, 1, 1))

        // One row keeps the decode's dispatch (no right bound without causal).
        o.causal = false
        o.windowRight = 3
        let plain = try dispatches(Case(), o)
        let psp = try plain[0].params(VecBuffer.seqParams, as: FlashAttnVecSeqParams.self)
        XCTAssertEqual([psp.q_rows, UInt32(bitPattern: psp.window_right)], [1, 3])

        // More than 8 query rows, or an LSE of the decode's shape, is refused naming q / the LSE.
        let long = HostTensor([2, 9, 4, 64], .f32), longOut = HostTensor([2, 9, 4, 64], .f32)
        let bad = VecSeqTensors(q: long.ref, k: k.ref, v: v.ref, out: longOut.ref, tmp: tmp.ref)
        XCTAssertThrowsError(try withExtendedLifetime([long, longOut]) { try VecSeqDispatcher.makeDispatches(bad, o) }) {
            XCTAssertTrue("\($0)".contains("query rows (dim 1) must be in 1...8, got 9"), "\($0)")
        }
        let flat = HostTensor([2, 4], .f32)
        let wrong = VecSeqTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref, tmp: tmp.ref, lse: flat.ref)
        XCTAssertThrowsError(try withExtendedLifetime([flat]) { try VecSeqDispatcher.makeDispatches(wrong, o) }) {
            XCTAssertTrue("\($0)".contains("lse must have shape [2, 4, 4]"), "\($0)")
        }
    }

    func testContiguousWithLengthsWindowSinksAndLSE() throws {
        var o = VecSeqOptions(scale: 0.5)
        o.windowLeft = 9; o.softcap = 20
        let (lens, sinks, lse) = (ints([3], [0, 17, 64]), HostTensor([8], .f32), HostTensor([3, 8], .f32))
        let ds = try dispatches(Case(), o, seqlens: lens, sinks: sinks, lse: lse)
        let (m, r) = (ds[0], ds[1])
        XCTAssertEqual(m.kernel, "flash_attn_vec_f16kv_dk128")
        XCTAssertEqual(m.grid, Size3(1, 6, 32))  // 4 query heads per kv head share a threadgroup
        XCTAssertEqual(m.threadgroup, Size3(128, 1, 1))
        XCTAssertEqual(Set(m.bindings.keys), [0, 1, 2, 3, 4, 5, 6])
        XCTAssertEqual(m.constants.bool(FunctionConstantIndex.vecSeq), true)
        XCTAssertEqual(m.constants.bool(FunctionConstantIndex.vecKVLens), true)
        XCTAssertEqual(m.constants.bool(FunctionConstantIndex.vecPaged), false)
        XCTAssertEqual(try m.buffer(VecBuffer.seqlensK).data, lens.data)
        let p = try m.params(VecBuffer.params, as: FlashAttnVecParams.self)
        // Per-sequence heads; flash-attn's window left 9 is the sliding window 10.
        XCTAssertEqual([p.n_heads, p.n_kv_heads, p.head_dim, p.kv_seq_len, p.kv_capacity, p.mask_type,
                        p.sliding_window, p.nwg], [8, 2, 128, 64, 64, 2, 10, 32])
        XCTAssertEqual(p.softcap, 20)
        let sp = try m.params(VecBuffer.seqParams, as: FlashAttnVecSeqParams.self)
        XCTAssertEqual([sp.K_strides.0, sp.K_strides.1, sp.K_strides.2], [64 * 2 * 128, 128, 2 * 128])
        XCTAssertEqual([sp.V_strides.0, sp.V_strides.1, sp.V_strides.2], [64 * 2 * 128, 128, 2 * 128])
        XCTAssertEqual([sp.page_size, sp.max_pages], [0, 0])
        XCTAssertEqual(m.writes, [VecBuffer.tmp])

        XCTAssertEqual(r.kernel, "flash_attn_vec_reduce_dk128")
        XCTAssertEqual(r.grid, Size3(24, 1, 1))
        XCTAssertEqual(Set(r.bindings.keys), [0, 1, 2, 3, 5, 6, 7])
        XCTAssertEqual(r.constants.bool(FunctionConstantIndex.vecHasSigns), false)
        XCTAssertEqual(r.constants.bool(FunctionConstantIndex.vecSinks), true)
        XCTAssertEqual(r.constants.bool(FunctionConstantIndex.vecLSE), true)
        XCTAssertEqual(try r.params(VecReduceBuffer.ext, as: FlashAttnVecReduceExtParams.self).n_heads, 8)
        XCTAssertEqual(try r.buffer(VecReduceBuffer.sinks).data, sinks.data)
        XCTAssertEqual(try r.buffer(VecReduceBuffer.lse).data, lse.data)
        XCTAssertEqual(r.writes, [VecReduceBuffer.out, VecReduceBuffer.lse])
    }

    func testPagedWithoutLengthsReadsEveryPage() throws {
        let c = Case(b: 2, pages: (num: 5, size: 32, max: 2))
        let table = ints([2, 2], [4, 0, 2, 3])
        var o = VecSeqOptions(scale: 1)
        o.causal = false
        let ds = try dispatches(c, o, table: table)
        let (m, r) = (ds[0], ds[1])
        XCTAssertEqual(Set(m.bindings.keys), [0, 1, 2, 3, 4, 5, 7])
        XCTAssertEqual(m.constants.bool(FunctionConstantIndex.vecKVLens), false)
        XCTAssertEqual(m.constants.bool(FunctionConstantIndex.vecPaged), true)
        let p = try m.params(VecBuffer.params, as: FlashAttnVecParams.self)
        XCTAssertEqual([p.kv_seq_len, p.kv_capacity, p.mask_type, p.sliding_window], [64, 64, 0, 0])
        let sp = try m.params(VecBuffer.seqParams, as: FlashAttnVecSeqParams.self)
        XCTAssertEqual([sp.K_strides.0, sp.K_strides.1, sp.K_strides.2], [32 * 2 * 128, 128, 2 * 128])
        XCTAssertEqual([sp.page_size, sp.max_pages], [32, 2])
        // Neither sinks nor lse: the reduce is the plain one.
        XCTAssertEqual(Set(r.bindings.keys), [0, 1, 2, 3])
        XCTAssertEqual(r.constants.bool(FunctionConstantIndex.vecSinks), false)
        XCTAssertEqual(r.constants.bool(FunctionConstantIndex.vecLSE), false)
        // Every entry is read without seqlens: one out of range is refused.
        expectFMError(VecSeqDispatcher.op, contains: "block_table[1, 1] = 5 is out of range [0, 5)") {
            _ = try dispatches(c, o, table: ints([2, 2], [4, 0, 2, 5]))
        }
    }

    func testTablesAreCheckedOnlyWhereRead() throws {
        let c = Case(b: 2, pages: (num: 4, size: 16, max: 3))
        // Sequence 0 holds 17 keys (pages 0 and 1 of its row); entries past them may be -1.
        XCTAssertNoThrow(try dispatches(c, seqlens: ints([2], [17, 0]), table: ints([2, 3], [3, 1, -1, -1, -1, -1])))
        expectFMError(VecSeqDispatcher.op, contains: "block_table[0, 1] = -1 is out of range [0, 4)") {
            _ = try dispatches(c, seqlens: ints([2], [17, 0]), table: ints([2, 3], [3, -1, -1, -1, -1, -1]))
        }
        expectFMError(VecSeqDispatcher.op, contains: "cache_seqlens[1] = 49 is out of range [0, 48]") {
            _ = try dispatches(c, seqlens: ints([2], [17, 49]), table: ints([2, 3], [0, 1, 2, 0, 1, 2]))
        }
        XCTAssertNoThrow(try dispatches(Case(b: 2, pages: (num: 4, size: 24, max: 3)), table: ints([2, 3], [0, 1, 2, 3, 0, 1])))
        expectFMError(VecSeqDispatcher.op, contains: "k page size 0 (its dim 1) must be positive") {
            _ = try dispatches(Case(b: 2, pages: (num: 4, size: 0, max: 3)), table: ints([2, 3], [0, 0, 0, 0, 0, 0]))
        }
    }

    func testFirstKeysFollowTheLengths() throws {
        // seqlens_k [2, B]: the lengths, then each sequence's first key (cache_leftpad).
        let table = ints([2, 3], [5, 17, 64, 0, 17, 40])
        let m = try dispatches(Case(), seqlens: table)[0]
        XCTAssertEqual(try m.buffer(VecBuffer.seqlensK).data, table.data)
        XCTAssertEqual(try m.params(VecBuffer.seqParams, as: FlashAttnVecSeqParams.self).key_starts_at, 3)
        let plain = try dispatches(Case(), seqlens: ints([3], [5, 17, 64]))[0]
        XCTAssertEqual(try plain.params(VecBuffer.seqParams, as: FlashAttnVecSeqParams.self).key_starts_at, 0)
        expectFMError(VecSeqDispatcher.op, contains: "cache_leftpad[2] = 65 is out of range [0, 64]") {
            _ = try dispatches(Case(), seqlens: ints([2, 3], [5, 17, 64, 0, 0, 65]))
        }
        expectFMError(VecSeqDispatcher.op, contains: "cache_seqlens must have shape [2, 3]") {
            _ = try dispatches(Case(), seqlens: ints([3, 3], Array(repeating: 0, count: 9)))
        }
    }

    func testValidation() {
        let op = VecSeqDispatcher.op
        expectFMError(op, contains: "cache_seqlens[0] = -1 is out of range [0, 64]") {
            _ = try dispatches(Case(), seqlens: ints([3], [-1, 0, 0]))
        }
        expectFMError(op, contains: "cache_seqlens must have shape") { _ = try dispatches(Case(), seqlens: ints([2], [1, 1])) }
        expectFMError(op, status: FM_ERROR_TYPE, contains: "cache_seqlens must be int32, got float32") {
            _ = try dispatches(Case(), seqlens: HostTensor([3], .f32))
        }
        expectFMError(op, contains: "k batch (3) must equal q batch (2)") {
            _ = try dispatches(Case(), q: HostTensor([2, 8, 128], .f32))
        }
        expectFMError(op, contains: "head_dim must be in 1...512 or 576, got 600") { _ = try dispatches(Case(d: 600)) }
        expectFMError(op, contains: "the q heads (8) must be a multiple of the k heads (3)") { _ = try dispatches(Case(hkv: 3)) }
        expectFMError(op, contains: "sinks must have shape [8]") { _ = try dispatches(Case(), sinks: HostTensor([4], .f32)) }
        expectFMError(op, status: FM_ERROR_TYPE, contains: "sinks must be float32") {
            _ = try dispatches(Case(), sinks: HostTensor([8], .f16))
        }
        expectFMError(op, contains: "lse must have shape [3, 8]") { _ = try dispatches(Case(), lse: HostTensor([8, 3], .f32)) }
        var o = VecSeqOptions(scale: 1)
        o.softcap = -1
        expectFMError(op, contains: "softcap must be 0 (off)") { _ = try dispatches(Case(), o) }
        o.softcap = 0; o.windowLeft = -2
        expectFMError(op, contains: "window_size[0] must be -1 (unbounded) or >= 0") { _ = try dispatches(Case(), o) }
    }

    func testOptionsFromC() throws {
        var c = FMAttnOptions()
        c.scale = 1; c.causal = 2
        expectFMError(VecSeqDispatcher.op, contains: "causal must be 0 or 1, got 2") { _ = try VecSeqOptions(c) }
        c.causal = 1; c.window_left = -2
        expectFMError(VecSeqDispatcher.op, contains: "window_size[0] must be -1 (unbounded) or >= 0, got -2") { _ = try VecSeqOptions(c) }
        c.window_left = 0; c.window_right = -1
        let o = try VecSeqOptions(c)
        XCTAssertEqual(o.windowLeft, 0)
        XCTAssertFalse(o.headMajor)
        c.head_major = 2
        expectFMError(VecSeqDispatcher.op, contains: "head_major must be 0 or 1, got 2") { _ = try VecSeqOptions(c) }
        c.head_major = 1
        XCTAssertTrue(try VecSeqOptions(c).headMajor)
        expectFMError("flash_attn_func", contains: "head_major must be 0 (flash-attn's [B, L, H, D] layouts), got 1") {
            _ = try AttnOptions(c, op: "flash_attn_func")
        }
    }

    /// Head-major: q/out [B, H, L, D] and caches [B, Hkv, cap, D] (pages
    /// [num_pages, Hkv, page_size, D]) give the kernel the head-major row
    /// order, those caches' strides, and the reduce the rows between heads.
    func testHeadMajorLayouts() throws {
        var o = VecSeqOptions(scale: 0.5)
        o.headMajor = true
        let (b, h, l, hkv, cap, d) = (2, 8, 3, 2, 40, 64)
        let q = HostTensor([b, h, l, d], .f32), out = HostTensor([b, h, l, d], .f32)
        let k = HostTensor([b, hkv, cap, d], .f16), v = HostTensor([b, hkv, cap, d], .f16)
        let tmp = HostTensor([1], .f32, bytes: VecDispatcher.tmpByteCount(rows: b * h * l, headDim: d))
        let sinks = HostTensor([h], .f32), lse = HostTensor([b, h, l], .f32)
        let t = VecSeqTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref, tmp: tmp.ref, sinks: sinks.ref, lse: lse.ref)
        let ds = try withExtendedLifetime([q, out, k, v, tmp, sinks, lse]) { try VecSeqDispatcher.makeDispatches(t, o) }
        let sp = try ds[0].params(VecBuffer.seqParams, as: FlashAttnVecSeqParams.self)
        XCTAssertEqual([sp.head_major, sp.q_rows], [1, UInt32(l)])
        let ks = [sp.K_strides.0, sp.K_strides.1, sp.K_strides.2]
        XCTAssertEqual(ks, [Int64(hkv * cap * d), Int64(cap * d), Int64(d)])
        let p = try ds[0].params(VecBuffer.params, as: FlashAttnVecParams.self)
        XCTAssertEqual([p.n_heads, p.n_kv_heads, p.kv_capacity], [UInt32(h), UInt32(hkv), UInt32(cap)])
        let ext = try ds[1].params(VecReduceBuffer.ext, as: FlashAttnVecReduceExtParams.self)
        XCTAssertEqual([ext.n_heads, ext.head_rows], [UInt32(h), UInt32(l)])

        // Pages [num_pages, Hkv, page_size, D]: the page stride, then the head's and the row's.
        let kp = HostTensor([5, hkv, 16, d], .f16), vp = HostTensor([5, hkv, 16, d], .f16)
        let table = ints([b, 2], [0, 1, 2, 3])
        let paged = VecSeqTensors(q: q.ref, k: kp.ref, v: vp.ref, out: out.ref, tmp: tmp.ref, blockTable: table.ref)
        let pd = try withExtendedLifetime([q, out, kp, vp, tmp, table]) { try VecSeqDispatcher.makeDispatches(paged, o) }
        let psp = try pd[0].params(VecBuffer.seqParams, as: FlashAttnVecSeqParams.self)
        XCTAssertEqual([psp.K_strides.0, psp.K_strides.1, psp.K_strides.2], [Int64(hkv * 16 * d), Int64(16 * d), Int64(d)])
        XCTAssertEqual([psp.page_size, psp.max_pages], [16, 2])

        // An LSE in flash-attn's [B, L, H] is refused naming the head-major shape.
        let seqMajorLSE = HostTensor([b, l, h], .f32)
        let wrong = VecSeqTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref, tmp: tmp.ref, lse: seqMajorLSE.ref)
        expectFMError(VecSeqDispatcher.op, contains: "lse must have shape [2, 8, 3] ([B, H, L])") {
            _ = try withExtendedLifetime([q, out, k, v, tmp, seqMajorLSE]) { try VecSeqDispatcher.makeDispatches(wrong, o) }
        }
    }
}
