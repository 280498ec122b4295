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
        try Self.requireFlashAttnLayout(o, op: op)
    }

    /// Serving prefill reads flash-attn's layouts only (head_major is fm_dispatch_vec_seq's).
    public static func requireFlashAttnLayout(_ o: FMAttnOptions, op: String) throws {
        if o.head_major != 0 {
            throw FlashMetalError.value(op, "head_major must be 0 (flash-attn's [B, L, H, D] layouts), got \(o.head_major)", arg: "head_major")
        }
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
    /// int32 [B] beside cu_seqlens_q: the query rows of each sequence that
    /// attend (flash-attn 3's seqused_q).
    public var sequsedQ: TensorRef? = nil
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

/// A serving prefill call checked in the caller's terms: the bytes of
/// library memory its rewritten tables need (seqused_q's; 0 without) and
/// its dispatches, given that memory.
public struct AttnPlan {
    /// Bytes of library memory `dispatches` writes tables to, living as long as the work.
    public let tableBytes: Int
    let build: (UnsafeMutableRawPointer?) -> [Dispatch]
    /// The packed rows no sequence owns.
    var unowned = UnownedRows()

    init(tableBytes: Int, build: @escaping (UnsafeMutableRawPointer?) -> [Dispatch]) {
        self.tableBytes = tableBytes
        self.build = build
    }

    /// The dispatches, with `tables` (of tableBytes, or nil when 0).
    public func dispatches(tables: UnsafeMutableRawPointer?) -> [Dispatch] { build(tables) }

    /// Clears the packed rows no sequence owns (UnownedRows.clear).
    public func clearUnownedRows() { unowned.clear() }
}

/// The serving prefill (flashmetal_kernels.h "serving extension"): the prefill
/// kernel in per-sequence mode. Validates a call, reads and checks
/// its tables, and builds the Dispatch: AttnParams with the largest lengths,
/// AttnSeqParams, the tables at 9-12, sinks at 13, lse at 14 (written), ALiBi slopes at 15, and
/// function constants 302, 304-311. Shared pieces are PrefillDispatcher's.
public enum AttnDispatcher {
    /// Validates a call that needs no library tables (no seqused_q) and
    /// builds its dispatches: none when there is no query row, else one prefill.
    public static func makeDispatches(_ t: AttnTensors, _ o: AttnOptions) throws -> [Dispatch] {
        let plan = try makePlan(t, o)
        guard plan.tableBytes == 0 else {
            throw FlashMetalError.internalError("seqused_q needs library tables: run the call through makePlan")
        }
        return plan.dispatches(tables: nil)
    }

    /// Validates a call and plans its dispatches. seqused_q, which the
    /// kernel has no table for, runs as a split of every sequence
    /// (UsedRowsSplit) in tables the plan writes to library memory.
    public static func makePlan(_ t: AttnTensors, _ o: AttnOptions) throws -> AttnPlan {
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
        let batch = SequenceTables.sequences(q: t.q, cuSeqlensQ: t.cuSeqlensQ)
        if let s = t.sinks {
            try s.requireDType([.f32], op: op, name: "sinks")
            if s.shape != [nHeads] { throw FlashMetalError.value(op, "sinks shape \(s.shape) must be [\(nHeads)]", arg: "sinks") }
        }
        if let a = t.alibiSlopes {
            try a.requireDType([.f32], op: op, name: "alibi_slopes")
            if a.shape != [batch, nHeads] {
                throw FlashMetalError.value(op, "alibi_slopes shape \(a.shape) must be [\(batch), \(nHeads)]", arg: "alibi_slopes")
            }
            try a.requireBytes(op: op, name: "alibi_slopes")
        }

        // Lengths per sequence, every table index checked before a kernel reads through it.
        let lens = try SequenceLengths(t, kind: kind, batch: batch, o: o, op: op)
        if let lse = t.lse {
            try lse.requireDType([.f32], op: op, name: "softmax_lse")
            let want = varlenQ ? [nHeads, qs[0]] : [batch, nHeads, qs[1]]
            if lse.shape != want { throw FlashMetalError.value(op, "softmax_lse shape \(lse.shape) must be \(want)", arg: "softmax_lse") }
        }

        // The dispatches over `t`'s tables for `batch` sequences, the longest of `maxQ`
        // rows: none without a row, else one prefill.
        func dispatches(_ t: AttnTensors, batch: Int, maxQ: Int) -> [Dispatch] {
            if batch == 0 || maxQ == 0 { return [] }
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
            let (qL, kL) = ext.perSequence ? (maxQ, lens.maxK) : (qs[1], ks[1])
            let params = PrefillDispatcher.attnParams(
                batch: batch, heads: nHeads, kvHeads: nKV, headDim: headDim, headDimV: headDimV, qL: qL, kL: kL,
                tiles: geo.tiles(qL: qL, kL: kL), scale: o.scale, softcap: o.softcap,
                qOffset: ext.perSequence ? 0 : kL - qL, q: qStrides, k: kStrides, v: vStrides, o: oStrides)
            return [PrefillDispatcher.assemble(PrefillTensors(q: t.q, k: t.k, v: t.v, out: t.out), params: params,
                                               maskParams: nil, geometry: geo, causal: o.causal, ext: ext)]
        }

        var plan: AttnPlan
        if let split = lens.usedRows {
            // The kernel reads the split's copies, so the caller's tables meet the outputs here.
            try Dispatch.requireDisjoint(
                [t.out, t.lse].compactMap { $0 },
                from: [t.cuSeqlensQ, t.cuSeqlensK, t.seqlensK, t.blockTable, t.sequsedQ, t.alibiSlopes].compactMap { $0 },
                op: op)
            plan = AttnPlan(tableBytes: split.bytes(t)) { memory in
                dispatches(split.write(t, to: memory!), batch: 2 * batch, maxQ: split.maxQ)
            }
        } else {
            plan = AttnPlan(tableBytes: 0) { _ in dispatches(t, batch: batch, maxQ: lens.maxQ) }
        }
        if varlenQ {
            plan.unowned = UnownedRows(rows: min(lens.totalQ, qs[0])..<qs[0], out: t.out, lse: t.lse)
        }
        return plan
    }
}

/// Every sequence's query and key lengths, read from the tables after
/// SequenceTables checked every entry a kernel reads (cu_seqlens within the
/// packed tensors and max_seqlen, cache lengths within the caches, the
/// block-table entries of the pages in use within [0, num_pages)).
struct SequenceLengths {
    /// The longest query and key sequence.
    let maxQ: Int, maxK: Int
    /// Query rows of all sequences (cu_seqlens_q[B] when packed).
    let totalQ: Int
    /// seqlens_k is [2, B]: each sequence's first key follows the lengths.
    var keyStarts = false
    /// seqused_q's split of every sequence, when given.
    var usedRows: UsedRowsSplit? = nil

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
        if let s = t.seqlensK, t.cuSeqlensK != nil {
            // Packed keys: flash-attn 3's seqused_k, int32 [B], each within its cu_seqlens_k range
            // (first keys, a [2, B] table, are the cache's leftpad: not of packed keys).
            kLens = try SequenceTables.used(s, op: op, name: kind.seqlensKName, lengths: kLens,
                                            lengthsName: "cu_seqlens_k")
        } else if let s = t.seqlensK {
            let bound = kLens.max() ?? 0
            let holds = paged ? SequenceTables.pagedCapacity(pages: t.blockTable!.shape[1], pageSize: pageSize,
                                                             table: "block_table", cache: kind.kName)
                : "the keys \(kind.kName) holds"
            let (lens, starts) = try SequenceTables.seqlensAndStarts(
                s, op: op, name: kind.seqlensKName, startsName: "cache_leftpad", batch: batch, capacity: bound,
                capacityName: holds)
            keyStarts = starts
            kLens = lens
        }
        if let bt = t.blockTable {
            try SequenceTables.blockTable(bt, op: op, name: "block_table", lengths: kLens, numPages: t.k.shape[0],
                                          pageSize: pageSize, cacheName: kind.kName)
        }
        if let u = t.sequsedQ {
            guard let cuQ = t.cuSeqlensQ else {
                throw FlashMetalError.value(op, "seqused_q needs cu_seqlens_q (packed query rows)", arg: "seqused_q")
            }
            guard t.cuSeqlensK != nil else {
                throw FlashMetalError.value(op, "seqused_q needs cu_seqlens_k (packed keys)", arg: "seqused_q")
            }
            let used = try SequenceTables.used(u, op: op, name: "seqused_q", lengths: qLens, lengthsName: "cu_seqlens_q")
            usedRows = UsedRowsSplit(cuSeqlensQ: cuQ, used: used, lengths: qLens)
        }
        maxQ = qLens.max() ?? 0
        totalQ = qLens.reduce(0, +)
        maxK = kLens.max() ?? 0
    }
}

