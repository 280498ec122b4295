import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `kv_append_*` on the cpu: one work item per (sequence, new row) of the
/// grid (n_new, Hkv, B), copying every kv head's row.
final class KVAppendKernel: CPUKernel {
    let name: String
    let paged: Bool

    init(_ key: PipelineKey) throws {
        name = key.kernel
        paged = try key.constants.requireBool(FunctionConstantIndex.appendPaged, kernel: name)
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var p = try d.params(KVAppendBuffer.params, as: KVAppendParams.self)
        let kNew = UnsafeRawPointer(try d.buffer(KVAppendBuffer.kNew).data)
        let vNew = UnsafeRawPointer(try d.buffer(KVAppendBuffer.vNew).data)
        let kCache = try d.buffer(KVAppendBuffer.kCache)
        let vCache = try d.buffer(KVAppendBuffer.vCache).data
        let seqlens = UnsafePointer(try d.buffer(KVAppendBuffer.seqlens).data.assumingMemoryBound(to: Int32.self))
        let table: UnsafePointer<Int32>? = paged
            ? UnsafePointer(try d.buffer(KVAppendBuffer.blockTable).data.assumingMemoryBound(to: Int32.self)) : nil
        let (rows, batch) = (d.grid.x, d.grid.z)
        let elem = Int32(kCache.dtype.byteSize)
        withUnsafePointer(to: &p) { pp in
            pool.forEach(batch * rows) { _, item in
                fm_cpu_kv_append_row(pp, kNew, vNew, kCache.data, vCache, seqlens, table, elem,
                                     Int64(item / rows), Int64(item % rows))
            }
        }
    }
}
