import CFlashMetal

/// The options of one sdpa call (FMSdpaOptions, read once).
public struct SdpaOptions: Sendable {
    /// Score scale, finite.
    public var scale: Float
    /// Bottom-right causal: query i sits at kv_len - qL + i. Off unless
    /// asked, as every op.
    public var causal: Bool = false
    /// Valid K/V length; nil means all of K's sequence axis (kv_capacity).
    public var kvLen: Int? = nil
    /// Absolute position of query row 0; nil is the plain kernel's bottom-right
    /// alignment (kv_len - qL). 0 is torch's top-left causal alignment.
    public var qOffset: Int? = nil
    /// Sliding window w (keys p with t - p < w); nil = none.
    public var window: Int? = nil
    /// Logit softcap c > 0 (c * tanh(s / c)); 0 = off.
    public var softcap: Float = 0

    /// Options from Swift values; validation happens in makeDispatch.
    public init(scale: Float, causal: Bool = false, kvLen: Int? = nil, qOffset: Int? = nil,
                window: Int? = nil, softcap: Float = 0) {
        self.scale = scale; self.causal = causal; self.kvLen = kvLen
        self.qOffset = qOffset; self.window = window; self.softcap = softcap
    }

    /// Reads the C options, rejecting out-of-range flags.
    public init(_ o: FMSdpaOptions) throws {
        let op = SdpaDispatcher.op
        guard o.causal == 0 || o.causal == 1 else {
            throw FlashMetalError.value(op, "causal must be 0 or 1, got \(o.causal)", arg: "causal")
        }
        guard o.has_q_offset == 0 || o.has_q_offset == 1 else {
            throw FlashMetalError.value(op, "has_q_offset must be 0 or 1, got \(o.has_q_offset)", arg: "has_q_offset")
        }
        if o.kv_len < 0 { throw FlashMetalError.value(op, "kv_len must be >= 0 (0 = all), got \(o.kv_len)", arg: "kv_len") }
        if o.window < 0 { throw FlashMetalError.value(op, "window must be >= 0 (0 = none), got \(o.window)", arg: "window") }
        self.init(scale: o.scale, causal: o.causal == 1, kvLen: o.kv_len == 0 ? nil : Int(o.kv_len),
                  qOffset: o.has_q_offset == 1 ? Int(o.q_offset) : nil,
                  window: o.window == 0 ? nil : Int(o.window), softcap: o.softcap)
    }

    /// Whether the call needs SdpaExtParams (SdpaBuffer.ext): anything beyond the plain kernel.
    var needsExt: Bool { qOffset != nil || window != nil || softcap != 0 }
}

/// Simple fused SDPA `sdpa` (float32) / `sdpa_bf16` / `sdpa_f16`, one thread per query row, TILE_Q = 32 rows per threadgroup.
/// Causal is bottom-right (query i at kv_len - qL + i) unless SdpaExtParams
/// (SdpaBuffer.ext, constant sdpaExt) give an explicit q_offset; the same
/// struct adds the window and the softcap (constant sdpaSoftcap).
///
/// Grid (B, H, ceil(qL/32)) of 32 threads; buffers SdpaBuffer. The optional
/// mask: a bool one at SdpaBuffer.boolMask with
/// constant sdpaBoolMask, an additive one (Q's dtype) at
/// SdpaBuffer.additiveMask with sdpaAdditiveMask, either with its
/// AttnMaskParams at SdpaBuffer.maskParams.
public enum SdpaDispatcher {
    /// The op name errors carry.
    public static let op = "sdpa"
    /// Query rows per threadgroup, one thread each.
    public static let tileQ = Int(FM_SDPA_TILE_Q)
    /// The largest head dim the kernel takes.
    public static var maxHeadDim: Int { SdpaCapability.maxHeadDim }

