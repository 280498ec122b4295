import CFlashMetal
import FlashMetalCore
import XCTest

final class KVCodecDispatcherTests: XCTestCase {
    func testLayouts() throws {
        let cases: [(d: Int, bits: Int, block: Int, blocks: Int, rowBytes: Int)] = [
            (64, 2, 64, 1, 16), (80, 3, 16, 5, 32), (80, 4, 16, 5, 48), (96, 5, 32, 3, 64),
            (128, 4, 128, 1, 64), (192, 6, 64, 3, 144), (256, 8, 256, 1, 256), (512, 3, 512, 1, 192),
        ]
        for c in cases {
            let codec = try KVCodec(headDim: c.d, bits: c.bits, seed: 9)
            XCTAssertEqual([codec.block, codec.numBlocks, codec.rowBytes], [c.block, c.blocks, c.rowBytes], "\(c)")
            let p = codec.params
            XCTAssertEqual([p.head_dim, p.bits, p.block, p.row_bytes], [Int32(c.d), Int32(c.bits), Int32(c.block),
                                                                         Int32(c.rowBytes)])
            XCTAssertEqual(p.seed, 9)
        }
        XCTAssertEqual(MemoryLayout<KVCodecParams>.size, 32)
        XCTAssertEqual(KVCodec.headDims, [64, 80, 96, 128, 192, 256, 512])
    }

    func testBadCodec() {
        expectFMError(KVCodec.op, contains: "head_dim must be 64, 80, 96, 128, 192, 256 or 512, got 100") {
            _ = try KVCodec(headDim: 100, bits: 4, seed: 0)
        }
        expectFMError(KVCodec.op, contains: "bits must be 2, 3, 4, 5, 6 or 8, got 7") {
            _ = try KVCodec(headDim: 128, bits: 7, seed: 0)
        }
    }

    func testEncodeDispatch() throws {
        let codec = try KVCodec(headDim: 80, bits: 3, seed: 1)
        let x = HostTensor([2, 3, 80], .bf16), codes = HostTensor([2, 3, 32], .u8), norms = HostTensor([2, 3, 5], .f32)
        let d = try withExtendedLifetime([x, codes, norms]) {
            try XCTUnwrap(try KVCodecDispatcher.encode(codec, x: x.ref, codes: codes.ref, norms: norms.ref))
        }
        XCTAssertEqual(d.kernel, "kv_encode_bf16")
        XCTAssertEqual(d.grid, Size3(6, 1, 1))
        XCTAssertEqual(d.threadgroup, Size3(KVCodecCapability.threads, 1, 1))
        XCTAssertEqual(d.writes, [KVEncodeBuffer.codes, KVEncodeBuffer.norms])
        let bad = HostTensor([2, 3, 4], .f32)
        expectFMError(KVCodecDispatcher.encodeOp, contains: "norms shape [2, 3, 4] must be [2, 3, 5]") {
            _ = try withExtendedLifetime([x, codes, bad]) {
                try KVCodecDispatcher.encode(codec, x: x.ref, codes: codes.ref, norms: bad.ref)
            }
        }
    }

    func testDequantizeDispatch() throws {
        let codec = try KVCodec(headDim: 128, bits: 4, seed: 1)
        let codes = HostTensor([4, 64], .u8), norms = HostTensor([4, 1], .f32), out = HostTensor([4, 128], .f32)
        let d = try withExtendedLifetime([codes, norms, out]) {
            try XCTUnwrap(try KVCodecDispatcher.dequantize(codec, codes: codes.ref, norms: norms.ref, out: out.ref))
        }
        XCTAssertEqual(d.kernel, "kv_dequantize_f32")
        XCTAssertEqual(d.writes, [KVDequantizeBuffer.out])
        let empty = HostTensor([0, 64], .u8), en = HostTensor([0, 1], .f32), eo = HostTensor([0, 128], .f32)
        XCTAssertNil(try withExtendedLifetime([empty, en, eo]) {
            try KVCodecDispatcher.dequantize(codec, codes: empty.ref, norms: en.ref, out: eo.ref)
        })
    }

