import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `flash_attn_prefill_blk_{bf16,f16}` on the cpu: one work item per
/// (K tile, Q tile) threadgroup of the grid (NK, NQ, 1).
final class BlkKernel: CPUKernel {
    let name: String
    let isBF16: Int32
    let bq: Int32
    let bk: Int32

    init(_ key: PipelineKey, maskType: DType) throws {
        name = key.kernel
        isBF16 = maskType == .bf16 ? 1 : 0
        bq = try key.constants.requireInt(FunctionConstantIndex.blkBQ, kernel: name)
        bk = try key.constants.requireInt(FunctionConstantIndex.blkBK, kernel: name)
        if bq <= 0 || bk <= 0 {
            throw FlashMetalError.backend("cpu backend: \(name): tile constants must be > 0, got (\(bq), \(bk))")
        }
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var p = try d.params(BlkBuffer.params, as: BlkParams.self)
        let mask = try d.buffer(BlkBuffer.mask)
        let blk = try d.buffer(BlkBuffer.out)
        let isBF16 = self.isBF16
        let (nk, nq) = (d.grid.x, d.grid.y)
        let m = UnsafePointer(mask.data.assumingMemoryBound(to: UInt16.self))
        let out = blk.data.assumingMemoryBound(to: UInt8.self)
        let (bq, bk) = (self.bq, self.bk)
        withUnsafePointer(to: &p) { pp in
            pool.forEach(nk * nq) { _, item in
                fm_cpu_blk_tile(pp, m, isBF16, out, bq, bk, Int64(nk), Int64(item / nk), Int64(item % nk))
            }
        }
    }
}
