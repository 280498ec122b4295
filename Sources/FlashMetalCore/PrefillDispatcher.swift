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
    /// Absolute position of query row 0 (mlx-native's qL_off).
    public var qOffset: Int = 0
    /// Valid K/V length; nil means all of K's sequence axis (kv_capacity).
    public var kvLen: Int? = nil
    /// Memory order of Q, K, V and out.
    public var layout: PrefillLayout = .headMajor
    /// Sliding window w: keys p with t - p < w (in-kernel, AttnSeqParams.window_left = w - 1); 0 = none.
    public var window: Int = 0

    /// Options with every default but the scale.
    public init(scale: Float) { self.scale = scale }

    /// Reads the C options, rejecting out-of-range enum values.
    public init(_ o: FMPrefillOptions) throws {
        guard let layout = PrefillLayout(rawValue: o.layout) else {
            throw FlashMetalError.value(PrefillDispatcher.op, "layout must be 0 (bhld) or 1 (blhd), got \(o.layout)", arg: "layout")
        }
        guard o.causal == 0 || o.causal == 1 else {
            throw FlashMetalError.value(PrefillDispatcher.op, "causal must be 0 or 1, got \(o.causal)", arg: "causal")
        }
        self.scale = o.scale
        self.softcap = o.softcap
        self.causal = o.causal == 1
        self.qOffset = Int(o.q_offset)
        self.kvLen = o.kv_len == 0 ? nil : Int(o.kv_len)
        self.layout = layout
        self.window = Int(o.window)
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
    /// float32 [H] per-head sink logits (gpt-oss): each joins its head's
    /// softmax denominators without a value, beside any mask.
    public var sinks: TensorRef? = nil

    /// The tensors of a call; mask, blk and sinks are optional.
    public init(q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef,
                mask: TensorRef? = nil, blk: TensorRef? = nil, sinks: TensorRef? = nil) {
        self.q = q; self.k = k; self.v = v; self.out = out; self.mask = mask; self.blk = blk; self.sinks = sinks
    }
}

