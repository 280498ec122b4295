import CFlashMetal

public struct VecOptions: Sendable {
    public var scale: Float
    public var softcap: Float = 0
    /// 0 none, 1 causal, 2 sliding window (the query sits at kv_len - 1).
    public var maskType: Int = 0
    public var window: Int = 0
    /// Valid K/V length; nil means kv_capacity.
    public var kvLen: Int? = nil
    /// Fuse the FWHT sign undo into the reduce.
    public var fwht: Bool = false

    public init(scale: Float) { self.scale = scale }

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
    public var q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef, tmp: TensorRef
    public var signs: TensorRef? = nil

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
/// FWHT undo: the signs bitmask (D/8 bytes) binds at buffer 4. Its absence
/// (all signs +1) is signalled by function constant 500 (`has_signs`,
/// bool) = false, so no dummy buffer is ever bound.
public enum VecDispatcher {
    public static let op = "flash_attn_vec"
    public static let reduceOp = "flash_attn_vec_reduce_tq_hb_undo"
    public static let nwg = 32
    public static let headDims = [64, 128, 256, 512]
    /// Function constant of the FWHT-undo reduce: a sign bitmask is bound at buffer 4.
    public static let hasSignsConstant = 500
    public static let signsBuffer = 4

    public static func kernelName(kvDType: DType, headDim: Int) -> String {
        switch kvDType {
        case .f16: return "flash_attn_vec_f16kv_dk\(headDim)"
        case .bf16: return "flash_attn_vec_bf16kv_dk\(headDim)"
        default: return "flash_attn_vec_dk\(headDim)"
        }
    }

    public static func reduceKernelName(headDim: Int, fwht: Bool) -> String {
        fwht ? "flash_attn_vec_reduce_tq_hb_undo_dk\(headDim)" : "flash_attn_vec_reduce_dk\(headDim)"
    }

    public static var mainKernelNames: [String] {
        headDims.flatMap { d in [DType.f32, .f16, .bf16].map { kernelName(kvDType: $0, headDim: d) } }
    }

    public static var reduceKernelNames: [String] {
        headDims.flatMap { d in [false, true].map { reduceKernelName(headDim: d, fwht: $0) } }
    }

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
        if !headDims.contains(d) {
            throw FlashMetalError.value(op, "head_dim must be 64, 128, 256 or 512, got \(d)")
        }
        if batch == 0 { throw FlashMetalError.value(op, "batch must be > 0") }
        if heads == 0 || kvHeads == 0 {
            throw FlashMetalError.value(op, "num_heads and num_kv_heads must be > 0, got \(heads) and \(kvHeads)")
        }
        if heads % kvHeads != 0 {
            throw FlashMetalError.value(op, "num_heads (\(heads)) must be divisible by num_kv_heads (\(kvHeads))")
        }
        if cap == 0 { throw FlashMetalError.value(op, "kv_capacity must be > 0") }
        let (rows, o1) = batch.multipliedReportingOverflow(by: heads)
        let (kvRows, o2) = batch.multipliedReportingOverflow(by: kvHeads)
        if o1 || o2 || rows > Int(UInt32.max) || kvRows > Int(UInt32.max) || cap > Int(UInt32.max)
            || rows > Int.max / (nwg * (d + 2) * 4) {
            throw FlashMetalError.value(op, "batch*num_heads (\(batch)x\(heads)) or kv_capacity (\(cap)) exceeds the uint32 range of FlashAttnVecParams")
        }
        return (rows, kvRows, heads, kvHeads, cap, d)
    }

