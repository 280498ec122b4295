import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// The fast prefill's driver (prefill_fast.c → the ISA's instance of
/// prefill_body.h), shared by `flash_attn_prefill_*` and float32 `sdpa`.
///
/// K/V of one (batch, kv head) are packed once into panels and shared by
/// the GQA heads. Groups run in chunks whose panels fit in the L2 cache
/// (packing every head up front thrashes L3 at long L); within a chunk the
/// heaviest items (the most visible keys: the last q rows under causal, the
/// longest sequences of a ragged batch) start first.
final class FastPrefill {
    /// One reusable buffer for panels + scratch (fresh pages cost a page
    /// fault each), taken by one call at a time. Policy: cache. The buffer is
    /// kept whatever its size, so a long prefill repeated does not fault in
    /// fresh pages every call; a call needing less than a quarter of a cached
    /// buffer over `shrinkAboveBytes` frees it and takes its own size, so one
    /// huge call does not pin its memory for the life of the process.
    private let cacheLock = Lock()
    private var cached: UnsafeMutableRawPointer? = nil
    private var cachedBytes = 0
    private static let shrinkAboveBytes = 48 << 20
    /// Packed panels per chunk: about one core's L2.
    private static let chunkBytes = 1 << 20

    deinit { if let c = cached { HostMemory.free(c) } }

    /// Whether the fast path covers this call on `isa`.
    static func covers(_ a: inout FMPrefillArgs, isa: Int32) -> Bool {
        isa != Int32(FM_ISA_PORTABLE) && fm_cpu_prefill_fast_covers(&a, isa) != 0
    }

    /// Runs a call `covers` accepted; `op` names it in errors (a buffer the
    /// machine cannot give is a BackendError, nothing is written).
    func run(_ a: inout FMPrefillArgs, isa: Int32, pool: WorkerPool, op: String) throws {
        a.panel_blocks = fm_cpu_prefill_panel_blocks(&a)
        let span = Int(a.panel_blocks)
        let packBytes = fm_cpu_prefill_pack_bytes(&a, isa)
        let rows = Int(fm_cpu_prefill_item_rows(isa))
        let gqa = max(1, Int(a.p.gqa_factor))
        let hkv = Int(a.p.H) / gqa
        let groups = Int(a.p.B) * hkv
        guard span > 0, groups > 0 else { return try runEmpty(&a, isa: isa, pool: pool, op: op) }
        let perChunk = max(1, min(groups, Self.chunkBytes / max(packBytes, 1)))
        let floats = fm_cpu_prefill_fast_scratch_floats(&a, isa)
        let workers = max(1, pool.threads)
        let (panels, o1) = packBytes.multipliedReportingOverflow(by: perChunk)
        let packedBytes = (panels + 63) & ~63
        let (total, o2) = packedBytes.addingReportingOverflow(floats * workers * 4)
        if o1 || o2 || panels > Int.max - 63 {
            throw FlashMetalError.backend(op, "the packed keys of \(span) blocks of \(FM_PF_KB) are too large to allocate")
        }
        let buf = try takeBuffer(total, op: op)
        defer { giveBack(buf) }
        let packed = buf.0
        let scratch = (buf.0 + packedBytes).bindMemory(to: Float.self, capacity: floats * workers)
        withUnsafePointer(to: &a) { args in
            var g0 = 0
            while g0 < groups {
                let ng = min(perChunk, groups - g0)
                pool.forEach(ng * span) { _, item in
                    let g = g0 + item / span, j = item % span
                    fm_cpu_prefill_pack(args, isa, Int64(g / hkv), Int64(g % hkv), Int64(j),
                                        packed + (item / span) * packBytes)
                }
                let items = Self.heaviestFirst(args, groups: g0..<(g0 + ng), hkv: hkv, gqa: gqa, rows: rows)
                items.withUnsafeBufferPointer { list in
                    pool.forEach(list.count) { w, i in
                        let it = list[i]
                        fm_cpu_prefill_fast_item(args, isa, Int64(it.b), Int64(it.h), Int64(it.qi),
                                                 packed + Int(it.local) * packBytes, scratch + w * floats)
                    }
                }
                g0 += ng
            }
        }
    }

