import CFlashMetal
import FlashMetalCore
import XCTest

/// MaskKeyRanges: which masks of one query row are per-row key ranges.
final class MaskKeyRangesTests: XCTestCase {
    /// A float32 additive mask [B, H, 1, kL] of `visible` (per batch row, per head) keys: 0 or -inf.
    func additive(_ visible: [[[Bool]]], bias: (index: Int, value: Float)? = nil) -> HostTensor {
        let (b, h, k) = (visible.count, visible[0].count, visible[0][0].count)
        let t = HostTensor([b, h, 1, k], .f32)
        let p = t.data.assumingMemoryBound(to: Float.self)
        for (i, v) in visible.joined().joined().enumerated() { p[i] = v ? (i % 2 == 0 ? 0 : -0.0) : -.infinity }
        if let bias { p[bias.index] = bias.value }
        return t
    }

    func find(_ mask: HostTensor, causal: Bool = false, at position: Int = 5, window: Int? = nil) throws -> [Int32]? {
        let out = HostTensor([2, mask.ref.shape[0]], .i32)
        return try withExtendedLifetime([mask, out]) {
            guard try MaskKeyRanges.find(mask.ref, causal: causal, queryPosition: position, window: window,
                                         out: out.ref) else { return nil }
            return (0..<(2 * mask.ref.shape[0])).map { out.data.load(fromByteOffset: 4 * $0, as: Int32.self) }
        }
    }

    func testRangesHolesBiasAndHeads() throws {
        let keys = { (lo: Int, hi: Int) in (0..<6).map { $0 >= lo && $0 < hi } }
        // Batch row 0 sees keys [1, 4), row 1 [0, 6) (both heads alike; +-0 both attend).
        let two = [[keys(1, 4), keys(1, 4)], [keys(0, 6), keys(0, 6)]]
        XCTAssertEqual(try find(additive(two)), [4, 6, 1, 0])
        // Causal at position 2 and a window of 2: keys p with p <= 2 and 2 - p < 2.
        XCTAssertEqual(try find(additive(two), causal: true, at: 2, window: 2), [3, 3, 1, 1])
        // A row seeing nothing is [0, 0).
        XCTAssertEqual(try find(additive([[keys(0, 0)]])), [0, 0])
        // A hole, heads that differ, a finite bias: no ranges.
        XCTAssertNil(try find(additive([[[true, false, true, false, false, false]]])))
        XCTAssertNil(try find(additive([[keys(1, 4), keys(1, 5)]])))
        XCTAssertNil(try find(additive([[keys(1, 4)]], bias: (index: 2, value: 0.5))))
        XCTAssertNil(try find(additive([[keys(1, 4)]], bias: (index: 0, value: .nan))))
        // The window leaves the hole outside: a range again.
        XCTAssertEqual(try find(additive([[[true, false, true, true, false, false]]]), window: 4), [4, 2])
        // bool masks: any nonzero byte attends.
        let b = HostTensor([1, 2, 1, 4], .bool)
        for (i, x) in [0, 2, 1, 0, 0, 1, 7, 0].enumerated() { b.data.storeBytes(of: UInt8(x), toByteOffset: i, as: UInt8.self) }
        XCTAssertEqual(try find(b), [3, 1])
    }

    func testRefusals() {
        expectFMError(MaskKeyRanges.op, contains: "mask must be [B or 1, H or 1, 1, kL] (one query row)") {
            _ = try self.find(HostTensor([1, 1, 2, 4], .f32))
        }
        expectFMError(MaskKeyRanges.op, status: FM_ERROR_TYPE, contains: "mask must be bool or float32 or float16 or bfloat16, got int32") {
            _ = try self.find(HostTensor([1, 1, 1, 4], .i32))
        }
        expectFMError(MaskKeyRanges.op, contains: "mask must have a head (its dim 1 is 0)") {
            _ = try self.find(HostTensor([2, 0, 1, 4], .f32))
        }
        expectFMError(MaskKeyRanges.op, contains: "window must be >= 1, got 0") {
            _ = try self.find(HostTensor([1, 1, 1, 4], .f32), window: 0)
        }
    }
}
