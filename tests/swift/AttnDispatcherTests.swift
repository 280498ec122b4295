import CFlashMetal
import FlashMetalCore
import XCTest

/// The serving prefill's Dispatch per flashmetal_kernels.h: AttnParams with the
/// largest lengths, AttnSeqParams, the tables at 9-12, sinks 13, lse 14,
/// constants 302/304-310; and table validation naming the function.
final class AttnDispatcherTests: XCTestCase {
    /// An int32 tensor holding `values`.
    func ints(_ values: [Int32], shape: [Int]? = nil) -> HostTensor {
        let t = HostTensor(shape ?? [values.count], .i32)
        for (i, x) in values.enumerated() { t.data.storeBytes(of: x, toByteOffset: i * 4, as: Int32.self) }
        return t
    }

    func expectError(_ body: () throws -> Any, _ prefix: String, _ contains: String, line: UInt = #line) {
        do {
            _ = try body()
            XCTFail("no error; expected '\(contains)'", line: line)
        } catch let e as FlashMetalError {
            XCTAssertTrue(e.message.hasPrefix(prefix + ": "), e.message, line: line)
            XCTAssertTrue(e.message.contains(contains), "\(e.message) lacks '\(contains)'", line: line)
        } catch {
            XCTFail("unexpected \(error)", line: line)
        }
    }

