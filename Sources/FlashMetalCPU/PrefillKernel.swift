import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `flash_attn_prefill_*` on the cpu: one work item per (batch, head, q tile).
final class PrefillKernel: CPUKernel {
    let name: String
    let hasMask: Bool
    let causal: Bool
    let hasBlk: Bool
    let boolMask: Bool
    /// One reusable buffer for packed panels + scratch (fresh pages cost a
    /// page fault each); kept up to `maxCachedBytes`, taken by one call at a time.
    private let cacheLock = Lock()
    private var cached: UnsafeMutableRawPointer? = nil
    private var cachedBytes = 0
    private static let maxCachedBytes = 48 << 20

    deinit { cached?.deallocate() }

    private func takeBuffer(_ bytes: Int) -> (UnsafeMutableRawPointer, Int) {
        let hit: (UnsafeMutableRawPointer, Int)? = cacheLock.withLock {
            guard let c = cached, cachedBytes >= bytes else { return nil }
            cached = nil
            return (c, cachedBytes)
        }
        return hit ?? (UnsafeMutableRawPointer.allocate(byteCount: bytes, alignment: 64), bytes)
    }

    private func giveBack(_ buf: (UnsafeMutableRawPointer, Int)) {
        guard buf.1 <= Self.maxCachedBytes else { buf.0.deallocate(); return }
        let old: UnsafeMutableRawPointer? = cacheLock.withLock {
            if cached != nil, cachedBytes >= buf.1 { return buf.0 }
            let o = cached
            cached = buf.0
            cachedBytes = buf.1
            return o
        }
        old?.deallocate()
    }

    init(_ key: PipelineKey, io: DType, headDim: Int, boolMask: Bool) throws {
        name = key.kernel
        self.boolMask = boolMask
        hasMask = try key.constants.requireBool(FunctionConstantIndex.hasMask, kernel: name)
        causal = try key.constants.requireBool(FunctionConstantIndex.doCausal, kernel: name)
        hasBlk = try key.constants.requireBool(FunctionConstantIndex.hasBlk, kernel: name)
        _ = try key.constants.requireBool(FunctionConstantIndex.alignQ, kernel: name)
        _ = try key.constants.requireBool(FunctionConstantIndex.alignK, kernel: name)
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var a = FMPrefillArgs()
        a.p = try d.params(PrefillBuffer.params, as: AttnParams.self)
        let q = try d.buffer(PrefillBuffer.q)
        a.q = UnsafeRawPointer(q.data)
        a.k = UnsafeRawPointer(try d.buffer(PrefillBuffer.k).data)
        a.v = UnsafeRawPointer(try d.buffer(PrefillBuffer.v).data)
        a.o = try d.buffer(PrefillBuffer.out).data
        a.io_dtype = q.dtype.rawValue
        a.causal = causal ? 1 : 0
        a.mask_kind = MaskKind.none.rawValue
        if hasMask {
            a.mp = try d.params(PrefillBuffer.maskParams, as: AttnMaskParams.self)
            a.mask = UnsafeRawPointer(try d.buffer(PrefillBuffer.mask).data)
            a.mask_kind = (boolMask ? MaskKind.bool : MaskKind.additive).rawValue
        }
        if hasBlk {
            a.blk = UnsafePointer(try d.buffer(PrefillBuffer.blk).data.assumingMemoryBound(to: UInt8.self))
        }
        guard let geo = PrefillGeometry.forHeadDim(Int(a.p.D)) else {
            throw FlashMetalError.internalError("\(name): no tile geometry for D=\(a.p.D)")
        }
        a.bq = Int32(geo.bq)
        a.bk = Int32(geo.bk)

        let isa = fm_cpu_isa()
        if isa > Int32(FM_ISA_PORTABLE), fm_cpu_prefill_pack_bytes(&a, isa) > 0 {
            runFast(&a, isa: isa, pool: pool)
            return
        }
        let nq = d.grid.x, heads = d.grid.y
        let floats = fm_cpu_prefill_scratch_floats(a.bq, a.bk, a.p.D)
        let workers = min(pool.threads, d.grid.count)
        let scratch = UnsafeMutablePointer<Float>.allocate(capacity: floats * max(workers, 1))
        defer { scratch.deallocate() }
        withUnsafePointer(to: &a) { args in
            pool.forEach(d.grid.count) { w, item in
                let qt = item % nq, h = (item / nq) % heads, b = item / (nq * heads)
                fm_cpu_prefill_tile(args, Int64(b), Int64(h), Int64(qt), scratch + w * floats)
            }
        }
    }

    /// Packs K/V panels once per (batch, kv head), then runs the q items of
    /// the GQA heads sharing them. Groups are processed in chunks so the
    /// packed panels stay under ~64 MiB.
    private func runFast(_ a: inout FMPrefillArgs, isa: Int32, pool: WorkerPool) {
        let packBytes = fm_cpu_prefill_pack_bytes(&a, isa)
        let nkb = (Int(a.p.kL) + Int(FM_PF_KB) - 1) / Int(FM_PF_KB)
        let nqi = (Int(a.p.qL) + Int(FM_PF_QI) - 1) / Int(FM_PF_QI)
        let gqa = max(1, Int(a.p.gqa_factor))
        let hkv = Int(a.p.H) / gqa
        let groups = Int(a.p.B) * hkv
        let perChunk = max(1, min(groups, (64 << 20) / max(packBytes, 1)))
        let floats = fm_cpu_prefill_fast_scratch_floats(&a)
        let workers = max(1, pool.threads)
        let packedBytes = (packBytes * perChunk + 63) & ~63
        let buf = takeBuffer(packedBytes + floats * workers * 4)
        defer { giveBack(buf) }
        let packed = buf.0
        let scratch = (buf.0 + packedBytes).bindMemory(to: Float.self, capacity: floats * workers)
        withUnsafePointer(to: &a) { args in
            var g0 = 0
            while g0 < groups {
                let ng = min(perChunk, groups - g0)
                pool.forEach(ng * nkb) { _, item in
                    let g = g0 + item / nkb, kb = item % nkb
                    fm_cpu_prefill_pack(args, isa, Int64(g / hkv), Int64(g % hkv), Int64(kb),
                                        packed + (item / nkb) * packBytes)
                }
                // Heaviest items (last q rows under causal) first.
                pool.forEach(ng * gqa * nqi) { w, item in
                    let qi = nqi - 1 - item / (ng * gqa)
                    let rest = item % (ng * gqa)
                    let gl = rest / gqa, g = g0 + gl
                    let b = g / hkv, h = (g % hkv) * gqa + rest % gqa
                    fm_cpu_prefill_fast_item(args, isa, Int64(b), Int64(h), Int64(qi),
                                             packed + gl * packBytes, scratch + w * floats)
                }
                g0 += ng
            }
        }
    }
}
