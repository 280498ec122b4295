import CFlashMetal

public enum PrefillLayout: Int32, Sendable {
    /// [B, H, L, D]
    case headMajor = 0
    /// [B, L, H, D]
    case seqMajor = 1
}

public struct PrefillOptions: Sendable {
    public var scale: Float
    public var softcap: Float = 0
    public var causal: Bool = false
    /// Absolute position of query row 0 (the seeds' qL_off).
    public var qOffset: Int = 0
    /// Valid K/V length; nil means all of K's sequence axis (kv_capacity).
    public var kvLen: Int? = nil
    public var layout: PrefillLayout = .headMajor

    public init(scale: Float) { self.scale = scale }

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
    public var q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef
    public var mask: TensorRef? = nil
    public var blk: TensorRef? = nil

    public init(q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef,
                mask: TensorRef? = nil, blk: TensorRef? = nil) {
        self.q = q; self.k = k; self.v = v; self.out = out; self.mask = mask; self.blk = blk
    }
}

/// Seed 000's host logic: validation, AttnParams, tile geometry, function
/// constants, grid and bindings for `flash_attn_prefill_*`.
public enum PrefillDispatcher {
    public static let op = "flash_attn_prefill"

    public static func kernelName(dtype: DType, headDim: Int, boolMask: Bool) -> String {
        let t = dtype == .bf16 ? "bf16" : "f16"
        return "flash_attn_prefill_\(t)_d\(headDim)" + (boolMask ? "_boolmask" : "")
    }

    /// Every prefill kernel name, for the backends' kernel tables.
    public static var allKernelNames: [String] {
        var names: [String] = []
        for d in PrefillGeometry.headDims {
            for t in [DType.bf16, .f16] {
                for b in [false, true] { names.append(kernelName(dtype: t, headDim: d, boolMask: b)) }
            }
        }
        return names
    }

    /// (batch, head, seq) element strides of a rank-4 tensor in `layout`.
    static func strides(_ layout: PrefillLayout, heads: Int, len: Int, dim: Int) -> [Int64] {
        let (h, l, d) = (Int64(heads), Int64(len), Int64(dim))
        switch layout {
        case .headMajor: return [h * l * d, l * d, d]
        case .seqMajor: return [l * h * d, d, h * d]
        }
    }

    public static func makeDispatch(_ t: PrefillTensors, _ o: PrefillOptions) throws -> Dispatch {
        let op = Self.op
        for (x, n) in [(t.q, "Q"), (t.k, "K"), (t.v, "V"), (t.out, "out")] {
            try x.requireRank([4], op: op, name: n)
        }
        try t.q.requireDType([.bf16, .f16], op: op, name: "Q")
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
        if qL == 0 { throw FlashMetalError.value(op, "seq_len_q must be > 0") }
        if capacity == 0 { throw FlashMetalError.value(op, "seq_len_k must be > 0") }
        if batch == 0 { throw FlashMetalError.value(op, "batch must be > 0") }
        guard let geo = PrefillGeometry.forHeadDim(headDim) else {
            throw FlashMetalError.value(op, "head_dim must be 64, 128, 256 or 512, got \(headDim)")
        }
        let kL = o.kvLen ?? capacity
        if kL <= 0 { throw FlashMetalError.value(op, "kv_len must be > 0, got \(kL)") }
        if kL > capacity {
            throw FlashMetalError.value(op, "seq_len_k (\(kL)) > kv_capacity (\(capacity)) — K/V overshoots slot capacity")
        }
        if o.qOffset < 0 { throw FlashMetalError.value(op, "q_offset must be >= 0, got \(o.qOffset)") }
        if o.qOffset + qL > kL {
            throw FlashMetalError.value(op, "q_offset (\(o.qOffset)) + seq_len_q (\(qL)) > seq_len_k (\(kL)) — Q overshoots K")
        }
        if !o.scale.isFinite { throw FlashMetalError.value(op, "scale must be finite, got \(o.scale)") }
        if !(o.softcap.isFinite && o.softcap >= 0) {
            throw FlashMetalError.value(op, "softcap must be 0 (off) or a finite value > 0, got \(o.softcap)")
        }
        // AttnParams carries int32 dims; every product is taken in 64 bits by the kernels.
        for (v, n) in [(batch, "batch"), (nHeads, "n_heads"), (qL, "seq_len_q"), (capacity, "kv_capacity")]
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
            let need = tiles.nq * tiles.nk
            if b.byteCount < need {
                throw FlashMetalError.value(op, "blk buffer too small: expected at least \(need) bytes (NQ=\(tiles.nq), NK=\(tiles.nk)), got \(b.byteCount)")
            }
        }

        let qs = strides(o.layout, heads: nHeads, len: qL, dim: headDim)
        let ks = strides(o.layout, heads: nKV, len: capacity, dim: headDim)
        let params = AttnParams(
            B: Int32(batch), H: Int32(nHeads), D: Int32(headDim), qL: Int32(qL), kL: Int32(kL),
            gqa_factor: Int32(nHeads / nKV), scale: o.scale, softcapping: o.softcap,
            NQ: Int32(tiles.nq), NK: Int32(tiles.nk), NQ_aligned: Int32(tiles.nqAligned),
            NK_aligned: Int32(tiles.nkAligned), qL_rem: Int32(tiles.qLRem), kL_rem: Int32(tiles.kLRem),
            qL_off: Int32(o.qOffset), _pad: 0,
            Q_strides: (qs[0], qs[1], qs[2]), K_strides: (ks[0], ks[1], ks[2]),
            V_strides: (ks[0], ks[1], ks[2]), O_strides: (qs[0], qs[1], qs[2]))

        let constants = FunctionConstants([
            (PrefillConstant.alignQ, .bool(tiles.qLRem == 0)),
            (PrefillConstant.alignK, .bool(tiles.kLRem == 0)),
            (PrefillConstant.hasMask, .bool(t.mask != nil)),
            (PrefillConstant.doCausal, .bool(o.causal)),
            (PrefillConstant.hasBlk, .bool(t.blk != nil)),
        ])
        var bindings: [Int: Binding] = [
            0: .buffer(t.q), 1: .buffer(t.k), 2: .buffer(t.v), 3: .buffer(t.out),
            4: .bytes(bytesOf(params)),
        ]
        if let m = t.mask, let mp = maskParams {
            bindings[5] = .bytes(bytesOf(mp))
            bindings[6] = .buffer(m)
        }
        if let b = t.blk { bindings[7] = .buffer(b) }
        let name = kernelName(dtype: t.q.dtype, headDim: headDim, boolMask: t.mask?.dtype == .bool)
        return Dispatch(kernel: name, constants: constants,
                        grid: Size3(tiles.nq, nHeads, batch), threadgroup: geo.threadsPerGroup,
                        bindings: bindings)
    }
}
