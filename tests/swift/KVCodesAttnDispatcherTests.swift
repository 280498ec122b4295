import CFlashMetal
import FlashMetalCore
import XCTest

/// kv_codes_decode over flash_attn_with_kvcache's caches and kv_codes_append:
/// what the dispatches bind, the constants they set, and what they refuse.
final class KVCodesAttnDispatcherTests: XCTestCase {
    let codec = try! KVCodec(headDim: 64, bits: 4, seed: 9)

    func int32s(_ values: [Int32], shape: [Int]) -> HostTensor {
        let t = HostTensor(shape, .i32)
        for (i, x) in values.enumerated() { t.data.storeBytes(of: x, toByteOffset: 4 * i, as: Int32.self) }
        return t
    }

    func options(causal: Int32 = 1) -> FMAttnOptions {
        FMAttnOptions(scale: 0.125, softcap: 0, causal: causal, window_left: 3, window_right: -1, max_seqlen_q: 0,
                      max_seqlen_k: 0, attention_chunk: 0, head_major: 0)
    }

    func testPagedAttentionWithADenseV() throws {
        // 5 pages of 4 keys, Hkv 2; K 4-bit codes, V a dense bf16 cache.
        let q = HostTensor([2, 3, 4, 64], .f32), out = HostTensor([2, 3, 4, 64], .f32)
        let kc = HostTensor([5, 4, 2, 32], .u8), kn = HostTensor([5, 4, 2, 1], .f32)
        let vd = HostTensor([5, 4, 2, 64], .bf16)
        let lens = int32s([6, 3], shape: [2]), table = int32s([4, 1, 0, 2], shape: [2, 2])
        let lse = HostTensor([2, 4, 3], .f32)
        func make(table bt: HostTensor? = nil, lens l: HostTensor? = nil, v: KVSide? = nil) throws -> Dispatch {
            try withExtendedLifetime([q, out, kc, kn, vd, lens, table, lse]) {
                var t = KVCodesAttnTensors(q: q.ref, k: .codes(QuantizedCache(codec: codec, codes: kc.ref, norms: kn.ref)),
                                           v: v ?? .dense(vd.ref), out: out.ref)
                (t.seqlens, t.blockTable, t.lse) = ((l ?? lens).ref, (bt ?? table).ref, lse.ref)
                return try KVCodesAttnDispatcher.makePlan(t, options()).dispatches(tmp: nil)[0]
            }
        }
        // 3 query rows per sequence: the tiled prefill, threadgroups of
        // FM_KVQ_PREFILL_ROWS (row, head) items of one kv head of one sequence.
        let d = try make()
        XCTAssertEqual(d.kernel, "kv_codes_prefill_bf16kv")
        XCTAssertEqual(d.grid, Size3(1, 2, 2))
        XCTAssertEqual(d.threadgroup, Size3(Int(FM_KVQ_PREFILL_ROWS) * Int(FM_KVQ_DECODE_THREADS), 1, 1))
        XCTAssertEqual(d.writes, [KVCodesDecodeBuffer.out, KVCodesDecodeBuffer.lse])
        XCTAssertNil(d.bindings[KVCodesDecodeBuffer.vCodes])
        XCTAssertNotNil(d.bindings[KVCodesDecodeBuffer.vDense])
        for (index, value) in [(FunctionConstantIndex.kvqLens, true), (FunctionConstantIndex.kvqPaged, true),
                               (FunctionConstantIndex.kvqSinks, false), (FunctionConstantIndex.kvqLSE, true),
                               (FunctionConstantIndex.kvqKDense, false), (FunctionConstantIndex.kvqVDense, true)] {
            XCTAssertEqual(d.constants.bool(index), value, "constant \(index)")
        }
        let p = try d.params(KVCodesDecodeBuffer.params, as: KVCodesDecodeParams.self)
        XCTAssertEqual([p.kv_strides.0, p.kv_strides.1, p.kv_strides.2], [8, 1, 2])
        XCTAssertEqual([p.q_len, p.causal, p.window_left, p.window_right, p.page_size, p.max_pages], [3, 1, 3, -1, 4, 2])

        expectFMError(KVCodesAttnDispatcher.op, contains: "block_table[0, 0] = 7 is out of range [0, 5)") {
            _ = try make(table: self.int32s([7, 1, 0, 2], shape: [2, 2]))
        }
        expectFMError(KVCodesAttnDispatcher.op, contains: "cache_seqlens[1] = 9 is out of range [0, 8]") {
            _ = try make(lens: self.int32s([6, 9], shape: [2]))
        }
        let wrong = HostTensor([5, 4, 2, 32], .bf16)
        expectFMError(KVCodesAttnDispatcher.op, contains: "v_cache shape [5, 4, 2, 32] must be [5, 4, 2, 64]") {
            _ = try withExtendedLifetime(wrong) { try make(v: .dense(wrong.ref)) }
        }
    }