    /// One work item: q block `qi` of head `h` of sequence `b`, whose K/V
    /// panels are the chunk's `local`-th.
    struct Item {
        var b: Int32, h: Int32, qi: Int32, local: Int32, keys: Int64
    }

    /// The items of a chunk of (sequence, kv head) groups, the most keys
    /// first, so the longest items start first and the short ones fill in at
    /// the end; ties (every item of full attention) go group by group, so a
    /// worker's consecutive items read the same panels from its L2 (q block
    /// first hopped between groups: 5-19% slower at L=512-2048).
    static func heaviestFirst(_ a: UnsafePointer<FMPrefillArgs>, groups: Range<Int>, hkv: Int, gqa: Int,
                              rows: Int) -> [Item] {
        var items: [Item] = []
        for g in groups {
            let b = g / hkv
            let qL = Int(fm_cpu_prefill_seq_rows(a, Int64(b)))
            for qi in stride(from: (qL + rows - 1) / rows - 1, through: 0, by: -1) {
                let keys = fm_cpu_prefill_rows_keys(a, Int64(b), Int64(qi * rows), Int64(rows))
                for j in 0..<gqa {
                    items.append(Item(b: Int32(b), h: Int32((g % hkv) * gqa + j), qi: Int32(qi),
                                      local: Int32(g - groups.lowerBound), keys: keys))
                }
            }
        }
        items.sort { x, y in
            if x.keys != y.keys { return x.keys > y.keys }
            if x.local != y.local { return x.local < y.local }
            if x.qi != y.qi { return x.qi > y.qi }
            return x.h < y.h
        }
        return items
    }

    /// A call where no row sees a key: the items write zero rows (and LSE
    /// -inf, or the sinks' share) without reading a panel.
    private func runEmpty(_ a: inout FMPrefillArgs, isa: Int32, pool: WorkerPool, op: String) throws {
        let rows = Int(fm_cpu_prefill_item_rows(isa))
        let floats = fm_cpu_prefill_fast_scratch_floats(&a, isa)
        let scratch = try HostMemory.allocate(Float.self, count: floats, op: op, what: "prefill scratch")
        defer { HostMemory.free(scratch) }
        let b = Int(a.p.B), h = Int(a.p.H)
        withUnsafePointer(to: &a) { args in
            for s in 0..<b {
                let qL = Int(fm_cpu_prefill_seq_rows(args, Int64(s)))
                for head in 0..<h {
                    for qi in 0..<((qL + rows - 1) / rows) {
                        fm_cpu_prefill_fast_item(args, isa, Int64(s), Int64(head), Int64(qi), scratch, scratch)
                    }
                }
            }
        }
    }

    /// A buffer of at least `bytes`: the cached one when it fits (and is not
    /// four times too big past `shrinkAboveBytes`), else a fresh one.
    private func takeBuffer(_ bytes: Int, op: String) throws -> (UnsafeMutableRawPointer, Int) {
        let (hit, drop): ((UnsafeMutableRawPointer, Int)?, UnsafeMutableRawPointer?) = cacheLock.withLock {
            guard let c = cached else { return (nil, nil) }
            let fits = cachedBytes >= bytes
            let oversized = cachedBytes > Self.shrinkAboveBytes && bytes < cachedBytes / 4
            if fits && !oversized {
                cached = nil
                return ((c, cachedBytes), nil)
            }
            // Freed before the fresh allocation, so the two never coexist.
            cached = nil
            return (nil, c)
        }
        if let hit { return hit }
        if let drop { HostMemory.free(drop) }
        return (try HostMemory.allocate(count: bytes, stride: 1, op: op, what: "packed keys and values"), bytes)
    }

