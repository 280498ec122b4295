import CFlashMetal

/// The options of one mask build (FMMaskOptions, read once).
public struct MaskOptions: Sendable {
    /// Hide keys after the query's position. Off unless asked, as every op.
    public var causal: Bool
    /// Sliding window w > 0 (`t - p < w`); nil = no window.
    public var window: Int?
    /// Absolute position of query row 0.
    public var qOffset: Int

    /// Options from Swift values; validation happens in makeDispatch.
    public init(causal: Bool = false, window: Int? = nil, qOffset: Int = 0) {
        self.causal = causal; self.window = window; self.qOffset = qOffset
    }

    /// Reads the C options, rejecting out-of-range flags.
    public init(_ o: FMMaskOptions) throws {
        guard o.causal == 0 || o.causal == 1 else {
            throw FlashMetalError.value(MaskDispatcher.op, "causal must be 0 or 1, got \(o.causal)", arg: "causal")
        }
        if o.window < 0 {
            throw FlashMetalError.value(MaskDispatcher.op, "window must be 0 (none) or > 0, got \(o.window)", arg: "window")
        }
        self.init(causal: o.causal == 1, window: o.window == 0 ? nil : Int(o.window), qOffset: Int(o.q_offset))
    }
}

/// The mask builder `flash_attn_prefill_mask_{bf16,f16}`: fills an additive
/// [qL, kL] mask with 0 (attend) or -inf (masked). Query row i sits at
/// t = q_offset + i and sees key p iff (!causal || p <= t) && (no window ||
/// t - p < window). Grid (ceil(kL/256), qL, 1), 256 threads, one cell each;
/// buffers MaskBuilderBuffer (out, MaskParams).
public enum MaskDispatcher {
    /// The op name errors carry.
    public static let op = "flash_attn_prefill_mask"
    /// Threads per threadgroup, one mask cell each.
    public static let threads = 256

    /// Validates a call and builds its dispatch. Preconditions: a rank-2
    /// out in MaskBuilderCapability.outTypes with both dims in 1...Int32.max,
    /// 0 <= q_offset <= Int32.max, a window in 1...Int32.max or none.
    public static func makeDispatch(out: TensorRef, _ o: MaskOptions) throws -> Dispatch {
        try out.requireRank([2], op: op, name: "out")
        try out.requireDType(MaskBuilderCapability.outTypes, op: op, name: "out")
        let (qL, kL) = (out.shape[0], out.shape[1])
        try Checks.positive("q_len", qL, op: op, arg: "q_len")
        try Checks.positive("kv_len", kL, op: op, arg: "kv_len")
        if qL > Int(Int32.max) || kL > Int(Int32.max) {
            throw FlashMetalError.value(op, "q_len (\(qL)) and kv_len (\(kL)) must fit in int32", arg: "q_len")
        }
        if o.qOffset < 0 || o.qOffset > Int(Int32.max) {
            throw FlashMetalError.value(op, "q_offset must be in 0...\(Int32.max), got \(o.qOffset)", arg: "q_offset")
        }
        if let w = o.window, w <= 0 || w > Int(Int32.max) {
            throw FlashMetalError.value(op, "window must be > 0 and fit in int32, got \(w)", arg: "window")
        }
        try out.requireBytes(op: op, name: "out")
        let params = MaskParams(seq_len_q: Int32(qL), seq_len_k: Int32(kL), q_offset: Int32(o.qOffset),
                                window: Int32(o.window ?? 0), causal: o.causal ? 1 : 0, _pad: 0)
        return Dispatch(kernel: .maskBuilder(out: out.dtype),
                        grid: Size3((kL + threads - 1) / threads, qL, 1), threadgroup: Size3(threads, 1, 1),
                        bindings: [MaskBuilderBuffer.out: .buffer(out),
                                   MaskBuilderBuffer.params: .bytes(bytesOf(params))],
                        writes: [MaskBuilderBuffer.out])
    }
}