/// The prefill's host logic: validation, AttnParams, tile geometry, function
/// constants, grid and bindings for `flash_attn_prefill_*`.
///
/// Grid (NQ, H, B) threadgroups of PrefillGeometry.threadsPerGroup; buffers
/// (PrefillBuffer) Q, K, V, out, AttnParams, then with a mask AttnMaskParams
/// and the mask, and the blk; constants align_Q/align_K/has_mask/do_causal/
/// has_blk/tile_load_bytes (FunctionConstantIndex).
public enum PrefillDispatcher {
    /// The op name errors carry.
    public static let op = "flash_attn_prefill"
    /// The name the head-dim query takes for the prefill's float32 I/O.
    public static let f32Name = "flash_attn_prefill_f32"

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
    /// tensors of one dtype in PrefillCapability.ioTypes, a head dim in
    /// 1...512, H a multiple of Hkv, 0 < kv_len <= capacity, q_offset >= 0,
    /// q_offset + qL <= kv_len when causal or windowed, a finite scale, softcap 0 or > 0, window >= 0, buffers that
    /// cover their shapes, a blk of shape [NQ, NK] with a rank-2 mask.
    public static func makeDispatch(_ t: PrefillTensors, _ o: PrefillOptions) throws -> Dispatch {
        let op = Self.op
        for (x, n) in [(t.q, "q"), (t.k, "k"), (t.v, "v"), (t.out, "out")] {
            try x.requireRank([4], op: op, name: n)
        }
        try requireIOTypes(q: (t.q, "q"), others: [(t.k, "k"), (t.v, "v"), (t.out, "out")], op: op)

        // Shapes by layout: Q/out [B, H, qL, D] or [B, qL, H, D]; K/V likewise with (Hkv, capacity).
        let seq = o.layout == .seqMajor
        let (batch, nHeads, qL, headDim) = seq
            ? (t.q.shape[0], t.q.shape[2], t.q.shape[1], t.q.shape[3])
            : (t.q.shape[0], t.q.shape[1], t.q.shape[2], t.q.shape[3])
        let (kBatch, nKV, capacity, kDim) = seq
            ? (t.k.shape[0], t.k.shape[2], t.k.shape[1], t.k.shape[3])
            : (t.k.shape[0], t.k.shape[1], t.k.shape[2], t.k.shape[3])
        let headDimV = try Checks.valueShapes(v: t.v, "v", k: t.k, "k", out: t.out, q: t.q, op: op, kDim: kDim,
                                              qDim: headDim)
        try Checks.sameDim("batch", kBatch, of: "k", as: batch, of: "q", op: op)
        try Checks.heads(nHeads, kvHeads: nKV, of: "k", op: op, kvHeadsArg: "k")
        try Checks.positive("q_len", qL, op: op, arg: "q")
        try Checks.positive("the cache capacity", capacity, op: op, arg: "k")
        try Checks.positive("batch", batch, op: op, arg: "q")
        let tileDim = try PrefillCapability.tileDim(headDim: headDim, headDimV: headDimV, op: op, vName: "v")
        let geo = try PrefillCapability.geometry(io: t.q.dtype, headDim: tileDim, op: op)
        let kL = o.kvLen ?? capacity
        try Checks.kvLen(kL, capacity: capacity, op: op)
        let qOffset = o.qOffset
        if qOffset < 0 { throw FlashMetalError.value(op, "q_offset must be >= 0, got \(qOffset)", arg: "q_offset") }
        // Positions matter only to causal and the window: without them every row sees every key, and q may
        // have more rows than there are keys.
        if qOffset + qL > kL && (o.causal || o.window > 0) {
            throw FlashMetalError.value(op, "q_offset (\(qOffset)) + q_len (\(qL)) must be <= kv_len (\(kL))", arg: "q_offset")
        }
        try Checks.scaleAndSoftcap(o.scale, o.softcap, op: op)
        if o.window < 0 { throw FlashMetalError.value(op, "window must be >= 0 (0 = none), got \(o.window)", arg: "window") }
        // AttnParams carries int32 dims; every product is taken in 64 bits by the kernels.
        for (v, n, arg) in [(batch, "batch", "q"), (nHeads, "the q heads", "q"), (qL, "q_len", "q"),
                            (capacity, "the cache capacity", "k")]
        where v > Int(Int32.max) {
            throw FlashMetalError.value(op, "\(n) (\(v)) exceeds the int32 range of AttnParams", arg: arg)
        }
        for (x, n) in [(t.q, "q"), (t.k, "k"), (t.v, "v"), (t.out, "out")] {
            try x.requireBytes(op: op, name: n)
        }

        let tiles = geo.tiles(qL: qL, kL: kL)
        let maskParams = try t.mask.map {
            try AttentionMask.params($0, io: t.q.dtype, batch: batch, heads: nHeads, qL: qL, kL: kL, op: op)
        }
        if let b = t.blk {
            if t.mask == nil {
                throw FlashMetalError.value(op, "blk requires mask (a blk without a mask is meaningless)", arg: "blk")
            }
            if t.mask?.shape != [qL, kL] {
                throw FlashMetalError.value(op, "blk requires a rank-2 [qL, kL] mask, got mask shape \(t.mask!.shape)", arg: "blk")
            }
            try b.requireDType([.u8], op: op, name: "blk")
            // Built for q's head dim (as the caller names it) where its tiles are the kernel's, else for the
            // larger of q's and v's, whose tile the kernel runs (q/k of 64 over v of 300: the 512 tile).
            let blkDim = (try? PrefillCapability.geometry(headDim: headDim, op: op)) == geo ? headDim
                : max(headDim, headDimV)
            if b.shape != [tiles.nq, tiles.nk] {
                throw FlashMetalError.value(
                    op, "blk shape \(b.shape) must be [NQ, NK] = [\(tiles.nq), \(tiles.nk)] for head_dim \(blkDim) "
                        + "and a [\(qL), \(kL)] mask (build it with that head dim and mask)", arg: "blk")
            }
            try BlkAllocations.requireMadeFor(b, headDim: blkDim, qL: qL, kL: kL, op: op, name: "blk")
        }

        let qs = strides(o.layout, heads: nHeads, len: qL, dim: headDim)
        let ks = strides(o.layout, heads: nKV, len: capacity, dim: headDim)
        let params = attnParams(
            batch: batch, heads: nHeads, kvHeads: nKV, headDim: headDim, headDimV: headDimV, qL: qL, kL: kL,
            tiles: tiles, scale: o.scale, softcap: o.softcap, qOffset: qOffset, q: qs, k: ks,
            v: strides(o.layout, heads: nKV, len: capacity, dim: headDimV),
            o: strides(o.layout, heads: nHeads, len: qL, dim: headDimV))
        var ext = PrefillExtension()
        if o.window > 0 {
            ext.window = true
            ext.params.window_left = Int32(o.window - 1)
        }
        if let s = t.sinks {
            try s.requireDType([.f32], op: op, name: "sinks")
            if s.shape != [nHeads] {
                throw FlashMetalError.value(op, "sinks must have shape [\(nHeads)] (the heads of Q), got \(s.shape)")
            }
            try s.requireBytes(op: op, name: "sinks")
            ext.sinks = s
        }
        return assemble(t, params: params, maskParams: maskParams, geometry: geo, causal: o.causal, ext: ext)
    }

