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
    /// Chunked local attention c > 0: keys p with floor(p / c) == floor(t / c); 0 = off.
    public var attentionChunk = 0

    /// Options with every default but the scale.
    public init(scale: Float) { self.scale = scale }

    /// Reads the C options; `op` names the public function in errors.
    public init(_ o: FMAttnOptions, op: String) throws {
        guard o.causal == 0 || o.causal == 1 else {
            throw FlashMetalError.value(op, "causal must be 0 or 1, got \(o.causal)", arg: "causal")
        }
        scale = o.scale
        softcap = o.softcap
        causal = o.causal == 1
        windowLeft = Int(o.window_left)
        windowRight = Int(o.window_right)
        maxSeqlenQ = Int(o.max_seqlen_q)
        maxSeqlenK = Int(o.max_seqlen_k)
        if o.attention_chunk < 0 {
            throw FlashMetalError.value(op, "attention_chunk must be >= 0 (0 = off), got \(o.attention_chunk)")
        }
        attentionChunk = Int(o.attention_chunk)
    }

    /// A window bound is set (either side not -1).
    var hasWindow: Bool { windowLeft >= 0 || windowRight >= 0 }

    /// The one window rule of every serving route (prefill and decode):
    /// each bound -1 (unbounded) or any int32 >= 0; a bound past every key
    /// simply hides none.
    public static func requireWindow(left: Int, right: Int, op: String) throws {
        for (w, n) in [(left, "window_size[0]"), (right, "window_size[1]")] where w < -1 || w > Int(Int32.max) {
            throw FlashMetalError.value(op, "\(n) must be -1 (unbounded) or >= 0, got \(w)", arg: n)
        }
    }
}

/// The tensors of one serving prefill call (FMSeqTensors plus q, k, v, out).
public struct AttnTensors {
    /// q [B, qL, H, D] or [total_q, H, D], out likewise with Dv; k [B, cap,
    /// Hkv, D], [total_k, Hkv, D] or [num_pages, page_size, Hkv, D], v likewise with Dv.
    public var q: TensorRef, k: TensorRef, v: TensorRef, out: TensorRef
    /// int32 tables (flashmetal.h FMSeqTensors).
    public var cuSeqlensQ: TensorRef? = nil, cuSeqlensK: TensorRef? = nil
    public var seqlensK: TensorRef? = nil, blockTable: TensorRef? = nil
    /// float32 [H] sink logits; float32 lse output.
    public var sinks: TensorRef? = nil, lse: TensorRef? = nil
    /// float32 [B, H] ALiBi slopes.
    public var alibiSlopes: TensorRef? = nil
    /// The public function the caller runs, which names the arguments in
    /// errors; nil = the one the tables present imply.
    public var kind: AttnOp? = nil

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

