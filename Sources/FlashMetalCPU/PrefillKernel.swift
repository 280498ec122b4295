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
    private let fast = FastPrefill()

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
        if FastPrefill.covers(&a, isa: isa) {
            fast.run(&a, isa: isa, pool: pool)
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
}