    /// Validates a call and builds its dispatch. Preconditions: rank-4
    /// tensors of one dtype in SdpaCapability.ioTypes, 0 < D <= maxHeadDim,
    /// H a multiple of Hkv, 0 < kv_len <= capacity, a finite scale, buffers
    /// that cover their shapes, a mask as AttentionMask describes.
    public static func makeDispatch(q: TensorRef, k: TensorRef, v: TensorRef, mask: TensorRef? = nil,
                                    out: TensorRef, _ o: SdpaOptions) throws -> Dispatch {
        for (x, n) in [(q, "q"), (k, "k"), (v, "v"), (out, "out")] {
            try x.requireRank([4], op: op, name: n)
        }
        try q.requireDType(SdpaCapability.ioTypes, op: op, name: "q")
        for (x, n) in [(k, "k"), (v, "v"), (out, "out")] { try Checks.sameDType(x, n, as: q, "q", op: op) }
        let (b, h, qL, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3])
        let (kb, hkv, cap, kd) = (k.shape[0], k.shape[1], k.shape[2], k.shape[3])
        let dv = try Checks.valueShapes(v: v, "v", k: k, "k", out: out, q: q, op: op, kDim: kd, qDim: d)
        try Checks.sameDim("batch", kb, of: "k", as: b, of: "q", op: op)
        try Checks.positive("head_dim", d, op: op, arg: "q")
        if d > maxHeadDim { throw FlashMetalError.value(op, "head_dim must be <= \(maxHeadDim), got \(d)", arg: "q") }
        try Checks.positive("the head dim of v", dv, op: op, arg: "v")
        if dv > maxHeadDim { throw FlashMetalError.value(op, "v's head dim must be <= \(maxHeadDim), got \(dv)", arg: "v") }
        try Checks.heads(h, kvHeads: hkv, of: "k", op: op, kvHeadsArg: "k")
        try Checks.positive("q_len", qL, op: op, arg: "q")
        try Checks.positive("batch", b, op: op, arg: "q")
        try Checks.positive("the cache capacity", cap, op: op, arg: "k")
        let kvLen = o.kvLen ?? cap
        try Checks.kvLen(kvLen, capacity: cap, op: op)
        let scale = o.scale
        try Checks.scaleAndSoftcap(scale, o.softcap, op: op)
        if let w = o.window, !(1...Int(Int32.max)).contains(w) {
            throw FlashMetalError.value(op, "window must be > 0 and fit in int32, got \(w)", arg: "window")
        }
        if let off = o.qOffset, !(Int(Int32.min)...Int(Int32.max)).contains(off) {
            throw FlashMetalError.value(op, "q_offset (\(off)) is out of the int32 range", arg: "q_offset")
        }
        for (v, n, arg) in [(b, "batch", "q"), (h, "the q heads", "q"), (qL, "q_len", "q"), (cap, "the cache capacity", "k")]
        where v > Int(UInt32.max) {
            throw FlashMetalError.value(op, "\(n) (\(v)) exceeds the uint32 range of SdpaParams", arg: arg)
        }
        for (x, n) in [(q, "q"), (k, "k"), (v, "v"), (out, "out")] {
            try x.requireBytes(op: op, name: n)
        }
        let maskParams = try mask.map {
            try AttentionMask.params($0, io: q.dtype, batch: b, heads: h, qL: qL, kL: kvLen, op: op)
        }
        let params = SdpaParams(n_heads: UInt32(h), n_kv_heads: UInt32(hkv), head_dim: UInt32(d),
                                seq_len: UInt32(qL), kv_seq_len: UInt32(kvLen), scale: scale,
                                kv_capacity: UInt32(cap), do_causal: o.causal ? 1 : 0)
        var bindings: [Int: Binding] = [SdpaBuffer.q: .buffer(q), SdpaBuffer.k: .buffer(k),
                                        SdpaBuffer.v: .buffer(v), SdpaBuffer.out: .buffer(out),
                                        SdpaBuffer.params: .bytes(bytesOf(params))]
        let boolMask = mask?.dtype == .bool
        if let m = mask, let mp = maskParams {
            bindings[SdpaBuffer.maskParams] = .bytes(bytesOf(mp))
            bindings[boolMask ? SdpaBuffer.boolMask : SdpaBuffer.additiveMask] = .buffer(m)
        }
        // v of its own head dim travels in SdpaExtParams (bound for it alone too).
        if o.needsExt || dv != d {
            let qOffset = o.qOffset ?? (kvLen - qL)
            guard let off32 = Int32(exactly: qOffset) else {
                throw FlashMetalError.value(op, "q_offset (\(qOffset)) is out of the int32 range", arg: "q_offset")
            }
            let ext = SdpaExtParams(softcap: o.softcap, q_offset: off32, window: Int32(o.window ?? 0),
                                    head_dim_v: Int32(dv))
            bindings[SdpaBuffer.ext] = .bytes(bytesOf(ext))
        }
        let constants = FunctionConstants([
            (FunctionConstantIndex.sdpaBoolMask, .bool(mask != nil && boolMask)),
            (FunctionConstantIndex.sdpaAdditiveMask, .bool(mask != nil && !boolMask)),
            (FunctionConstantIndex.sdpaExt, .bool(o.needsExt || dv != d)),
            (FunctionConstantIndex.sdpaSoftcap, .bool(o.softcap != 0)),
        ])
        return Dispatch(kernel: .sdpa(io: q.dtype), constants: constants,
                        grid: Size3(b, h, (qL + tileQ - 1) / tileQ), threadgroup: Size3(tileQ, 1, 1),
                        bindings: bindings, writes: [SdpaBuffer.out])
    }
}