    /// Auto-blk: a caller mask without a blk gets one built
    /// by the blk pre-pass when it pays. It pays when one blk serves every
    /// (batch, head) — a mask (additive or bool) broadcast over B and H with
    /// its own qL rows, i.e. mask strides (0, 0, kL)
    /// — and the problem has at least `autoBlkMinKeyTiles` key tiles and
    /// `autoBlkMinTiles` tiles: the pre-pass reads the mask once (what one
    /// head's prefill reads anyway, against D multiply-adds per cell there),
    /// and each all-masked tile it finds is a tile of QK^T and PV no (batch,
    /// head) computes. Below those sizes the extra launch costs more than a
    /// skipped tile can save. The output is bit-identical to the run without
    /// blk (the kernel's contract).
    public static let autoBlkMinKeyTiles = 2
    /// See autoBlkMinKeyTiles.
    public static let autoBlkMinTiles = 4

    /// Validates a call; the scratch bytes of its auto-blk, or nil when the
    /// call gets none (see autoBlkMinKeyTiles).
    public static func autoBlkBytes(_ t: PrefillTensors, _ o: PrefillOptions) throws -> Int? {
        let d = try makeDispatch(t, o)
        guard t.blk == nil, let m = t.mask, BlkCapability.maskTypes.contains(m.dtype) else { return nil }
        let p = try d.params(PrefillBuffer.params, as: AttnParams.self)
        let mp = try d.params(PrefillBuffer.maskParams, as: AttnMaskParams.self)
        let shared = mp.M_strides.0 == 0 && mp.M_strides.1 == 0 && mp.M_strides.2 == Int64(p.kL)
        let tiles = Int(p.NQ) * Int(p.NK)
        return shared && Int(p.NK) >= autoBlkMinKeyTiles && tiles >= autoBlkMinTiles ? tiles : nil
    }

    /// The dispatches of a call: the prefill alone, or with `blkMemory` (at
    /// least autoBlkBytes) the blk pre-pass of the caller's mask into it,
    /// then the prefill reading that blk.
    public static func makeDispatches(_ t: PrefillTensors, _ o: PrefillOptions,
                                      blkMemory: TensorRef? = nil) throws -> [Dispatch] {
        guard let mem = blkMemory, let m = t.mask else { return [try makeDispatch(t, o)] }
        let p = try makeDispatch(t, o).params(PrefillBuffer.params, as: AttnParams.self)
        let (nq, nk) = (Int(p.NQ), Int(p.NK))
        if mem.byteCount < nq * nk {
            throw FlashMetalError.internalError("\(op): auto-blk scratch of \(mem.byteCount) bytes < \(nq * nk)")
        }
        // The mask as the [qL, kL] it is read as (its B and H strides are 0).
        let mask = m.reshaped([Int(p.qL), Int(p.kL)])
        let blk = mem.reshaped([nq, nk], dtype: .u8, byteCount: nq * nk)
        var withBlk = t
        withBlk.mask = mask
        withBlk.blk = blk
        return [try BlkDispatcher.makeDispatch(mask: mask, blk: blk, headDim: Int(max(p.D, p.Dv))),
                try makeDispatch(withBlk, o)]
    }

    /// q's dtype is a prefill I/O type and every other tensor has it.
    static func requireIOTypes(q: (TensorRef, String), others: [(TensorRef, String)], op: String) throws {
        try q.0.requireDType(PrefillCapability.ioTypes, op: op, name: q.1)
        for (x, n) in others { try Checks.sameDType(x, n, as: q.0, q.1, op: op) }
    }

    /// AttnParams of validated dims (each within int32); strides are (batch,
    /// head, seq) elements. headDim is q's and k's, headDimV v's and out's.
    static func attnParams(batch: Int, heads: Int, kvHeads: Int, headDim: Int, headDimV: Int, qL: Int, kL: Int,
                           tiles: PrefillTiles, scale: Float, softcap: Float, qOffset: Int,
                           q: [Int64], k: [Int64], v: [Int64], o: [Int64]) -> AttnParams {
        AttnParams(
            B: Int32(batch), H: Int32(heads), D: Int32(headDim), qL: Int32(qL), kL: Int32(kL),
            gqa_factor: Int32(heads / kvHeads), scale: scale, softcapping: softcap,
            NQ: Int32(tiles.nq), NK: Int32(tiles.nk), NQ_aligned: Int32(tiles.nqAligned),
            NK_aligned: Int32(tiles.nkAligned), qL_rem: Int32(tiles.qLRem), kL_rem: Int32(tiles.kLRem),
            qL_off: Int32(qOffset), Dv: Int32(headDimV),
            Q_strides: (q[0], q[1], q[2]), K_strides: (k[0], k[1], k[2]),
            V_strides: (v[0], v[1], v[2]), O_strides: (o[0], o[1], o[2]))
    }

