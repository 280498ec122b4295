import CFlashMetal

/// The front door's routing (torch's scaled_dot_product_attention as the
/// Python package offers it): which kernel computes exactly a call, and why,
/// from what the call is (dtype, rows, head dims, keys, mask, causal
/// position, window, sinks) and what the capability tables say each kernel
/// takes. One owner of the rule: the package asks (fm_route_attention) and
/// runs the kernel named; nothing is chosen twice.
public enum AttentionRouter {
    public static let op = "scaled_dot_product_attention"

    /// The kernel families a call can take (FMRouteKernel of flashmetal.h).
    public enum Kernel: Int32, Sendable {
        case decode = 1, prefill = 2, sdpa = 3
    }

    /// One call as the router sees it.
    public struct Call: Sendable {
        /// q's dtype (k and v have it too).
        public var dtype: DType
        public var queryRows: Int
        public var headDim: Int
        /// v's head dim (the output's).
        public var headDimV: Int
        /// Keys attended (kv_len, or key's sequence length).
        public var keys: Int
        /// An attn_mask array is applied (not a causal pattern).
        public var mask: Bool
        /// The mask keeps, for the one query row, one key range per batch
        /// row (padding, window, causal): the decode kernel takes it as ranges.
        public var maskIsKeyRanges: Bool
        public var causal: Bool
        /// The position of query row 0 among the keys.
        public var queryOffset: Int
        /// The sliding window w (nil: none).
        public var window: Int?
        public var sinks: Bool

        public init(dtype: DType, queryRows: Int, headDim: Int, headDimV: Int, keys: Int, mask: Bool,
                    maskIsKeyRanges: Bool, causal: Bool, queryOffset: Int, window: Int?, sinks: Bool) {
            self.dtype = dtype
            self.queryRows = queryRows
            self.headDim = headDim
            self.headDimV = headDimV
            self.keys = keys
            self.mask = mask
            self.maskIsKeyRanges = maskIsKeyRanges
            self.causal = causal
            self.queryOffset = queryOffset
            self.window = window
            self.sinks = sinks
        }
    }

    /// The kernel and why.
    public struct Route: Sendable, Equatable {
        public let kernel: Kernel
        public let reason: String
    }

    /// Whether the decode kernel takes `rows` (> 1) query rows of head dims
    /// (d, dv): only pairs both it and the prefill run, so the route changes
    /// the kernel, never which calls run.
    public static func shortQueryRuns(dtype: DType, headDim d: Int, headDimV dv: Int) -> Bool {
        VecCapability.runs(headDim: d, headDimV: dv)
            && PrefillCapability.runs(io: dtype == .f32 ? .f32 : .bf16, headDim: d, headDimV: dv)
    }

    /// The fastest kernel that computes exactly this call; a call no kernel
    /// takes with its sinks is an unsupported feature, one whose head dim is
    /// above every kernel's a ValueError.
    public static func route(_ c: Call) throws -> Route {
        let (d, dv, rows) = (c.headDim, c.headDimV, c.queryRows)
        let io: DType = c.dtype == .f32 ? .f32 : .bf16
        let decodeRuns = VecCapability.runs(headDim: d, headDimV: dv)
        if rows == 1 && c.maskIsKeyRanges && !c.sinks && decodeRuns {
            return Route(kernel: .decode, reason: "one query row whose attn_mask keeps one key range "
                + "per batch row (padding, window, causal): split-KV decode over per-row key ranges")
        }
        let unbounded = !c.causal && c.window == nil  // positions do not matter
        let lastRow = c.queryOffset == c.keys - 1 || unbounded
        if rows == 1 && !c.mask && decodeRuns && lastRow && !c.sinks {
            return Route(kernel: .decode, reason: "one query row at the newest position, no attn_mask: "
                + "split-KV decode")
        }
        let newest = c.queryOffset == c.keys - rows || unbounded
        if rows > 1 && rows <= min(VecSeqDispatcher.maxQueryRows, c.keys) && !c.mask && newest
            && !c.sinks && shortQueryRuns(dtype: c.dtype, headDim: d, headDimV: dv) {
            return Route(kernel: .decode, reason: "\(rows) query rows at the newest positions, no "
                + "attn_mask: split-KV decode, each row with its own causal/window keys, K/V read once per kv head")
        }
        var whyNot: [String] = []
        if (c.causal || c.window != nil) && !(c.queryOffset >= 0 && c.queryOffset <= c.keys - rows) {
            whyNot.append("\(c.causal ? "causal rows" : "rows with a window") at positions "
                + "\(c.queryOffset)..\(c.queryOffset + rows - 1) outside the \(c.keys) keys")
        }
        if !PrefillCapability.runs(io: io, headDim: d, headDimV: dv) {
            let above = PrefillCapability.headDims(io: io).filter { $0 > maxPaddedHeadDim }.map { " or \($0)" }
            whyNot.append(dv != d
                ? "head dims \(d) (query, key) and \(dv) (value) (prefill runs unequal ones both in "
                    + "1...\(maxPaddedHeadDim), or 576 over 512 in bfloat16/float16)"
                : "head dim \(d) (prefill runs 1...\(maxPaddedHeadDim)\(above.joined()))")
        }
        if whyNot.isEmpty {
            let extra = c.window != nil ? ", the window in the kernel (no mask; key tiles outside it skipped)" : ""
            return Route(kernel: .prefill, reason: "tiled flash attention\(extra)")
        }
        let because = whyNot.joined(separator: "; ")
        if c.sinks {
            throw FlashMetalError.unsupported(op, "sinks are applied by the prefill kernel only, which cannot take "
                + "this call because of \(because)", arg: "sinks")
        }
        if max(d, dv) > SdpaCapability.maxHeadDim {
            throw FlashMetalError.value(op, "head dim \(max(d, dv)) is above \(SdpaCapability.maxHeadDim), the "
                + "largest any kernel takes (the general sdpa kernel); the prefill kernel is out because of \(because)",
                arg: "query")
        }
        return Route(kernel: .sdpa, reason: "general kernel (one thread per query row), because of \(because)")
    }
}
