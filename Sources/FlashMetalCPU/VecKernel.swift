import CFlashMetal
import FlashMetalCPUKernels
import FlashMetalCore

/// Multiply-adds below which a decode dispatch runs on the calling thread alone.
private let smallWork = 1 << 18

/// `flash_attn_vec_*` on the cpu: one work item per (kv row, workgroup) of
/// the grid's rows (VecDispatcher.rows) and NWG, covering the GQA group's rows so K/V are read
/// once per group; each row's partial (O, S, M) goes into tmp. With the
/// serving constants (501-503) the strides, per-sequence lengths and block
/// table come from the dispatch (flashmetal_kernels.h, FlashAttnVecSeqParams).
final class VecKernel: CPUKernel {
    let name: String
    /// FM_FC_VEC_SEQ, FM_FC_VEC_KV_LENS, FM_FC_VEC_PAGED; unset means false
    /// (the plain decode sets none of them).
    let seq: Bool, kvLens: Bool, paged: Bool, alibi: Bool
    /// FM_FC_VEC_Q_IO: q in the K/V dtype (widened to float32 before the items).
    let qIO: Bool

    init(_ key: PipelineKey) throws {
        name = key.kernel
        let c = key.constants
        seq = c.bool(FunctionConstantIndex.vecSeq) ?? false
        kvLens = c.bool(FunctionConstantIndex.vecKVLens) ?? false
        paged = c.bool(FunctionConstantIndex.vecPaged) ?? false
        alibi = c.bool(FunctionConstantIndex.vecAlibi) ?? false
        qIO = c.bool(FunctionConstantIndex.vecQIO) ?? false
        if (kvLens || paged || alibi) && !seq {
            throw FlashMetalError.backend("cpu backend: \(name): seqlens or paging without FlashAttnVecSeqParams (constant 501)")
        }
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        var a = try args(d)
        // q in the K/V dtype: widened once (exactly) to the float32 rows the items read.
        var wideQ: UnsafeMutablePointer<Float>? = nil
        defer { if let w = wideQ { HostMemory.free(w) } }
        if qIO {
            let q = try d.buffer(VecBuffer.qIO)
            let n = q.elementCount ?? 0
            let w = try HostMemory.allocate(Float.self, count: max(n, 1), op: name, what: "decode q")
            wideQ = w
            fm_cpu_widen_to_f32(q.data, q.dtype.rawValue, Int64(n), w)
            a.q = UnsafePointer(w)
        }
        let p = a.p
        let kvRows = Int(a.batch) * Int(p.n_kv_heads)
        let gqa = Int(p.n_heads / p.n_kv_heads) * max(Int(a.q_rows), 1)
        let nwg = Int(p.nwg)
        let (floats, active, keyMajor) = withUnsafePointer(to: &a) {
            (fm_cpu_vec_scratch_floats($0), Int(fm_cpu_vec_active_wgs($0)), fm_cpu_vec_key_major($0) != 0)
        }
        // At most this many FMAs (every row, every key of a full chunk per
        // item): below ~100 us of work a second thread costs more than it saves.
        let fmas = kvRows * active * Int(FM_VEC_CHUNK) * gqa * Int(p.head_dim) * 2
        // Items: (kv row, workgroup), or (sequence, workgroup) with every
        // head inside when the heads of one key are adjacent in memory.
        let items = (keyMajor ? Int(a.batch) : kvRows) * active
        let workers = fmas < smallWork ? 1 : max(min(pool.threads, items), 1)
        let scratch = try HostMemory.allocate(Float.self, count: floats * workers, op: name, what: "decode scratch")
        defer { HostMemory.free(scratch) }
        withUnsafePointer(to: &a) { ap in
            pool.forEach(items, workers: workers) { w, item in
                let (outer, wg) = (Int64(item / active), Int64(item % active))
                if keyMajor {
                    fm_cpu_vec_item_keys(ap, outer, wg, scratch + w * floats)
                } else {
                    fm_cpu_vec_item(ap, outer, wg, scratch + w * floats)
                }
            }
            // Workgroups past the busiest sequence's last key only have empty
            // partials: written here, so a short cache wakes no worker for them.
            if active < nwg { fm_cpu_vec_empty_partials(ap, Int64(active)) }
        }
    }