    /// The function named `name`, if it is one of these.
    public init?(name: String) {
        guard let op = [AttnOp.function, .varlen, .kvcache].first(where: { $0.name == name }) else { return nil }
        self = op
    }

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

/// The serving prefill (flashmetal_kernels.h "serving extension"): the prefill
/// kernel in per-sequence mode. Validates a call, reads and checks
/// its tables, and builds the Dispatch: AttnParams with the largest lengths,
/// AttnSeqParams, the tables at 9-12, sinks at 13, lse at 14 (written), ALiBi slopes at 15, and
/// function constants 302, 304-311. Shared pieces are PrefillDispatcher's.
public enum AttnDispatcher {
    /// Validates a call and builds its dispatches: none when there is no
    /// query row, else one prefill.
    public static func makeDispatches(_ t: AttnTensors, _ o: AttnOptions) throws -> [Dispatch] {
        let kind = t.kind ?? AttnOp(varlen: t.cuSeqlensQ != nil || t.cuSeqlensK != nil,
                                    cache: t.seqlensK != nil || t.blockTable != nil)
        let op = kind.name
        let varlenQ = t.cuSeqlensQ != nil, varlenK = t.cuSeqlensK != nil, paged = t.blockTable != nil

        // Shapes: q/out [B, qL, H, D] or [total_q, H, D]; k/v by layout.
        try t.q.requireRank([varlenQ ? 3 : 4], op: op, name: "q")
        try t.k.requireRank([paged || !varlenK ? 4 : 3], op: op, name: kind.kName)
        try PrefillDispatcher.requireIOTypes(q: (t.q, "q"), others: [(t.k, kind.kName), (t.v, kind.vName), (t.out, "out")],
                                             op: op)
        let qs = t.q.shape, ks = t.k.shape
        let (nHeads, headDim) = (qs[qs.count - 2], qs[qs.count - 1])
        let (nKV, kDim) = (ks[ks.count - 2], ks[ks.count - 1])
        let headDimV = try Checks.valueShapes(v: t.v, kind.vName, k: t.k, kind.kName, out: t.out, q: t.q, op: op,
                                              kDim: kDim, qDim: headDim)
        let tileDim = try PrefillCapability.tileDim(headDim: headDim, headDimV: headDimV, op: op, vName: kind.vName)
        let geo = try PrefillCapability.geometry(io: t.q.dtype, headDim: tileDim, op: op)
        try Checks.heads(nHeads, kvHeads: nKV, of: kind.kName, op: op, kvHeadsArg: "q")
        try Checks.scaleAndSoftcap(o.scale, o.softcap, op: op)
        try AttnOptions.requireWindow(left: o.windowLeft, right: o.windowRight, op: op)
        for d in qs + ks where d > Int(Int32.max) {
            throw FlashMetalError.value(op, "dimension \(d) exceeds the int32 range of AttnParams")
        }
        let batch = varlenQ ? max(t.cuSeqlensQ!.shape.first ?? 0, 1) - 1 : qs[0]
        if let s = t.sinks {
            try s.requireDType([.f32], op: op, name: "sinks")
            if s.shape != [nHeads] { throw FlashMetalError.value(op, "sinks shape \(s.shape) must be [\(nHeads)]", arg: "sinks") }
        }
        if let a = t.alibiSlopes {
            try a.requireDType([.f32], op: op, name: "alibi_slopes")
            if a.shape != [batch, nHeads] {
                throw FlashMetalError.value(op, "alibi_slopes shape \(a.shape) must be [\(batch), \(nHeads)]", arg: "alibi_slopes")
            }
        }

        // Lengths per sequence, every table index checked before a kernel reads through it.
        let lens = try SequenceLengths(t, kind: kind, batch: batch, o: o, op: op)
        if let lse = t.lse {
            try lse.requireDType([.f32], op: op, name: "softmax_lse")
            let want = varlenQ ? [nHeads, qs[0]] : [batch, nHeads, qs[1]]
            if lse.shape != want { throw FlashMetalError.value(op, "softmax_lse shape \(lse.shape) must be \(want)", arg: "softmax_lse") }
        }
        if batch == 0 || lens.maxQ == 0 { return [] }

        var ext = PrefillExtension()
        ext.cuSeqlensQ = t.cuSeqlensQ; ext.cuSeqlensK = t.cuSeqlensK
        ext.seqlensK = t.seqlensK; ext.blockTable = t.blockTable
        ext.sinks = t.sinks; ext.lse = t.lse; ext.alibi = t.alibiSlopes
        if lens.keyStarts { ext.params.key_starts_at = Int32(batch) }
        if o.hasWindow || o.attentionChunk > 0 {
            ext.window = true
            ext.params.window_left = Int32(o.windowLeft)
            ext.params.window_right = Int32(o.windowRight)
            ext.params.attention_chunk = Int32(o.attentionChunk)
        }
        // Element strides: (batch, head, row); a packed axis has batch stride 0
        // (the kernel adds cu_seqlens[b]); paged K/V step by page instead.
        let (qRows, kRows) = (varlenQ ? qs[0] : qs[1], ks[ks.count - 3])  // kRows: page_size when paged
        var qStrides = PrefillDispatcher.strides(.seqMajor, heads: nHeads, len: qRows, dim: headDim)
        var kStrides = PrefillDispatcher.strides(.seqMajor, heads: nKV, len: kRows, dim: headDim)
        var vStrides = PrefillDispatcher.strides(.seqMajor, heads: nKV, len: kRows, dim: headDimV)
        var oStrides = PrefillDispatcher.strides(.seqMajor, heads: nHeads, len: qRows, dim: headDimV)
        if varlenQ { qStrides[0] = 0; oStrides[0] = 0 }
        if paged {
            ext.params.page_size = Int32(ks[1])
            ext.params.max_pages = Int32(t.blockTable!.shape[1])
            ext.params.K_page_stride = kStrides[0]
            ext.params.V_page_stride = vStrides[0]
        }
        if paged || varlenK { kStrides[0] = 0; vStrides[0] = 0 }
        if t.lse != nil {
            let (h, rows) = (Int64(nHeads), Int64(qRows))
            ext.params.lse_strides = varlenQ ? (0, rows, 1) : (h * rows, rows, 1)
        }

        // Outside per-sequence mode (flash_attn_func) rows sit bottom-right at kL - qL + i.
        let (qL, kL) = ext.perSequence ? (lens.maxQ, lens.maxK) : (qs[1], ks[1])
        let params = PrefillDispatcher.attnParams(
            batch: batch, heads: nHeads, kvHeads: nKV, headDim: headDim, headDimV: headDimV, qL: qL, kL: kL,
            tiles: geo.tiles(qL: qL, kL: kL), scale: o.scale, softcap: o.softcap,
            qOffset: ext.perSequence ? 0 : kL - qL, q: qStrides, k: kStrides, v: vStrides, o: oStrides)
        return [PrefillDispatcher.assemble(PrefillTensors(q: t.q, k: t.k, v: t.v, out: t.out), params: params,
                                           maskParams: nil, geometry: geo, causal: o.causal, ext: ext)]
    }
}

/// Every sequence's query and key lengths, read from the tables after
/// SequenceTables checked every entry a kernel reads (cu_seqlens within the
/// packed tensors and max_seqlen, cache lengths within the caches, the
/// block-table entries of the pages in use within [0, num_pages)).
struct SequenceLengths {
    /// The longest query and key sequence.
    let maxQ: Int, maxK: Int
    /// seqlens_k is [2, B]: each sequence's first key follows the lengths.
    var keyStarts = false

