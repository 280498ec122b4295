import CFlashMetal

/// The memory order of prefill tensors; raw values are FMLayout's.
public enum PrefillLayout: Int32, CaseIterable, Sendable {
    /// [B, H, L, D]
    case headMajor = 0
    /// [B, L, H, D]
    case seqMajor = 1
}

/// The options of one prefill call (FMPrefillOptions, read once).
public struct PrefillOptions: Sendable {
    /// Score scale, finite (callers usually pass 1/sqrt(D)).
    public var scale: Float
    /// Logit softcap c > 0 (`c * tanh(s / c)`); 0 disables it.
    public var softcap: Float = 0
    /// Query row i sees keys <= qOffset + i.
    public var causal: Bool = false
    /// Absolute position of query row 0 (the seeds' qL_off).
    public var qOffset: Int = 0
    /// Valid K/V length; nil means all of K's sequence axis (kv_capacity).
    public var kvLen: Int? = nil
    /// Memory order of Q, K, V and out.
    public var layout: PrefillLayout = .headMajor

    /// Options with every default but the scale.
    public init(scale: Float) { self.scale = scale }

    /// Reads the C options, rejecting out-of-range enum values.
    public init(_ o: FMPrefillOptions) throws {
        guard let layout = PrefillLayout(rawValue: o.layout) else {
            throw FlashMetalError.value(PrefillDispatcher.op, "layout must be 0 (bhld) or 1 (blhd), got \(o.layout)")
        }
        guard o.causal == 0 || o.causal == 1 else {
            throw FlashMetalError.value(PrefillDispatcher.op, "causal must be 0 or 1, got \(o.causal)")
        }
        self.scale = o.scale
        self.softcap = o.softcap
        self.causal = o.causal == 1
        self.qOffset = Int(o.q_offset)
        self.kvLen = o.kv_len == 0 ? nil : Int(o.kv_len)
        self.layout = layout
    }
}

/// The tensors of one prefill call.
public struct PrefillTensors {
    /// Q, K, V and the output: rank 4 in the call's layout.
    public var q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef
    /// Additive (Q's dtype) or bool mask, [qL, kL] or [B, H, qL, kL].
    public var mask: TensorRef? = nil
    /// uint8 [NQ, NK] tile classes from the blk pre-pass (needs a rank-2 mask).
    public var blk: TensorRef? = nil

    /// The tensors of a call; mask and blk are optional.
    public init(q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef,
                mask: TensorRef? = nil, blk: TensorRef? = nil) {
        self.q = q; self.k = k; self.v = v; self.out = out; self.mask = mask; self.blk = blk
    }
}

/// Seed 000's host logic: validation, AttnParams, tile geometry, function
/// constants, grid and bindings for `flash_attn_prefill_*`.
///
/// Grid (NQ, H, B) threadgroups of PrefillGeometry.threadsPerGroup; buffers
/// (PrefillBuffer) Q, K, V, out, AttnParams, then with a mask AttnMaskParams
/// and the mask, and the blk; constants align_Q/align_K/has_mask/do_causal/
/// has_blk (FunctionConstantIndex).
public enum PrefillDispatcher {
    /// The op name errors carry.
    public static let op = "flash_attn_prefill"

    /// (batch, head, seq) element strides of a rank-4 tensor in `layout`.
    static func strides(_ layout: PrefillLayout, heads: Int, len: Int, dim: Int) -> [Int64] {
        let (h, l, d) = (Int64(heads), Int64(len), Int64(dim))
        switch layout {
        case .headMajor: return [h * l * d, l * d, d]
        case .seqMajor: return [l * h * d, d, h * d]
        }
    }