    /// The kernel's view of a dispatch. The dispatcher validated every
    /// length and table entry; the cheap bounds are checked again here
    /// because a wrong one would read outside the caches.
    private func args(_ d: Dispatch) throws -> FMVecArgs {
        let p = try d.params(VecBuffer.params, as: FlashAttnVecParams.self)
        let k = try d.buffer(VecBuffer.k), v = try d.buffer(VecBuffer.v)
        if Int(p.nwg) != d.grid.z {
            throw FlashMetalError.internalError("\(name): params nwg \(p.nwg) != grid z \(d.grid.z)")
        }
        let rows = VecDispatcher.rows(of: d)
        // Query rows per sequence (short queries; 1 for the decode).
        let qRows = seq ? max(Int(try d.params(VecBuffer.seqParams, as: FlashAttnVecSeqParams.self).q_rows), 1) : 1
        if p.n_heads == 0 || p.n_kv_heads == 0 || p.n_heads % p.n_kv_heads != 0 || rows % (Int(p.n_heads) * qRows) != 0 {
            throw FlashMetalError.internalError("\(name): heads \(p.n_heads)/\(p.n_kv_heads) x \(qRows) query rows do not divide rows \(rows)")
        }
        var a = FMVecArgs()
        a.p = p
        if !qIO { a.q = UnsafePointer(try d.buffer(VecBuffer.q).data.assumingMemoryBound(to: Float.self)) }
        a.k = UnsafeRawPointer(k.data)
        a.v = UnsafeRawPointer(v.data)
        a.tmp = try d.buffer(VecBuffer.tmp).data.assumingMemoryBound(to: Float.self)
        a.kv_dtype = k.dtype.rawValue
        a.batch = Int64(rows / (Int(p.n_heads) * qRows))
        a.q_rows = Int64(qRows)
        a.window_right = -1
        let dk = Int64(p.head_dim)
        guard seq else {
            // The plain decode's [(B,) Hkv, cap, D]: batch folded into the heads.
            let dv = Int64(p.head_dim_v)
            a.k_strides = (0, Int64(p.kv_capacity) * dk, dk)
            a.v_strides = (0, Int64(p.kv_capacity) * dv, dv)
            return a
        }
        let sp = try d.params(VecBuffer.seqParams, as: FlashAttnVecSeqParams.self)
        a.k_strides = sp.K_strides
        a.v_strides = sp.V_strides
        a.attention_chunk = Int32(bitPattern: sp.attention_chunk)
        a.window_right = Int64(sp.window_right)
        a.head_major = Int64(sp.head_major != 0 ? 1 : 0)
        if alibi {
            let slopes = try d.buffer(VecBuffer.alibi)
            let bh = Int(a.batch) * Int(p.n_heads)
            if slopes.dtype != .f32 || slopes.byteCount < bh * 4 {
                throw FlashMetalError.internalError("\(name): alibi slopes \(slopes.shape) do not cover \(bh) heads")
            }
            a.alibi = UnsafePointer(slopes.data.assumingMemoryBound(to: Float.self))
        }
        var capacity = Int64(p.kv_capacity)
        if paged {
            if sp.page_size == 0 { throw FlashMetalError.internalError("\(name): page size 0") }
            a.page_size = Int64(sp.page_size)
            a.max_pages = Int64(sp.max_pages)
            capacity = a.page_size * a.max_pages
        }
        if kvLens {
            let lens = try d.buffer(VecBuffer.seqlensK)
            if lens.dtype != .i32 || lens.byteCount < Int(a.batch) * 4 {
                throw FlashMetalError.internalError("\(name): seqlens_k \(lens.shape) does not cover batch \(a.batch)")
            }
            let l = UnsafePointer(lens.data.assumingMemoryBound(to: Int32.self))
            for b in 0..<Int(a.batch) where l[b] < 0 || Int64(l[b]) > capacity {
                throw FlashMetalError.internalError("\(name): seqlens_k[\(b)] = \(l[b]) outside [0, \(capacity)]")
            }
            a.seqlens = l
            if sp.key_starts_at > 0 {
                // The first keys follow the lengths in the same table.
                let at = Int(sp.key_starts_at)
                if at != Int(a.batch) || lens.byteCount < 2 * at * 4 {
                    throw FlashMetalError.internalError("\(name): key starts at \(at) do not fit seqlens_k \(lens.shape)")
                }
                for b in 0..<at where l[at + b] < 0 || Int64(l[at + b]) > capacity {
                    throw FlashMetalError.internalError("\(name): key start \(b) = \(l[at + b]) outside [0, \(capacity)]")
                }
                a.key_starts = l + at
            }
        } else if Int64(p.kv_seq_len) > capacity {
            throw FlashMetalError.internalError("\(name): kv_seq_len \(p.kv_seq_len) > capacity \(capacity)")
        }
        if paged {
            // Only the entries of pages holding a sequence's keys are read
            // (flash-attn leaves the rest of a row unspecified).
            let table = try d.buffer(VecBuffer.blockTable)
            let pages = Int64(k.shape.first ?? 0)
            if table.dtype != .i32 || table.byteCount < Int(a.batch) * Int(a.max_pages) * 4 {
                throw FlashMetalError.internalError("\(name): block table \(table.shape) does not fit the dispatch")
            }
            let t = UnsafePointer(table.data.assumingMemoryBound(to: Int32.self))
            for b in 0..<Int(a.batch) {
                let len = a.seqlens.map { Int64($0[b]) } ?? Int64(p.kv_seq_len)
                let used = Int((len + a.page_size - 1) / a.page_size)
                for j in 0..<used where t[b * Int(a.max_pages) + j] < 0 || Int64(t[b * Int(a.max_pages) + j]) >= pages {
                    throw FlashMetalError.internalError("\(name): block_table[\(b), \(j)] = \(t[b * Int(a.max_pages) + j]) outside [0, \(pages))")
                }
            }
            a.block_table = t
        }
        return a
    }
}