    func testOneQueryRowTakesTheDecodeAndManyRowsThePrefill() throws {
        // GQA 8:2, 4-bit K and V codes, no cache_seqlens: one query row per
        // sequence is kv_codes_decode (a SIMD group per kv head's 4 heads, 16
        // keys: one split); 5 rows are kv_codes_prefill, ceil(5 * 4 / 8) = 3
        // threadgroups per kv head.
        let kc = HostTensor([2, 16, 2, 32], .u8), kn = HostTensor([2, 16, 2, 1], .f32)
        let vc = HostTensor([2, 16, 2, 32], .u8), vn = HostTensor([2, 16, 2, 1], .f32)
        for (rows, kernel, grid) in [(1, "kv_codes_decode_f32", Size3(4, 1, 1)),
                                     (5, "kv_codes_prefill_f32", Size3(3, 2, 2))] {
            let q = HostTensor([2, rows, 8, 64], .f32), out = HostTensor([2, rows, 8, 64], .f32)
            let d = try withExtendedLifetime([q, out, kc, kn, vc, vn]) {
                try KVCodesAttnDispatcher.makePlan(
                    KVCodesAttnTensors(q: q.ref, k: .codes(QuantizedCache(codec: codec, codes: kc.ref, norms: kn.ref)),
                                       v: .codes(QuantizedCache(codec: codec, codes: vc.ref, norms: vn.ref)),
                                       out: out.ref), options(causal: 0)).dispatches(tmp: nil)[0]
            }
            XCTAssertEqual(d.kernel, kernel)
            XCTAssertEqual(d.grid, grid)
            let p = try d.params(KVCodesDecodeBuffer.params, as: KVCodesDecodeParams.self)
            XCTAssertEqual([p.q_len, p.kv_len, p.n_heads, p.n_kv_heads], [Int32(rows), 16, 8, 2])
        }
    }

    func testAppendEncodesOneSideAndCopiesTheOther() throws {
        let kNew = HostTensor([2, 3, 2, 64], .f16), vNew = HostTensor([2, 3, 2, 64], .f16)
        let kd = HostTensor([2, 8, 2, 64], .f16)
        let vc = HostTensor([2, 8, 2, 32], .u8), vn = HostTensor([2, 8, 2, 1], .f32)
        let lens = int32s([0, 5], shape: [2])
        func make(k: KVSide? = nil, lens l: HostTensor? = nil) throws -> Dispatch? {
            try withExtendedLifetime([kNew, vNew, kd, vc, vn, lens]) {
                try KVCodesAppendDispatcher.makeDispatch(
                    kNew: kNew.ref, vNew: vNew.ref, k: k ?? .dense(kd.ref),
                    v: .codes(QuantizedCache(codec: codec, codes: vc.ref, norms: vn.ref)), seqlens: (l ?? lens).ref,
                    blockTable: nil)
            }
        }
        let d = try XCTUnwrap(try make())
        XCTAssertEqual(d.kernel, "kv_codes_append_f16")
        XCTAssertEqual(d.grid, Size3(3, 2, 2))
        XCTAssertEqual(d.writes, [KVCodesAppendBuffer.kDense, KVCodesAppendBuffer.vCodes, KVCodesAppendBuffer.vNorms])
        XCTAssertEqual(d.constants.bool(FunctionConstantIndex.kvqAppendKDense), true)
        XCTAssertEqual(d.constants.bool(FunctionConstantIndex.kvqAppendVDense), false)
        XCTAssertEqual(d.constants.bool(FunctionConstantIndex.kvqAppendPaged), false)
        let p = try d.params(KVCodesAppendBuffer.params, as: KVCodesAppendParams.self)
        XCTAssertEqual([p.cache_strides.0, p.cache_strides.1, p.cache_strides.2], [16, 2, 1])
        XCTAssertEqual(MemoryLayout<KVCodesAppendParams>.size, 128)

        expectFMError(KVCodesAppendDispatcher.op, contains: "cache_seqlens[1] + the new rows of k_new (its dim 1) = 6 + 3 = 9 exceeds") {
            _ = try make(lens: self.int32s([0, 6], shape: [2]))
        }
        let f32 = HostTensor([2, 8, 2, 64], .f32)
        expectFMError(KVCodesAppendDispatcher.op, status: FM_ERROR_TYPE, contains: "k_cache dtype float32 does not match k_new dtype float16") {
            _ = try withExtendedLifetime(f32) { try make(k: .dense(f32.ref)) }
        }
        let vd = HostTensor([2, 8, 2, 64], .f16)
        expectFMError(KVCodesAppendDispatcher.op, contains: "k_cache or v_cache must be quantized") {
            _ = try withExtendedLifetime([vd]) {
                try KVCodesAppendDispatcher.makeDispatch(kNew: kNew.ref, vNew: vNew.ref, k: .dense(kd.ref), v: .dense(vd.ref),
                                                         seqlens: lens.ref, blockTable: nil)
            }
        }
    }