    /// The tile loaders' device load width (FunctionConstantIndex.tileLoadBytes):
    /// 16 or 8 when Q, K and V start on a boundary of that many bytes and every
    /// element stride of theirs (the page strides of paged K/V too) and the
    /// head dim are multiples of the elements in it, so every run the kernel
    /// reads is aligned and lies wholly inside D or wholly past it; else 4
    /// (column pairs, any alignment).
    static func tileLoadBytes(_ t: PrefillTensors, params p: AttnParams, ext: PrefillExtension) -> Int {
        var strides = [p.Q_strides.0, p.Q_strides.1, p.Q_strides.2, p.K_strides.0, p.K_strides.1, p.K_strides.2,
                       p.V_strides.0, p.V_strides.1, p.V_strides.2]
        if ext.blockTable != nil { strides += [ext.params.K_page_stride, ext.params.V_page_stride] }
        for bytes in [16, 8] {
            let run = Int64(bytes / t.q.dtype.byteSize)
            if Int64(p.D) % run == 0, strides.allSatisfy({ $0 % run == 0 }),
               [t.q, t.k, t.v].allSatisfy({ Int(bitPattern: $0.data) % bytes == 0 }) {
                return bytes
            }
        }
        return 4
    }

    /// The Dispatch of a validated prefill: every function constant the
    /// kernel declares (200, 201, 300-312), a grid of the kernel's query
    /// tiles (NQ of its own geometry, which for float32 may be finer than
    /// AttnParams' tile-skip NQ) by H by B, the bindings.
    /// Per-sequence mode is never aligned (its lengths differ per sequence).
    static func assemble(_ t: PrefillTensors, params p: AttnParams, maskParams: AttnMaskParams?,
                         geometry: PrefillGeometry, causal: Bool, ext: PrefillExtension) -> Dispatch {
        // The kernel of max(D, Dv)'s tile width; p.D and p.Dv carry the true
        // dims (Q/K loads stop at D, V loads and stores at Dv).
        let wide = Int(max(p.D, p.Dv))
        let tile = PrefillCapability.tileHeadDim(wide) ?? wide
        let geo = PrefillCapability.kernelGeometry(io: t.q.dtype, headDim: tile) ?? geometry
        let tiles = geo.tiles(qL: Int(p.qL), kL: Int(p.kL))
        let constants = FunctionConstants([
            (FunctionConstantIndex.alignQ, .bool(tiles.qLRem == 0 && !ext.perSequence)),
            (FunctionConstantIndex.alignK, .bool(tiles.kLRem == 0 && !ext.perSequence)),
            (FunctionConstantIndex.hasMask, .bool(t.mask != nil)),
            (FunctionConstantIndex.doCausal, .bool(causal)),
            (FunctionConstantIndex.hasBlk, .bool(t.blk != nil)),
            (FunctionConstantIndex.tileLoadBytes, .int(Int32(tileLoadBytes(t, params: p, ext: ext)))),
        ] + ext.constants)
        var bindings: [Int: Binding] = [
            PrefillBuffer.q: .buffer(t.q), PrefillBuffer.k: .buffer(t.k), PrefillBuffer.v: .buffer(t.v),
            PrefillBuffer.out: .buffer(t.out), PrefillBuffer.params: .bytes(bytesOf(p)),
        ]
        if let m = t.mask, let mp = maskParams {
            bindings[PrefillBuffer.maskParams] = .bytes(bytesOf(mp))
            bindings[PrefillBuffer.mask] = .buffer(m)
        }
        if let b = t.blk { bindings[PrefillBuffer.blk] = .buffer(b) }
        ext.bind(&bindings)
        let spec = KernelSpec.prefill(io: t.q.dtype, headDim: tile, boolMask: t.mask?.dtype == .bool)
        return Dispatch(kernel: spec, constants: constants,
                        grid: Size3(tiles.nq, Int(p.H), Int(p.B)), threadgroup: geo.threadsPerGroup,
                        bindings: bindings, writes: Set([PrefillBuffer.out] + ext.writes))
    }
}
