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
        var p = try d.params(0, as: FlashAttnVecParams.self)
        let q = UnsafePointer(try d.buffer(1).data.assumingMemoryBound(to: Float.self))
        let k = try d.buffer(2)
        let v = UnsafeRawPointer(try d.buffer(3).data)
        let tmp = try d.buffer(4).data.assumingMemoryBound(to: Float.self)
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

    init(_ key: PipelineKey) throws {
        name = key.kernel
        fwht = key.kernel.hasPrefix("flash_attn_vec_reduce_tq_hb_undo_dk")
        guard let dk = key.kernel.split(separator: "k").last.flatMap({ Int32($0) }),
              VecDispatcher.headDims.contains(Int(dk)) else {
            throw FlashMetalError.backend("cpu backend: unknown kernel '\(key.kernel)'")
        }
        headDim = dk
        hasSigns = fwht ? try key.constants.requireBool(VecDispatcher.hasSignsConstant, kernel: name) : false
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        let rows = Int(try d.params(0, as: FlashAttnVecReduceParams.self).nrows)
        let nwg = Int32(try d.params(3, as: UInt32.self))
        if nwg <= 0 { throw FlashMetalError.internalError("\(name): nwg must be > 0") }
        let tmp = UnsafePointer(try d.buffer(1).data.assumingMemoryBound(to: Float.self))
        let out = try d.buffer(2).data.assumingMemoryBound(to: Float.self)
        let signs: UnsafePointer<UInt8>? = hasSigns
            ? UnsafePointer(try d.buffer(VecDispatcher.signsBuffer).data.assumingMemoryBound(to: UInt8.self)) : nil
        let (dk, fwht) = (headDim, Int32(self.fwht ? 1 : 0))
        pool.forEach(rows) { _, r in
            fm_cpu_vec_reduce_row(tmp, out, Int64(rows), dk, nwg, Int64(r), fwht, signs)
        }
    }
}
