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

    init(_ key: PipelineKey) throws {
        name = key.kernel
        boolMask = key.kernel.hasSuffix("_boolmask")
        hasMask = try key.constants.requireBool(PrefillConstant.hasMask, kernel: name)
        causal = try key.constants.requireBool(PrefillConstant.doCausal, kernel: name)
        hasBlk = try key.constants.requireBool(PrefillConstant.hasBlk, kernel: name)
        _ = try key.constants.requireBool(PrefillConstant.alignQ, kernel: name)
        _ = try key.constants.requireBool(PrefillConstant.alignK, kernel: name)
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var a = FMPrefillArgs()
        a.p = try d.params(4, as: AttnParams.self)
        let q = try d.buffer(0)
        a.q = UnsafeRawPointer(q.data)
        a.k = UnsafeRawPointer(try d.buffer(1).data)
        a.v = UnsafeRawPointer(try d.buffer(2).data)
        a.o = try d.buffer(3).data
        a.io_dtype = q.dtype.rawValue
        a.causal = causal ? 1 : 0
        a.mask_kind = Int32(FM_MASK_NONE)
        if hasMask {
            a.mp = try d.params(5, as: AttnMaskParams.self)
            a.mask = UnsafeRawPointer(try d.buffer(6).data)
            a.mask_kind = Int32(boolMask ? FM_MASK_BOOL : FM_MASK_ADDITIVE)
        }
        if hasBlk {
            a.blk = UnsafePointer(try d.buffer(7).data.assumingMemoryBound(to: UInt8.self))
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
