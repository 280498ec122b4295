import CFlashMetal

/// The options of one serving prefill call (FMAttnOptions, read once).
public struct AttnOptions: Sendable {
    /// Score scale, finite.
    public var scale: Float
    /// Logit softcap c > 0; 0 disables it.
    public var softcap: Float = 0
    /// Bottom-right causal per sequence.
    public var causal = false
    /// flash-attn's window_size: keys t - left <= p <= t + right; -1 = unbounded.
    public var windowLeft = -1, windowRight = -1
    /// Varlen: at least every sequence's length (flash-attn's max_seqlen_q/k).
    public var maxSeqlenQ = 0, maxSeqlenK = 0

    /// Options with every default but the scale.
    public init(scale: Float) { self.scale = scale }

    /// Reads the C options; `op` names the public function in errors.
    public init(_ o: FMAttnOptions, op: String) throws {
        guard o.causal == 0 || o.causal == 1 else {
            throw FlashMetalError.value(op, "causal must be 0 or 1, got \(o.causal)")
        }
        scale = o.scale
        softcap = o.softcap
        causal = o.causal == 1
        windowLeft = Int(o.window_left)
        windowRight = Int(o.window_right)
        maxSeqlenQ = Int(o.max_seqlen_q)
        maxSeqlenK = Int(o.max_seqlen_k)
    }

    /// A window bound is set (either side not -1).
    var hasWindow: Bool { windowLeft >= 0 || windowRight >= 0 }
}

/// The tensors of one serving prefill call (FMSeqTensors plus q, k, v, out).
public struct AttnTensors {
    /// q/out [B, qL, H, D] or [total_q, H, D]; k/v [B, cap, Hkv, D],
    /// [total_k, Hkv, D] or [num_pages, page_size, Hkv, D].
    public var q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef
    /// int32 tables (flashmetal.h FMSeqTensors).
    public var cuSeqlensQ: TensorRef? = nil, cuSeqlensK: TensorRef? = nil
    public var seqlensK: TensorRef? = nil, blockTable: TensorRef? = nil
    /// float32 [H] sink logits; float32 lse output.
    public var sinks: TensorRef? = nil, lse: TensorRef? = nil

    /// The tensors of a call; the per-sequence ones are optional.
    public init(q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef) {
        self.q = q; self.k = k; self.v = v; self.out = out
    }
}

/// The public function a serving prefill call is (errors name it): varlen
/// when a cu_seqlens is given, with_kvcache when cache lengths or a block
/// table are, else flash_attn_func. Decided by which tables are present, so
/// the C entry point can name it before reading any tensor.
public enum AttnOp {
    case function, varlen, kvcache

    /// From which FMSeqTensors fields are set.
    public init(varlen: Bool, cache: Bool) {
        self = varlen ? .varlen : cache ? .kvcache : .function
    }

    /// flash-attn's name of the function.
    public var name: String {
        switch self {
        case .function: return "flash_attn_func"
        case .varlen: return "flash_attn_varlen_func"
        case .kvcache: return "flash_attn_with_kvcache"
        }
    }

    /// The caller's names of k, v and seqlens_k in flash-attn's signature.
    public var kName: String { self == .kvcache ? "k_cache" : "k" }
    public var vName: String { self == .kvcache ? "v_cache" : "v" }
    public var seqlensKName: String { self == .kvcache ? "cache_seqlens" : "seqused_k" }
}