    init(_ t: AttnTensors, kind: AttnOp, batch: Int, o: AttnOptions, op: String) throws {
        let paged = t.blockTable != nil
        // Its rank before its shape sizes the capacity (a rank-0 table has no dim 1).
        try t.blockTable?.requireRank([2], op: op, name: "block_table")
        let qLens = try t.cuSeqlensQ.map {
            try SequenceTables.cuSeqlens($0, op: op, name: "cu_seqlens_q", tokens: t.q.shape[0], tokensName: "q",
                                         maxSeqlen: o.maxSeqlenQ, maxSeqlenName: "max_seqlen_q")
        } ?? [Int](repeating: t.q.shape[1], count: batch)
        // Keys one sequence may hold: the cache's rows, or the block table's pages.
        let pageSize = t.k.shape[1]
        let capacity = paged ? t.blockTable!.shape.last! * pageSize : t.k.shape[t.k.rank - 3]
        var kLens = [Int](repeating: capacity, count: batch)
        if let c = t.cuSeqlensK {
            kLens = try SequenceTables.cuSeqlens(
                c, op: op, name: "cu_seqlens_k", batch: batch, tokens: paged ? capacity * batch : t.k.shape[0],
                tokensName: paged ? "block_table" : kind.kName, maxSeqlen: o.maxSeqlenK, maxSeqlenName: "max_seqlen_k")
        } else if !paged {
            try Checks.sameDim("batch", t.k.shape[0], of: kind.kName, as: batch, of: "q", op: op)
        }
        if let s = t.seqlensK {
            let bound = kLens.max() ?? 0
            let holds = paged ? SequenceTables.pagedCapacity(pages: t.blockTable!.shape[1], pageSize: pageSize,
                                                             table: "block_table", cache: kind.kName)
                : "the keys \(kind.kName) holds"
            let (lens, starts) = try SequenceTables.seqlensAndStarts(
                s, op: op, name: kind.seqlensKName, startsName: "cache_leftpad", batch: batch, capacity: bound,
                capacityName: t.cuSeqlensK == nil ? holds : "cu_seqlens_k")
            keyStarts = starts
            for b in 0..<batch where lens[b] > kLens[b] {
                throw FlashMetalError.value(op, "\(kind.seqlensKName)[\(b)] = \(lens[b]) is out of range [0, \(kLens[b])] (cu_seqlens_k)", arg: kind.seqlensKName)
            }
            kLens = lens
        }
        if let bt = t.blockTable {
            try SequenceTables.blockTable(bt, op: op, name: "block_table", lengths: kLens, numPages: t.k.shape[0],
                                          pageSize: pageSize, cacheName: kind.kName)
        }
        maxQ = qLens.max() ?? 0
        maxK = kLens.max() ?? 0
    }
}