/// flash-attn 3's seqused_q as the kernels run it: sequence b becomes
/// sequence 2b, its first seqused_q[b] rows over its keys, and 2b+1, its
/// other rows over no key (they read 0; their LSE is -inf, or the sink
/// logit). Both halves keep b's rows in place, so q, out and the LSE are
/// bound as they are; the tables (checked already) are rewritten for 2B
/// sequences: cu_seqlens_q split at each used length, cu_seqlens_k with an
/// empty range after each sequence, seqused_k with a 0 after each entry, the
/// block table's and the ALiBi slopes' rows each twice.
public struct UsedRowsSplit {
    /// The per-sequence tables a split rewrites (those present).
    public struct Tables {
        public var cuSeqlensQ: TensorRef?, cuSeqlensK: TensorRef?, seqlensK: TensorRef?, blockTable: TensorRef?,
            alibi: TensorRef?
    }

    /// The caller's cu_seqlens_q, seqused_q and each sequence's rows.
    let cuSeqlensQ: TensorRef, used: [Int], lengths: [Int]

    /// The longest sequence after the split.
    public var maxQ: Int { zip(used, lengths).map { max($0, $1 - $0) }.max() ?? 0 }

    /// The rewritten tables' bytes (every entry 4 bytes).
    public func bytes(_ t: Tables) -> Int {
        let n = 2 * used.count
        let perSequence = (t.seqlensK == nil ? 0 : 1) + (t.blockTable?.shape[1] ?? 0) + (t.alibi?.shape[1] ?? 0)
        return 4 * (2 * (n + 1) + n * perSequence)
    }

