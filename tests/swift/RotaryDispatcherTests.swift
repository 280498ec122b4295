import CFlashMetal
import FlashMetalCore
import XCTest

final class RotaryDispatcherTests: XCTestCase {
    func ints(_ shape: [Int], _ values: [Int32]) -> HostTensor {
        let t = HostTensor(shape, .i32)
        for (i, x) in values.enumerated() { t.data.storeBytes(of: x, toByteOffset: 4 * i, as: Int32.self) }
        return t
    }

    func dispatch(x: [Int] = [2, 3, 4, 80], tables: [Int] = [20, 16], dtype: DType = .bf16, tableType: DType = .f32,
                  offsets: HostTensor, perRow: Bool = true) throws -> Dispatch? {
        let (xs, out) = (HostTensor(x, dtype), HostTensor(x, dtype))
        let (c, s) = (HostTensor(tables, tableType), HostTensor(tables, tableType))
        let t = RotaryTensors(x: xs.ref, cos: c.ref, sin: s.ref, offsets: offsets.ref, out: out.ref, interleaved: true,
                              perRow: perRow)
        return try withExtendedLifetime([xs, out, c, s]) { try RotaryDispatcher.makeDispatch(t) }
    }

    func testDispatch() throws {
        let d = try XCTUnwrap(try dispatch(offsets: ints([2], [0, 17])))
        XCTAssertEqual(d.kernel, "rotary_bf16_f32")
        XCTAssertEqual(d.grid, Size3(3, 4, 2))
        XCTAssertEqual(d.writes, [RotaryBuffer.out])
        let p = try d.params(RotaryBuffer.params, as: RotaryParams.self)
        XCTAssertEqual([p.n_rows, p.n_heads, p.head_dim, p.rotary_half, p.interleaved, p.per_row], [3, 4, 80, 16, 1, 1])
    }

    func testPositionsAreChecked() throws {
        // Rows 0..2 of sequence 1 at 18..20: position 20 is past the 20 table rows.
        expectFMError(RotaryDispatcher.op, contains: "cache_seqlens[1] + 3 rows of x - 1 = 20 is outside rotary_cos's positions [0, 20)") {
            _ = try dispatch(offsets: ints([2], [0, 18]))
        }
        // Every row at offsets[b] when not per row: 19 fits.
        XCTAssertNotNil(try dispatch(offsets: ints([2], [0, 19]), perRow: false))
        expectFMError(RotaryDispatcher.op, contains: "cache_seqlens[0] = -1") {
            _ = try dispatch(offsets: ints([2], [-1, 0]), perRow: false)
        }
        XCTAssertNil(try dispatch(x: [2, 0, 4, 80], offsets: ints([2], [19, 20])))
    }

    func testShapes() {
        let op = RotaryDispatcher.op
        expectFMError(op, contains: "0 < rotary_dim <= head_dim (80), got shape [20, 41] (rotary_dim 82)") {
            _ = try dispatch(tables: [20, 41], offsets: ints([2], [0, 0]))
        }
        expectFMError(op, status: FM_ERROR_TYPE, contains: "rotary_cos") {
            _ = try dispatch(tableType: .i32, offsets: ints([2], [0, 0]))
        }
        expectFMError(op, contains: "cache_seqlens must have shape [2]") {
            _ = try dispatch(offsets: ints([3], [0, 0, 0]))
        }
    }
}