    /// Keeps the larger of the returned and the cached buffer.
    private func giveBack(_ buf: (UnsafeMutableRawPointer, Int)) {
        let old: UnsafeMutableRawPointer? = cacheLock.withLock {
            if cached != nil, cachedBytes >= buf.1 { return buf.0 }
            let o = cached
            cached = buf.0
            cachedBytes = buf.1
            return o
        }
        if let old { HostMemory.free(old) }
    }
}

/// float32 `sdpa` dispatches the fast prefill covers, mapped onto it: SDPA's
/// contiguous [B, H, L, D] tensors, bottom-right causal (query i at
/// kv_len - L + i) or SdpaExtParams' explicit q_offset (top-left causal is
/// q_offset 0), its window w as the in-kernel window (keys p >= t - (w - 1))
/// and its softcap, an additive (float32) or bool mask. Anything else is left
/// to the general sdpa kernel.
final class SdpaFastPath {
    private let fast = FastPrefill()

    /// Runs `d` and returns true when the fast path covers it.
    func run(_ d: Dispatch, maskKind: MaskKind, ext: SdpaExtParams?, softcap: Bool, pool: WorkerPool) throws -> Bool {
        let q = try d.buffer(SdpaBuffer.q)
        guard q.dtype == .f32 else { return false }
        let isa = fm_cpu_isa()
        let sp = try d.params(SdpaBuffer.params, as: SdpaParams.self)
        let (H, Hkv, D) = (Int64(sp.n_heads), Int64(sp.n_kv_heads), Int64(sp.head_dim))
        let (qL, kL) = (Int64(sp.seq_len), Int64(sp.kv_seq_len))
        guard Hkv > 0, H % Hkv == 0, qL > 0, kL > 0 else { return false }
        let cap = sp.kv_capacity != 0 ? Int64(sp.kv_capacity) : kL
        var a = FMPrefillArgs()
        a.p.B = Int32(d.grid.x)
        a.p.H = Int32(H)
        let Dv = Int64(ext?.head_dim_v ?? Int32(D))  // v's and the output's head dim
        a.p.D = Int32(D)
        a.p.Dv = Int32(Dv)
        a.p.qL = Int32(qL)
        a.p.kL = Int32(kL)
        a.p.gqa_factor = Int32(H / Hkv)
        a.p.scale = sp.scale
        a.p.NK = Int32((kL + 63) / 64)
        a.p.NQ = Int32((qL + 63) / 64)
        a.p.qL_off = ext?.q_offset ?? Int32(kL - qL)
        if softcap, let e = ext { a.p.softcapping = e.softcap }
        if let e = ext, e.window > 0 {
            a.seq.window = 1
            a.seq.sp.window_left = e.window - 1
            a.seq.sp.window_right = -1
        }
        a.p.Q_strides = (H * qL * D, qL * D, D)
        a.p.O_strides = (H * qL * Dv, qL * Dv, Dv)
        a.p.K_strides = (Hkv * cap * D, cap * D, D)
        a.p.V_strides = (Hkv * cap * Dv, cap * Dv, Dv)
        a.bq = 64
        a.bk = 64
        a.io_dtype = DType.f32.rawValue
        a.causal = sp.do_causal != 0 ? 1 : 0
        a.mask_kind = maskKind.rawValue
        guard FastPrefill.covers(&a, isa: isa) else { return false }
        a.q = UnsafeRawPointer(q.data)
        a.k = UnsafeRawPointer(try d.buffer(SdpaBuffer.k).data)
        a.v = UnsafeRawPointer(try d.buffer(SdpaBuffer.v).data)
        a.o = try d.buffer(SdpaBuffer.out).data
        if maskKind != .none {
            a.mp = try d.params(SdpaBuffer.maskParams, as: AttnMaskParams.self)
            a.mask = UnsafeRawPointer(try d.buffer(maskKind == .bool ? SdpaBuffer.boolMask : SdpaBuffer.additiveMask).data)
        }
        try fast.run(&a, isa: isa, pool: pool, op: "sdpa")
        return true
    }
}
