import FlashMetalCore
import XCTest

final class AttentionPlanTests: XCTestCase {
    typealias T = (DType, [Int])

    func options(scale: Double? = nil, softcap: Double = 0, window: Int? = nil, kvLen: Int? = nil,
                 bias: (Int, Int)? = nil, gqa: Bool = false, bottomRight: Bool = false) -> AttentionPlan.Options {
        AttentionPlan.Options(scale: scale, softcap: softcap, window: window, kvLen: kvLen, causalBias: bias,
                              enableGQA: gqa, bottomRight: bottomRight)
    }

    func plan(_ q: [Int] = [2, 4, 3, 64], _ k: [Int] = [2, 2, 9, 64], _ v: [Int]? = nil, sinks: [Int]? = nil,
              dtypes: (DType, DType, DType) = (.bf16, .bf16, .bf16), _ o: AttentionPlan.Options? = nil) throws
        -> AttentionPlan.Plan {
        try AttentionPlan.plan(q: (dtypes.0, q), k: (dtypes.1, k), v: (dtypes.2, v ?? k), sinks: sinks,
                               o ?? options(gqa: true))
    }

    func refusal(_ body: @autoclosure () throws -> AttentionPlan.Plan) -> FlashMetalError? {
        do {
            _ = try body()
            return nil
        } catch let e as FlashMetalError {
            return e
        } catch {
            return nil
        }
    }

    func testPlans() throws {
        let p = try plan([4, 3, 64], [2, 9, 64], [2, 9, 32], options(kvLen: 7, gqa: true, bottomRight: true))
        XCTAssertEqual([p.batch, p.heads, p.kvHeads, p.queryRows, p.headDim, p.headDimV, p.capacity, p.keys,
                        p.queryOffset], [1, 4, 2, 3, 64, 32, 9, 7, 4])
        XCTAssertEqual(p.kind, .run)
        XCTAssertEqual(try plan([2, 4, 0, 64]).kind, .empty)
        XCTAssertEqual(try plan([2, 4, 3, 64], [2, 2, 0, 64]).kind, .noKeys)
        // kv_len given over no keys is out of range, not zeros.
        XCTAssertEqual(refusal(try self.plan([2, 4, 3, 64], [2, 2, 0, 64], nil, options(kvLen: 1, gqa: true)))?
            .argument, "kv_len")
    }

    func testRefusalsNameTheArgument() {
        let cases: [(() throws -> AttentionPlan.Plan, String, String)] = [
            ({ try self.plan([2, 4, 3, 64], [2, 2, 9, 64], nil, self.options(scale: .infinity, gqa: true)) },
             "scale", "scale must be finite, got inf"),
            ({ try self.plan([2, 4, 3, 64], [2, 2, 9, 64], nil, self.options(softcap: -1, gqa: true)) }, "softcap",
             "got -1.0"),
            ({ try self.plan([2, 4, 3, 64], [2, 2, 9, 64], nil, self.options(window: 0, gqa: true)) }, "window",
             "window must be > 0 and fit in int32, got 0"),
            ({ try self.plan([2, 4, 3, 64], [2, 2, 9, 64]) }, "", ""),
            ({ try self.plan(dtypes: (.i32, .bf16, .bf16)) }, "query", "got int32"),
            ({ try self.plan(dtypes: (.f16, .f16, .f32)) }, "value", "value dtype float32 does not match query dtype float16"),
            ({ try self.plan([4, 3, 64]) }, "key", "key has shape (2, 2, 9, 64)"),
            ({ try self.plan([3, 3, 64], [2, 9, 64]) }, "key", "query heads (3) must be a multiple of key heads (2)"),
            ({ try self.plan([2, 4, 3, 64], [2, 2, 9, 64], [2, 2, 8, 64]) }, "key", "value (2, 2, 8, 64)"),
            ({ try self.plan([1, 4, 3, 64]) }, "key", "key batch (2) must equal query batch (1)"),
            ({ try self.plan([2, 4, 3, 64], [2, 2, 9, 64], nil, self.options()) }, "enable_gqa", "pass enable_gqa=True"),
            ({ try self.plan([2, 4, 3, 64], [2, 2, 9, 64], nil, self.options(bias: (3, 8), gqa: true)) }, "attn_mask",
             "CausalBias for (3 queries, 8 keys), not this call's (3, 9)"),
            ({ try self.plan(sinks: [2]) }, "sinks", "sinks must have shape [4] (query's heads), got [2]"),
            ({ try self.plan([2, 4, 3, 0], [2, 2, 9, 0], [2, 2, 9, 8]) }, "query", "query shape (2, 4, 3, 0) has an empty head dim"),
        ]
        for (i, (body, argument, text)) in cases.enumerated() {
            let e = refusal(try body())
            if argument.isEmpty {
                XCTAssertNil(e, "case \(i)")
                continue
            }
            XCTAssertEqual(e?.op, AttentionPlan.op, "case \(i)")
            XCTAssertEqual(e?.argument, argument, "case \(i): \(e?.message ?? "accepted")")
            XCTAssertTrue(e?.what.contains(text) ?? false, "case \(i): \(e?.message ?? "accepted")")
        }
    }
}
