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
            throw FlashMetalError.value(VecDispatcher.op, "fwht must be 0 or 1, got \(o.fwht)", arg: "fwht")
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
    /// q/out [(B,) H, D], each float32 or the caches' dtype; k/v [(B,) Hkv, cap, D]; tmp float32 scratch.
    public var q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef, tmp: TensorRef
    /// uint8 [D/8] FWHT sign bitmask, or nil for all +1.
    public var signs: TensorRef? = nil
    /// The caller's names of k and v in errors (flash_attn_decode calls them
    /// k_cache and v_cache).
    public var kName = "k", vName = "v"

    /// The tensors of a call; signs are optional.
    public init(q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef, tmp: TensorRef, signs: TensorRef? = nil) {
        self.q = q; self.k = k; self.v = v; self.out = out; self.tmp = tmp; self.signs = signs
    }
}

/// Split-KV decode `flash_attn_vec_*` over NWG = 32
/// workgroups, then `flash_attn_vec_reduce_dk*` or the fused
/// `flash_attn_vec_reduce_tq_hb_undo_dk*` as a second dispatch.
///
/// tmp (float32): partial outputs [rows, NWG, Dv] first (Dv: v's head dim),
/// then (S, M) pairs [rows, NWG, 2]; rows*NWG*(Dv+2)*4 bytes.
///
/// FWHT undo: the signs bitmask (D/8 bytes) binds at VecReduceBuffer.signs.
/// Its absence (all signs +1) is signalled by the function constant
/// FunctionConstantIndex.vecHasSigns = false, so no dummy buffer is bound.
///
/// Main grid (1, rows / HG, NWG) of 32 * HG threads (HG query heads of one
/// kv head per threadgroup), buffers VecBuffer; reduce grid
/// (rows, 1, 1) of 32*NWG threads, buffers VecReduceBuffer.
public enum VecDispatcher {
    /// The op name errors carry.
    public static let op = "flash_attn_vec"
    /// The public name of the op (its kernel's name, `op`, is an alias in
    /// the capability queries).
    public static let publicName = "flash_attn_decode"
    /// The op name of the FWHT-undo reduce's errors.
    public static let reduceOp = "flash_attn_vec_reduce_tq_hb_undo"
    /// Workgroups each row's keys are split over (FM_VEC_NWG).
    public static let nwg = VecCapability.nwg
    /// The head dims with a decode kernel.
    public static var headDims: [Int] { VecCapability.headDims }

    /// tmp bytes for `rows` query rows (B*H) of v's head dim `headDim`.
    public static func tmpByteCount(rows: Int, headDim: Int) -> Int {
        rows * nwg * (headDim + 2) * 4
    }

    /// Query rows one main threadgroup serves (one SIMD group each), sharing
    /// their kv head's K/V reads: the largest divisor of `rows` (the rows of
    /// one kv head: H / Hkv, times L for short queries) up to
    /// VecCapability.groupRows(headDim:), so a kv head whose rows fit reads K/V once.
    public static func headsPerGroup(rows: Int, headDim: Int) -> Int {
        let cap = VecCapability.groupRows(headDim: headDim)
        if rows <= cap { return max(rows, 1) }
        return (1...cap).last { rows % $0 == 0 } ?? 1
    }

    /// Key rows the main kernel stages in threadgroup memory at a time when
    /// it serves several heads: the largest power of two <= 32 such that two
    /// stages of rows of `elementBytes`-byte elements fit in 16 KiB (the
    /// kernel's vec_stage_rows).
    public static func stageRows(headDim: Int, elementBytes: Int) -> Int {
        let rows = 8192 / (headDim * elementBytes)
        return rows >= 32 ? 32 : rows >= 16 ? 16 : rows >= 8 ? 8 : 4
    }

    /// Elements of one lane's vector load of K/V (the kernel's vec_width).
    public static func vectorWidth(headDim: Int) -> Int {
        headDim % 128 == 0 ? 4 : (headDim % 64 == 0 ? 2 : 4)
    }

    /// Main-kernel threadgroup memory for `heads` query heads per group over
    /// K/V of `elementBytes`-byte elements: 32 probability floats per head,
    /// plus two stages of RS x D elements when several heads share the group.
    public static func threadgroupMemoryBytes(headDim: Int, heads: Int = 1, elementBytes: Int) -> Int {
        let stages = heads > 1 ? 2 * stageRows(headDim: headDim, elementBytes: elementBytes) * headDim * elementBytes : 0
        return 32 * heads * 4 + stages
    }

