import CFlashMetal

/// The options of one decode call (FMVecOptions, read once).
public struct VecOptions: Sendable {
    /// Score scale, finite.
    public var scale: Float
    /// Logit softcap c > 0; 0 disables it.
    public var softcap: Float = 0
    /// VecMaskType's raw value: none, causal or sliding window (the query
    /// sits at kv_len - 1). Kept an Int so bad C values reach validation.
    public var maskType: Int = VecMaskType.none.rawValue
    /// Sliding window w > 0 with the window mask: keys p with (kv_len - 1) - p < w.
    public var window: Int = 0
    /// Valid K/V length; nil means kv_capacity.
    public var kvLen: Int? = nil
    /// Fuse the FWHT sign undo into the reduce.
    public var fwht: Bool = false

    /// Options with every default but the scale.
    public init(scale: Float) { self.scale = scale }

    /// Reads the C options, rejecting out-of-range flags.
    public init(_ o: FMVecOptions) throws {
        guard o.fwht == 0 || o.fwht == 1 else {
            throw FlashMetalError.value(VecDispatcher.op, "fwht must be 0 or 1, got \(o.fwht)")
        }
        self.scale = o.scale
        self.softcap = o.softcap
        self.maskType = Int(o.mask_type)
        self.window = Int(o.window)
        self.kvLen = Int(o.kv_len)
        self.fwht = o.fwht == 1
    }
}

/// The tensors of one decode call. Batch folds into heads: rows = B*H,
/// kv rows = B*Hkv and row r reads kv row r / (H/Hkv), which is exactly the
/// memory order of [B, Hkv, cap, D].
public struct VecTensors {
    /// q/out float32 [(B,) H, D]; k/v [(B,) Hkv, cap, D]; tmp float32 scratch.
    public var q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef, tmp: TensorRef
    /// uint8 [D/8] FWHT sign bitmask, or nil for all +1.
    public var signs: TensorRef? = nil

    /// The tensors of a call; signs are optional.
    public init(q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef, tmp: TensorRef, signs: TensorRef? = nil) {
        self.q = q; self.k = k; self.v = v; self.out = out; self.tmp = tmp; self.signs = signs
    }
}

/// Seeds 002 and 004: split-KV decode `flash_attn_vec_*` over NWG = 32
/// workgroups, then `flash_attn_vec_reduce_dk*` or the fused
/// `flash_attn_vec_reduce_tq_hb_undo_dk*` as a second dispatch.
///
/// tmp (float32): partial outputs [rows, NWG, D] first, then (S, M) pairs
/// [rows, NWG, 2]; rows*NWG*(D+2)*4 bytes.
///
/// FWHT undo: the signs bitmask (D/8 bytes) binds at VecReduceBuffer.signs.
/// Its absence (all signs +1) is signalled by the function constant
/// FunctionConstantIndex.vecHasSigns = false, so no dummy buffer is bound.
///
/// Main grid (1, rows, NWG) of 32 threads, buffers VecBuffer; reduce grid
/// (rows, 1, 1) of 32*NWG threads, buffers VecReduceBuffer.
public enum VecDispatcher {
    /// The op name errors carry.
    public static let op = "flash_attn_vec"
    /// The op name of the FWHT-undo reduce's errors.
    public static let reduceOp = "flash_attn_vec_reduce_tq_hb_undo"
    /// Workgroups each row's keys are split over (FM_VEC_NWG).
    public static let nwg = VecCapability.nwg
    /// The head dims with a decode kernel.
    public static var headDims: [Int] { VecCapability.headDims }

    /// tmp bytes for `rows` query rows (B*H) of head dim `headDim`.
    public static func tmpByteCount(rows: Int, headDim: Int) -> Int {
        rows * nwg * (headDim + 2) * 4
    }

    /// Main-kernel threadgroup memory: PK + SH + 2*PV halfs, PK = PV = pad(D, 128), SH = 128.
    public static func threadgroupMemoryBytes(headDim: Int) -> Int {
        let pk = (headDim + 127) & ~127
        return (pk + 4 * 32 + 2 * pk) * 2
    }