    func testCodesDecodeDispatch() throws {
        let (kc, vc) = (try KVCodec(headDim: 96, bits: 8, seed: 1), try KVCodec(headDim: 96, bits: 4, seed: 2))
        let q = HostTensor([2, 6, 96], .f32), out = HostTensor([2, 6, 96], .f32)
        let k = (HostTensor([2, 3, 10, 96], .u8), HostTensor([2, 3, 10, 3], .f32))
        let v = (HostTensor([2, 3, 10, 48], .u8), HostTensor([2, 3, 10, 3], .f32))
        func make(kvLen: Int32 = 7, window: Int32 = 0) throws -> Dispatch {
            try withExtendedLifetime([q, out, k.0, k.1, v.0, v.1]) {
                let plan = try KVCodesDecodeDispatcher.makePlan(
                    q: q.ref, k: QuantizedCache(codec: kc, codes: k.0.ref, norms: k.1.ref),
                    v: QuantizedCache(codec: vc, codes: v.0.ref, norms: v.1.ref), out: out.ref,
                    options: FMKVCodesDecodeOptions(scale: 0.1, softcap: 0, kv_len: kvLen, window: window))
                XCTAssertEqual(plan.tmpBytes, 0, "7 keys: one split, no partials")
                return plan.dispatches(tmp: nil)[0]
            }
        }
        let d = try make()
        XCTAssertEqual(d.kernel, "kv_codes_decode_f32")
        // GQA 2 at D 96 (3 coordinates per lane): one SIMD group serves both
        // heads of a kv head, 12 rows in 6 threadgroups, one key split.
        XCTAssertEqual(d.grid, Size3(6, 1, 1))
        XCTAssertEqual(d.writes, [KVCodesDecodeBuffer.out])
        let p = try d.params(KVCodesDecodeBuffer.params, as: KVCodesDecodeParams.self)
        XCTAssertEqual([p.kv_strides.0, p.kv_strides.1, p.kv_strides.2], [30, 10, 1])
        XCTAssertEqual([p.n_heads, p.n_kv_heads, p.block, p.k_bits, p.v_bits, p.k_row_bytes, p.v_row_bytes],
                       [6, 3, 32, 8, 4, 96, 48])
        XCTAssertEqual([p.k_seed, p.v_seed], [1, 2])
        XCTAssertEqual(MemoryLayout<KVCodesDecodeParams>.size, 128)
        XCTAssertEqual([p.nwg, p.heads_per_group], [1, 2])
        XCTAssertEqual([p.q_len, p.causal, p.window_left, p.window_right, p.kv_len], [1, 0, -1, -1, 7])
        let w = try make(window: 7).params(KVCodesDecodeBuffer.params, as: KVCodesDecodeParams.self)
        XCTAssertEqual(w.window_left, 6, "the last 7 keys: window_size left 6")
        expectFMError(KVCodesDecodeDispatcher.op, contains: "kv_len (11) must be <= the cache capacity (10)") {
            _ = try make(kvLen: 11)
        }
        // Registry.run owns the overlap check: the dispatch over shared bytes is built, then refused there.
        func named(_ t: HostTensor, _ n: String) -> TensorRef {
            TensorRef(data: t.data, byteCount: t.ref.byteCount, dtype: t.ref.dtype, shape: t.ref.shape, name: n)
        }
        let shared = try withExtendedLifetime([q, k.0, k.1, v.0, v.1]) {
            try KVCodesDecodeDispatcher.makePlan(
                q: named(q, "q"), k: QuantizedCache(codec: kc, codes: k.0.ref, norms: k.1.ref),
                v: QuantizedCache(codec: vc, codes: v.0.ref, norms: v.1.ref), out: named(q, "out"),
                options: FMKVCodesDecodeOptions(scale: 0.1, softcap: 0, kv_len: 7, window: 0)).dispatches(tmp: nil)
        }
        expectFMError(KVCodesDecodeDispatcher.op, contains: "out and q overlap") {
            try Dispatch.requireDisjointOutputs(shared, op: KVCodesDecodeDispatcher.op)
        }
    }

    func testSplitDecodePlansADecodeAndAReduce() throws {
        // MHA, 8 heads, D 128, 3000 keys: 8 threadgroups per split, so
        // min(ceil(960 / 8), 3000 / 128) = 23 splits, each row's partials
        // (D + 2 floats per split) in tmp; the cpu keeps one dispatch.
        let codec = try KVCodec(headDim: 128, bits: 4, seed: 1)
        let q = HostTensor([8, 128], .f32), out = HostTensor([8, 128], .f32)
        let c = (HostTensor([8, 3000, 64], .u8), HostTensor([8, 3000, 1], .f32))
        let tmp = HostTensor([8 * 23 * 130], .f32)
        try withExtendedLifetime([q, out, c.0, c.1, tmp]) {
            func plan(split: Bool) throws -> KVCodesPlan {
                let cache = QuantizedCache(codec: codec, codes: c.0.ref, norms: c.1.ref)
                return try KVCodesDecodeDispatcher.makePlan(
                    q: q.ref, k: cache, v: cache, out: out.ref,
                    options: FMKVCodesDecodeOptions(scale: 0.1, softcap: 0, kv_len: 3000, window: 0), splitKeys: split)
            }
            let p = try plan(split: true)
            XCTAssertEqual(p.tmpBytes, 8 * 23 * 130 * 4)
            let ds = p.dispatches(tmp: tmp.ref)
            XCTAssertEqual(ds.map(\.kernel), ["kv_codes_decode_f32", "kv_codes_reduce_f32"])
            XCTAssertEqual(ds[0].grid, Size3(8, 23, 1))
            XCTAssertEqual(ds[0].writes, [KVCodesDecodeBuffer.tmp])
            XCTAssertNil(ds[0].bindings[KVCodesDecodeBuffer.out])
            XCTAssertEqual(ds[0].constants.bool(FunctionConstantIndex.kvqSplit), true)
            XCTAssertEqual(ds[1].grid, Size3(8, 1, 1))
            XCTAssertEqual(ds[1].writes, [KVCodesReduceBuffer.out])
            XCTAssertEqual(try ds[1].params(KVCodesReduceBuffer.params, as: KVCodesDecodeParams.self).nwg, 23)
            let cpu = try plan(split: false)
            XCTAssertEqual(cpu.tmpBytes, 0)
            XCTAssertEqual(cpu.dispatches(tmp: nil).map(\.grid), [Size3(8, 1, 1)])
        }
        XCTAssertEqual(KVCodesDecodeDispatcher.headsPerGroup(gqa: 8, headDim: 128), 4)
        XCTAssertEqual(KVCodesDecodeDispatcher.headsPerGroup(gqa: 8, headDim: 64), 8)
        XCTAssertEqual(KVCodesDecodeDispatcher.headsPerGroup(gqa: 6, headDim: 512), 1)
        XCTAssertEqual(KVCodesDecodeDispatcher.splits(keys: 255, threadgroups: 1), 1)
        XCTAssertEqual(KVCodesDecodeDispatcher.splits(keys: 1 << 20, threadgroups: 1), Int(FM_KVQ_MAX_SPLITS))
    }
}
