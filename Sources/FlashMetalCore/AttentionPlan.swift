/// The front door's contract (torch's scaled_dot_product_attention as the
/// Python package offers it), up to the mask: the dtypes and shapes of q, k,
/// v and sinks, the options' values, grouped-query attention, kv_len, and
/// what a call with an empty axis or no keys returns. The mask's own shape is
/// the package's to read (it converts the array); the route is
/// AttentionRouter's. Every message names the front door and the argument.
public enum AttentionPlan {
    public static let op = AttentionRouter.op

    /// The options beside the tensors (nil: not given).
    public struct Options: Sendable {
        public var scale: Double?
        public var softcap: Double
        public var window: Int?
        public var kvLen: Int?
        /// A CausalBias attn_mask's (query rows, keys): the call must have them.
        public var causalBias: (queryRows: Int, keys: Int)?
        public var enableGQA: Bool
        /// align "bottom_right": query row i sits at kv_len - qL + i.
        public var bottomRight: Bool

        public init(scale: Double?, softcap: Double, window: Int?, kvLen: Int?,
                    causalBias: (queryRows: Int, keys: Int)?, enableGQA: Bool, bottomRight: Bool) {
            self.scale = scale
            self.softcap = softcap
            self.window = window
            self.kvLen = kvLen
            self.causalBias = causalBias
            self.enableGQA = enableGQA
            self.bottomRight = bottomRight
        }
    }

    /// What runs: a kernel, or nothing (an empty result, or zeros).
    public enum Kind: Int32, Sendable {
        case run = 0, empty = 1, noKeys = 2
    }

    /// A checked call.
    public struct Plan: Sendable, Equatable {
        public var kind: Kind
        public var batch: Int, heads: Int, kvHeads: Int, queryRows: Int
        public var headDim: Int, headDimV: Int
        /// Key's sequence length.
        public var capacity: Int
        /// Keys attended: kv_len, or the capacity.
        public var keys: Int
        /// Query row 0's position among the keys.
        public var queryOffset: Int
        /// Why no kernel runs ("" when one does).
        public var reason: String
    }

    /// The shapes as numpy prints them ("(2, 4, 8, 64)", "(3,)"): the
    /// messages quote the arrays the caller passed.
    static func tuple(_ shape: [Int]) -> String {
        shape.count == 1 ? "(\(shape[0]),)" : "(" + shape.map(String.init).joined(separator: ", ") + ")"
    }

    /// Checks the call; throws the error of the first rule it breaks.
    public static func plan(q: (DType, [Int]), k: (DType, [Int]), v: (DType, [Int]), sinks: [Int]?,
                            _ o: Options) throws -> Plan {
        try checkOptions(o)
        if ![DType.f32, .bf16, .f16].contains(q.0) {
            throw FlashMetalError.type(op, "query must be float32, float16 or bfloat16, got \(q.0.name)", arg: "query")
        }
        for (name, t) in [("key", k), ("value", v)] where t.0 != q.0 {
            throw FlashMetalError.type(op, "\(name) dtype \(t.0.name) does not match query dtype \(q.0.name)",
                                       arg: name)
        }
        let rank = q.1.count
        for (name, shape) in [("query", q.1), ("key", k.1), ("value", v.1)] where shape.count != rank || ![3, 4].contains(rank) {
            throw FlashMetalError.value(op, "query, key and value must all have rank 4 [B, H, L, D] (or 3: [H, L, D]); "
                + "\(name) has shape \(tuple(shape))", arg: name)
        }
        // Rank 3 is batch 1; the messages below quote the rank-4 shapes.
        let (qs, ks, vs) = rank == 3 ? ([1] + q.1, [1] + k.1, [1] + v.1) : (q.1, k.1, v.1)
        let (b, h, ql, d, dv) = (qs[0], qs[1], qs[2], qs[3], vs[3])
        if Array(ks[..<3]) != Array(vs[..<3]) || ks[3] != d {
            throw FlashMetalError.value(op, "key \(tuple(ks)) must be [B, Hkv, kL, D] with D = \(d) (query's head dim) "
                + "and value \(tuple(vs)) [B, Hkv, kL, Ev] with key's B, Hkv and kL", arg: "key")
        }
        if ks[0] != b {
            throw FlashMetalError.value(op, "key batch (\(ks[0])) must equal query batch (\(b))", arg: "key")
        }
        let (hkv, cap) = (ks[1], ks[2])
        let keys = o.kvLen ?? cap
        if let bias = o.causalBias, bias != (ql, keys) {
            throw FlashMetalError.value(op, "attn_mask is a CausalBias for (\(bias.queryRows) queries, \(bias.keys) "
                + "keys), not this call's (\(ql), \(keys))", arg: "attn_mask")
        }
        if hkv != h && !o.enableGQA {
            throw FlashMetalError.value(op, "query has \(h) heads and key \(hkv); pass enable_gqa=True for "
                + "grouped-query attention", arg: "enable_gqa")
        }
        var plan = Plan(kind: .run, batch: b, heads: h, kvHeads: hkv, queryRows: ql, headDim: d, headDimV: dv,
                        capacity: cap, keys: cap, queryOffset: 0, reason: "")
        if b == 0 || h == 0 || ql == 0 {  // an empty result, as torch's
            plan.kind = .empty
            plan.reason = "an empty batch, head or query axis: the result is empty"
            return plan
        }
        if dv == 0 { throw FlashMetalError.value(op, "value shape \(tuple(vs)) has an empty head dim", arg: "value") }
        if hkv == 0 || h % hkv != 0 {
            throw FlashMetalError.value(op, "query heads (\(h)) must be a multiple of key heads (\(hkv))", arg: "key")
        }
        if d == 0 { throw FlashMetalError.value(op, "query shape \(tuple(qs)) has an empty head dim", arg: "query") }
        let noKeys = cap == 0 && o.kvLen == nil  // torch's result: zeros (every row attends to nothing)
        if !(keys > 0 && keys <= cap) && !noKeys {
            throw FlashMetalError.value(op, "kv_len must be in 1..\(cap) (key's sequence length), got \(keys)",
                                        arg: "kv_len")
        }
        if let sinks, sinks != [h] {
            throw FlashMetalError.value(op, "sinks must have shape [\(h)] (query's heads), got \(sinks)", arg: "sinks")
        }
        plan.keys = keys
        plan.queryOffset = o.bottomRight ? keys - ql : 0
        if noKeys {
            plan.kind = .noKeys
            plan.queryOffset = 0
            plan.reason = "no keys (key's sequence length 0): every row attends to nothing, so the result is zeros"
        }
        return plan
    }

    /// The options' values (their types are the caller's language's to check).
    static func checkOptions(_ o: Options) throws {
        if let scale = o.scale, !scale.isFinite {
            throw FlashMetalError.value(op, "scale must be finite, got \(scale)", arg: "scale")
        }
        if !(o.softcap.isFinite && o.softcap >= 0) {
            throw FlashMetalError.value(op, "softcap must be 0 (off) or a finite value > 0, got \(o.softcap)",
                                        arg: "softcap")
        }
        if let w = o.window, !(w > 0 && w <= Int(Int32.max)) {
            throw FlashMetalError.value(op, "window must be > 0 and fit in int32, got \(w)", arg: "window")
        }
    }
}