/// `flash_attn_vec_reduce_dk*` and `flash_attn_vec_reduce_tq_hb_undo_dk*`
/// on the cpu: one work item per row. The plain reduce takes sinks (504)
/// and an lse output (505) with FlashAttnVecReduceExtParams.
final class VecReduceKernel: CPUKernel {
    let name: String
    let headDim: Int32
    let fwht: Bool
    let hasSigns: Bool
    let sinks: Bool, lse: Bool
    /// FM_FC_VEC_OUT_F16 / _BF16: the output's dtype (float32 when neither).
    let outF16: Bool, outBF16: Bool

    init(_ key: PipelineKey, headDim: Int, fwht: Bool) throws {
        name = key.kernel
        self.fwht = fwht
        self.headDim = Int32(headDim)
        let c = key.constants
        hasSigns = fwht ? try c.requireBool(FunctionConstantIndex.vecHasSigns, kernel: name) : false
        sinks = fwht ? false : c.bool(FunctionConstantIndex.vecSinks) ?? false
        lse = fwht ? false : c.bool(FunctionConstantIndex.vecLSE) ?? false
        outF16 = c.bool(FunctionConstantIndex.vecOutF16) ?? false
        outBF16 = c.bool(FunctionConstantIndex.vecOutBF16) ?? false
        if outF16 && outBF16 { throw FlashMetalError.backend("cpu backend: \(name): both output dtypes (509, 510) set") }
    }

