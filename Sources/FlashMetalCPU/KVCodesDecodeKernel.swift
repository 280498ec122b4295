import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `kv_codes_decode_f32` on the cpu (kv_codec.c): one work item per chunk of
/// the query heads that share a kv head, so each key's codes are unpacked
/// once for all of them.
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
        let heads = Int(p.n_heads), kvHeads = Int(p.n_kv_heads), chunk = Int(FM_CPU_KVQ_HEAD_CHUNK)
        let items = d.grid.x / heads * kvHeads * ((heads / kvHeads + chunk - 1) / chunk)
        withUnsafePointer(to: &p) { pp in
            pool.forEach(items) { _, item in
                fm_cpu_kv_codes_decode_item(pp, q, kc, kn, vc, vn, o, Int64(item))
            }
        }
    }
}