    /// Query rows of a main dispatch: the grid's y times the heads per threadgroup.
    public static func rows(of d: Dispatch) -> Int { d.grid.y * (d.threadgroup.x / 32) }

    /// Shape facts of a call, validated: (rows, kvRows, heads, kvHeads,
    /// capacity, headDim, headDimV); v (when given) has k's shape but for its
    /// own head dim (headDimV; q's without v).
    public static func shapes(q: TensorRef, k: TensorRef, v: TensorRef? = nil, kName: String = "k",
                              vName: String = "v") throws -> (rows: Int, kvRows: Int, heads: Int, kvHeads: Int, capacity: Int, headDim: Int, headDimV: Int) {
        try q.requireRank([2, 3], op: op, name: "q")
        try k.requireRank([q.rank + 1], op: op, name: kName)
        let batch = q.rank == 3 ? q.shape[0] : 1
        let (heads, d) = (q.shape[q.rank - 2], q.shape[q.rank - 1])
        let kb = k.rank == 4 ? k.shape[0] : 1
        let (kvHeads, cap, kd) = (k.shape[k.rank - 3], k.shape[k.rank - 2], k.shape[k.rank - 1])
        try Checks.sameDim("batch", kb, of: kName, as: batch, of: "q", op: op)
        try Checks.sameDim("head_dim", kd, of: kName, as: d, of: "q", op: op)
        try VecCapability.requireHeadDim(d, op: op)
        var dv = d
        if let v = v {
            if v.rank != k.rank || Array(v.shape.dropLast()) != Array(k.shape.dropLast()) {
                throw FlashMetalError.value(
                    op, "\(vName) shape \(v.shape) must equal \(kName) shape \(k.shape) but for the head dim", arg: vName)
            }
            dv = v.shape[v.rank - 1]
            try VecCapability.tileDim(d, dv: dv, op: op, vName: vName)
        }
        try requireHeads(batch: batch, heads: heads, kvHeads: kvHeads, op: op, kName: kName)
        try Checks.positive("the cache capacity", cap, op: op, arg: kName)
        let (rows, o1) = batch.multipliedReportingOverflow(by: heads)
        let (kvRows, o2) = batch.multipliedReportingOverflow(by: kvHeads)
        if o1 || o2 || rows > Int(UInt32.max) || kvRows > Int(UInt32.max) || cap > Int(UInt32.max)
            || rows > Int.max / (nwg * (max(d, dv) + 2) * 4) {
            throw FlashMetalError.value(op, "batch*num_heads (\(batch)x\(heads)) or the cache capacity (\(cap)) exceeds the uint32 range of FlashAttnVecParams", arg: "q")
        }
        return (rows, kvRows, heads, kvHeads, cap, d, dv)
    }

