import CFlashMetal
import FlashMetalCore
import XCTest

final class SequenceTablesTests: XCTestCase {
    /// An int32 tensor holding `values` with `shape` (default [count]).
    func int32s(_ values: [Int32], _ shape: [Int]? = nil, dtype: DType = .i32) -> HostTensor {
        let t = HostTensor(shape ?? [values.count], dtype, bytes: values.count * 4)
        for (i, v) in values.enumerated() { t.data.storeBytes(of: v, toByteOffset: i * 4, as: Int32.self) }
        return t
    }

    func expectValueError(_ contains: String, line: UInt = #line, _ body: () throws -> Void) {
        do {
            try body()
            XCTFail("no error; expected one containing \"\(contains)\"", line: line)
        } catch let e as FlashMetalError {
            XCTAssertEqual(e.status, FM_ERROR_VALUE, e.message, line: line)
            XCTAssertTrue(e.message.contains(contains), "\"\(e.message)\" lacks \"\(contains)\"", line: line)
        } catch { XCTFail("unexpected \(error)", line: line) }
    }

    func cu(_ values: [Int32], batch: Int? = nil, tokens: Int = 100, max: Int = 100) throws -> [Int] {
        let t = int32s(values)
        return try withExtendedLifetime(t) {
            try SequenceTables.cuSeqlens(t.ref, op: "op", name: "cu_seqlens_q", batch: batch, tokens: tokens,
                                         tokensName: "q", maxSeqlen: max, maxSeqlenName: "max_seqlen_q")
        }
    }

    func testCuSeqlensReturnsLengths() throws {
        XCTAssertEqual(try cu([0, 3, 3, 10]), [3, 0, 7])
        XCTAssertEqual(try cu([0, 3, 3, 10], batch: 3, tokens: 10, max: 7), [3, 0, 7])
        XCTAssertEqual(try cu([0, 0]), [0])
    }

    func testCuSeqlensErrors() {
        expectValueError("op: cu_seqlens_q[0] must be 0, got 1") { _ = try cu([1, 3]) }
        expectValueError("cu_seqlens_q[2] = 2 < cu_seqlens_q[1] = 5") { _ = try cu([0, 5, 2]) }
        expectValueError("cu_seqlens_q[2] = 11 exceeds the 10 tokens of q") { _ = try cu([0, 5, 11], tokens: 10) }
        expectValueError("sequence 1 has length 6") { _ = try cu([0, 5, 11], max: 5) }
        expectValueError("max_seqlen_q must be >= 0, got -1") { _ = try cu([0, 0], max: -1) }
        expectValueError("must have shape [3], got [2]") { _ = try cu([0, 5], batch: 2) }
        expectValueError("B >= 1") { _ = try cu([0]) }
        let wrongRank = int32s([0, 1, 2, 3], [2, 2])
        expectValueError("must have rank 1") {
            _ = try SequenceTables.cuSeqlens(wrongRank.ref, op: "op", name: "cu", tokens: 9, tokensName: "q",
                                             maxSeqlen: 9, maxSeqlenName: "m")
        }
        let f32 = int32s([0, 1], dtype: .f32)
        do {
            _ = try SequenceTables.cuSeqlens(f32.ref, op: "op", name: "cu", tokens: 9, tokensName: "q",
                                             maxSeqlen: 9, maxSeqlenName: "m")
            XCTFail("float32 accepted")
        } catch let e as FlashMetalError {
            XCTAssertEqual(e.status, FM_ERROR_TYPE)
            XCTAssertEqual(e.message, "op: cu must be int32, got float32")
        } catch { XCTFail("\(error)") }
        withExtendedLifetime([wrongRank, f32]) {}
    }

    func testSeqlens() throws {
        let t = int32s([0, 5, 7])
        try withExtendedLifetime(t) {
            XCTAssertEqual(try SequenceTables.seqlens(t.ref, op: "op", name: "cache_seqlens", batch: 3,
                                                      capacity: 7, capacityName: "k_cache"), [0, 5, 7])
            expectValueError("op: cache_seqlens[2] = 7 is out of range [0, 6] (k_cache)") {
                _ = try SequenceTables.seqlens(t.ref, op: "op", name: "cache_seqlens", batch: 3,
                                               capacity: 6, capacityName: "k_cache")
            }
            expectValueError("must have shape [2], got [3]") {
                _ = try SequenceTables.seqlens(t.ref, op: "op", name: "s", batch: 2, capacity: 9, capacityName: "c")
            }
        }
        let negative = int32s([3, -1])
        expectValueError("s[1] = -1 is out of range [0, 9]") {
            _ = try SequenceTables.seqlens(negative.ref, op: "op", name: "s", batch: 2, capacity: 9, capacityName: "c")
        }
        withExtendedLifetime(negative) {}
    }

    func table(_ values: [Int32], _ shape: [Int], lengths: [Int], numPages: Int = 4, pageSize: Int = 16) throws -> Int {
        let t = int32s(values, shape)
        return try withExtendedLifetime(t) {
            try SequenceTables.blockTable(t.ref, op: "op", name: "block_table", lengths: lengths,
                                          numPages: numPages, pageSize: pageSize, cacheName: "k_cache")
        }
    }

    func testBlockTable() throws {
        // Sequence 0 reads pages 3 and 0; sequence 1 (length 0) reads nothing: its -1 entries are padding.
        XCTAssertEqual(try table([3, 0, -1, -1], [2, 2], lengths: [17, 0]), 2)
        XCTAssertEqual(try table([2, 99], [1, 2], lengths: [16]), 2)  // the second page is never read
        XCTAssertEqual(try table([1, 2], [1, 2], lengths: [32], pageSize: 32), 2)
    }

    func testBlockTableErrors() {
        expectValueError("op: block_table[0, 1] = 4 is out of range [0, 4) (the pages of k_cache)") {
            _ = try table([3, 4], [1, 2], lengths: [17])
        }
        expectValueError("block_table[1, 0] = -1 is out of range") {
            _ = try table([0, 1, -1, 2], [2, 2], lengths: [20, 1])
        }
        expectValueError("sequence 0 has 33 keys but block_table holds 2 pages of 16 (32 keys)") {
            _ = try table([0, 1], [1, 2], lengths: [33])
        }
        XCTAssertEqual(try table([0, 1], [1, 2], lengths: [3], pageSize: 3), 2)  // any positive page size
        expectValueError("sequence 0 has 7 keys but block_table holds 2 pages of 3 (6 keys)") {
            _ = try table([0, 1], [1, 2], lengths: [7], pageSize: 3)
        }
        expectValueError("k_cache page size 0 (its dim 1) must be positive") { _ = try table([0, 1], [1, 2], lengths: [0], pageSize: 0) }
        expectValueError("block_table must have shape [2, _], got [1, 2]") {
            _ = try table([0, 1], [1, 2], lengths: [3, 3])
        }
    }

    /// A buffer shorter than its shape is caught before any entry is read.
    func testShortBufferIsRejected() {
        let t = HostTensor([4], .i32, bytes: 8)
        expectValueError("buffer too small") {
            _ = try SequenceTables.seqlens(t.ref, op: "op", name: "s", batch: 4, capacity: 9, capacityName: "c")
        }
        withExtendedLifetime(t) {}
    }
}
