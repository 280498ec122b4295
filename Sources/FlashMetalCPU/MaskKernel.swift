import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `flash_attn_prefill_mask_{bf16,f16}` on the cpu: one work item per mask row.
final class MaskKernel: CPUKernel {
    let isBF16: Int32

    init(_ key: PipelineKey, outType: DType) {
        isBF16 = outType == .bf16 ? 1 : 0
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var p = try d.params(MaskBuilderBuffer.params, as: MaskParams.self)
        let out = try d.buffer(MaskBuilderBuffer.out).data.assumingMemoryBound(to: UInt16.self)
        let isBF16 = self.isBF16
        withUnsafePointer(to: &p) { pp in
            pool.forEach(Int(pp.pointee.seq_len_q)) { _, i in fm_cpu_mask_row(pp, out, isBF16, Int64(i)) }
        }
    }
}