    /// Validates a call and builds its two dispatches (decode, then reduce).
    /// Preconditions: q and out float32 or the caches' dtype, float32 tmp, k and v of one dtype in
    /// VecCapability.kvTypes, a head dim in 1...512 or 576, 0 < kv_len <= capacity,
    /// a known mask type with a window > 0 for the window mask, a finite
    /// scale, softcap 0 or > 0, tmp of tmpByteCount bytes, D/8 sign bytes.
    public static func makeDispatches(_ t: VecTensors, _ o: VecOptions) throws -> [Dispatch] {
        try requireTypes(q: t.q, k: t.k, v: t.v, out: t.out, tmp: t.tmp, op: op, kName: t.kName, vName: t.vName)
        let s = try shapes(q: t.q, k: t.k, v: t.v, kName: t.kName, vName: t.vName)
        _ = try Checks.valueShapes(v: t.v, t.vName, k: t.k, t.kName, out: t.out, q: t.q, op: op)
        let kvLen = o.kvLen ?? s.capacity
        try Checks.kvLen(kvLen, capacity: s.capacity, op: op)
        guard let maskType = VecMaskType(rawValue: o.maskType) else {
            throw FlashMetalError.value(op, "mask_type must be 0 (none), 1 (causal) or 2 (sliding window), got \(o.maskType)", arg: "mask_type")
        }
        if maskType == .window && (o.window <= 0 || o.window > Int(UInt32.max)) {
            throw FlashMetalError.value(op, "window must be > 0 with the sliding-window mask, got \(o.window)", arg: "window")
        }
        try Checks.scaleAndSoftcap(o.scale, o.softcap, op: op)
        try requireTmp(t.tmp, rows: s.rows, headDim: s.headDimV, op: op)
        if let sg = t.signs {
            if !o.fwht { throw FlashMetalError.value(op, "fwht_signs given without fwht", arg: "fwht_signs") }
            try sg.requireDType([.u8], op: reduceOp, name: "fwht_signs")
            let need = s.headDimV / 8
            if sg.elementCount != need || sg.byteCount < need {
                throw FlashMetalError.value(reduceOp, "fwht_signs must hold head_dim/8 = \(need) bytes, got shape \(sg.shape) (\(sg.byteCount) bytes)", arg: "fwht_signs")
            }
        }

        let params = FlashAttnVecParams(
            n_heads: UInt32(s.rows), n_kv_heads: UInt32(s.kvRows), head_dim: UInt32(s.headDim),
            kv_seq_len: UInt32(kvLen), kv_capacity: UInt32(s.capacity), scale: o.scale,
            mask_type: UInt32(maskType.rawValue), sliding_window: UInt32(maskType == .window ? o.window : 0),
            softcap: o.softcap, nwg: UInt32(nwg), head_dim_v: UInt32(s.headDimV), _pad: 0)
        let main = mainDispatch(params, rows: s.rows, q: t.q, k: t.k, v: t.v, tmp: t.tmp)
        let reduce = try reduceDispatch(tmp: t.tmp, out: t.out, rows: s.rows, headDim: s.headDimV,
                                        nwg: nwg, fwht: o.fwht, signs: t.signs)
        return [main, reduce]
    }

    /// q and out float32 or the caches' dtype (the kernel reads q exactly as
    /// float32 and rounds the float32 result once into out); float32 tmp; k
    /// and v of one dtype in VecCapability.kvTypes; each buffer covers its shape.
    static func requireTypes(q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef, tmp: TensorRef,
                             op: String, kName: String = "k", vName: String = "v") throws {
        try k.requireDType(VecCapability.kvTypes, op: op, name: kName)
        try Checks.sameDType(v, vName, as: k, kName, op: op)
        let io: [DType] = k.dtype == .f32 ? [.f32] : [.f32, k.dtype]
        try q.requireDType(io, op: op, name: "q")
        try out.requireDType(io, op: op, name: "out")
        try tmp.requireDType([.f32], op: op, name: "tmp")
        for (x, n) in [(q, "q"), (k, kName), (v, vName), (out, "out")] {
            try x.requireBytes(op: op, name: n)
        }
    }

    /// A non-empty batch and heads that group evenly over the kv heads
    /// (every error names q, which carries the batch and the heads).
    static func requireHeads(batch: Int, heads: Int, kvHeads: Int, op: String, kName: String = "k") throws {
        try Checks.positive("batch", batch, op: op, arg: "q")
        try Checks.heads(heads, kvHeads: kvHeads, of: kName, op: op, kvHeadsArg: "q")
    }

    /// tmp holds the partials of `rows` rows.
    static func requireTmp(_ tmp: TensorRef, rows: Int, headDim: Int, op: String) throws {
        let tmpBytes = tmpByteCount(rows: rows, headDim: headDim)
        if tmp.byteCount < tmpBytes {
            throw FlashMetalError.value(op, "tmp buffer too small: expected at least \(tmpBytes) bytes (rows=\(rows), NWG=\(nwg), D=\(headDim)), got \(tmp.byteCount)", arg: "tmp")
        }
    }

    /// The per-sequence extension of a main dispatch (FunctionConstantIndex.vecSeq).
    public struct SeqBindings {
        /// Strides and paging.
        public var params: FlashAttnVecSeqParams
        /// int32 [B] kv lengths, or nil (every sequence sees kv_seq_len keys).
        public var seqlensK: TensorRef?
        /// int32 [B, max_pages], or nil (K/V contiguous per sequence).
        public var blockTable: TensorRef?
        /// float32 [B, H] ALiBi slopes, or nil.
        public var alibi: TensorRef? = nil
    }

    /// tmp starts on a float4 boundary (else the kernels move it in scalars:
    /// FunctionConstantIndex.vecUnaligned).
    static func tmpAligned(_ tmp: TensorRef) -> Bool { Int(bitPattern: tmp.data) % 16 == 0 }

