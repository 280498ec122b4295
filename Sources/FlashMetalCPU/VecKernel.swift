import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// `flash_attn_vec_*` on the cpu: one work item per (kv head, workgroup) of
/// the grid (1, rows, NWG), covering the GQA group's rows so K/V are read
/// once per group; each row's partial (O, S, M) goes into tmp.
final class VecKernel: CPUKernel {
    let name: String

    init(_ key: PipelineKey) { name = key.kernel }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var p = try d.params(VecBuffer.params, as: FlashAttnVecParams.self)
        let q = UnsafePointer(try d.buffer(VecBuffer.q).data.assumingMemoryBound(to: Float.self))
        let k = try d.buffer(VecBuffer.k)
        let v = UnsafeRawPointer(try d.buffer(VecBuffer.v).data)
        let tmp = try d.buffer(VecBuffer.tmp).data.assumingMemoryBound(to: Float.self)
        let kd = UnsafeRawPointer(k.data)
        let dtype = k.dtype.rawValue
        let nwg = d.grid.z
        if Int(p.nwg) != nwg {
            throw FlashMetalError.internalError("\(name): params nwg \(p.nwg) != grid z \(nwg)")
        }
        let kvRows = Int(p.n_kv_heads)
        let gqa = Int32(p.n_heads / p.n_kv_heads)
        let floats = fm_cpu_vec_scratch_floats(Int32(p.head_dim), gqa)
        let workers = max(min(pool.threads, kvRows * nwg), 1)
        let scratch = UnsafeMutablePointer<Float>.allocate(capacity: floats * workers)
        defer { scratch.deallocate() }
        // Workgroup w starts at key CHUNK*w: those past kv_len see nothing and
        // only write their empty partials, on this thread, so a short cache
        // (e.g. kv_len = 1) wakes no worker for them.
        let chunk = Int(FM_VEC_CHUNK)
        let active = min(nwg, (Int(p.kv_seq_len) + chunk - 1) / chunk)
        withUnsafePointer(to: &p) { pp in
            pool.forEach(kvRows * active) { w, item in
                fm_cpu_vec_partial_group(pp, q, kd, v, dtype, tmp, Int64(item / active), Int64(item % active),
                                         scratch + w * floats)
            }
            for r in 0..<kvRows {
                for wg in active..<nwg {
                    fm_cpu_vec_partial_group(pp, q, kd, v, dtype, tmp, Int64(r), Int64(wg), scratch)
                }
            }
        }
    }
}

/// `flash_attn_vec_reduce_dk*` and `flash_attn_vec_reduce_tq_hb_undo_dk*`
/// on the cpu: one work item per row.
final class VecReduceKernel: CPUKernel {
    let name: String
    let headDim: Int32
    let fwht: Bool
    let hasSigns: Bool

    init(_ key: PipelineKey, headDim: Int, fwht: Bool) throws {
        name = key.kernel
        self.fwht = fwht
        self.headDim = Int32(headDim)
        hasSigns = fwht ? try key.constants.requireBool(FunctionConstantIndex.vecHasSigns, kernel: name) : false
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        let rows = Int(try d.params(VecReduceBuffer.params, as: FlashAttnVecReduceParams.self).nrows)
        let nwg = Int32(try d.params(VecReduceBuffer.nwg, as: UInt32.self))
        if nwg <= 0 { throw FlashMetalError.internalError("\(name): nwg must be > 0") }
        let tmp = UnsafePointer(try d.buffer(VecReduceBuffer.tmp).data.assumingMemoryBound(to: Float.self))
        let out = try d.buffer(VecReduceBuffer.out).data.assumingMemoryBound(to: Float.self)
        let signs: UnsafePointer<UInt8>? = hasSigns
            ? UnsafePointer(try d.buffer(VecReduceBuffer.signs).data.assumingMemoryBound(to: UInt8.self)) : nil
        let (dk, fwht) = (headDim, Int32(self.fwht ? 1 : 0))
        pool.forEach(rows) { _, r in
            fm_cpu_vec_reduce_row(tmp, out, Int64(rows), dk, nwg, Int64(r), fwht, signs)
        }
    }
}
