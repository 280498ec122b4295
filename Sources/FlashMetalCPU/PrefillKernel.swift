import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `flash_attn_prefill_*` on the cpu: one work item per (batch, head, q tile)
/// (portable) or per (sequence, head, q block) of the fast path.
final class PrefillKernel: CPUKernel {
    let name: String
    let hasMask: Bool
    let causal: Bool
    let hasBlk: Bool
    let boolMask: Bool
    let serving: PrefillServingConstants
    private let fast = FastPrefill()

    init(_ key: PipelineKey, io: DType, headDim: Int, boolMask: Bool) throws {
        name = key.kernel
        self.boolMask = boolMask
        hasMask = try key.constants.requireBool(FunctionConstantIndex.hasMask, kernel: name)
        causal = try key.constants.requireBool(FunctionConstantIndex.doCausal, kernel: name)
        hasBlk = try key.constants.requireBool(FunctionConstantIndex.hasBlk, kernel: name)
        _ = try key.constants.requireBool(FunctionConstantIndex.alignQ, kernel: name)
        _ = try key.constants.requireBool(FunctionConstantIndex.alignK, kernel: name)
        serving = try PrefillServingConstants(key.constants, kernel: name)
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
        a.seq = try serving.bind(d)
        let width = max(a.p.D, a.p.Dv)  // q/k's and v's head dims share the tile of the larger
        guard let geo = PrefillGeometry.forHeadDim(Int(width)) else {
            throw FlashMetalError.internalError("\(name): no tile geometry for D=\(a.p.D), Dv=\(a.p.Dv)")
        }
        a.bq = Int32(geo.bq)
        a.bk = Int32(geo.bk)

        let isa = fm_cpu_isa()
        if FastPrefill.covers(&a, isa: isa) {
            try fast.run(&a, isa: isa, pool: pool, op: name)
            return
        }
        // Tiles of the tile-skip geometry (AttnParams' NQ), which the blk
        // indexes; the grid may be a float32 kernel's finer one.
        let nq = Int(a.p.NQ), heads = d.grid.y
        let items = nq * heads * d.grid.z
        let floats = fm_cpu_prefill_scratch_floats(a.bq, a.bk, width)
        let workers = min(pool.threads, items)
        let scratch = try HostMemory.allocate(Float.self, count: floats * max(workers, 1), op: name,
                                              what: "prefill scratch")
        defer { HostMemory.free(scratch) }
        withUnsafePointer(to: &a) { args in
            pool.forEach(items) { w, item in
                let qt = item % nq, h = (item / nq) % heads, b = item / (nq * heads)
                fm_cpu_prefill_tile(args, Int64(b), Int64(h), Int64(qt), scratch + w * floats)
            }
        }
    }
}

/// The serving extension's function constants of a prefill pipeline
/// (flashmetal_kernels.h: 302, 304-311; the dispatchers set every one) and the
/// buffers they bind (PrefillBuffer.seqParams ... lse).
struct PrefillServingConstants {
    let seq: Bool, sinks: Bool, window: Bool, varlenQ: Bool, varlenK: Bool, kvLens: Bool, paged: Bool, lse: Bool, alibi: Bool

    init(_ c: FunctionConstants, kernel: String) throws {
        typealias F = FunctionConstantIndex
        seq = try c.requireBool(F.prefillSeq, kernel: kernel)
        sinks = try c.requireBool(F.hasSinks, kernel: kernel)
        window = try c.requireBool(F.window, kernel: kernel)
        varlenQ = try c.requireBool(F.varlenQ, kernel: kernel)
        varlenK = try c.requireBool(F.varlenK, kernel: kernel)
        kvLens = try c.requireBool(F.kvLens, kernel: kernel)
        paged = try c.requireBool(F.paged, kernel: kernel)
        lse = try c.requireBool(F.hasLSE, kernel: kernel)
        alibi = try c.requireBool(F.hasAlibi, kernel: kernel)
        if !seq && (sinks || window || varlenQ || varlenK || kvLens || paged || lse || alibi) {
            throw FlashMetalError.backend("cpu backend: \(kernel): a serving constant is set without \(F.prefillSeq) (AttnSeqParams)")
        }
    }

    /// The FMPrefillSeq of dispatch `d`: zeroed unless AttnSeqParams is bound.
    func bind(_ d: Dispatch) throws -> FMPrefillSeq {
        var s = FMPrefillSeq()
        guard seq else { return s }
        func ints(_ on: Bool, _ index: Int) throws -> UnsafePointer<Int32>? {
            on ? UnsafePointer(try d.buffer(index).data.assumingMemoryBound(to: Int32.self)) : nil
        }
        s.sp = try d.params(PrefillBuffer.seqParams, as: AttnSeqParams.self)
        s.cu_seqlens_q = try ints(varlenQ, PrefillBuffer.cuSeqlensQ)
        s.cu_seqlens_k = try ints(varlenK, PrefillBuffer.cuSeqlensK)
        s.seqlens_k = try ints(kvLens, PrefillBuffer.seqlensK)
        s.block_table = try ints(paged, PrefillBuffer.blockTable)
        if s.sp.key_starts_at > 0 {
            // The first keys follow the lengths in the seqlens_k table.
            let lens = try d.buffer(PrefillBuffer.seqlensK)
            if !kvLens || lens.dtype != .i32 || lens.byteCount < 2 * Int(s.sp.key_starts_at) * 4 {
                throw FlashMetalError.internalError("\(d.kernel): key starts at \(s.sp.key_starts_at) do not fit seqlens_k")
            }
        }
        if sinks {
            s.sinks = UnsafePointer(try d.buffer(PrefillBuffer.sinks).data.assumingMemoryBound(to: Float.self))
        }
        if alibi {
            let slopes = try d.buffer(PrefillBuffer.alibi)
            let p = try d.params(PrefillBuffer.params, as: AttnParams.self)
            if slopes.dtype != .f32 || slopes.byteCount < Int(p.B) * Int(p.H) * 4 {
                throw FlashMetalError.internalError("\(d.kernel): alibi slopes \(slopes.shape) do not cover [\(p.B), \(p.H)]")
            }
            s.alibi = UnsafePointer(slopes.data.assumingMemoryBound(to: Float.self))
        }
        if lse {
            s.lse = try d.buffer(PrefillBuffer.lse).data.assumingMemoryBound(to: Float.self)
        }
        s.window = window ? 1 : 0
        return s
    }
}