    /// Shape facts of a call, validated: (rows, kvRows, heads, kvHeads, capacity, headDim).
    public static func shapes(q: TensorRef, k: TensorRef) throws -> (rows: Int, kvRows: Int, heads: Int, kvHeads: Int, capacity: Int, headDim: Int) {
        try q.requireRank([2, 3], op: op, name: "q")
        try k.requireRank([q.rank + 1], op: op, name: "k")
        let batch = q.rank == 3 ? q.shape[0] : 1
        let (heads, d) = (q.shape[q.rank - 2], q.shape[q.rank - 1])
        let kb = k.rank == 4 ? k.shape[0] : 1
        let (kvHeads, cap, kd) = (k.shape[k.rank - 3], k.shape[k.rank - 2], k.shape[k.rank - 1])
        if kb != batch { throw FlashMetalError.value(op, "k batch (\(kb)) must equal q batch (\(batch))") }
        if kd != d { throw FlashMetalError.value(op, "k head_dim (\(kd)) must equal q head_dim (\(d))") }
        try VecCapability.requireHeadDim(d, op: op)
        if batch == 0 { throw FlashMetalError.value(op, "batch must be > 0") }
        if heads == 0 || kvHeads == 0 {
            throw FlashMetalError.value(op, "num_heads and num_kv_heads must be > 0, got \(heads) and \(kvHeads)")
        }
        if heads % kvHeads != 0 {
            throw FlashMetalError.value(op, "num_heads (\(heads)) must be divisible by num_kv_heads (\(kvHeads))")
        }
        if cap == 0 { throw FlashMetalError.value(op, "the cache capacity must be > 0") }
        let (rows, o1) = batch.multipliedReportingOverflow(by: heads)
        let (kvRows, o2) = batch.multipliedReportingOverflow(by: kvHeads)
        if o1 || o2 || rows > Int(UInt32.max) || kvRows > Int(UInt32.max) || cap > Int(UInt32.max)
            || rows > Int.max / (nwg * (d + 2) * 4) {
            throw FlashMetalError.value(op, "batch*num_heads (\(batch)x\(heads)) or the cache capacity (\(cap)) exceeds the uint32 range of FlashAttnVecParams")
        }
        return (rows, kvRows, heads, kvHeads, cap, d)
    }