    /// q, K and V start on a vector load's boundary, every stride keeps rows
    /// on one, and tmp is aligned (else the kernel moves them in scalars:
    /// FunctionConstantIndex.vecUnaligned).
    static func vectorAligned(q: TensorRef, k: TensorRef, v: TensorRef, tmp: TensorRef, headDim: Int, headDimV: Int,
                              seq: FlashAttnVecSeqParams?) -> Bool {
        let tile = max(headDim, headDimV)
        let w = vectorWidth(headDim: VecCapability.tileHeadDim(tile) ?? tile)
        let bytes = w * k.dtype.byteSize
        // Rows of q and the plain K are D elements apart, of tmp and the plain
        // V Dv: a dim off the vector width (a padded head dim, e.g. 59) puts
        // them off a vector boundary.
        if headDim % w != 0 || headDimV % w != 0 || Int(bitPattern: k.data) % bytes != 0 || Int(bitPattern: v.data) % bytes != 0
            || Int(bitPattern: q.data) % (w * q.dtype.byteSize) != 0 || !tmpAligned(tmp) { return false }
        guard let sp = seq else { return true }
        let strides = [sp.K_strides.0, sp.K_strides.1, sp.K_strides.2, sp.V_strides.0, sp.V_strides.1, sp.V_strides.2]
        return strides.allSatisfy { Int($0) % w == 0 }
    }

    /// The decode main dispatch: grid (1, rows / HG, NWG) of 32 * HG threads
    /// (HG = headsPerGroup of the GQA group times the query rows per
    /// sequence: query rows sharing one kv head's K/V reads). Without
    /// `seq` it is the plain decode (constants 501-503 false, nothing bound at 5-7).
    static func mainDispatch(_ params: FlashAttnVecParams, rows: Int, q: TensorRef, k: TensorRef, v: TensorRef,
                             tmp: TensorRef, seq: SeqBindings? = nil) -> Dispatch {
        let qIO = q.dtype != .f32
        var bindings: [Int: Binding] = [
            VecBuffer.params: .bytes(bytesOf(params)), qIO ? VecBuffer.qIO : VecBuffer.q: .buffer(q),
            VecBuffer.k: .buffer(k), VecBuffer.v: .buffer(v), VecBuffer.tmp: .buffer(tmp)]
        if let seq = seq {
            bindings[VecBuffer.seqParams] = .bytes(bytesOf(seq.params))
            if let l = seq.seqlensK { bindings[VecBuffer.seqlensK] = .buffer(l) }
            if let b = seq.blockTable { bindings[VecBuffer.blockTable] = .buffer(b) }
            if let s = seq.alibi { bindings[VecBuffer.alibi] = .buffer(s) }
        }
        let constants = FunctionConstants([
            (FunctionConstantIndex.vecSeq, .bool(seq != nil)),
            (FunctionConstantIndex.vecKVLens, .bool(seq?.seqlensK != nil)),
            (FunctionConstantIndex.vecPaged, .bool(seq?.blockTable != nil)),
            (FunctionConstantIndex.vecAlibi, .bool(seq?.alibi != nil)),
            (FunctionConstantIndex.vecQIO, .bool(qIO)),
            (FunctionConstantIndex.vecUnaligned, .bool(!vectorAligned(q: q, k: k, v: v, tmp: tmp, headDim: Int(params.head_dim),
                                                                         headDimV: Int(params.head_dim_v),
                                                                         seq: seq?.params))),
        ])
        // The kernel of max(D, Dv)'s tile width; params carry the true dims.
        let wide = Int(max(params.head_dim, params.head_dim_v))
        let d = VecCapability.tileHeadDim(wide) ?? wide
        // Short queries: the L rows of each head join its kv head's group.
        let qRows = max(Int(seq?.params.q_rows ?? 1), 1)
        let hg = headsPerGroup(rows: Int(params.n_heads / params.n_kv_heads) * qRows, headDim: d)
        return Dispatch(
            kernel: .vec(kv: k.dtype, headDim: d), constants: constants,
            grid: Size3(1, rows / hg, nwg), threadgroup: Size3(32 * hg, 1, 1), bindings: bindings,
            threadgroupMemory: [0: threadgroupMemoryBytes(headDim: d, heads: hg, elementBytes: k.dtype.byteSize)], writes: [VecBuffer.tmp])
    }

