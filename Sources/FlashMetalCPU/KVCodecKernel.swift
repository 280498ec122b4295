import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `kv_encode_*` and `kv_dequantize_f32` on the cpu (kv_codec.c): the rows
/// of the grid's x, dealt in runs over the worker pool.
final class KVCodecKernel: CPUKernel {
    /// Rows per work item: enough to amortise a pool hand-off.
    static let rowsPerItem = 64
    let spec: KernelSpec

    init(_ key: PipelineKey) { spec = key.spec }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        let rows = d.grid.x
        let per = Self.rowsPerItem
        let items = (rows + per - 1) / per
        if case let .kvEncode(input) = spec {
            var p = try d.params(KVEncodeBuffer.params, as: KVCodecParams.self)
            let x = UnsafeRawPointer(try d.buffer(KVEncodeBuffer.x).data)
            let codes = try d.buffer(KVEncodeBuffer.codes).data.assumingMemoryBound(to: UInt8.self)
            let norms = try d.buffer(KVEncodeBuffer.norms).data.assumingMemoryBound(to: Float.self)
            withUnsafePointer(to: &p) { pp in
                pool.forEach(items) { _, item in
                    fm_cpu_kv_encode_rows(pp, x, input.rawValue, codes, norms, Int64(item * per),
                                          Int64(min(rows, (item + 1) * per)))
                }
            }
        } else {
            var p = try d.params(KVDequantizeBuffer.params, as: KVCodecParams.self)
            let codes = UnsafePointer(try d.buffer(KVDequantizeBuffer.codes).data.assumingMemoryBound(to: UInt8.self))
            let norms = UnsafePointer(try d.buffer(KVDequantizeBuffer.norms).data.assumingMemoryBound(to: Float.self))
            let out = try d.buffer(KVDequantizeBuffer.out).data.assumingMemoryBound(to: Float.self)
            withUnsafePointer(to: &p) { pp in
                pool.forEach(items) { _, item in
                    fm_cpu_kv_dequantize_rows(pp, codes, norms, out, Int64(item * per),
                                              Int64(min(rows, (item + 1) * per)))
                }
            }
        }
    }
}