    /// `t` rewritten, into `memory` (of `bytes(t)`).
    public func write(_ t: Tables, to memory: UnsafeMutableRawPointer) -> Tables {
        let n = 2 * used.count
        var at = memory
        func table<T>(_ shape: [Int], _ dtype: DType, _ entry: (Int) -> T) -> TensorRef {
            let count = shape.reduce(1, *)
            for i in 0..<count { at.storeBytes(of: entry(i), toByteOffset: i * 4, as: T.self) }
            defer { at += count * 4 }
            return TensorRef(data: at, byteCount: count * 4, dtype: dtype, shape: shape)
        }
        func int32(_ x: TensorRef, _ i: Int) -> Int32 { Int32(SequenceTables.int32(x, i)) }
        var s = t
        // Entry 2b+1 ends sequence b's used rows, entry 2b+2 its rows.
        s.cuSeqlensQ = table([n + 1], .i32) { i in
            i == 0 ? 0 : i % 2 == 1 ? int32(cuSeqlensQ, i / 2) + Int32(used[i / 2]) : int32(cuSeqlensQ, i / 2)
        }
        s.cuSeqlensK = t.cuSeqlensK.map { c in table([n + 1], .i32) { i in i == 0 ? 0 : int32(c, (i + 1) / 2) } }
        s.seqlensK = t.seqlensK.map { k in table([n], .i32) { i in i % 2 == 0 ? int32(k, i / 2) : 0 } }
        s.blockTable = t.blockTable.map { bt in
            let pages = bt.shape[1]
            return table([n, pages], .i32) { i in int32(bt, (i / pages / 2) * pages + i % pages) }
        }
        s.alibi = t.alibi.map { a in
            let heads = a.shape[1]
            return table([n, heads], .f32) { i in
                a.data.loadUnaligned(fromByteOffset: ((i / heads / 2) * heads + i % heads) * 4, as: Float.self)
            }
        }
        return s
    }

    /// The split of AttnTensors.
    func bytes(_ t: AttnTensors) -> Int { bytes(Self.tables(t)) }

    func write(_ t: AttnTensors, to memory: UnsafeMutableRawPointer) -> AttnTensors {
        let w = write(Self.tables(t), to: memory)
        var s = t
        s.sequsedQ = nil
        (s.cuSeqlensQ, s.cuSeqlensK, s.seqlensK, s.blockTable, s.alibiSlopes) =
            (w.cuSeqlensQ, w.cuSeqlensK, w.seqlensK, w.blockTable, w.alibi)
        return s
    }

    static func tables(_ t: AttnTensors) -> Tables {
        Tables(cuSeqlensQ: t.cuSeqlensQ, cuSeqlensK: t.cuSeqlensK, seqlensK: t.seqlensK, blockTable: t.blockTable,
               alibi: t.alibiSlopes)
    }
}