/// The serving prefill (issue 14; flashmetal.h "serving extension"): the
/// seed-000 kernel in per-sequence mode. Validates a call, reads and checks
/// its tables, and builds the Dispatch: AttnParams with the largest lengths,
/// AttnSeqParams, the tables at 9-12, sinks at 13, lse at 14 (written), and
/// function constants 302, 304-310. Shared pieces are PrefillDispatcher's.
public enum AttnDispatcher {
    /// Validates a call and builds its dispatches: none when there is no
    /// query row, else one prefill.
    public static func makeDispatches(_ t: AttnTensors, _ o: AttnOptions) throws -> [Dispatch] {
        let kind = AttnOp(varlen: t.cuSeqlensQ != nil || t.cuSeqlensK != nil,
                          cache: t.seqlensK != nil || t.blockTable != nil)
        let op = kind.name
        let varlenQ = t.cuSeqlensQ != nil, varlenK = t.cuSeqlensK != nil, paged = t.blockTable != nil

        // Shapes: q/out [B, qL, H, D] or [total_q, H, D]; k/v by layout.
        try t.q.requireRank([varlenQ ? 3 : 4], op: op, name: "q")
        try t.k.requireRank([paged || !varlenK ? 4 : 3], op: op, name: kind.kName)
        try PrefillDispatcher.requireIOTypes(q: (t.q, "q"), others: [(t.k, kind.kName), (t.v, kind.vName), (t.out, "out")],
                                             op: op)
        if t.out.shape != t.q.shape {
            throw FlashMetalError.value(op, "out shape \(t.out.shape) must equal q shape \(t.q.shape)")
        }
        if t.v.shape != t.k.shape {
            throw FlashMetalError.value(op, "\(kind.vName) shape \(t.v.shape) must equal \(kind.kName) shape \(t.k.shape)")
        }
        let qs = t.q.shape, ks = t.k.shape
        let (nHeads, headDim) = (qs[qs.count - 2], qs[qs.count - 1])
        let (nKV, kDim) = (ks[ks.count - 2], ks[ks.count - 1])
        if kDim != headDim {
            throw FlashMetalError.value(op, "\(kind.kName) head_dim (\(kDim)) must equal q head_dim (\(headDim))")
        }
        let geo = try PrefillCapability.geometry(headDim: headDim, op: op)
        if nHeads == 0 || nKV == 0 { throw FlashMetalError.value(op, "the head counts must be > 0, got q \(nHeads), \(kind.kName) \(nKV)") }
        if nHeads % nKV != 0 {
            throw FlashMetalError.value(op, "the q heads (\(nHeads)) must be a multiple of the \(kind.kName) heads (\(nKV))")
        }
        try PrefillDispatcher.requireScaleAndSoftcap(o.scale, o.softcap, op: op)
        for (w, n) in [(o.windowLeft, "window_size[0]"), (o.windowRight, "window_size[1]")] where w < -1 {
            throw FlashMetalError.value(op, "\(n) must be -1 (unbounded) or >= 0, got \(w)")
        }
        for d in qs + ks where d > Int(Int32.max) {
            throw FlashMetalError.value(op, "dimension \(d) exceeds the int32 range of AttnParams")
        }
        let batch = varlenQ ? try batchOf(cuSeqlens: t.cuSeqlensQ!, op: op, name: "cu_seqlens_q") : qs[0]
        if let s = t.sinks {
            try s.requireDType([.f32], op: op, name: "sinks")
            if s.shape != [nHeads] { throw FlashMetalError.value(op, "sinks shape \(s.shape) must be [\(nHeads)]") }
        }

        // Lengths per sequence, every table index checked before a kernel reads through it.
        let lens = try SequenceLengths(t, kind: kind, batch: batch, bk: geo.bk, o: o, op: op)
        if let lse = t.lse {
            try lse.requireDType([.f32], op: op, name: "softmax_lse")
            let want = varlenQ ? [nHeads, qs[0]] : [batch, nHeads, qs[1]]
            if lse.shape != want { throw FlashMetalError.value(op, "softmax_lse shape \(lse.shape) must be \(want)") }
        }
        if batch == 0 || lens.maxQ == 0 { return [] }

        var ext = PrefillExtension()
        ext.cuSeqlensQ = t.cuSeqlensQ; ext.cuSeqlensK = t.cuSeqlensK
        ext.seqlensK = t.seqlensK; ext.blockTable = t.blockTable
        ext.sinks = t.sinks; ext.lse = t.lse
        if o.hasWindow {
            ext.window = true
            ext.params.window_left = Int32(o.windowLeft)
            ext.params.window_right = Int32(o.windowRight)
        }
        // Element strides: (batch, head, row); a packed axis has batch stride 0
        // (the kernel adds cu_seqlens[b]); paged K/V step by page instead.
        let (qRows, kRows) = (varlenQ ? qs[0] : qs[1], ks[ks.count - 3])  // kRows: page_size when paged
        var qStrides = PrefillDispatcher.strides(.seqMajor, heads: nHeads, len: qRows, dim: headDim)
        var kStrides = PrefillDispatcher.strides(.seqMajor, heads: nKV, len: kRows, dim: headDim)
        if varlenQ { qStrides[0] = 0 }
        if paged {
            ext.params.page_size = Int32(ks[1])
            ext.params.max_pages = Int32(t.blockTable!.shape[1])
            ext.params.K_page_stride = kStrides[0]
            ext.params.V_page_stride = kStrides[0]
        }
        if paged || varlenK { kStrides[0] = 0 }
        if t.lse != nil {
            let (h, rows) = (Int64(nHeads), Int64(qRows))
            ext.params.lse_strides = varlenQ ? (0, rows, 1) : (h * rows, rows, 1)
        }

        // Outside per-sequence mode (flash_attn_func) rows sit bottom-right at kL - qL + i.
        let (qL, kL) = ext.perSequence ? (lens.maxQ, lens.maxK) : (qs[1], ks[1])
        let params = PrefillDispatcher.attnParams(
            batch: batch, heads: nHeads, kvHeads: nKV, headDim: headDim, qL: qL, kL: kL,
            tiles: geo.tiles(qL: qL, kL: kL), scale: o.scale, softcap: o.softcap,
            qOffset: ext.perSequence ? 0 : kL - qL, q: qStrides, k: kStrides, v: kStrides)
        return [PrefillDispatcher.assemble(PrefillTensors(q: t.q, k: t.k, v: t.v, out: t.out), params: params,
                                           maskParams: nil, geometry: geo, causal: o.causal, ext: ext)]
    }