    /// Validates a call and builds its dispatch. Preconditions (each a
    /// ValueError/TypeError naming the op and the value otherwise): rank-4
    /// tensors of one dtype in PrefillCapability.ioTypes, a head dim with a
    /// kernel, H a multiple of Hkv, 0 < kv_len <= capacity, q_offset >= 0,
    /// q_offset + qL <= kv_len, a finite scale, softcap 0 or > 0, buffers that
    /// cover their shapes, a blk of shape [NQ, NK] with a rank-2 mask.
    public static func makeDispatch(_ t: PrefillTensors, _ o: PrefillOptions) throws -> Dispatch {
        let op = Self.op
        for (x, n) in [(t.q, "Q"), (t.k, "K"), (t.v, "V"), (t.out, "out")] {
            try x.requireRank([4], op: op, name: n)
        }
        try t.q.requireDType(PrefillCapability.ioTypes, op: op, name: "Q")
        for (x, n) in [(t.k, "K"), (t.v, "V"), (t.out, "out")] where x.dtype != t.q.dtype {
            throw FlashMetalError.type(op, "\(n) dtype \(x.dtype.name) does not match Q dtype \(t.q.dtype.name)")
        }

        // Shapes by layout: Q/out [B, H, qL, D] or [B, qL, H, D]; K/V likewise with (Hkv, capacity).
        let seq = o.layout == .seqMajor
        let (batch, nHeads, qL, headDim) = seq
            ? (t.q.shape[0], t.q.shape[2], t.q.shape[1], t.q.shape[3])
            : (t.q.shape[0], t.q.shape[1], t.q.shape[2], t.q.shape[3])
        let (kBatch, nKV, capacity, kDim) = seq
            ? (t.k.shape[0], t.k.shape[2], t.k.shape[1], t.k.shape[3])
            : (t.k.shape[0], t.k.shape[1], t.k.shape[2], t.k.shape[3])
        if t.v.shape != t.k.shape {
            throw FlashMetalError.value(op, "V shape \(t.v.shape) must equal K shape \(t.k.shape)")
        }
        if t.out.shape != t.q.shape {
            throw FlashMetalError.value(op, "out shape \(t.out.shape) must equal Q shape \(t.q.shape)")
        }
        if kBatch != batch {
            throw FlashMetalError.value(op, "K batch (\(kBatch)) must equal Q batch (\(batch))")
        }
        if kDim != headDim {
            throw FlashMetalError.value(op, "K head_dim (\(kDim)) must equal Q head_dim (\(headDim))")
        }
        if nHeads == 0 { throw FlashMetalError.value(op, "n_heads must be > 0") }
        if nKV == 0 { throw FlashMetalError.value(op, "n_kv_heads must be > 0") }
        if nHeads % nKV != 0 {
            throw FlashMetalError.value(op, "n_heads (\(nHeads)) must be divisible by n_kv_heads (\(nKV))")
        }
        if qL == 0 { throw FlashMetalError.value(op, "q_len must be > 0") }
        if capacity == 0 { throw FlashMetalError.value(op, "the K/V capacity must be > 0") }
        if batch == 0 { throw FlashMetalError.value(op, "batch must be > 0") }
        let geo = try PrefillCapability.geometry(headDim: headDim, op: op)
        let kL = o.kvLen ?? capacity
        if kL <= 0 { throw FlashMetalError.value(op, "kv_len must be > 0, got \(kL)") }
        if kL > capacity {
            throw FlashMetalError.value(op, "kv_len (\(kL)) must be <= the K/V capacity (\(capacity))")
        }
        let qOffset = o.qOffset
        if qOffset < 0 { throw FlashMetalError.value(op, "q_offset must be >= 0, got \(qOffset)") }
        if qOffset + qL > kL {
            throw FlashMetalError.value(op, "q_offset (\(qOffset)) + q_len (\(qL)) must be <= kv_len (\(kL))")
        }
        let scale = o.scale
        if !scale.isFinite { throw FlashMetalError.value(op, "scale must be finite, got \(o.scale)") }
        if !(o.softcap.isFinite && o.softcap >= 0) {
            throw FlashMetalError.value(op, "softcap must be 0 (off) or a finite value > 0, got \(o.softcap)")
        }
        // AttnParams carries int32 dims; every product is taken in 64 bits by the kernels.
        for (v, n) in [(batch, "batch"), (nHeads, "n_heads"), (qL, "q_len"), (capacity, "K/V capacity")]
        where v > Int(Int32.max) {
            throw FlashMetalError.value(op, "\(n) (\(v)) exceeds the int32 range of AttnParams")
        }
        for (x, n) in [(t.q, "Q"), (t.k, "K"), (t.v, "V"), (t.out, "out")] {
            try x.requireBytes(op: op, name: n)
        }

        let tiles = geo.tiles(qL: qL, kL: kL)
        let maskParams = try t.mask.map {
            try AttentionMask.params($0, io: t.q.dtype, batch: batch, heads: nHeads, qL: qL, kL: kL, op: op)
        }
        if let b = t.blk {
            if t.mask == nil {
                throw FlashMetalError.value(op, "blk requires mask (a blk without a mask is meaningless)")
            }
            if t.mask?.shape != [qL, kL] {
                throw FlashMetalError.value(op, "blk requires a rank-2 [qL, kL] mask, got mask shape \(t.mask!.shape)")
            }
            try b.requireDType([.u8], op: op, name: "blk")
            if b.shape != [tiles.nq, tiles.nk] {
                throw FlashMetalError.value(op, "blk shape \(b.shape) must be [NQ, NK] = [\(tiles.nq), \(tiles.nk)] for head_dim \(headDim) and a [\(qL), \(kL)] mask (build it with that head dim and mask)")
            }
            try BlkAllocations.requireMadeFor(b, headDim: headDim, qL: qL, kL: kL, op: op, name: "blk")
        }

        let qs = strides(o.layout, heads: nHeads, len: qL, dim: headDim)
        let ks = strides(o.layout, heads: nKV, len: capacity, dim: headDim)
        let params = AttnParams(
            B: Int32(batch), H: Int32(nHeads), D: Int32(headDim), qL: Int32(qL), kL: Int32(kL),
            gqa_factor: Int32(nHeads / nKV), scale: scale, softcapping: o.softcap,
            NQ: Int32(tiles.nq), NK: Int32(tiles.nk), NQ_aligned: Int32(tiles.nqAligned),
            NK_aligned: Int32(tiles.nkAligned), qL_rem: Int32(tiles.qLRem), kL_rem: Int32(tiles.kLRem),
            qL_off: Int32(qOffset), _pad: 0,
            Q_strides: (qs[0], qs[1], qs[2]), K_strides: (ks[0], ks[1], ks[2]),
            V_strides: (ks[0], ks[1], ks[2]), O_strides: (qs[0], qs[1], qs[2]))

        let constants = FunctionConstants([
            (FunctionConstantIndex.alignQ, .bool(tiles.qLRem == 0)),
            (FunctionConstantIndex.alignK, .bool(tiles.kLRem == 0)),
            (FunctionConstantIndex.hasMask, .bool(t.mask != nil)),
            (FunctionConstantIndex.doCausal, .bool(o.causal)),
            (FunctionConstantIndex.hasBlk, .bool(t.blk != nil)),
        ])
        var bindings: [Int: Binding] = [
            PrefillBuffer.q: .buffer(t.q), PrefillBuffer.k: .buffer(t.k), PrefillBuffer.v: .buffer(t.v),
            PrefillBuffer.out: .buffer(t.out), PrefillBuffer.params: .bytes(bytesOf(params)),
        ]
        if let m = t.mask, let mp = maskParams {
            bindings[PrefillBuffer.maskParams] = .bytes(bytesOf(mp))
            bindings[PrefillBuffer.mask] = .buffer(m)
        }
        if let b = t.blk { bindings[PrefillBuffer.blk] = .buffer(b) }
        let spec = KernelSpec.prefill(io: t.q.dtype, headDim: headDim, boolMask: t.mask?.dtype == .bool)
        return Dispatch(kernel: spec, constants: constants,
                        grid: Size3(tiles.nq, nHeads, batch), threadgroup: geo.threadsPerGroup,
                        bindings: bindings, writes: [PrefillBuffer.out])
    }
}