    func run(_ d: Dispatch, pool: WorkerPool) throws {
        let rp = try d.params(VecReduceBuffer.params, as: FlashAttnVecReduceParams.self)
        let rows = Int(rp.nrows)
        // The true D (the kernel is named for its tile width, which may be wider).
        let dk = Int32(rp.head_dim)
        if dk <= 0 || dk > headDim || (fwht && dk != headDim) {
            throw FlashMetalError.internalError("\(name): head_dim \(rp.head_dim) does not fit the kernel's \(headDim)")
        }
        let nwg = Int32(try d.params(VecReduceBuffer.nwg, as: UInt32.self))
        if nwg <= 0 { throw FlashMetalError.internalError("\(name): nwg must be > 0") }
        let tmp = UnsafePointer(try d.buffer(VecReduceBuffer.tmp).data.assumingMemoryBound(to: Float.self))
        let outAt = outF16 ? VecReduceBuffer.outF16 : outBF16 ? VecReduceBuffer.outBF16 : VecReduceBuffer.out
        let outRef = try d.buffer(outAt)
        let outDType = outF16 ? DType.f16 : outBF16 ? DType.bf16 : DType.f32
        if outRef.dtype != outDType || outRef.byteCount < rows * Int(dk) * outDType.byteSize || (outDType != .f32 && dk > Int32(FM_VEC_ROUNDED_ROW_MAX)) {
            throw FlashMetalError.internalError("\(name): out \(outRef.dtype) \(outRef.shape) does not hold \(rows) rows of \(dk) \(outDType)")
        }
        let out = outRef.data
        let outCode = outDType.rawValue
        let signs: UnsafePointer<UInt8>? = hasSigns
            ? UnsafePointer(try d.buffer(VecReduceBuffer.signs).data.assumingMemoryBound(to: UInt8.self)) : nil
        var (heads, headRows): (Int64, Int64) = (1, 1)
        var sinkPtr: UnsafePointer<Float>? = nil
        var lsePtr: UnsafeMutablePointer<Float>? = nil
        if sinks || lse {
            let ext = try d.params(VecReduceBuffer.ext, as: FlashAttnVecReduceExtParams.self)
            if ext.n_heads == 0 || rows % Int(ext.n_heads) != 0 {
                throw FlashMetalError.internalError("\(name): n_heads \(ext.n_heads) does not divide rows \(rows)")
            }
            heads = Int64(ext.n_heads)
            headRows = Int64(max(ext.head_rows, 1))
            if rows % (Int(heads) * Int(headRows)) != 0 {
                throw FlashMetalError.internalError("\(name): \(heads) heads of \(headRows) rows do not divide rows \(rows)")
            }
            if sinks {
                let s = try d.buffer(VecReduceBuffer.sinks)
                if s.dtype != .f32 || s.byteCount < Int(heads) * 4 {
                    throw FlashMetalError.internalError("\(name): sinks \(s.shape) do not cover \(heads) heads")
                }
                sinkPtr = UnsafePointer(s.data.assumingMemoryBound(to: Float.self))
            }
            if lse {
                let l = try d.buffer(VecReduceBuffer.lse)
                if l.dtype != .f32 || l.byteCount < rows * 4 {
                    throw FlashMetalError.internalError("\(name): lse \(l.shape) does not cover \(rows) rows")
                }
                lsePtr = l.data.assumingMemoryBound(to: Float.self)
            }
        }
        let fwht = Int32(self.fwht ? 1 : 0)
        pool.forEach(rows, workers: rows * Int(nwg) * Int(dk) < smallWork ? 1 : Int.max) { _, r in
            let head = (Int64(r) / headRows) % heads
            fm_cpu_vec_reduce_row(tmp, out, outCode, Int64(rows), dk, nwg, Int64(r), fwht, signs, sinkPtr, lsePtr, head)
        }
    }
}
