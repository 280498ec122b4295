import CFlashMetal
import FlashMetalCore
import XCTest

final class KVAppendDispatcherTests: XCTestCase {
    func ints(_ shape: [Int], _ values: [Int32]) -> HostTensor {
        let t = HostTensor(shape, .i32)
        for (i, x) in values.enumerated() { t.data.storeBytes(of: x, toByteOffset: 4 * i, as: Int32.self) }
        return t
    }

    func dispatch(new: [Int] = [2, 3, 4, 80], cache: [Int] = [2, 16, 4, 80], dtype: DType = .bf16,
                  seqlens: HostTensor, table: HostTensor? = nil) throws -> Dispatch? {
        let (kn, vn) = (HostTensor(new, dtype), HostTensor(new, dtype))
        let (kc, vc) = (HostTensor(cache, dtype), HostTensor(cache, dtype))
        let t = KVAppendTensors(kNew: kn.ref, vNew: vn.ref, kCache: kc.ref, vCache: vc.ref, seqlens: seqlens.ref,
                                blockTable: table?.ref)
        return try withExtendedLifetime([kn, vn, kc, vc]) { try KVAppendDispatcher.makeDispatch(t) }
    }

    func testContiguous() throws {
        let d = try XCTUnwrap(try dispatch(seqlens: ints([2], [0, 13])))
        XCTAssertEqual(d.kernel, "kv_append_bf16")
        XCTAssertEqual(d.grid, Size3(3, 4, 2))
        XCTAssertEqual(d.threadgroup, Size3(KVAppendCapability.threads, 1, 1))
        XCTAssertEqual(d.constants.bool(FunctionConstantIndex.appendPaged), false)
        XCTAssertEqual(Set(d.bindings.keys), [0, 1, 2, 3, 4, 5])
        XCTAssertEqual(d.writes, [KVAppendBuffer.kCache, KVAppendBuffer.vCache])
        let p = try d.params(KVAppendBuffer.params, as: KVAppendParams.self)
        XCTAssertEqual([p.n_new, p.n_kv_heads, p.head_dim, p.page_size, p.max_pages], [3, 4, 80, 0, 0])
        XCTAssertEqual([p.new_strides.0, p.new_strides.1, p.new_strides.2], [3 * 4 * 80, 4 * 80, 80])
        XCTAssertEqual([p.cache_strides.0, p.cache_strides.1, p.cache_strides.2], [16 * 4 * 80, 4 * 80, 80])
    }

    func testPaged() throws {
        let d = try XCTUnwrap(try dispatch(cache: [6, 8, 4, 80], seqlens: ints([2], [5, 0]),
                                           table: ints([2, 2], [5, 2, 1, -1])))
        XCTAssertEqual(d.constants.bool(FunctionConstantIndex.appendPaged), true)
        XCTAssertEqual(Set(d.bindings.keys), [0, 1, 2, 3, 4, 5, 6])
        let p = try d.params(KVAppendBuffer.params, as: KVAppendParams.self)
        XCTAssertEqual([p.page_size, p.max_pages], [8, 2])
        XCTAssertEqual([p.cache_strides.0, p.cache_strides.1, p.cache_strides.2], [8 * 4 * 80, 4 * 80, 80])
        // Rows 6..8 of sequence 0 fall in pages 0 and 1 of its row: entry [0, 1] is used.
        expectFMError(KVAppendDispatcher.op, contains: "block_table[0, 1] = 6 is out of range [0, 6)") {
            _ = try dispatch(cache: [6, 8, 4, 80], seqlens: ints([2], [6, 0]), table: ints([2, 2], [5, 6, 1, -1]))
        }
    }

    func testNothingToWrite() throws {
        XCTAssertNil(try dispatch(new: [2, 0, 4, 80], seqlens: ints([2], [16, 3])))
        expectFMError(KVAppendDispatcher.op, contains: "cache_seqlens[0] = 17 is out of range [0, 16]") {
            _ = try dispatch(new: [2, 0, 4, 80], seqlens: ints([2], [17, 3]))
        }
    }