    public static func makeDispatches(_ t: VecTensors, _ o: VecOptions) throws -> [Dispatch] {
        try t.q.requireDType([.f32], op: op, name: "q")
        try t.k.requireDType([.f32, .f16, .bf16], op: op, name: "k")
        if t.v.dtype != t.k.dtype {
            throw FlashMetalError.type(op, "v dtype \(t.v.dtype.name) does not match k dtype \(t.k.dtype.name)")
        }
        try t.out.requireDType([.f32], op: op, name: "out")
        try t.tmp.requireDType([.f32], op: op, name: "tmp")
        let s = try shapes(q: t.q, k: t.k)
        if t.v.shape != t.k.shape { throw FlashMetalError.value(op, "v shape \(t.v.shape) must equal k shape \(t.k.shape)") }
        if t.out.shape != t.q.shape { throw FlashMetalError.value(op, "out shape \(t.out.shape) must equal q shape \(t.q.shape)") }
        let kvLen = o.kvLen ?? s.capacity
        if kvLen <= 0 { throw FlashMetalError.value(op, "kv_seq_len must be > 0, got \(kvLen)") }
        if kvLen > s.capacity {
            throw FlashMetalError.value(op, "kv_capacity (\(s.capacity)) must be >= kv_seq_len (\(kvLen))")
        }
        if !(0...2).contains(o.maskType) {
            throw FlashMetalError.value(op, "mask_type must be 0 (none), 1 (causal) or 2 (sliding window), got \(o.maskType)")
        }
        if o.maskType == 2 && (o.window <= 0 || o.window > Int(UInt32.max)) {
            throw FlashMetalError.value(op, "sliding_window must be > 0 with mask_type 2, got \(o.window)")
        }
        if !o.scale.isFinite { throw FlashMetalError.value(op, "scale must be finite, got \(o.scale)") }
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
            kv_seq_len: UInt32(kvLen), kv_capacity: UInt32(s.capacity), scale: o.scale,
            mask_type: UInt32(o.maskType), sliding_window: UInt32(o.maskType == 2 ? o.window : 0),
            softcap: o.softcap, nwg: UInt32(nwg))
        let main = Dispatch(
            kernel: kernelName(kvDType: t.k.dtype, headDim: s.headDim),
            grid: Size3(1, s.rows, nwg), threadgroup: Size3(32, 1, 1),
            bindings: [0: .bytes(bytesOf(params)), 1: .buffer(t.q), 2: .buffer(t.k), 3: .buffer(t.v),
                       4: .buffer(t.tmp)],
            threadgroupMemory: [0: threadgroupMemoryBytes(headDim: s.headDim)])
        let reduce = try reduceDispatch(tmp: t.tmp, out: t.out, rows: s.rows, headDim: s.headDim,
                                        nwg: nwg, fwht: o.fwht, signs: t.signs)
        return [main, reduce]
    }

    /// The reduce (plain or fused with the FWHT sign undo) over `nwg` partials.
    public static func reduceDispatch(tmp: TensorRef, out: TensorRef, rows: Int, headDim: Int, nwg: Int,
                                      fwht: Bool, signs: TensorRef?) throws -> Dispatch {
        let rop = fwht ? reduceOp : "flash_attn_vec_reduce"
        if nwg <= 0 || nwg > 32 { throw FlashMetalError.value(rop, "nwg must be > 0 and <= 32, got \(nwg)") }
        if !headDims.contains(headDim) {
            throw FlashMetalError.value(rop, "unsupported head_dim \(headDim)")
        }
        let nwg32 = UInt32(nwg)
        var bindings: [Int: Binding] = [
            0: .bytes(bytesOf(FlashAttnVecReduceParams(nrows: UInt32(rows)))),
            1: .buffer(tmp), 2: .buffer(out), 3: .bytes(bytesOf(nwg32)),
        ]
        var constants = FunctionConstants()
        var tgMem: [Int: Int] = [:]
        if fwht {
            if let s = signs { bindings[signsBuffer] = .buffer(s) }
            constants = FunctionConstants([(hasSignsConstant, .bool(signs != nil))])
            tgMem[0] = headDim * 4
        }
        return Dispatch(kernel: reduceKernelName(headDim: headDim, fwht: fwht), constants: constants,
                        grid: Size3(rows, 1, 1), threadgroup: Size3(32 * nwg, 1, 1),
                        bindings: bindings, threadgroupMemory: tgMem)
    }
}