    /// B of a varlen call: cu_seqlens is int32 [B+1].
    static func batchOf(cuSeqlens c: TensorRef, op: String, name: String) throws -> Int {
        try c.requireDType([.i32], op: op, name: name)
        try c.requireRank([1], op: op, name: name)
        if c.shape[0] < 1 { throw FlashMetalError.value(op, "\(name) must have B+1 >= 1 entries, got shape \(c.shape)") }
        return c.shape[0] - 1
    }
}

// MINIMAL TABLE CHECK — until serving-api's SequenceTables.swift lands on
// main; then this struct's body is replaced by SequenceTables' validation.
/// Every sequence's query and key lengths, read from the tables after
/// checking every entry a kernel reads (cu_seqlens within the packed
/// tensors, cache lengths within the caches, block-table entries of the
/// pages in use within [0, num_pages)).
struct SequenceLengths {
    /// The longest query and key sequence.
    let maxQ: Int, maxK: Int

    init(_ t: AttnTensors, kind: AttnOp, batch: Int, bk: Int, o: AttnOptions, op: String) throws {
        let varlenQ = t.cuSeqlensQ != nil, paged = t.blockTable != nil
        var qLens = [Int](repeating: varlenQ ? 0 : t.q.shape[1], count: batch)
        if let c = t.cuSeqlensQ { qLens = try Self.packed(c, batch: batch, total: t.q.shape[0], op: op, name: "cu_seqlens_q") }
        var capacity = paged ? 0 : t.k.shape[t.k.rank - 3]  // keys one sequence may hold
        if let bt = t.blockTable {
            try bt.requireDType([.i32], op: op, name: "block_table")
            try bt.requireRank([2], op: op, name: "block_table")
            if bt.shape[0] != batch {
                throw FlashMetalError.value(op, "block_table shape \(bt.shape) must have \(batch) rows (the batch)")
            }
            let pageSize = t.k.shape[1]
            if pageSize == 0 || pageSize % bk != 0 {
                throw FlashMetalError.value(op, "page_size (\(pageSize)) must be a positive multiple of \(bk), the key tile of head_dim \(t.q.shape[t.q.rank - 1])")
            }
            capacity = bt.shape[1] * pageSize
        }
        var kLens = [Int](repeating: capacity, count: batch)
        if let c = t.cuSeqlensK {
            // Packed keys are bounded by the packed tensor; paged ones by the table.
            kLens = try Self.packed(c, batch: batch, total: paged ? Int(Int32.max) : t.k.shape[0], op: op, name: "cu_seqlens_k")
            if paged, let (b, n) = kLens.enumerated().first(where: { $0.1 > capacity }) {
                throw FlashMetalError.value(op, "cu_seqlens_k gives sequence \(b) \(n) keys, more than block_table holds (\(capacity))")
            }
        } else if !paged && t.k.shape[0] != batch {
            throw FlashMetalError.value(op, "\(kind.kName) batch (\(t.k.shape[0])) must equal q batch (\(batch))")
        }
        if let s = t.seqlensK {
            let name = kind.seqlensKName
            try s.requireDType([.i32], op: op, name: name)
            if s.shape != [batch] { throw FlashMetalError.value(op, "\(name) shape \(s.shape) must be [\(batch)]") }
            let v = Self.int32s(s)
            for b in 0..<batch where v[b] < 0 || v[b] > kLens[b] {
                throw FlashMetalError.value(op, "\(name)[\(b)] = \(v[b]) must be in [0, \(kLens[b])] (the keys sequence \(b) holds)")
            }
            kLens = v
        }
        if let bt = t.blockTable {
            let pageSize = t.k.shape[1], numPages = t.k.shape[0], maxPages = bt.shape[1]
            let table = Self.int32s(bt)
            for b in 0..<batch {
                for j in 0..<((kLens[b] + pageSize - 1) / pageSize) {
                    let e = table[b * maxPages + j]
                    if e < 0 || e >= numPages {
                        throw FlashMetalError.value(op, "block_table[\(b), \(j)] = \(e) is not a page of \(kind.kName) (num_pages \(numPages))")
                    }
                }
            }
        }
        maxQ = qLens.max() ?? 0
        maxK = kLens.max() ?? 0
        if varlenQ && o.maxSeqlenQ < maxQ {
            throw FlashMetalError.value(op, "max_seqlen_q (\(o.maxSeqlenQ)) is less than the longest query sequence (\(maxQ))")
        }
        if t.cuSeqlensK != nil && t.seqlensK == nil && o.maxSeqlenK < maxK {
            throw FlashMetalError.value(op, "max_seqlen_k (\(o.maxSeqlenK)) is less than the longest key sequence (\(maxK))")
        }
    }