    /// Validates a call and builds its two dispatches (decode, then reduce).
    /// Preconditions: float32 q/out/tmp, k and v of one dtype in
    /// VecCapability.kvTypes, a head dim with a kernel, 0 < kv_len <= capacity,
    /// a known mask type with a window > 0 for the window mask, a finite
    /// scale, softcap 0 or > 0, tmp of tmpByteCount bytes, D/8 sign bytes.
    public static func makeDispatches(_ t: VecTensors, _ o: VecOptions) throws -> [Dispatch] {
        try t.q.requireDType([.f32], op: op, name: "q")
        try t.k.requireDType(VecCapability.kvTypes, op: op, name: "k")
        if t.v.dtype != t.k.dtype {
            throw FlashMetalError.type(op, "v dtype \(t.v.dtype.name) does not match k dtype \(t.k.dtype.name)")
        }
        try t.out.requireDType([.f32], op: op, name: "out")
        try t.tmp.requireDType([.f32], op: op, name: "tmp")
        let s = try shapes(q: t.q, k: t.k)
        if t.v.shape != t.k.shape { throw FlashMetalError.value(op, "v shape \(t.v.shape) must equal k shape \(t.k.shape)") }
        if t.out.shape != t.q.shape { throw FlashMetalError.value(op, "out shape \(t.out.shape) must equal q shape \(t.q.shape)") }
        let kvLen = o.kvLen ?? s.capacity
        if kvLen <= 0 { throw FlashMetalError.value(op, "kv_len must be > 0, got \(kvLen)") }
        if kvLen > s.capacity {
            throw FlashMetalError.value(op, "kv_len (\(kvLen)) must be <= the cache capacity (\(s.capacity))")
        }
        guard let maskType = VecMaskType(rawValue: o.maskType) else {
            throw FlashMetalError.value(op, "mask_type must be 0 (none), 1 (causal) or 2 (sliding window), got \(o.maskType)")
        }
        if maskType == .window && (o.window <= 0 || o.window > Int(UInt32.max)) {
            throw FlashMetalError.value(op, "window must be > 0 with the sliding-window mask, got \(o.window)")
        }
        let scale = o.scale
        if !scale.isFinite { throw FlashMetalError.value(op, "scale must be finite, got \(o.scale)") }
        if !(o.softcap.isFinite && o.softcap >= 0) {
            throw FlashMetalError.value(op, "softcap must be 0 (off) or a finite value > 0, got \(o.softcap)")
        }
        for (x, n) in [(t.q, "q"), (t.k, "k"), (t.v, "v"), (t.out, "out")] {
            try x.requireBytes(op: op, name: n)
        }
        let tmpBytes = tmpByteCount(rows: s.rows, headDim: s.headDim)
        if t.tmp.byteCount < tmpBytes {
            throw FlashMetalError.value(op, "tmp buffer too small: expected at least \(tmpBytes) bytes (rows=\(s.rows), NWG=\(nwg), D=\(s.headDim)), got \(t.tmp.byteCount)")
        }
        if let sg = t.signs {
            if !o.fwht { throw FlashMetalError.value(op, "fwht_signs given without fwht") }
            try sg.requireDType([.u8], op: reduceOp, name: "fwht_signs")
            let need = s.headDim / 8
            if sg.elementCount != need || sg.byteCount < need {
                throw FlashMetalError.value(reduceOp, "fwht_signs must hold head_dim/8 = \(need) bytes, got shape \(sg.shape) (\(sg.byteCount) bytes)")
            }
        }

        let params = FlashAttnVecParams(
            n_heads: UInt32(s.rows), n_kv_heads: UInt32(s.kvRows), head_dim: UInt32(s.headDim),
            kv_seq_len: UInt32(kvLen), kv_capacity: UInt32(s.capacity), scale: scale,
            mask_type: UInt32(maskType.rawValue), sliding_window: UInt32(maskType == .window ? o.window : 0),
            softcap: o.softcap, nwg: UInt32(nwg))
        let main = Dispatch(
            kernel: .vec(kv: t.k.dtype, headDim: s.headDim),
            grid: Size3(1, s.rows, nwg), threadgroup: Size3(32, 1, 1),
            bindings: [VecBuffer.params: .bytes(bytesOf(params)), VecBuffer.q: .buffer(t.q),
                       VecBuffer.k: .buffer(t.k), VecBuffer.v: .buffer(t.v), VecBuffer.tmp: .buffer(t.tmp)],
            threadgroupMemory: [0: threadgroupMemoryBytes(headDim: s.headDim)],
            writes: [VecBuffer.tmp])
        let reduce = try reduceDispatch(tmp: t.tmp, out: t.out, rows: s.rows, headDim: s.headDim,
                                        nwg: nwg, fwht: o.fwht, signs: t.signs)
        return [main, reduce]
    }

    /// The reduce (plain or fused with the FWHT sign undo) over `nwg` partials
    /// (1...32) of `rows` rows in `tmp`, into float32 `out`.
    public static func reduceDispatch(tmp: TensorRef, out: TensorRef, rows: Int, headDim: Int, nwg: Int,
                                      fwht: Bool, signs: TensorRef?) throws -> Dispatch {
        let rop = fwht ? reduceOp : "flash_attn_vec_reduce"
        if nwg <= 0 || nwg > 32 { throw FlashMetalError.value(rop, "nwg must be > 0 and <= 32, got \(nwg)") }
        try VecCapability.requireHeadDim(headDim, op: rop)
        let nwg32 = UInt32(nwg)
        var bindings: [Int: Binding] = [
            VecReduceBuffer.params: .bytes(bytesOf(FlashAttnVecReduceParams(nrows: UInt32(rows)))),
            VecReduceBuffer.tmp: .buffer(tmp), VecReduceBuffer.out: .buffer(out),
            VecReduceBuffer.nwg: .bytes(bytesOf(nwg32)),
        ]
        var constants = FunctionConstants()
        var tgMem: [Int: Int] = [:]
        if fwht {
            if let s = signs { bindings[VecReduceBuffer.signs] = .buffer(s) }
            constants = FunctionConstants([(FunctionConstantIndex.vecHasSigns, .bool(signs != nil))])
            tgMem[0] = headDim * 4
        }
        return Dispatch(kernel: .vecReduce(headDim: headDim, fwht: fwht), constants: constants,
                        grid: Size3(rows, 1, 1), threadgroup: Size3(32 * nwg, 1, 1),
                        bindings: bindings, threadgroupMemory: tgMem,
                        // Correct for any multiple of 32 threads: Metal may allow fewer than 1024.
                        writes: [VecReduceBuffer.out], threadgroupFlexible: true)
    }
}