    func testVarlenPagedSinksLse() throws {
        // 2 sequences: q lengths 3 and 20 (packed 23 rows), keys 17 and 40 through pages of 16.
        let (h, hkv, d) = (4, 2, 64)
        let q = HostTensor([23, h, d], .bf16), out = HostTensor([23, h, d], .bf16)
        let k = HostTensor([6, 16, hkv, d], .bf16), v = HostTensor([6, 16, hkv, d], .bf16)
        let cuQ = ints([0, 3, 23]), lens = ints([17, 40])
        let table = ints([5, 1, -1, 0, 2, 3], shape: [2, 3])
        let sinks = HostTensor([h], .f32), lse = HostTensor([h, 23], .f32)
        var t = AttnTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref)
        t.cuSeqlensQ = cuQ.ref; t.seqlensK = lens.ref; t.blockTable = table.ref
        t.sinks = sinks.ref; t.lse = lse.ref
        var o = AttnOptions(scale: 0.5)
        o.causal = true
        o.windowLeft = 7
        o.maxSeqlenQ = 20
        let ds = try AttnDispatcher.makeDispatches(t, o)
        XCTAssertEqual(ds.count, 1)
        let dp = ds[0]
        let p = try dp.params(PrefillBuffer.params, as: AttnParams.self)
        XCTAssertEqual([p.B, p.H, p.D, p.qL, p.kL, p.gqa_factor, p.NQ, p.NK], [2, 4, 64, 20, 40, 2, 1, 3])
        XCTAssertEqual([p.Q_strides.0, p.Q_strides.1, p.Q_strides.2], [0, 64, 4 * 64])
        XCTAssertEqual([p.K_strides.0, p.K_strides.1, p.K_strides.2], [0, 64, 2 * 64])
        XCTAssertEqual([p.O_strides.0, p.O_strides.1, p.O_strides.2], [0, 64, 4 * 64])
        let s = try dp.params(PrefillBuffer.seqParams, as: AttnSeqParams.self)
        XCTAssertEqual([s.window_left, s.window_right, s.page_size, s.max_pages], [7, -1, 16, 3])
        XCTAssertEqual([s.K_page_stride, s.V_page_stride], [16 * 2 * 64, 16 * 2 * 64])
        XCTAssertEqual([s.lse_strides.0, s.lse_strides.1, s.lse_strides.2], [0, 23, 1])
        XCTAssertEqual(dp.constants, FunctionConstants([
            (200, .bool(false)), (201, .bool(false)), (300, .bool(false)), (301, .bool(true)), (303, .bool(false)),
            (302, .bool(true)), (304, .bool(true)), (305, .bool(true)), (306, .bool(true)), (307, .bool(false)),
            (308, .bool(true)), (309, .bool(true)), (310, .bool(true)), (311, .bool(false)), (312, .int(16)),
        ]))
        XCTAssertEqual(Set(dp.bindings.keys), [0, 1, 2, 3, 4, 8, 9, 11, 12, 13, 14])
        XCTAssertEqual(dp.writes, [PrefillBuffer.out, PrefillBuffer.lse])
        XCTAssertEqual(dp.grid, Size3(1, 4, 2))
    }

    func testPlainCallIsBottomRightWithoutTables() throws {
        let q = HostTensor([2, 5, 4, 128], .f16), out = HostTensor([2, 5, 4, 128], .f16)
        let k = HostTensor([2, 33, 1, 128], .f16), v = HostTensor([2, 33, 1, 128], .f16)
        let lse = HostTensor([2, 4, 5], .f32)
        var t = AttnTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref)
        t.lse = lse.ref
        let dp = try AttnDispatcher.makeDispatches(t, AttnOptions(scale: 1))[0]
        let p = try dp.params(PrefillBuffer.params, as: AttnParams.self)
        XCTAssertEqual([p.qL, p.kL, p.qL_off, p.gqa_factor], [5, 33, 28, 4])
        XCTAssertEqual([p.Q_strides.0, p.Q_strides.1, p.Q_strides.2], [5 * 4 * 128, 128, 4 * 128])
        XCTAssertEqual([p.K_strides.0, p.K_strides.1, p.K_strides.2], [33 * 128, 128, 128])
        let s = try dp.params(PrefillBuffer.seqParams, as: AttnSeqParams.self)
        XCTAssertEqual([s.lse_strides.0, s.lse_strides.1, s.lse_strides.2], [20, 5, 1])
        XCTAssertEqual(dp.constants.bool(304), true)
        XCTAssertEqual(dp.constants.bool(305), false)
        XCTAssertEqual(dp.constants.bool(200), false)
    }

    func testVarlenKStrides() throws {
        let q = HostTensor([9, 2, 64], .bf16), out = HostTensor([9, 2, 64], .bf16)
        let k = HostTensor([30, 2, 64], .bf16), v = HostTensor([30, 2, 64], .bf16)
        var t = AttnTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref)
        let cuQ = ints([0, 4, 9]), cuK = ints([0, 10, 30])
        t.cuSeqlensQ = cuQ.ref; t.cuSeqlensK = cuK.ref
        var o = AttnOptions(scale: 1)
        o.maxSeqlenQ = 5; o.maxSeqlenK = 20
        let dp = try AttnDispatcher.makeDispatches(t, o)[0]
        let p = try dp.params(PrefillBuffer.params, as: AttnParams.self)
        XCTAssertEqual([p.qL, p.kL, p.NQ, p.NK], [5, 20, 1, 2])
        XCTAssertEqual([p.K_strides.0, p.K_strides.1, p.K_strides.2], [0, 64, 128])
        XCTAssertEqual(dp.constants.bool(307), true)
        o.maxSeqlenK = 19
        expectError({ try AttnDispatcher.makeDispatches(t, o) }, "flash_attn_varlen_func", "sequence 1 has length 20 (cu_seqlens_k[2] - cu_seqlens_k[1]) > max_seqlen_k = 19")
    }

    func testFirstKeysFollowTheLengths() throws {
        // seqlens_k [2, B]: the lengths, then each sequence's first key (cache_leftpad).
        let q = HostTensor([2, 5, 2, 64], .bf16), out = HostTensor([2, 5, 2, 64], .bf16)
        let k = HostTensor([2, 32, 2, 64], .bf16), v = HostTensor([2, 32, 2, 64], .bf16)
        var t = AttnTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref)
        let table = ints([20, 32, 3, 32], shape: [2, 2])
        t.seqlensK = table.ref
        let d = try AttnDispatcher.makeDispatches(t, AttnOptions(scale: 1))[0]
        XCTAssertEqual(try d.params(PrefillBuffer.seqParams, as: AttnSeqParams.self).key_starts_at, 2)
        XCTAssertEqual(try d.buffer(PrefillBuffer.seqlensK).data, table.data)
        let bad = ints([20, 32, 3, 33], shape: [2, 2])
        t.seqlensK = bad.ref
        expectError({ try AttnDispatcher.makeDispatches(t, AttnOptions(scale: 1)) },
                    "flash_attn_with_kvcache", "cache_leftpad[1] = 33 is out of range [0, 32]")
    }

    func testTableErrorsNameTheFunctionAndValue() {
        let q = HostTensor([2, 20, 2, 64], .bf16), out = HostTensor([2, 20, 2, 64], .bf16)
        let k = HostTensor([4, 16, 2, 64], .bf16), v = HostTensor([4, 16, 2, 64], .bf16)
        var t = AttnTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref)
        let lens = ints([20, 32]), table = ints([0, 1, 2, 4], shape: [2, 2])
        t.seqlensK = lens.ref; t.blockTable = table.ref
        expectError({ try AttnDispatcher.makeDispatches(t, AttnOptions(scale: 1)) },
                    "flash_attn_with_kvcache", "block_table[1, 1] = 4 is out of range [0, 4) (the pages of k_cache)")
        let long = ints([20, 33])
        t.seqlensK = long.ref
        expectError({ try AttnDispatcher.makeDispatches(t, AttnOptions(scale: 1)) },
                    "flash_attn_with_kvcache", "cache_seqlens[1] = 33 is out of range [0, 32] (block_table's 2 pages (its dim 1) of 16 keys (k_cache's dim 1))")
        let k8 = HostTensor([4, 8, 2, 64], .bf16), v8 = HostTensor([4, 8, 2, 64], .bf16)
        var t8 = AttnTensors(q: q.ref, k: k8.ref, v: v8.ref, out: out.ref)
        let table8 = ints([0, 1, 2, 3], shape: [2, 2])
        t8.blockTable = table8.ref
        XCTAssertEqual(try AttnDispatcher.makeDispatches(t8, AttnOptions(scale: 1)).count, 1)  // pages of 8 keys
        let k0 = HostTensor([4, 0, 2, 64], .bf16), v0 = HostTensor([4, 0, 2, 64], .bf16)
        var t0 = AttnTensors(q: q.ref, k: k0.ref, v: v0.ref, out: out.ref)
        let none = ints([0, 0])  // with cache lengths too: their bound is named before the page size is checked
        t0.blockTable = table.ref; t0.seqlensK = none.ref
        expectError({ try AttnDispatcher.makeDispatches(t0, AttnOptions(scale: 1)) },
                    "flash_attn_with_kvcache", "k_cache page size 0 (its dim 1) must be positive")
        var w = AttnOptions(scale: 1)
        w.windowLeft = -2
        let plain = AttnTensors(q: q.ref, k: HostTensor([2, 16, 2, 64], .bf16).ref, v: HostTensor([2, 16, 2, 64], .bf16).ref, out: out.ref)
        expectError({ try AttnDispatcher.makeDispatches(plain, w) }, "flash_attn_func", "window_size[0] must be -1 (unbounded) or >= 0, got -2")
        let qv = HostTensor([9, 2, 64], .bf16), ov = HostTensor([9, 2, 64], .bf16)
        var tv = AttnTensors(q: qv.ref, k: qv.ref, v: qv.ref, out: ov.ref)
        var big = AttnOptions(scale: 1)
        big.maxSeqlenQ = 100; big.maxSeqlenK = 100
        let badCu = ints([0, 5, 3])
        tv.cuSeqlensQ = badCu.ref; tv.cuSeqlensK = badCu.ref
        expectError({ try AttnDispatcher.makeDispatches(tv, big) },
                    "flash_attn_varlen_func", "cu_seqlens_q must be non-decreasing: cu_seqlens_q[2] = 3 < cu_seqlens_q[1] = 5")
        let overCu = ints([0, 5, 10])
        tv.cuSeqlensQ = overCu.ref; tv.cuSeqlensK = overCu.ref
        expectError({ try AttnDispatcher.makeDispatches(tv, big) },
                    "flash_attn_varlen_func", "cu_seqlens_q[2] = 10 exceeds the 9 tokens of q")
    }

    /// The int32 entries of the table a dispatch binds at `index`.
    func entries(_ d: Dispatch, _ index: Int) throws -> [Int32] {
        let t = try d.buffer(index)
        return (0..<t.shape.reduce(1, *)).map { t.data.loadUnaligned(fromByteOffset: $0 * 4, as: Int32.self) }
    }

    func testSequsedQSplitsEverySequence() throws {
        // Rows 3 and 5 of which 2 and 5 attend, to 4 of 5 and 3 of 4 keys: sequences (2 rows, 4 keys),
        // (1 row, 0 keys), (5 rows, 3 keys), (0 rows, 0 keys).
        let (h, d) = (2, 64)
        let q = HostTensor([8, h, d], .f16), out = HostTensor([8, h, d], .f16)
        let k = HostTensor([9, h, d], .f16), v = HostTensor([9, h, d], .f16)
        let cuQ = ints([0, 3, 8]), cuK = ints([0, 5, 9]), usedQ = ints([2, 5]), usedK = ints([4, 3])
        let slopes = HostTensor([2, h], .f32)
        for i in 0..<4 { slopes.data.storeBytes(of: Float(i + 1), toByteOffset: i * 4, as: Float.self) }
        var t = AttnTensors(q: q.ref, k: k.ref, v: v.ref, out: out.ref)
        t.cuSeqlensQ = cuQ.ref; t.cuSeqlensK = cuK.ref; t.seqlensK = usedK.ref; t.sequsedQ = usedQ.ref
        t.alibiSlopes = slopes.ref
        var o = AttnOptions(scale: 1)
        o.maxSeqlenQ = 5; o.maxSeqlenK = 5
        let plan = try AttnDispatcher.makePlan(t, o)
        XCTAssertEqual(plan.tableBytes, 4 * (5 + 5 + 4 + 4 * h))
        let memory = HostTensor([plan.tableBytes], .u8)
        let dp = plan.dispatches(tables: memory.data)[0]
        let p = try dp.params(PrefillBuffer.params, as: AttnParams.self)
        XCTAssertEqual([p.B, p.qL, p.kL], [4, 5, 4])
        XCTAssertEqual(try entries(dp, PrefillBuffer.cuSeqlensQ), [0, 2, 3, 8, 8])
        XCTAssertEqual(try entries(dp, PrefillBuffer.cuSeqlensK), [0, 5, 5, 9, 9])
        XCTAssertEqual(try entries(dp, PrefillBuffer.seqlensK), [4, 0, 3, 0])
        let a = try dp.buffer(PrefillBuffer.alibi)
        XCTAssertEqual(a.shape, [4, h])
        XCTAssertEqual((0..<8).map { a.data.loadUnaligned(fromByteOffset: $0 * 4, as: Float.self) }, [1, 2, 1, 2, 3, 4, 3, 4])
        XCTAssertEqual(try dp.buffer(PrefillBuffer.q).data, q.data)
        expectError({ try AttnDispatcher.makeDispatches(t, o) }, "internal error", "seqused_q needs library tables")

        // The kernel reads the split's copies; the caller's seqused_q still meets the overlap check.
        var aliased = t
        out.data.storeBytes(of: Int64(0), as: Int64.self)  // seqused_q [0, 0] over out's first bytes
        aliased.out = TensorRef(data: out.data, byteCount: out.ref.byteCount, dtype: .f16, shape: [8, h, d], name: "out")
        aliased.sequsedQ = TensorRef(data: out.data, byteCount: 8, dtype: .i32, shape: [2], name: "seqused_q")
        expectError({ try AttnDispatcher.makePlan(aliased, o) }, "flash_attn_varlen_func",
                    "out and seqused_q overlap in memory")

        let long = ints([2, 6])
        t.sequsedQ = long.ref
        expectError({ try AttnDispatcher.makePlan(t, o) }, "flash_attn_varlen_func",
                    "seqused_q[1] = 6 is out of range [0, 5] (cu_seqlens_q)")
        t.sequsedQ = usedQ.ref
        t.cuSeqlensK = nil
        let kb = HostTensor([2, 5, h, d], .f16), vb = HostTensor([2, 5, h, d], .f16)
        (t.k, t.v) = (kb.ref, vb.ref)
        expectError({ try AttnDispatcher.makePlan(t, o) }, "flash_attn_varlen_func",
                    "seqused_q needs cu_seqlens_k (packed keys)")
    }
}
