import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `kv_codes_decode_f32` on the cpu (kv_codec.c): one work item per query row.
final class KVCodesDecodeKernel: CPUKernel {
    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var p = try d.params(KVCodesDecodeBuffer.params, as: KVCodesDecodeParams.self)
        func input<T>(_ i: Int, _ t: T.Type) throws -> UnsafePointer<T> {
            UnsafePointer(try d.buffer(i).data.assumingMemoryBound(to: T.self))
        }
        let q = try input(KVCodesDecodeBuffer.q, Float.self)
        let kc = try input(KVCodesDecodeBuffer.kCodes, UInt8.self), kn = try input(KVCodesDecodeBuffer.kNorms, Float.self)
        let vc = try input(KVCodesDecodeBuffer.vCodes, UInt8.self), vn = try input(KVCodesDecodeBuffer.vNorms, Float.self)
        let o = try d.buffer(KVCodesDecodeBuffer.out).data.assumingMemoryBound(to: Float.self)
        withUnsafePointer(to: &p) { pp in
            pool.forEach(d.grid.x) { _, row in
                fm_cpu_kv_codes_decode_row(pp, q, kc, kn, vc, vn, o, Int64(row))
            }
        }
    }
}
