import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `flash_attn_prefill_blk_{bf16,f16,f32,bool}` on the cpu: one work item per
/// (K tile, Q tile) threadgroup of the grid (NK, NQ, 1).
final class BlkKernel: CPUKernel {
    let name: String
    let isBF16: Int32
    let isBool: Bool
    let isF32: Bool
    let bq: Int32
    let bk: Int32

    init(_ key: PipelineKey, maskType: DType) throws {
        name = key.kernel
        isBF16 = maskType == .bf16 ? 1 : 0
        isBool = maskType == .bool
        isF32 = maskType == .f32
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
        let (isBF16, isBool, isF32) = (self.isBF16, self.isBool, self.isF32)
        let (nk, nq) = (d.grid.x, d.grid.y)
        let out = blk.data.assumingMemoryBound(to: UInt8.self)
        let (bq, bk) = (self.bq, self.bk)
        withUnsafePointer(to: &p) { pp in
            pool.forEach(nk * nq) { _, item in
                let (qt, kt) = (Int64(item / nk), Int64(item % nk))
                if isBool {
                    fm_cpu_blk_tile_bool(pp, mask.data.assumingMemoryBound(to: UInt8.self), out, bq, bk, Int64(nk), qt, kt)
                } else if isF32 {
                    fm_cpu_blk_tile_f32(pp, mask.data.assumingMemoryBound(to: Float.self), out, bq, bk, Int64(nk), qt, kt)
                } else {
                    fm_cpu_blk_tile(pp, mask.data.assumingMemoryBound(to: UInt16.self), isBF16, out, bq, bk, Int64(nk),
                                    qt, kt)
                }
            }
        }
    }
}