    /// Sequence lengths of an int32 [B+1] offsets table within `total` rows.
    static func packed(_ c: TensorRef, batch: Int, total: Int, op: String, name: String) throws -> [Int] {
        try c.requireDType([.i32], op: op, name: name)
        if c.shape != [batch + 1] { throw FlashMetalError.value(op, "\(name) shape \(c.shape) must be [\(batch + 1)] (B+1)") }
        let v = int32s(c)
        if v[0] != 0 { throw FlashMetalError.value(op, "\(name)[0] must be 0, got \(v[0])") }
        for b in 0..<batch where v[b + 1] < v[b] {
            throw FlashMetalError.value(op, "\(name) must be non-decreasing: [\(b)] = \(v[b]) > [\(b + 1)] = \(v[b + 1])")
        }
        if v[batch] > total {
            throw FlashMetalError.value(op, "\(name)[\(batch)] = \(v[batch]) exceeds the \(total) packed rows")
        }
        return (0..<batch).map { v[$0 + 1] - v[$0] }
    }

    /// The entries of an int32 tensor whose byte length was checked.
    static func int32s(_ t: TensorRef) -> [Int] {
        (0..<(t.elementCount ?? 0)).map { Int(t.data.loadUnaligned(fromByteOffset: $0 * 4, as: Int32.self)) }
    }
}