    func testValidation() {
        let op = KVAppendDispatcher.op
        expectFMError(op, contains: "cache_seqlens[1] + the new rows of k_new (its dim 1) = 14 + 3 = 17 exceeds the cache capacity, k_cache's dim 1 (16)") {
            _ = try dispatch(seqlens: ints([2], [0, 14]))
        }
        expectFMError(op, contains: "exceeds block_table's 2 pages (its dim 1) of 8 keys (k_cache's dim 1) (16)") {
            _ = try dispatch(cache: [6, 8, 4, 80], seqlens: ints([2], [14, 0]), table: ints([2, 2], [0, 1, 2, 3]))
        }
        expectFMError(op, status: FM_ERROR_TYPE, contains: "v_new dtype float16 does not match k_cache dtype bfloat16") {
            let (kn, vn, kc, vc) = (HostTensor([2, 3, 4, 80], .bf16), HostTensor([2, 3, 4, 80], .f16),
                                    HostTensor([2, 16, 4, 80], .bf16), HostTensor([2, 16, 4, 80], .bf16))
            let s = self.ints([2], [0, 0])
            try withExtendedLifetime([kn, vn, kc, vc, s]) {
                _ = try KVAppendDispatcher.makeDispatch(KVAppendTensors(kNew: kn.ref, vNew: vn.ref, kCache: kc.ref,
                                                                        vCache: vc.ref, seqlens: s.ref))
            }
        }
        expectFMError(op, status: FM_ERROR_TYPE, contains: "k_cache must be float32 or float16 or bfloat16, got uint8") {
            _ = try dispatch(dtype: .u8, seqlens: ints([2], [0, 0]))
        }
        expectFMError(op, contains: "must match k_cache's (Hkv, D) = (2, 80)") {
            _ = try dispatch(cache: [2, 16, 2, 80], seqlens: ints([2], [0, 0]))
        }
        expectFMError(op, contains: "k_cache batch (3) must equal k_new batch (2)") {
            _ = try dispatch(cache: [3, 16, 4, 80], seqlens: ints([2], [0, 0]))
        }
        expectFMError(op, contains: "cache_seqlens must have shape") { _ = try dispatch(seqlens: ints([3], [0, 0, 0])) }
        expectFMError(op, status: FM_ERROR_TYPE, contains: "cache_seqlens must be int32") {
            _ = try dispatch(seqlens: HostTensor([2], .f32))
        }
    }

    func testRaggedRowsLandThroughATokenMajorView() throws {
        // 6 pages of 4 rows; sequence 0 appends 3 rows at 3 (pages 5, 2), sequence 1 none, sequence 2 one at 0.
        let (kn, vn) = (HostTensor([4, 2, 64], .f16), HostTensor([4, 2, 64], .f16))
        let (kc, vc) = (HostTensor([6, 4, 2, 64], .f16), HostTensor([6, 4, 2, 64], .f16))
        let table = ints([3, 2], [5, 2, 0, 1, 3, 4]), cu = ints([4], [0, 3, 3, 4])
        let memory = UnsafeMutableRawPointer.allocate(byteCount: RaggedAppend.tableBytes(rows: 4), alignment: 64)
        defer { memory.deallocate() }
        try withExtendedLifetime([kn, vn, kc, vc, table, cu]) {
            func plan(_ ends: [Int32], table bt: HostTensor? = nil) throws -> (dispatch: Dispatch?, added: [Int]) {
                let e = ints([3], ends)
                return try withExtendedLifetime(e) {
                    try RaggedAppend(kCache: kc.ref, vCache: vc.ref, blockTable: (bt ?? table).ref, cuSeqlensKNew: cu.ref,
                                     names: ("k", "v")).plan(rows: (kn.ref, vn.ref), ends: e.ref, tables: memory)
                }
            }
            let (d, added) = try plan([3, 1, 0])
            XCTAssertEqual(added, [3, 0, 1])
            let append = try XCTUnwrap(d)
            XCTAssertEqual(append.grid, Size3(1, 2, 4))  // one row of each of 4 one-row sequences
            XCTAssertEqual(append.constants.bool(FunctionConstantIndex.appendPaged), true)
            let pages = (0..<4).map { memory.load(fromByteOffset: 4 * $0, as: Int32.self) }
            let rows = (0..<4).map { memory.load(fromByteOffset: 64 + 4 * $0, as: Int32.self) }
            XCTAssertEqual(pages, [5, 2, 2, 3])  // keys 3, 4, 5 of sequence 0; key 0 of sequence 2
            XCTAssertEqual(rows, [3, 0, 1, 0])
            expectFMError(KVAppendDispatcher.op, contains: "sequence 0's new keys overflow its cache: cache_seqlens[0] "
                          + "+ 3 new keys (cu_seqlens_k_new) = 9 exceeds the 8 keys a sequence's cache holds") {
                _ = try plan([6, 1, 0])
            }
            expectFMError(KVAppendDispatcher.op, contains: "block_table[0, 1] and block_table[2, 0] both name page 2") {
                _ = try plan([3, 1, 0], table: self.ints([3, 2], [5, 2, 0, 1, 2, 4]))
            }
            expectFMError(KVAppendDispatcher.op, contains: "cu_seqlens_k_new[3] = 3 must equal the rows of k (its dim 0, 4)") {
                let short = self.ints([4], [0, 3, 3, 3])
                try withExtendedLifetime(short) {
                    let e = self.ints([3], [3, 1, 0])
                    _ = try withExtendedLifetime(e) {
                        try RaggedAppend(kCache: kc.ref, vCache: vc.ref, blockTable: table.ref, cuSeqlensKNew: short.ref,
                                         names: ("k", "v")).plan(rows: (kn.ref, vn.ref), ends: e.ref, tables: memory)
                    }
                }
            }
        }
    }
}