    func testLeftPadReadsEachSequenceThroughOneKeyPages() throws {
        // 5 pages of 4 keys, Hkv 2; sequence 0 is keys [2, 7) through pages 4, 1; sequence 1 keys [0, 3) of page 0.
        let q = HostTensor([2, 1, 4, 64], .f32), out = HostTensor([2, 1, 4, 64], .f32)
        let kc = HostTensor([5, 4, 2, 32], .u8), kn = HostTensor([5, 4, 2, 1], .f32)
        let vd = HostTensor([5, 4, 2, 64], .f32)
        let table = int32s([4, 1, 0, 2], shape: [2, 2])
        let memory = UnsafeMutableRawPointer.allocate(byteCount: 64, alignment: 16)
        defer { memory.deallocate() }
        try withExtendedLifetime([q, out, kc, kn, vd, table]) {
            let t = KVCodesAttnTensors(q: q.ref, k: .codes(QuantizedCache(codec: codec, codes: kc.ref, norms: kn.ref)),
                                       v: .dense(vd.ref), out: out.ref)
            func pad(_ ends: [Int32], _ starts: [Int32], table bt: HostTensor? = nil) throws -> KVCodesLeftPad? {
                let lens = int32s(ends + starts, shape: [2, 2])
                return try withExtendedLifetime(lens) {
                    try KVCodesLeftPad(seqlens: lens.ref, lead: [5, 4, 2], blockTable: (bt ?? table).ref, batch: 2,
                                       op: KVCodesAttnDispatcher.op)
                }
            }
            let p = try XCTUnwrap(try pad([7, 3], [2, 0]))
            XCTAssertEqual(p.width, 5)
            XCTAssertEqual(p.byteCount, 2 * 6 * 4)
            let v = p.view(of: t, memory: memory)
            let rows = (0..<10).map { v.blockTable!.data.load(fromByteOffset: 4 * $0, as: Int32.self) }
            // Physical row = page * 4 + key % 4: keys 2, 3 of page 4, then 4, 5, 6 of page 1; keys 0-2 of page 0.
            XCTAssertEqual(rows, [18, 19, 4, 5, 6, 0, 1, 2, 0, 0])
            XCTAssertEqual((0..<2).map { v.seqlens!.data.load(fromByteOffset: 4 * $0, as: Int32.self) }, [5, 3])
            XCTAssertEqual(v.k.quantized?.codes.shape, [20, 1, 2, 32])
            XCTAssertEqual(v.k.quantized?.norms.shape, [20, 1, 2, 1])
            if case let .dense(x) = v.v { XCTAssertEqual(x.shape, [20, 1, 2, 64]) } else { XCTFail("v stays dense") }
            _ = try KVCodesAttnDispatcher.makePlan(v, options())
            // A [B] table is read as it is.
            let lens = int32s([7, 3], shape: [2])
            try withExtendedLifetime(lens) {
                XCTAssertNil(try KVCodesLeftPad(seqlens: lens.ref, lead: [5, 4, 2], blockTable: table.ref, batch: 2, op: "x"))
            }
            expectFMError(KVCodesAttnDispatcher.op, contains: "cache_leftpad[1] = 9 is out of range [0, 8]") {
                _ = try pad([7, 3], [2, 9])
            }
            expectFMError(KVCodesAttnDispatcher.op, contains: "block_table[0, 1] = 5 is out of range [0, 5)") {
                _ = try pad([7, 3], [2, 0], table: self.int32s([4, 5, 0, 2], shape: [2, 2]))
            }
        }
    }
}