    /// The serving extension of the plain reduce (FunctionConstantIndex.vecSinks/vecLSE).
    public struct ReduceExt {
        /// Heads per sequence: row r has head (r / headRows) % heads.
        public var heads: Int
        /// Rows between one head's row and the next's: 1, or the query rows L when head-major.
        public var headRows = 1
        /// float32 [H] sink logits, or nil.
        public var sinks: TensorRef?
        /// float32 [rows] natural-log LSE output, or nil.
        public var lse: TensorRef?
    }

    /// The reduce (plain or fused with the FWHT sign undo) over `nwg` partials
    /// (1...32) of `rows` rows in `tmp`, into `out` (float32, float16 or bfloat16). `ext` (plain
    /// reduce only) adds sinks and the LSE output.
    public static func reduceDispatch(tmp: TensorRef, out: TensorRef, rows: Int, headDim: Int, nwg: Int,
                                      fwht: Bool, signs: TensorRef?, ext: ReduceExt? = nil) throws -> Dispatch {
        let rop = fwht ? reduceOp : "flash_attn_vec_reduce"
        if nwg <= 0 || nwg > 32 { throw FlashMetalError.value(rop, "nwg must be > 0 and <= 32, got \(nwg)") }
        let tile = try VecCapability.requireHeadDim(headDim, fwht: fwht, op: rop)
        let nwg32 = UInt32(nwg)
        let outAt = out.dtype == .f16 ? VecReduceBuffer.outF16 : out.dtype == .bf16 ? VecReduceBuffer.outBF16 : VecReduceBuffer.out
        var bindings: [Int: Binding] = [
            VecReduceBuffer.params: .bytes(bytesOf(FlashAttnVecReduceParams(nrows: UInt32(rows), head_dim: UInt32(headDim)))),
            VecReduceBuffer.tmp: .buffer(tmp), outAt: .buffer(out),
            VecReduceBuffer.nwg: .bytes(bytesOf(nwg32)),
        ]
        var writes: Set<Int> = [outAt]
        let outType: [(Int, ConstantValue)] = [(FunctionConstantIndex.vecOutF16, .bool(out.dtype == .f16)),
                                                       (FunctionConstantIndex.vecOutBF16, .bool(out.dtype == .bf16))]
        let constants: FunctionConstants
        var tgMem: [Int: Int] = [:]
        if fwht {
            if ext != nil { throw FlashMetalError.internalError("\(rop): sinks/lse need the plain reduce") }
            if let s = signs { bindings[VecReduceBuffer.signs] = .buffer(s) }
            // 504/505 false: the fused reduce's buffers 5-7 only keep the positions of 8 and 9.
            constants = FunctionConstants([(FunctionConstantIndex.vecHasSigns, .bool(signs != nil)),
                                           (FunctionConstantIndex.vecSinks, .bool(false)),
                                           (FunctionConstantIndex.vecLSE, .bool(false)),
                                           (FunctionConstantIndex.vecUnaligned, .bool(!tmpAligned(tmp)))] + outType)
            tgMem[0] = headDim * 4
        } else {
            if let e = ext {
                bindings[VecReduceBuffer.ext] = .bytes(bytesOf(FlashAttnVecReduceExtParams(
                    n_heads: UInt32(e.heads), head_rows: UInt32(e.headRows), _pad: (0, 0))))
                if let s = e.sinks { bindings[VecReduceBuffer.sinks] = .buffer(s) }
                if let l = e.lse {
                    bindings[VecReduceBuffer.lse] = .buffer(l)
                    writes.insert(VecReduceBuffer.lse)
                }
            }
            // 500 false: the plain reduce's buffer 4 only keeps the buffer positions.
            constants = FunctionConstants([(FunctionConstantIndex.vecHasSigns, .bool(false)),
                                           (FunctionConstantIndex.vecSinks, .bool(ext?.sinks != nil)),
                                           (FunctionConstantIndex.vecLSE, .bool(ext?.lse != nil)),
                                           (FunctionConstantIndex.vecUnaligned, .bool(!tmpAligned(tmp)))] + outType)
        }
        return Dispatch(kernel: .vecReduce(headDim: tile, fwht: fwht), constants: constants,
                        grid: Size3(rows, 1, 1), threadgroup: Size3(32 * nwg, 1, 1),
                        bindings: bindings, threadgroupMemory: tgMem,
                        // Correct for any multiple of 32 threads: Metal may allow fewer than 1024.
                        writes: writes, threadgroupFlexible: true)
    }
}
